"""Releasing a broker's identity on one node's data path, in process (127.0.0.134), in front of
the session cluster (left untouched: the test tells discovery what "Kafka answered").

* without a fleet: a broker missing from two complete answers (``release_after_s = 0``) is
  released at once: its clients are closed cleanly (FIN after their responses, no reset),
  its port refuses new connections, the map no longer lists it; a response naming it again
  (it was there after all) binds it again;
* in a fleet: the listener stays (and still forwards to the broker) while the map in effect
  lists the identity, and is released when a map without it arrives.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvloop
from kio.schema.api_versions.v0.request import ApiVersionsRequest
from kio.schema.api_versions.v0.response import ApiVersionsResponse
from kio.schema.metadata.v1.request import MetadataRequest
from kio.schema.metadata.v1.response import MetadataResponse

from chaos.bench import frames as fx
from membership.serving import ServingMap, addresses_for
from proxy.config import parse
from proxy.datapath import DataPath

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.134"
BASE = 9100
BOOTSTRAP_PORT = 9092
DEADLINE_S = 15.0


class Node:
    """A DataPath on its own uvloop in a background thread; ``run(coro_fn)`` runs on that loop."""

    def __init__(self, config, *, fleet: bool) -> None:  # type: ignore[no-untyped-def]
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="proxy-node-134", daemon=True)
        self.config, self.fleet = config, fleet
        self.dp: DataPath | None = None

    def run(self, fn, timeout: float = DEADLINE_S):  # type: ignore[no-untyped-def]
        async def call():  # type: ignore[no-untyped-def]
            out = fn()
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def __enter__(self) -> "Node":
        self.thread.start()
        self.dp = DataPath(self.config, "p1", fleet=self.fleet)
        self.run(lambda: self.dp.start(discovery_timeout=30), 60)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.dp is not None:
            self.run(self.dp.stop, 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def config(bootstrap: list[str]):  # type: ignore[no-untyped-def]
    # No refresh during the test (an hour): what Kafka "answers" is what the test says.
    return parse({"upstream": {"bootstrap": bootstrap, "refresh_interval_s": 3600.0, "release_after_s": 0.0},
                  "ports": {"base": BASE}, "nodes": [{"id": "p1", "host": HOST, "bootstrap_port": BOOTSTRAP_PORT}],
                  "logging": {"level": "WARNING"}})


def answer_without(node: Node, broker_id: int) -> None:
    """Discovery hears Kafka's complete broker list without ``broker_id``, twice (the two misses)."""
    others = [b for b in node.dp.brokers.values() if b.node_id != broker_id]
    for _ in range(2):
        node.run(lambda: node.dp.discovery.polled(others))


def connected_client(port: int) -> socket.socket:
    """A client connection on ``port`` that has had one answer (its upstream is up)."""
    s = socket.create_connection((HOST, port), timeout=DEADLINE_S)
    s.sendall(fx.request_frame(fx.make(ApiVersionsRequest), 1, "release-test"))
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        chunk = s.recv(65536)
        assert chunk, "closed before answering"
        data += chunk
    assert fx.decode_response(ApiVersionsResponse, data)[1].error_code == 0
    return s


def closed_cleanly(s: socket.socket) -> bool:
    """The proxy closed ``s`` with a FIN (recv returns b""), not a reset."""
    s.settimeout(DEADLINE_S)
    return s.recv(1) == b""


def refused(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def wait(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_node_without_fleet_releases_a_gone_broker_closing_its_clients_cleanly(kafka_cluster):
    gone = sorted(kafka_cluster.pids)[0]
    with Node(config(kafka_cluster.bootstrap), fleet=False) as node:
        assert gone in node.run(lambda: node.dp.listeners.bound)
        client = connected_client(BASE + gone)
        answer_without(node, gone)
        assert closed_cleanly(client)
        client.close()
        assert refused(BASE + gone)
        assert gone not in node.run(lambda: node.dp.listeners.bound)
        assert gone not in node.run(lambda: node.dp.serving.owner_map())
        assert node.run(lambda: node.dp.unbound) == []  # forgotten, not "known but unbound"
        # It was there after all: a Metadata response naming it binds it again (listener first).
        with socket.create_connection((HOST, BOOTSTRAP_PORT), timeout=DEADLINE_S) as s:
            s.sendall(fx.request_frame(fx.make(MetadataRequest, topics=None), 7, "release-test"))
            data = b""
            while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
                chunk = s.recv(65536)
                assert chunk, "closed instead of answering Metadata"
                data += chunk
        body = fx.decode_response(MetadataResponse, data)[1]
        assert (gone, HOST, BASE + gone) in {(b.node_id, b.host, b.port) for b in body.brokers}
        assert gone in node.run(lambda: node.dp.listeners.bound)
        connected_client(BASE + gone).close()


def test_in_a_fleet_the_listener_stays_while_the_map_lists_the_identity(kafka_cluster):
    ids = sorted(kafka_cluster.pids)
    gone = ids[0]
    with Node(config(kafka_cluster.bootstrap), fleet=True) as node:
        me = node.dp.node

        def a_map(brokers: list[int], version: int) -> ServingMap:
            owners = {b: "p1" for b in brokers}
            return ServingMap(epoch=version, owners=owners, addresses=addresses_for(owners, [me], brokers)[0],
                              nodes=(me,), version=version)

        node.run(lambda: node.dp.apply_map(a_map(ids, 1)))
        client = connected_client(BASE + gone)
        answer_without(node, gone)
        assert gone not in node.run(lambda: node.dp.brokers)  # forgotten by discovery ...
        assert gone in node.run(lambda: node.dp.listeners.bound)  # ... but the map still lists it
        connected_client(BASE + gone).close()  # new connections still reach the broker meanwhile
        node.run(lambda: node.dp.apply_map(a_map([b for b in ids if b != gone], 2)))  # the leader committed
        wait(lambda: gone not in node.run(lambda: node.dp.listeners.bound), "the release")
        assert closed_cleanly(client)
        client.close()
        assert refused(BASE + gone)
        assert all(b in node.run(lambda: node.dp.listeners.bound) for b in ids if b != gone)
