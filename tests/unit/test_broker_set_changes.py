"""The fleet's reaction to brokers joining and leaving the Kafka cluster: the leader commits the
set its data path reports (a broker gone from it already waited out proxy.broker_roster's grace
period), identities of new brokers get owners, a removed broker's identity leaves every node's
map, and only what must move moves."""

from __future__ import annotations

import pytest

from membership.commands import APPLIED, Join, MarkDown, MarkUp, Reassign, SetBrokers
from membership.config import MemberConfig, MemberSpec
from membership.control import MemberCore, Publish, RaftView, SubmitPlan
from membership.planner import Planner
from membership.state import FleetState
from topology import Broker, PortScheme, ProxyNode, is_balanced

pytestmark = pytest.mark.unit

P = {i: ProxyNode(f"p{i}", f"127.0.0.1{i}", 9092, ports=PortScheme.offset(19000)) for i in (1, 2, 3)}
B = {i: Broker(i, f"kafka{i}", 9092) for i in range(1, 9)}
LIVE = frozenset({"p1", "p2", "p3"})
TABLE = {1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2", 6: "p3"}


def fleet(brokers=range(1, 7), table=TABLE) -> FleetState:
    s = FleetState()
    for command in (Join(P[1]), Join(P[2]), Join(P[3]), SetBrokers([B[i] for i in brokers])):
        s, r = s.apply(command)
        assert r.outcome == APPLIED
    s, r = s.apply(MarkUp(set(LIVE), s.epoch, table))
    assert r.outcome == APPLIED
    return s


def settle(s: FleetState, planner: Planner, brokers, now: float, steps: int = 5) -> tuple[FleetState, list]:
    """Apply the leader's commands until it has nothing left to propose."""
    commands = []
    for i in range(steps):
        cmd = planner.next_command(s, LIVE, now + i * 0.01, brokers)
        if cmd is None:
            return s, commands
        s, r = s.apply(cmd)
        assert r.outcome == APPLIED, r
        commands.append(cmd)
    raise AssertionError(f"not settled after {steps} commands: {commands}")


def test_a_removed_broker_leaves_the_table_and_nothing_else_moves():
    s = fleet()
    planner = Planner(rebalance_delay=1.0)
    planner.observe(LIVE, 0.0)
    reported = [B[i] for i in (1, 2, 3, 4, 5)]
    s, commands = settle(s, planner, reported, now=5.0)
    assert commands == [SetBrokers(reported)]
    assert s.owner_map() == {b: p for b, p in TABLE.items() if b != 6}
    assert s.is_valid()


def test_removing_a_nodes_every_broker_rebalances_once_it_has_been_live_long_enough():
    s = fleet()
    planner = Planner(rebalance_delay=1.0)
    planner.observe(LIVE, 0.0)
    reported = [B[i] for i in (1, 2, 4, 5)]  # p3's brokers 3 and 6 are gone
    s, commands = settle(s, planner, reported, now=5.0)
    assert [type(c) for c in commands] == [SetBrokers, Reassign]
    owners = s.owner_map()
    assert sorted(owners) == [1, 2, 4, 5] and is_balanced(owners, sorted(LIVE))
    assert sum(owners[b] != TABLE[b] for b in owners) == 1  # one identity moved to p3, the rest stay


def test_a_broker_replaced_by_a_new_one_takes_its_place():
    s = fleet()
    planner = Planner(rebalance_delay=1.0)
    planner.observe(LIVE, 0.0)
    reported = [B[i] for i in (1, 2, 3, 4, 5, 7)]  # 6 decommissioned, 7 added
    s, commands = settle(s, planner, reported, now=5.0)
    assert [type(c) for c in commands] == [SetBrokers, Reassign]
    assert s.owner_map() == {**{b: p for b, p in TABLE.items() if b != 6}, 7: "p3"}


def test_new_brokers_get_owners_at_once_balanced():
    s = fleet(brokers=(1, 2, 3), table={1: "p1", 2: "p2", 3: "p3"})
    planner = Planner(rebalance_delay=60.0)  # no rebalance delay stands in the way of a new broker
    planner.observe(LIVE, 0.0)
    reported = [B[i] for i in (1, 2, 3, 4, 5, 6)]
    s, commands = settle(s, planner, reported, now=0.5)
    assert [type(c) for c in commands] == [SetBrokers, Reassign]
    owners = s.owner_map()
    assert {b: owners[b] for b in (1, 2, 3)} == {1: "p1", 2: "p2", 3: "p3"}
    assert is_balanced(owners, sorted(LIVE)) and sorted(owners) == [1, 2, 3, 4, 5, 6]


def test_a_leader_that_just_started_reporting_removes_nothing_before_the_grace_period():
    """A node started during a broker's rolling restart never knew that broker: as a new leader,
    its report lacks it. It adds what is new at once, removes only after reporting that long."""
    s = fleet()
    planner = Planner(rebalance_delay=1.0, broker_grace=30.0)
    planner.observe(LIVE, 0.0)
    reported = [B[i] for i in (1, 2, 3, 4, 5, 7)]  # 6 missing (restarting?), 7 new
    s, commands = settle(s, planner, reported, now=100.0)
    assert commands[0] == SetBrokers([B[i] for i in (1, 2, 3, 4, 5, 6, 7)])  # 7 added, 6 kept
    assert sorted(s.owner_map()) == [1, 2, 3, 4, 5, 6, 7]
    assert planner.next_command(s, LIVE, 129.9, reported) is None
    assert planner.next_command(s, LIVE, 130.0, reported) == SetBrokers(reported)
    # Leadership lost and won again: the clock starts over.
    planner.reset()
    assert planner.next_command(s, LIVE, 200.0, reported) is None
    assert planner.next_command(s, LIVE, 230.0, reported) == SetBrokers(reported)
    # Back within the grace period: nothing to do at all.
    planner.reset()
    assert planner.next_command(s, LIVE, 300.0, [B[i] for i in range(1, 8)]) is None


def test_a_dead_node_is_marked_down_before_the_broker_set_changes():
    s = fleet()
    planner = Planner(rebalance_delay=1.0)
    cmd = planner.next_command(s, {"p1", "p2"}, 0.0, [B[i] for i in range(1, 8)])
    assert isinstance(cmd, MarkDown) and cmd.nodes == frozenset({"p3"})


def test_without_a_report_the_leader_keeps_the_committed_brokers():
    s = fleet()
    assert Planner(rebalance_delay=1.0).next_command(s, LIVE, 0.0, None) is None


# ---- through MemberCore: the leader proposes, every node's map follows --------------------------

NODES = [ProxyNode(p, f"127.0.0.{11 + i}", 9092, ports=PortScheme.offset(19000)) for i, p in enumerate(("a", "b"))]
SPECS = [MemberSpec(n, n.host, 7000) for n in NODES]


def core(node: str) -> MemberCore:
    return MemberCore(MemberConfig(node_id=node, members=SPECS, password="pw"), now=0.0)


def committed(brokers) -> FleetState:
    s = FleetState()
    for n in NODES:
        s, _ = s.apply(Join(n))
    s, _ = s.apply(SetBrokers(brokers))
    s, _ = s.apply(MarkUp({"a", "b"}, s.epoch, {b.id: "ab"[i % 2] for i, b in enumerate(brokers)}))
    return s


def published(actions) -> list:
    return [a.map for a in actions if isinstance(a, Publish)]


def test_the_leader_proposes_the_smaller_set_its_data_path_reports():
    c = core("a")
    state = committed([B[1], B[2], B[3]])
    c.set_brokers([B[1], B[2]])
    plan = [a for a in c.tick(2.0, frozenset("ab"), True, RaftView("leader", "a", 1, state))
            if isinstance(a, SubmitPlan)]
    assert [p.command for p in plan] == [SetBrokers([B[1], B[2]])]
    c.set_brokers([])  # "does not know" (no answer): the last report stands
    assert c.local_brokers == (B[1], B[2])


def test_a_follower_advertises_a_removed_broker_until_its_own_roster_lets_it_go():
    c = core("b")
    live = frozenset("ab")
    before = committed([B[1], B[2], B[3]])
    after, r = before.apply(SetBrokers([B[1], B[2]]))
    assert r.outcome == APPLIED
    c.set_brokers([B[1], B[2], B[3]])
    maps = published(c.tick(1.0, live, True, RaftView("follower", "a", 1, before)))
    assert sorted(maps[-1].owner_map()) == [1, 2, 3]
    # Committed without broker 3, but this node's data path still sees it: still covered.
    maps = published(c.tick(1.1, live, True, RaftView("follower", "a", 1, after)))
    assert not maps or sorted(maps[-1].owner_map()) == [1, 2, 3]
    assert sorted(c.serving.owner_map()) == [1, 2, 3]
    # Its own roster forgot it too: a new map without it (the data path then releases the listener).
    c.set_brokers([B[1], B[2]])
    maps = published(c.tick(1.2, live, True, RaftView("follower", "a", 1, after)))
    assert len(maps) == 1 and sorted(maps[0].owner_map()) == [1, 2]
    assert 3 not in maps[0].address_map()


def test_a_refusal_publishes_a_map_naming_the_refused_peer_before_any_commit():
    """membership.control passes the heartbeat's refused peers into the map (their address floats
    at once: proxy.takeover.down_nodes); owners and the committed view stay as they were."""
    c = core("a")
    state = committed([B[1], B[2]])
    view = RaftView("follower", "b", 1, state)
    (first,) = published(c.tick(1.0, frozenset("ab"), True, view))
    assert first.refused == frozenset()
    (gone,) = published(c.tick(1.1, frozenset("a"), True, view, refused=frozenset({"b"})))
    assert gone.refused == {"b"} and gone.owners == first.owners and gone.vacant == first.vacant
    assert published(c.tick(1.2, frozenset("a"), True, view, refused=frozenset({"b"}))) == []  # nothing new
    (back,) = published(c.tick(5.0, frozenset("ab"), True, view))
    assert back.refused == frozenset()
