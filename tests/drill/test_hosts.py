"""Emulated hosts (`kproxy fleet up --hosts netns`): each proxy node, the broker and the clients in
a network namespace of their own on one bridge; records flow from the clients' host through the
fleet; `fleet down` leaves no namespace, link or address behind.

Cost: a fleet of its own (one broker, two proxies: about 30-40 s to start on a 2-core machine)
and one short drill; skipped, with the reason, where namespaces cannot be made (no root)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest

from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
from chaos.testbed.hosts import SUBNET, unavailable_reason

pytestmark = [pytest.mark.drill, pytest.mark.slow]

PRODUCE_CONSUME = """
import sys
from chaos.clients.batch import produce, consume
acks = produce("confluent", sys.argv[1], "hosts", 40, 5)
got = consume("aiokafka", sys.argv[1], "hosts", "hosts-g", 40, timeout=60)
print(len(acks), len({c.value for c in got}))
"""


def _ip_json(*args: str) -> list[dict]:
    return json.loads(subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout or "[]")


def _left_behind(tag: str) -> list[str]:
    """Every namespace and link named for the fleet, and every address of the test range."""
    left = [f"netns {n['name']}" for n in _ip_json("netns", "list") if n["name"].startswith(tag)]
    left += [f"link {link['ifname']}" for link in _ip_json("link", "show") if link["ifname"].startswith(tag)]
    left += [f"address {a['local']} on {link['ifname']}" for link in _ip_json("addr", "show")
             for a in link.get("addr_info", []) if a.get("family") == "inet" and ipaddress.ip_address(a["local"]) in SUBNET]
    return left


def test_netns_fleet_carries_records_from_the_clients_host_and_leaves_nothing(tmp_path):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated hosts need network namespaces: {reason}")
    from click.testing import CliRunner

    from chaos.testbed.fleet import LocalFleet
    from cli.main import cli

    state = tmp_path / "fleet"
    up = CliRunner().invoke(cli, ["fleet", "up", "--hosts", "netns", "--brokers", "1", "--proxies", "2",
                                  "--state-dir", str(state), "--json"])
    fleet = LocalFleet.load(state) if (state / "fleet.json").exists() else None
    tag = fleet.hosts.tag if fleet is not None and fleet.hosts is not None else None
    try:
        assert up.exit_code == 0, up.output
        assert fleet is not None and fleet.hosts is not None and tag is not None
        assert json.loads(up.stdout)["bootstrap"] == ["198.18.0.11:9092", "198.18.0.12:9092"]
        assert fleet.kafka is not None and fleet.kafka.bootstrap == ["198.18.0.2:19092"]
        fleet.kafka.create_topic("hosts", partitions=2, replication=1)
        # From the clients' own host, through the fleet: 40 records acknowledged and read back.
        proc = subprocess.run([*fleet.client_exec, sys.executable, "-c", PRODUCE_CONSUME, fleet.bootstrap_servers],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.split() == ["40", "40"], proc.stdout + proc.stderr[-3000:]
        # A drill's workloads run on the clients' host too, and its final read finds every acked record.
        config = DrillConfig(fault="none", out_dir=tmp_path / "drill", clients=parse_clients("aiokafka"), rate=50,
                             seed=4100, partitions=2, replication=1)
        result = run_drill(config, Target.of_fleet(fleet))
        context = json.dumps({k: result.get(k) for k in ("errors", "records", "final_read", "lost")}, default=str)
        assert result["passed"] is True and result["lost"] == 0, context
        assert result["records"]["acked"] > 0 and result["final_read"]["via"] == "fleet", context
        manifest = json.loads((tmp_path / "drill" / result["run_id"] / "drill.json").read_text())
        assert manifest["bootstrap"] == ["198.18.0.11:9092", "198.18.0.12:9092"]
        assert manifest["client_exec"] == ["ip", "netns", "exec", f"{tag}-clients"]
    finally:
        down = CliRunner().invoke(cli, ["fleet", "down", "--state-dir", str(state)])
    assert down.exit_code == 0, down.output
    assert _left_behind(tag) == []
