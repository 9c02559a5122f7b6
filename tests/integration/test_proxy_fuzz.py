"""Garbage against the running proxy: it survives, other clients are unaffected."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest

from chaos.clients import batch as clients

pytestmark = [pytest.mark.integration]


def _garbage_frames(rng: random.Random) -> list[bytes]:
    hdr = struct.Struct(">ihhih")
    return [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",                       # HTTP on a Kafka port: length 1195725856
        struct.pack(">i", -5) + b"\x00" * 8,                         # negative length
        struct.pack(">i", 0x7FFFFFFF),                                # oversized length
        struct.pack(">i", 100) + b"\x00\x03",                        # truncated, then the peer leaves
        hdr.pack(10, 999, 0, 1, 0),                                   # unknown api key
        hdr.pack(10, 3, 99, 1, 0),                                    # unknown Metadata version
        hdr.pack(12, 3, 12, 7, 30000) + b"ab",                        # client_id longer than the frame
        struct.pack(">i", 2) + b"\x00",                               # frame too short for a header
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))),
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))),
        bytes(rng.randrange(256) for _ in range(2000)),
    ]


def _send_garbage(host: str, port: int, payload: bytes) -> bytes:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(5)
        chunks = []
        while True:  # the proxy closes the connection: read until EOF (bounded by the timeout)
            try:
                data = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


def _errors_metric(proxy) -> float:
    text = proxy.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kproxy_protocol_errors_total"))


def test_garbage_closes_only_that_connection(proxy, topic_name):
    bs = proxy.bootstrap
    clients.produce("confluent", bs, topic_name, 1, prefix=0)  # topic auto-created, warm metadata
    healthy: dict[str, object] = {}

    def produce_meanwhile() -> None:
        try:
            acks = []
            for batch in range(10):
                acks += clients.produce("confluent", bs, topic_name, 20, prefix=100 + batch, timeout=30)
            healthy["acks"] = acks
        except Exception as exc:  # reported below
            healthy["error"] = exc

    before = _errors_metric(proxy)
    worker = threading.Thread(target=produce_meanwhile)
    worker.start()
    rng = random.Random(1234)
    ports = [9092, 9101, 9102, 9103]
    sent = 0
    for round_ in range(3):
        for frame in _garbage_frames(rng):
            reply = _send_garbage("127.0.0.21", ports[sent % len(ports)], frame)
            assert reply == b"", f"garbage got an answer: {reply[:50]!r}"
            sent += 1
    worker.join(120)
    assert not worker.is_alive()
    assert "error" not in healthy, healthy.get("error")
    assert len(healthy["acks"]) == 200  # type: ignore[arg-type]
    assert proxy.alive()
    assert proxy.get("/healthz").status_code == 200
    # Every malformed request was counted as a protocol error (truncated-then-EOF ones are plain closes).
    deadline = time.monotonic() + 10
    while _errors_metric(proxy) - before < sent - 3 * 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _errors_metric(proxy) - before >= sent - 3
    got = clients.consume("confluent", bs, topic_name, f"g-{topic_name}", 201)
    assert len({c.value for c in got}) == 201
