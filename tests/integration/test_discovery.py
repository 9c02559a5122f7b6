"""Upstream discovery survives a listener that cannot be bound: a proxy node in front of the
real session cluster, with one broker's port taken by another socket. That broker stays
unadvertised, a client whose Metadata names it is closed (never left hanging), the other
listeners serve, the node says it is not ready, and once the port is free the periodic refresh
binds it. In process (127.0.0.24) for the data path, as `kproxy run` (127.0.0.25) for readiness."""

from __future__ import annotations

import socket
import time

import pytest
from kio.schema.api_versions.v0.request import ApiVersionsRequest
from kio.schema.api_versions.v0.response import ApiVersionsResponse
from kio.schema.metadata.v1.request import MetadataRequest
from kio.schema.metadata.v1.response import MetadataResponse

from chaos.bench import frames as fx
from proxy.config import parse
from tests.integration.test_splice_data_path import NodeThread

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.24"
BASE = 9300
BOOTSTRAP_PORT = 9092
DEADLINE_S = 15.0


def roundtrip(port: int, request: object, response_type: type) -> object | None:
    """One request on a fresh connection: the response, or None if the proxy closed the
    connection. A proxy that neither answers nor closes fails the test (socket timeout)."""
    with socket.create_connection((HOST, port), timeout=DEADLINE_S) as s:
        s.sendall(fx.request_frame(request, 7, "discovery-test"))
        data = b""
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            data += chunk
    correlation_id, body = fx.decode_response(response_type, data)
    assert correlation_id == 7
    return body


def metadata(port: int) -> MetadataResponse | None:
    return roundtrip(port, fx.make(MetadataRequest, topics=None), MetadataResponse)  # type: ignore[return-value]


def test_a_listener_that_cannot_bind_closes_its_clients_and_is_bound_by_a_later_refresh(kafka_cluster):
    broker_ids = sorted(kafka_cluster.pids)
    assert len(broker_ids) == 3
    blocked = broker_ids[0]
    config = parse({"upstream": {"bootstrap": kafka_cluster.bootstrap, "refresh_interval_s": 0.5},
                    "ports": {"base": BASE},
                    "nodes": [{"id": "p1", "host": HOST, "bootstrap_port": BOOTSTRAP_PORT}],
                    "logging": {"level": "WARNING"}})
    blocker = socket.socket()
    blocker.bind((HOST, BASE + blocked))
    blocker.listen()
    try:
        with NodeThread(config) as node:
            assert set(node.listeners.bound) == set(broker_ids) - {blocked}
            assert node.unbound == [blocked] and node.status().to_json()["unbound"] == [blocked]
            # The response names a broker without a listener: closed, not hung, not leaked.
            assert metadata(BOOTSTRAP_PORT) is None
            # Another broker's listener still forwards to its broker.
            versions = roundtrip(BASE + broker_ids[1], fx.make(ApiVersionsRequest), ApiVersionsResponse)
            assert versions is not None and versions.error_code == 0
            blocker.close()
            deadline = time.monotonic() + DEADLINE_S
            while blocked not in node.listeners.bound and time.monotonic() < deadline:
                time.sleep(0.1)
            assert blocked in node.listeners.bound, "the refresh loop did not bind the freed port"
            body = metadata(BOOTSTRAP_PORT)
            assert body is not None
            assert sorted((b.node_id, b.host, b.port) for b in body.brokers) == [
                (b, HOST, BASE + b) for b in broker_ids]
    finally:
        blocker.close()


def _wait_readyz(node, code: int) -> None:  # type: ignore[no-untyped-def]
    import httpx

    deadline = time.monotonic() + DEADLINE_S
    last = None
    while time.monotonic() < deadline:
        try:
            last = node.get("/readyz", timeout=1.0).status_code
        except httpx.HTTPError as exc:
            last = repr(exc)
        if last == code:
            return
        time.sleep(0.1)
    raise AssertionError(f"/readyz never answered {code} within {DEADLINE_S} s (last: {last})")


def test_kproxy_run_is_not_ready_while_a_listener_cannot_bind(kafka_cluster, tmp_path):
    from chaos.testbed.proxies import NodeProcess, fleet_config

    host, admin_port = "127.0.0.25", 9200  # below the broker ports' window (BASE and up)
    blocked = sorted(kafka_cluster.pids)[0]
    cfg = fleet_config(tmp_path / "node.toml", kafka_cluster.bootstrap, 1, first_ip=25, fleet=False,
                       port_base=BASE, admin_port=admin_port, extra={"upstream": {"refresh_interval_s": 0.5}})
    blocker = socket.socket()
    blocker.bind((host, BASE + blocked))
    blocker.listen()
    node = NodeProcess(cfg, "p1", host, admin_port, tmp_path / "p1.log").start()
    try:
        _wait_readyz(node, 503)  # also before the first discovery: wait for the failed bind itself
        from tests import waiting

        waiting.wait_until("the blocked listener reported unbound",
                           lambda: node.get("/status").json()["unbound"] == [blocked], DEADLINE_S)
        status = node.get("/status").json()
        assert status["unbound"] == [blocked] and status["ready"] is False
        assert "listener bind failed" in node.log_path.read_text()
        assert f'"address": "{host}:{BASE + blocked}"' in node.log_path.read_text()  # names the address
        blocker.close()
        _wait_readyz(node, 200)
        assert node.get("/status").json()["unbound"] == []
    finally:
        blocker.close()
        node.stop()

