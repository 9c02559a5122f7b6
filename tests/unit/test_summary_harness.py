"""Pure parts of the drill harness: client lists, record values, the fleet watcher's diffing, the
partition address guard. The fleet here is a hand-written view dict (no processes)."""

from __future__ import annotations

import json
import time

import attrs
import pytest
import trio

from chaos.drills.drill import describe_error, parse_clients
from chaos.drills.load import client_specs
from chaos.drills.watcher import Observation, ReactionWatcher
from proxy.status import FleetView, NodeEndpoint, NodeStatus
from chaos.drills.netfault import PartitionError, check_address
from chaos.trace import TraceWriter
from chaos.clients.paced import Pacer, parse_value, record_value
from chaos.clients.workload import command

pytestmark = pytest.mark.unit


def test_parse_clients():
    assert parse_clients("aiokafka,java:producer") == (
        ("aiokafka", "consumer"), ("aiokafka", "producer"), ("java", "producer"))
    assert parse_clients("confluent, confluent:consumer") == (("confluent", "consumer"), ("confluent", "producer"))
    for bad in ("rust", "java:reader", "", "java:consumer"):
        with pytest.raises(ValueError):
            parse_clients(bad)


def test_client_specs_number_producers_and_name_groups():
    specs = client_specs((("java", "consumer"), ("java", "producer"), ("aiokafka", "producer")), "run7")
    assert [(s.client_id, s.prefix, s.group) for s in specs] == [
        ("java-consumer", None, "run7-java-consumer"), ("java-producer", 1, None), ("aiokafka-producer", 2, None)]


def test_record_values_round_trip():
    assert record_value(3, 41) == "3.41"
    assert parse_value(b"3.41") == ("3.41", 41)
    assert parse_value("12.0") == ("12.0", 0)
    for foreign in (None, b"", b"hello", b"3.", b".4", b"a.1", b"1.2.3", b"-1.2"):
        assert parse_value(foreign) is None


def test_command_line():
    cmd = command("producer", "java", bootstrap="h:1", topic="t", trace_dir="/d", client_id="c", run_id="r",
                  rate=50, prefix=2, python="py")
    assert cmd == ["py", "-m", "chaos.clients.workload", "producer", "--family", "java", "--bootstrap", "h:1", "--topic",
                   "t", "--trace-dir", "/d", "--client-id", "c", "--run-id", "r", "--rate", "50", "--prefix", "2"]
    with pytest.raises(ValueError):
        command("consumer", "java", bootstrap="h:1", topic="t", trace_dir="/d", client_id="c", run_id="r")


def test_pacer_keeps_the_schedule_and_does_not_burst_after_a_stall(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("chaos.clients.paced.time.monotonic", lambda: now[0])
    p = Pacer(10.0)  # one send every 0.1 s
    assert p.delay_s() == 0.0
    p.advance()
    assert p.delay_s() == pytest.approx(0.1)
    now[0] = 105.0  # stalled 5 s: resume now, no 50 sends in a burst
    assert p.delay_s() == 0.0
    p.advance()
    assert p.delay_s() == pytest.approx(0.1)


def test_an_observation_of_a_fleet_view_prefers_the_fleets_verdict():
    statuses = {"p1": NodeStatus.from_json(_status("p1", "p2", 5, {"1": "p1"}, {"p1": False, "p2": True})),
                "p2": None, "p3": None}
    endpoints = [NodeEndpoint(n, f"127.0.0.1{i}") for i, n in enumerate(("p1", "p2", "p3"), 1)]
    view = FleetView.build(endpoints, statuses, [])
    # p1 answers but the fleet counts it down; p2 does not answer but the fleet counts it up;
    # p3 is neither a member nor answering.
    assert Observation.of_view(view).up == {"p1": False, "p2": True, "p3": False}


def _view(epoch, assignment, up):
    return Observation(epoch=epoch, assignment=assignment, up=up)


def test_watcher_writes_node_down_and_assignment_committed(tmp_path):
    w = TraceWriter(tmp_path, "fleet", "r1")
    watcher = ReactionWatcher(fleet=None, trace=w)
    watcher.observe(_view(5, {"1": "p1", "2": "p2", "3": "p3"}, {"p1": True, "p2": True, "p3": True}),
                    baseline=True)
    watcher.observe(_view(5, {"1": "p1", "2": "p2", "3": "p3"}, {"p1": True, "p2": True, "p3": True}))
    watcher.observe(_view(6, {"1": "p1", "2": "p2", "3": "p3"}, {"p1": False, "p2": True, "p3": True}))
    watcher.observe(_view(6, {"1": "p1", "2": "p2", "3": "p3"}, {"p1": False, "p2": True, "p3": True}))
    watcher.observe(_view(7, {"1": "p2", "2": "p2", "3": "p3"}, {"p1": False, "p2": True, "p3": True}))
    watcher.observe(_view(8, {"1": "p1", "2": "p2", "3": "p3"}, {"p1": True, "p2": True, "p3": True}))
    w.close()
    events = [json.loads(line) for line in (tmp_path / "fleet.jsonl").read_text().splitlines()]
    got = [(e["event"], e["node"], e["epoch"], e["detail"]) for e in events]
    assert got == [
        ("node_down", "p1", 6, None),
        ("assignment_committed", None, 7, json.dumps({"1": "p2", "2": "p2", "3": "p3"}, sort_keys=True)),
        ("assignment_committed", None, 8, json.dumps({"1": "p1", "2": "p2", "3": "p3"}, sort_keys=True)),
    ]
    first_down = events[0]["ts_ns"]
    assert watcher.down_since("p1", first_down) and not watcher.down_since("p1", first_down + 1)
    assert not watcher.down_since("p2", 0)
    assert watcher.committed_since(events[2]["ts_ns"]) and not watcher.committed_since(events[2]["ts_ns"] + 1)
    assert watcher.up == {"p1": True, "p2": True, "p3": True}


def _status(node, leader, epoch, committed, up, advertised=None):
    """A member's /status JSON, as a node serves it."""
    return {"node": node, "pid": 1, "ready": True, "bootstrap": "h:9092", "listeners": [1], "unbound": [],
            "standing_in": [], "connections": 0, "draining": False, "brokers": [], "admin_endpoints": {},
            "term": 1, "has_quorum": True,
            "role": "leader" if node == leader else "follower", "leader": leader, "epoch": epoch,
            "assignment": advertised or committed, "committed_epoch": epoch, "committed_assignment": committed,
            "members": {m: {"host": "h", "bootstrap_port": 9092, "up": u, "draining": False} for m, u in up.items()}}


def test_an_observation_of_a_status_uses_the_committed_table_and_member_flags():
    v = Observation.of_status(NodeStatus.from_json(
        _status("p2", "p2", 4, {"1": "p1"}, {"p1": False, "p2": True}, advertised={"1": "p2"})))
    assert v.assignment == {"1": "p1"} and v.epoch == 4
    assert v.up == {"p1": False, "p2": True}
    # The committed table's epoch, not the data path's (which applies it a moment later).
    lagging = _status("p2", "p2", 4, {"1": "p2"}, {"p1": False, "p2": True}) | {"committed_epoch": 5}
    assert Observation.of_status(NodeStatus.from_json(lagging)).epoch == 5


class TinyFleet:
    """In-test fake: answers status() from a script; p1 is 'frozen' (times out)."""

    node_ids = ["p1", "p2", "p3"]

    def __init__(self):
        self.calls = []
        self.up = {"p1": True, "p2": True, "p3": True}
        self.committed = {"1": "p1", "2": "p2", "3": "p3"}
        self.epoch = 3

    def status(self, node):
        self.calls.append(node)
        if node == "p1":
            raise TimeoutError("p1 does not answer")
        return NodeStatus.from_json(_status(node, "p3", self.epoch, dict(self.committed), dict(self.up)))


def test_watcher_polls_the_leader_and_skips_a_silent_node(tmp_path):
    fleet = TinyFleet()
    w = TraceWriter(tmp_path, "fleet", "r1")
    watcher = ReactionWatcher(fleet, w)

    async def main():
        view = await watcher.view()  # p1 first (no hint yet): fails, then p2, which names p3 leader
        watcher.observe(view, baseline=True)
        fleet.up["p1"], fleet.epoch = False, 4
        watcher.observe(await watcher.view())
        fleet.committed, fleet.epoch = {"1": "p2", "2": "p2", "3": "p3"}, 5
        watcher.observe(await watcher.view())

    trio.run(main)
    w.close()
    assert fleet.calls == ["p1", "p2", "p3", "p3"]
    events = [json.loads(line) for line in (tmp_path / "fleet.jsonl").read_text().splitlines()]
    assert [(e["event"], e["node"], e["epoch"]) for e in events] == [("node_down", "p1", 4),
                                                                      ("assignment_committed", None, 5)]


def test_partition_only_on_proxy_loopback_addresses():
    assert check_address("127.0.0.12") == "127.0.0.12"
    for bad in ("127.0.0.1", "10.0.0.5", "192.168.1.1", "::1"):
        with pytest.raises((PartitionError, ValueError)):
            check_address(bad)


class ClockFleet(TinyFleet):
    """Like TinyFleet, but with the node's own event log stamped with time.monotonic()."""

    def __init__(self):
        super().__init__()
        self.events = []

    def status(self, node):
        return attrs.evolve(super().status(node), now=time.monotonic(), events=tuple(self.events))


def test_watcher_takes_the_fleets_own_event_time(tmp_path):
    fleet = ClockFleet()
    w = TraceWriter(tmp_path, "fleet", "r1")
    watcher = ReactionWatcher(fleet, w)
    marks = {}

    async def main():
        watcher.observe(await watcher.view(), baseline=True)
        await trio.sleep(0.01)
        marks["down"] = time.time_ns()
        fleet.events.append({"t": time.monotonic(), "event": "committed", "command": "MarkDown", "epoch": 4,
                             "nodes": ["p1"]})
        fleet.up["p1"] = False
        await trio.sleep(0.1)  # the poll comes 100 ms after the change
        marks["commit"] = time.time_ns()
        fleet.events.append({"t": time.monotonic(), "event": "committed", "command": "Reassign", "epoch": 5})
        fleet.committed, fleet.epoch = {"1": "p2", "2": "p2", "3": "p3"}, 5
        await trio.sleep(0.1)
        watcher.observe(await watcher.view())

    trio.run(main)
    w.close()
    down, commit = [json.loads(line) for line in (tmp_path / "fleet.jsonl").read_text().splitlines()]
    assert (down["event"], down["epoch"], commit["event"], commit["epoch"]) == (
        "node_down", 4, "assignment_committed", 5)
    # Stamped at the fleet's event (within 5 ms), not at the poll (100+ ms later).
    assert abs(down["ts_ns"] - marks["down"]) < 5_000_000
    assert abs(commit["ts_ns"] - marks["commit"]) < 5_000_000


def test_describe_error_flattens_groups_and_keeps_the_head():
    def fail(exc):
        try:
            raise exc
        except Exception as caught:
            return caught

    group = ExceptionGroup("outer", [fail(ValueError("x" * 50)), ExceptionGroup("inner", [fail(KeyError("k"))])])
    lines = describe_error(group, limit=10).splitlines()
    assert lines[0].startswith("ValueError: xxxxxxxxxx ... (40 more characters) (test_summary_harness.py:")
    assert lines[1].startswith("KeyError: 'k' (test_summary_harness.py:")


def test_node_down_is_the_detection_and_precedes_the_commit(tmp_path):
    """The breakdown on the nodes' own clock: node_down at the leader's peer_down of the victim
    (even one before the previous poll), assignment_committed at the MarkDown's commit; an older
    peer_down followed by a peer_up is not this fault's detection."""
    w = TraceWriter(tmp_path, "fleet", "r1")
    watcher = ReactionWatcher(fleet=None, trace=w)
    up = {"p1": True, "p2": True, "p3": True}
    table = {"1": "p1", "2": "p2", "3": "p3"}
    watcher.observe(Observation(epoch=5, assignment=table, up=up), baseline=True)
    base = time.time_ns() - 2_000_000_000  # the events happened in the last two seconds
    log = (
        {"event": "peer_down", "node": "p1", "ts_ns": base, "t": 1.0},          # an old flap ...
        {"event": "peer_up", "node": "p1", "ts_ns": base + 100_000_000, "t": 1.1},  # ... over
        {"event": "peer_down", "node": "p1", "ts_ns": base + 1_000_000_000, "t": 2.0},  # detected
    )
    # A poll between the detection and the commit: the table is unchanged yet.
    watcher.observe(Observation(epoch=5, assignment=table, up=up, events=log, sent_wall_ns=base + 1_200_000_000))
    log += ({"event": "committed", "command": "MarkDown", "epoch": 6, "nodes": ["p1"],
             "ts_ns": base + 1_300_000_000, "t": 2.3},)
    watcher.observe(Observation(epoch=6, assignment={"1": "p2", "2": "p2", "3": "p3"}, up={**up, "p1": False},
                                events=log, sent_wall_ns=time.time_ns()))
    w.close()
    down, commit = [json.loads(line) for line in (tmp_path / "fleet.jsonl").read_text().splitlines()]
    assert (down["event"], down["node"], down["epoch"]) == ("node_down", "p1", 6)
    assert down["ts_ns"] == base + 1_000_000_000
    assert (commit["event"], commit["epoch"], commit["ts_ns"]) == ("assignment_committed", 6, base + 1_300_000_000)
