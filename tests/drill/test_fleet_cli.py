"""End to end through the CLI: fleet up → status → kill-node → status → fleet down, nothing left."""

from __future__ import annotations

import json
import time

import psutil
import pytest
from click.testing import CliRunner

from cli.main import cli

pytestmark = [pytest.mark.drill, pytest.mark.integration]


def test_fleet_up_status_kill_status_down(kafka_cluster, tmp_path):
    state = str(tmp_path / "fleet")
    run = CliRunner().invoke
    up = run(cli, ["fleet", "up", "--proxies", "3", "--state-dir", state, "--bootstrap",
                   kafka_cluster.bootstrap_servers, "--json"])
    assert up.exit_code == 0, up.output
    info = json.loads(up.output)
    assert info["bootstrap"] == ["127.0.0.11:9092", "127.0.0.12:9092", "127.0.0.13:9092"]
    pids = [n["pid"] for n in json.loads((tmp_path / "fleet" / "fleet.json").read_text())["nodes"]]
    try:
        before = run(cli, ["cluster", "status", "--state-dir", state, "--json"])
        assert before.exit_code == 0, before.output
        view = json.loads(before.output)
        assert len(view["nodes"]) == 3 and all(n["alive"] for n in view["nodes"])
        assert sorted(view["assignment"]) == ["1", "2", "3"]
        victim = view["assignment"]["2"]
        kill = run(cli, ["cluster", "kill-node", victim, "--state-dir", state, "--yes"])
        assert kill.exit_code == 0, kill.output
        deadline = time.monotonic() + 15
        after = view
        while time.monotonic() < deadline:
            out = run(cli, ["cluster", "status", "--state-dir", state, "--json"])
            after = json.loads(out.output)
            if victim not in after["assignment"].values():
                break
            time.sleep(0.1)
        assert out.exit_code == 1  # a node is down: unhealthy
        assert after["epoch"] > view["epoch"]
        assert victim not in after["assignment"].values()
        assert sorted(after["assignment"]) == ["1", "2", "3"]
        dead = next(n for n in after["nodes"] if n["id"] == victim)
        assert dead["alive"] is False and dead["identities"] == []
    finally:
        down = run(cli, ["fleet", "down", "--state-dir", state])
    assert down.exit_code == 0, down.output
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []
