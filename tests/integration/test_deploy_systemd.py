"""deploy/systemd/kproxy@.service, run as systemd would run it: its ExecStart line (the instance
substituted for %i, the install paths for this checkout's), its EnvironmentFile's variables, a real
node config; the node serves; the unit's KillSignal stops it within TimeoutStopSec, exit 0, the
drain logged and no process of the node left (KillMode=mixed would SIGKILL leftovers)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.unit.test_deploy_files import UNIT, read_unit

pytestmark = pytest.mark.integration

HOST = "127.0.0.126"
INSTANCE = "p1"


def test_the_units_command_line_runs_a_node_that_serves_and_stops_cleanly(kafka_cluster, tmp_path):
    from chaos.testbed.proxies import fleet_config, read_env

    kproxy = Path(sys.executable).parent / "kproxy"  # the console script the venv installs (pyproject)
    if not kproxy.exists():
        pytest.skip(f"no kproxy console script next to {sys.executable} (pip install -e .)")
    cfg = fleet_config(tmp_path / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=126, workers=2)
    service = read_unit(UNIT)["Service"]
    install = {"/opt/kproxy/venv/bin/kproxy": str(kproxy), "/etc/kproxy/fleet.toml": str(cfg)}
    argv = [install.get(arg, arg) for arg in shlex.split(service["ExecStart"].replace("%i", INSTANCE))]
    assert argv == [str(kproxy), "run", "--config", str(cfg), "--node", INSTANCE]  # only paths substituted
    # EnvironmentFile: KEY=VALUE lines; the test bed writes the fleet's secrets in that format.
    env = {**os.environ, **read_env(cfg)}
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        _wait_ready(proc, f"http://{HOST}:9400/readyz", log_path)
        from confluent_kafka.admin import AdminClient

        md = AdminClient({"bootstrap.servers": f"{HOST}:9092", "log_level": 2}).list_topics(timeout=20)
        assert sorted((b.id, b.host, b.port) for b in md.brokers.values()) == [
            (1, HOST, 9101), (2, HOST, 9102), (3, HOST, 9103)]

        kill_signal = signal.Signals[service["KillSignal"]]
        started = time.monotonic()
        proc.send_signal(kill_signal)  # KillMode=mixed: the main process only
        code = proc.wait(int(service["TimeoutStopSec"]))
        stopped_in_s = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert stopped_in_s < 15, stopped_in_s
    assert "stopping: draining clients first" in log and "node stopped" in log, log[-3000:]
    assert log.index("stopping: draining clients first") < log.index("node stopped")
    with pytest.raises(ProcessLookupError):  # no worker outlived the supervisor
        os.killpg(proc.pid, 0)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the node exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"the node was not ready within {timeout_s} s:\n{log_path.read_text()[-3000:]}")
