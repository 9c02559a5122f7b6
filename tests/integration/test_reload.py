"""Config reload on a running node (issue 15, item 5), in front of the session's real Kafka.

A node holding client connections gets a lower ``limits.max_connections`` by SIGHUP: the
connections it holds keep being served, a new one is refused, and the reload says what it
applied and which changed field needs a restart. ``kproxy cluster reload`` (POST /reload) then
raises the limit again and a new connection is served. Once with one process (workers = 1) and
once with a supervisor and two workers, which get the new limits from the supervisor."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
import tomllib

from tests.sockets import recv_exact
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

HOSTS = {1: "127.0.0.104", 2: "127.0.0.105"}  # by workers
API_VERSIONS = 18


def _api_versions(sock: socket.socket, correlation_id: int) -> int:
    """One ApiVersions v0 round trip through the proxy; the correlation id answered."""
    client = b"reload-test"
    body = struct.pack(">hhih", API_VERSIONS, 0, correlation_id, len(client)) + client
    sock.sendall(struct.pack(">i", len(body)) + body)
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    return struct.unpack(">i", recv_exact(sock, size)[:4])[0]


def _served(host: str) -> socket.socket:
    sock = socket.create_connection((host, 9092), timeout=10)
    assert _api_versions(sock, 1) == 1
    return sock


def _refused(host: str) -> bool:
    try:
        with socket.create_connection((host, 9092), timeout=10) as sock:
            _api_versions(sock, 7)
    except (ConnectionError, OSError):
        return True
    return False



def _log_lines(path: Path, msg: str) -> list[dict]:
    text = path.read_text()
    text = text[:text.rfind("\n") + 1]  # a line still being written is read next time
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("msg") == msg]


def _set_limits(cfg: Path, **limits: object) -> None:
    doc = tomllib.loads(cfg.read_text())
    doc.setdefault("limits", {}).update(limits)
    cfg.write_text(tomli_w.dumps(doc))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reloaded_lower_limit_refuses_new_connections_and_keeps_the_held_ones(kafka_cluster, tmp_path, workers):
    from chaos.testbed.proxies import NodeProcess, fleet_config, read_env

    host = HOSTS[workers]
    cfg = fleet_config(tmp_path / "node.toml", kafka_cluster.bootstrap, 1, first_ip=int(host.rsplit(".", 1)[1]),
                       fleet=False, workers=workers, extra={"limits": {"max_connections": 50}})
    log_path = tmp_path / "p1.log"
    node = NodeProcess(cfg, "p1", host, 9400, log_path).start()
    held: list[socket.socket] = []
    try:
        node.wait_ready(60)
        held.append(_served(host))
        held.append(_served(host))
        if workers > 1:  # one held connection in each worker at least (SO_REUSEPORT spreads them)
            def each_worker_holds() -> bool:
                rows = node.get("/status").json()["workers"]
                if all((w["connections"] or 0) > 0 for w in rows):
                    return True
                held.append(_served(host))
                return False

            wait_for(each_worker_holds, "a held connection in every worker")

        _set_limits(cfg, max_connections=1, listen_backlog=128)
        os.kill(node.pid, signal.SIGHUP)
        # The node's own line (a worker's may come first), then its warning, written just after it.
        reloaded = wait_for(lambda: [x for x in _log_lines(log_path, "config reloaded")
                                     if x.get("kproxy_worker") is None], "the reload logged")
        main = reloaded[0]
        assert main["applied"] == ["limits.max_connections"] and main["needs_restart"] == ["limits.listen_backlog"]
        assert main["trigger"] == "SIGHUP"
        restart = wait_for(lambda: _log_lines(
            log_path, "config changes that take effect only after a restart: limits.listen_backlog"),
            "the restart warning logged")
        assert len(restart) == 1
        if workers > 1:
            wait_for(lambda: len([x for x in _log_lines(log_path, "config reloaded")
                                   if x.get("kproxy_worker") is not None]) == workers, "every worker reloaded")

        assert _refused(host), "a new connection was taken above the reloaded limit"
        for i, sock in enumerate(held):  # the held ones are still served
            assert _api_versions(sock, 100 + i) == 100 + i

        _set_limits(cfg, max_connections=50)
        env = {**os.environ, **read_env(cfg)}
        out = subprocess.run([sys.executable, "-m", "cli.main", "cluster", "reload", "p1", "--admin",
                              f"http://{host}:9400", "--json"], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["applied"] == ["limits.max_connections"]
        assert answer["needs_restart"] == ["limits.listen_backlog"]  # still differs from what runs

        def new_one_served() -> bool:  # the workers apply it on their loop, a moment later
            try:
                held.append(_served(host))
                return True
            except (ConnectionError, OSError):
                return False

        wait_for(new_one_served, "a new connection served under the raised limit", timeout=10)
        for i, sock in enumerate(held):
            assert _api_versions(sock, 200 + i) == 200 + i
    finally:
        for sock in held:
            sock.close()
        node.stop()
