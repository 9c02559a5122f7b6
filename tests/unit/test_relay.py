"""The bench's baseline hop (chaos.bench.relay) and the RELAY listener the launcher gives brokers for it."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from chaos.bench.throughput import _alternate_arms
from chaos.testbed.kafka_cluster import RELAY_PORT_OFFSET, KafkaCluster
from chaos.bench.relay import Relay, parse_route

pytestmark = pytest.mark.unit

HOST = "127.0.0.27"


def _server() -> socket.socket:
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen(4)
    return ls


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(1 << 20, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def test_relay_moves_bytes_both_ways_and_passes_eof():
    target = _server()
    target.settimeout(10)
    relay = Relay([((HOST, 0), target.getsockname())]).start()
    try:
        client = socket.create_connection(relay.addresses[0], timeout=10)
        upstream, _ = target.accept()
        upstream.settimeout(10)
        request = os.urandom(3000)
        client.sendall(request)
        assert _recv_exactly(upstream, len(request)) == request
        # A response larger than the relay's pipe, sent from another thread (the client reads meanwhile).
        response = os.urandom(3 * (1 << 20) + 12345)
        sender = threading.Thread(target=upstream.sendall, args=(response,))
        sender.start()
        got = _recv_exactly(client, len(response))
        sender.join(10)
        assert got == response
        assert relay.moved[0] == len(request) + len(response)
        upstream.close()  # the broker side goes away: the client sees the end of the stream
        assert client.recv(1) == b""
        client.close()
    finally:
        relay.close()
        target.close()


def test_relay_refuses_to_connect_a_client_when_the_target_is_down():
    ls = _server()
    dead = ls.getsockname()
    ls.close()  # nothing listens there any more
    relay = Relay([((HOST, 0), dead)]).start()
    try:
        client = socket.create_connection(relay.addresses[0], timeout=10)
        assert client.recv(1) == b""  # closed, not left hanging
        assert relay.connections == 0
    finally:
        relay.close()


@pytest.mark.parametrize("route", ["10.0.0.1:9092=127.0.0.1:9092", "127.0.0.33:9092=192.168.1.5:9092",
                                   "127.0.0.33:9092", "127.0.0.33:x=127.0.0.1:9092"])
def test_relay_routes_are_loopback_only_and_well_formed(route):
    with pytest.raises(ValueError, match="bad route"):
        parse_route(route)


def test_parse_route():
    assert parse_route("127.0.0.33:19292=127.0.0.1:19292") == (("127.0.0.33", 19292), ("127.0.0.1", 19292))


def _props(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_broker_config_gets_a_relay_listener_only_when_asked(tmp_path):
    plain = KafkaCluster(tmp_path / "a", 3, base_port=30000)
    props = _props(plain._write_config(plain.specs[1]))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:30001,CONTROLLER://127.0.0.1:30101"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:30001"
    assert "RELAY" not in props["listener.security.protocol.map"]

    relayed = KafkaCluster(tmp_path / "b", 3, base_port=30000, relay_host="127.0.0.33")
    spec = relayed.specs[1]
    assert spec.relay_port == 30001 + RELAY_PORT_OFFSET
    props = _props(relayed._write_config(spec))
    assert props["listeners"] == ("PLAINTEXT://127.0.0.1:30001,CONTROLLER://127.0.0.1:30101,"
                                  "RELAY://127.0.0.1:30201")
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:30001,RELAY://127.0.0.33:30201"
    assert props["listener.security.protocol.map"].split(",")[-1] == "RELAY:PLAINTEXT"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # replication stays off the relay


def test_relay_host_survives_a_reload(tmp_path):
    cluster = KafkaCluster(tmp_path / "c", 2, base_port=30000, relay_host="127.0.0.33")
    cluster._save()
    assert KafkaCluster.load(tmp_path / "c").relay_host == "127.0.0.33"


def test_alternate_arms_rotates_the_order_after_direct():
    calls: list[str] = []

    def arm(name):
        return lambda: calls.append(name) or {"arm": name}

    d, others = _alternate_arms(3, arm("direct"), {"a": arm("a"), "b": arm("b"), "c": arm("c")})
    assert calls == ["direct", "a", "b", "c", "direct", "b", "c", "a", "direct", "c", "a", "b"]
    assert [r["arm"] for r in d] == ["direct"] * 3
    assert {k: len(v) for k, v in others.items()} == {"a": 3, "b": 3, "c": 3}


def test_machine_meter_splits_cpu_between_client_and_hop():
    import subprocess
    import sys

    import psutil

    from chaos.bench.throughput import _Machine

    machine = _Machine([])
    me = psutil.Process()

    def client_run() -> dict:  # a child that burns CPU, waited for like the client tools' JVMs
        subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
        return {"records": 1_000_000}

    def hop_run() -> dict:  # CPU spent by the "hop" process (here: this one)
        sum(i * i for i in range(3_000_000))
        return {"records": 1_000_000}

    machine.run("fetch_x", "direct", client_run)
    machine.run("fetch_x", "relay", hop_run, hop=me)
    machine.run(None, "direct", client_run)  # no phase: not measured
    report = machine.report(1000)  # 1 GB of payload per run
    direct, relay = report["fetch_x"]["direct"], report["fetch_x"]["relay"]
    assert direct["client_cpu_s_per_gb"] > 0.05 and "hop_cpu_s_per_gb" not in direct
    assert relay["hop_cpu_s_per_gb"] > 0.05 and relay["client_cpu_s_per_gb"] < direct["client_cpu_s_per_gb"]
    assert "brokers_cpu_s_per_gb" not in direct  # no brokers given
    assert set(report) == {"fetch_x"}
