"""Every host fault once on emulated hosts (issue 13), each with all four client families and the
final read of every partition (0 lost, 0 duplicated): kill, freeze, partition, a one-way
partition (the host hears nothing but still sends: its peers must declare it down, which needs
two-way liveness, membership.liveness), a flapping link, two hosts cut off one after the other and
two nodes killed one after the other.

Cost: one fleet for the module (one broker, three proxies, each on its own host: 30-40 s to start
on a 2-core machine) and seven short drills (hold 2 s, 20 records/s per producer); skipped, with the
reason, where namespaces (or, for the one-way partition, nft) cannot be used."""

from __future__ import annotations

import json
import shutil

import pytest

from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
from chaos.testbed.hosts import unavailable_reason
from tests.waiting import wait_for

pytestmark = [pytest.mark.drill, pytest.mark.slow]

CLIENTS = "aiokafka,confluent,kafka-python,java"
RATE = 20.0
# Generous bounds for a loaded 2-core CI machine (the targets are measured by the bench:
# BENCHMARKS.md); what these catch is a client that never recovers or a fault nobody detects.
RTO_BOUND_MS = 15_000
TWO_NODE_BOUND_MS = 25_000
# A client's longest silence over the whole drill may add a heal's reconnects to the fault's.
HEAL_SLACK_MS = 10_000
# Faults whose victim the fleet must declare down, so that a survivor holds its address.
MOVES_ADDRESS = ("kill", "freeze", "partition", "partition-one-way")


@pytest.fixture(scope="module")
def hosts_fleet(tmp_path_factory):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated hosts need network namespaces: {reason}")
    from chaos.testbed.fleet import LocalFleet
    from chaos.testbed.hosts import HostNet

    fleet = LocalFleet.up(tmp_path_factory.mktemp("hosts-faults") / "fleet", brokers=1, proxies=3, hosts="netns")
    try:
        yield fleet
    finally:
        fleet.down()
        assert fleet.hosts is None or HostNet(fleet.hosts).leftovers() == []


def _each_node_holds_only_its_own_address(fleet, timeout_s: float) -> None:
    """Every node's /status: its floating addresses are its own only, and it is not fenced
    (the state after every heal and handback)."""
    expected = {n: {"held": {n: fleet.nodes[n].bootstrap_host}, "fenced": False} for n in fleet.node_ids}
    seen: dict[str, object] = {}

    def settled() -> bool:
        seen.update({n: None if st is None or st.floating is None else
                     {"held": st.floating["held"], "fenced": st.floating["fenced"]}
                     for n, st in fleet.statuses().items()})
        return seen == expected

    try:
        wait_for(settled, "every node holding only its own floating address", timeout_s, interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: expected {expected}, last seen {seen}") from None


@pytest.mark.parametrize("fault", ["kill", "freeze", "partition", "partition-one-way", "flap", "partition-two",
                                   "kill-two"])
def test_host_fault(hosts_fleet, tmp_path, fault):
    if fault == "partition-one-way" and shutil.which("nft") is None:
        pytest.skip("partition-one-way drops packets with nftables: the nft command is not installed")
    hosts_fleet.wait_healthy(60)
    _each_node_holds_only_its_own_address(hosts_fleet, 30.0)
    two_node = fault in ("partition-two", "kill-two")
    bound_ms = TWO_NODE_BOUND_MS if two_node else RTO_BOUND_MS
    seed = 1300 + ["kill", "freeze", "partition", "partition-one-way", "flap", "partition-two", "kill-two"].index(fault)
    config = DrillConfig(fault=fault, out_dir=tmp_path, repeat=1, clients=parse_clients(CLIENTS), rate=RATE,
                         seed=seed, partitions=3, replication=1, hold_s=2.0,
                         recovery_timeout_s=bound_ms / 1000 + 10)
    result = run_drill(config, Target.of_fleet(hosts_fleet))
    if result["skipped"]:
        pytest.skip(result["reason"])
    context = f"seed {seed}, trace {result.get('trace_dir')}\n" + json.dumps(
        {k: result.get(k) for k in ("errors", "steps", "rto_ms", "max_gap_ms", "longest_silence_ms", "faults",
                                    "records", "lost_keys",
                                    "duplicated_keys", "unrecovered", "final_read")}, indent=1, default=str)
    assert result["errors"] == [], context
    assert result["records"]["acked"] > 0, context
    assert result["lost"] == 0, context
    assert result["duplicated"] == 0, context
    assert result["recovered"] is True, context
    assert set(result["rto_ms"]) == set(CLIENTS.split(",")), context
    for family, s in result["rto_ms"].items():
        assert s["unrecovered"] == 0 and s["max"] < bound_ms, (family, context)
    # heals included (outside the fault windows): a stall after a heal used to last 10-60 s
    for family, s in result["longest_silence_ms"].items():
        assert s["max"] < bound_ms + HEAL_SLACK_MS, (family, "longest silence", context)
    if fault in MOVES_ADDRESS:  # detected: a survivor took the victim's address
        assert result["steps"][0].get("address_moved_ms") is not None, context
    assert result["passed"] is True, context
    _each_node_holds_only_its_own_address(hosts_fleet, 30.0)  # after the heal and the handback
    # ...and the links themselves say so (`ip addr` on every host): a process killed while it
    # stood in for a peer left that address on its host, which its restarted process's own
    # status did not show (kill-two)
    hosts_fleet.wait_addresses_settled(30.0)
