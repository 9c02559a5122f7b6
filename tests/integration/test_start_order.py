"""Start-up order (issue 15, item 7): a node takes its lock, binds its admin endpoint and checks
its Raft ports before any data listener, and a second `kproxy run` of the node binds nothing.

The order is read from the kernel's side: every bind(2) of the node's processes, traced by
strace, in the order they happened."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt install strace)")]

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.124"
# Below the test Kafka cluster's 20000-39000.
BOOTSTRAP, BASE, ADMIN, RAFT = 14140, 14150, 14141, 14142
# bind(3, {sa_family=AF_INET, sin_port=htons(25141), sin_addr=inet_addr("127.0.0.124")}, 16) = 0
BIND = re.compile(r'bind\(\d+, \{sa_family=AF_INET6?, sin6?_port=htons\((\d+)\).*?(?:inet_addr|inet_pton)\(.*?"([^"]+)"')


def _binds(trace: Path) -> list[tuple[str, int]]:
    """Every inet (host, port) bound, in order, any process of the traced tree (abstract unix
    sockets, the instance lock, are not inet)."""
    return [(m.group(2), int(m.group(1))) for m in BIND.finditer(trace.read_text())]


@pytest.fixture
def node_config(kafka_cluster, tmp_path):
    from chaos.testbed.proxies import fleet_config

    return fleet_config(tmp_path / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=124, bootstrap_port=BOOTSTRAP,
                        port_base=BASE, admin_port=ADMIN, raft_port=RAFT)


def test_admin_and_raft_before_the_data_listeners_and_a_second_run_binds_nothing(node_config, tmp_path):
    from chaos.testbed.proxies import NodeProcess, read_env

    first_trace, second_trace = tmp_path / "first.strace", tmp_path / "second.strace"
    node = NodeProcess(node_config, "p1", HOST, ADMIN, tmp_path / "p1.log",
                       exec_prefix=("strace", "-f", "-qq", "-e", "trace=bind", "-o", str(first_trace))).start()
    try:
        node.wait_ready(90)
        binds = [b for b in _binds(first_trace) if b[0] == HOST]
        order = [port for _, port in binds]
        data = [p for p in order if p == BOOTSTRAP or BASE <= p < BASE + 256]
        assert data, binds
        first_data = order.index(data[0])
        assert ADMIN in order[:first_data], binds  # the admin endpoint is up before any data listener
        assert RAFT in order[:first_data], binds   # the Raft ports were checked before too (TCP and UDP)

        second = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=bind", "-o", str(second_trace),
             sys.executable, "-m", "cli.main", "run", "--config", str(node_config), "--node", "p1"],
            cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env={**os.environ, **read_env(node_config)})
        assert second.returncode == 2, second.stderr
        assert f"node p1 is already running for {HOST}:{BOOTSTRAP}" in second.stderr
        assert _binds(second_trace) == []  # not one inet socket bound: no data port, no admin, no Raft
        assert node.get("/readyz").status_code == 200
    finally:
        _stop_group(node)


def _stop_group(node) -> None:
    """SIGTERM to strace and the node alike (strace alone would leave its tracee running)."""
    import signal

    try:
        os.killpg(node.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not node.wait_gone(20):
        os.killpg(node.pid, signal.SIGKILL)
        node.wait_gone(10)


def test_a_raft_port_in_use_ends_the_start_before_any_data_listener(node_config, tmp_path):
    from chaos.testbed.proxies import read_env

    trace = tmp_path / "blocked.strace"
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        blocker.bind((HOST, RAFT))
        blocker.listen()
        proc = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=bind", "-o", str(trace),
             sys.executable, "-m", "cli.main", "run", "--config", str(node_config), "--node", "p1"],
            cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env={**os.environ, **read_env(node_config)})
    finally:
        blocker.close()
    assert proc.returncode == 2, proc.stderr
    assert f"error: Raft listener (TCP) {HOST}:{RAFT}: cannot bind (address already in use)" in proc.stderr
    ports = [port for host, port in _binds(trace) if host == HOST]
    assert ADMIN in ports and not [p for p in ports if p == BOOTSTRAP or BASE <= p < BASE + 256], ports
