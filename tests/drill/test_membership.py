"""Live membership under load (issue 15): a real fleet on 127.0.0.111-113 in front of the
session's Kafka grows to five nodes (127.0.0.114, .115) and shrinks back to three (p3 and p2
leave: their identities move by planned moves), one Raft membership change at a time, without restarting any node, while producers (acks=all) and
consumers of every client family run. Nothing acknowledged is lost (the final read of the
topic), nothing is read twice, and the time clients lose at each change is printed (the
figures in BENCHMARKS.md come from this test's output).

Also: the CLI's refusals (a change while one is in flight, a removal that would lose quorum)
exit 2 with the reason."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
from chaos.measures import percentile
from chaos.testbed.fleet import LocalFleet
from cli.exit_codes import EXIT_USAGE
from cli.main import cli
from tests.waiting import wait_for

pytestmark = [pytest.mark.drill, pytest.mark.integration, pytest.mark.timeout(300)]

FIRST_IP = 111
CLIENTS = "aiokafka,confluent,kafka-python,java:producer"
RATE = 50  # records/s per producer
RTO_TARGET_MS = 1000  # issue 15: RTO p99 <= 1 s at every change
# A client's longest gap in a change's window (RTO counts from the change; a consumer's group
# rejoin after its coordinator moved can add a second on a loaded machine: 1,185 ms seen in CI).
CLIENT_GAP_BOUND_MS = 2500


@pytest.fixture(scope="module")
def fleet(kafka_cluster, tmp_path_factory):
    f = LocalFleet.up(tmp_path_factory.mktemp("members"), kafka_bootstrap=kafka_cluster.bootstrap, timeout=90,
                      first_ip=FIRST_IP)
    try:
        yield f
    finally:
        f.down()


def per_change(result: dict) -> list[dict]:
    """One row per membership change: the node, how long the change took, the clients' gaps."""
    rows = []
    for fault, step in zip(result["faults"], result["steps"]):
        clients = [c for c in result["clients"] if c["fault_idx"] == fault["fault_idx"]]
        gaps = [c["max_gap_ms"] for c in clients]
        rtos = [c["rto_ms"] for c in clients]
        rows.append({"node": fault["node"], "change_s": round(step["change_s"], 2), "timings_s": step["timings_s"],
                     "clients": len(clients), "rto_ms_p99": round(percentile(rtos, 0.99) or 0.0),
                     "gap_ms_p50": round(percentile(gaps, 0.5) or 0.0), "gap_ms_p99": round(percentile(gaps, 0.99) or 0.0),
                     "gap_ms_max": round(max(gaps, default=0.0)),
                     "worst": max(clients, key=lambda c: c["max_gap_ms"])["client_id"] if clients else None})
    return rows


def _wait(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    wait_for(condition, what, timeout)


def test_cli_refuses_what_would_lose_quorum(fleet):
    """Membership as `cluster status --json` lists it; a second change while one is in
    flight, and a removal the rest could not survive, exit 2 naming the reason."""
    runner = CliRunner()
    state = ["--state-dir", str(fleet.state_dir)]
    fleet.wait_balanced(60)
    status = json.loads(runner.invoke(cli, ["cluster", "status", *state, "--json"]).output)
    assert sorted(status["members"]) == ["p1", "p2", "p3"]
    # The admin action alone: p4 is added to Raft but never started, so its change stays in flight.
    fleet.add_node_action("p4", f"127.0.0.{FIRST_IP + 3}")
    try:
        second = runner.invoke(cli, ["cluster", "add-node", "p5", "--host", f"127.0.0.{FIRST_IP + 4}", *state])
        assert second.exit_code == EXIT_USAGE, second.output
        assert "in flight (add p4)" in second.output
    finally:  # undoing the add in flight is the one change allowed meanwhile
        done = runner.invoke(cli, ["cluster", "remove-node", "p4", "--admin", fleet.nodes["p1"].admin_url],
                             env={"KPROXY_ADMIN_TOKEN": fleet.nodes["p1"].token()})
        assert done.exit_code == 0, done.output
    fleet.signal_node("p3", "KILL")
    try:
        _wait(lambda: not fleet.fleet_view().members["p3"].up, 10, "p3 marked down")
        refused = runner.invoke(cli, ["cluster", "remove-node", "p2", *state])
        assert refused.exit_code == EXIT_USAGE, refused.output
        assert "would lose quorum" in refused.output
    finally:
        fleet.restart_node("p3")
    view = fleet.wait_balanced(60)
    assert sorted(view.members) == ["p1", "p2", "p3"]


def test_grow_to_five_and_shrink_back_under_load(fleet, kafka_cluster, tmp_path):
    fleet.wait_balanced(60)
    config = DrillConfig(fault="grow-shrink", out_dir=tmp_path, repeat=1, clients=parse_clients(CLIENTS),
                         rate=RATE, seed=1500, recovery_timeout_s=60.0)
    result = run_drill(config, Target(list(fleet.bootstrap), fleet, kafka_cluster))
    rows = per_change(result)
    print("\nmembership changes under load (kproxy grow 3 -> 5 -> 3):")
    for r in rows:
        print(f"  {'add' if r['node'] in ('p4', 'p5') else 'remove'} {r['node']}: "
              f"change {r['change_s']} s {r['timings_s']}; {r['clients']} clients: RTO p99 {r['rto_ms_p99']} ms, "
              f"longest gap p50 {r['gap_ms_p50']} / p99 {r['gap_ms_p99']} / max {r['gap_ms_max']} ms ({r['worst']})")
    print(f"  records acked {result['records']['acked']}, lost {result['lost']}, duplicated {result['duplicated']}, "
          f"final read {result['records']['final_read']}, duration {result['duration_s']} s")
    context = f"trace {result.get('trace_dir')}\n" + json.dumps(
        {k: result.get(k) for k in ("errors", "steps", "rto_ms", "max_gap_ms", "faults", "records", "lost_keys",
                                    "duplicated_keys", "missed_by_group", "unrecovered", "workload_exits")},
        indent=1, default=str)
    assert result["errors"] == [] and result["trace_errors"] == [], context
    assert [r["node"] for r in rows] == ["p4", "p5", "p3", "p2"], context
    assert result["records"]["acked"] > 0 and result["final_read"], context
    assert result["lost"] == 0 and result["duplicated"] == 0, context
    assert result["recovered"] is True, context
    assert {c.partition(":")[0] for c in CLIENTS.split(",")} == set(result["rto_ms"]), context
    for r in rows:
        assert r["rto_ms_p99"] <= RTO_TARGET_MS and r["gap_ms_p99"] <= CLIENT_GAP_BOUND_MS, context
    view = fleet.wait_balanced(30)
    assert sorted(fleet.node_ids) == ["p1", "p4", "p5"] and sorted(view.members) == ["p1", "p4", "p5"]
    assert sorted(set(view.assignment.values())) == ["p1", "p4", "p5"]  # p2's and p3's identities moved
    assert result["passed"] is True, context
