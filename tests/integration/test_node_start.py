"""`kproxy run` as an operator starts it by hand: one instance per node, one-line bind errors,
and SIGTERM saying what it does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.44"
ADMIN_PORT, RAFT_PORT = 9400, 9500


def _run(cfg: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    from chaos.testbed.proxies import read_env

    return subprocess.run([sys.executable, "-m", "cli.main", "run", "--config", str(cfg), "--node", "p1"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **read_env(cfg)})


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture
def node_config(kafka_cluster, tmp_path):
    from chaos.testbed.proxies import fleet_config

    return fleet_config(tmp_path / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=44, admin_port=ADMIN_PORT,
                        raft_port=RAFT_PORT)


def test_a_second_run_of_a_node_is_refused_naming_the_first_and_sigterm_logs_its_drain(node_config, tmp_path):
    from chaos.testbed.proxies import NodeProcess

    node = NodeProcess(node_config, "p1", HOST, ADMIN_PORT, tmp_path / "p1.log").start()
    try:
        node.wait_ready(60)
        second = _run(node_config, timeout=20)
        assert second.returncode == 2
        line = _error_line(second)
        assert line.startswith("error: node p1 is already running for 127.0.0.44:9092")
        assert f"pid {node.pid}" in line and str(node_config) in line
        assert "proxy node serving" not in second.stderr and "listener bound" not in second.stderr
        assert node.get("/readyz").status_code == 200  # the first one never noticed
        metrics = node.get("/metrics").text  # the fleet gauges deploy/prometheus's alerts watch
        assert 'kproxy_fleet_member_up{member="p1",node="p1"} 1.0' in metrics
        assert 'kproxy_identities_unbound{node="p1"} 0.0' in metrics
    finally:
        node.stop()
    log = node.log_path.read_text()
    assert node.wait_gone(1) and "stopping: draining clients first" in log and "node stopped" in log
    assert log.index("stopping: draining clients first") < log.index("node stopped")


@pytest.mark.parametrize(("port", "listener"), [
    (RAFT_PORT, "Raft listener (TCP) 127.0.0.44:9500: cannot bind"),
    (ADMIN_PORT, "admin listener (HTTP) 127.0.0.44:9400: address already in use"),
])
def test_a_port_in_use_ends_in_one_line_naming_the_listener(node_config, port, listener):
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the TIME_WAITs of an earlier test
    try:
        blocker.bind((HOST, port))
        blocker.listen()
        proc = _run(node_config)
    finally:
        blocker.close()
    assert proc.returncode == 2, proc.stderr
    assert _error_line(proc).startswith(f"error: {listener}")
