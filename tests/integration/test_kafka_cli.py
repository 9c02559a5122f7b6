"""`kproxy kafka up|kill|restart|down` end to end: a real one-broker KRaft cluster of its own
(one broker keeps it short; the session's three-broker cluster comes from the same launcher)."""

from __future__ import annotations

import json

import psutil
import pytest
from click.testing import CliRunner

from chaos.testbed.kafka_cluster import free_base_port
from cli.main import cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ours(state_dir: str) -> list[psutil.Process]:
    """Every process whose command line names this state dir (the brokers `up` started)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(state_dir in part for part in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_kafka_up_kill_restart_down_leaves_no_process(tmp_path):
    state = str(tmp_path / "k")
    base = free_base_port(1)
    runner = CliRunner()
    up = runner.invoke(cli, ["kafka", "up", "--brokers", "1", "--state-dir", state, "--base-port", str(base),
                             "--json"])
    try:
        assert up.exit_code == 0, up.output
        info = json.loads(up.stdout)
        assert info["bootstrap"] == [f"127.0.0.1:{base}"]
        [broker] = info["brokers"]
        assert {k: broker[k] for k in ("host", "port")} == {"host": "127.0.0.1", "port": base}
        assert psutil.pid_exists(broker["pid"]) and [p.pid for p in _ours(state)] == [broker["pid"]]

        kill = runner.invoke(cli, ["kafka", "kill", str(broker["id"]), "--state-dir", state])
        assert kill.exit_code == 0, kill.output
        assert _ours(state) == []
        restart = runner.invoke(cli, ["kafka", "restart", str(broker["id"]), "--state-dir", state])
        assert restart.exit_code == 0, restart.output
        assert len(_ours(state)) == 1
        # A second `up` on the same ports is refused with a reason, and starts nothing.
        again = runner.invoke(cli, ["kafka", "up", "--brokers", "1", "--state-dir", str(tmp_path / "k2"),
                                    "--base-port", str(base)])
        assert again.exit_code == 1 and "error:" in again.output
        assert _ours(str(tmp_path / "k2")) == []
    finally:
        down = runner.invoke(cli, ["kafka", "down", "--state-dir", state])
    assert down.exit_code == 0, down.output
    assert _ours(state) == []
