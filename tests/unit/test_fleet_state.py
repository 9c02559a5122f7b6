"""FleetState.apply: conditional epochs, idempotence, replays; the planner; the effective view."""

from __future__ import annotations

import pickle

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from membership.commands import (
    APPLIED,
    REJECTED,
    UNCHANGED,
    Drain,
    Join,
    MarkDown,
    MarkUp,
    Reassign,
    SetBrokers,
    Undrain,
)
from membership.effective import QuorumLease, build_serving_map, committed_is_sane, effective_owners
from membership.serving import BOOTSTRAP, StandIn
from membership.planner import Planner
from membership.state import FleetState
from topology import Broker, PortScheme, ProxyNode, is_balanced

pytestmark = pytest.mark.unit

P = {i: ProxyNode(f"p{i}", f"127.0.0.1{i}", 9092, ports=PortScheme.offset(19000)) for i in (1, 2, 3)}
B = {i: Broker(i, f"kafka{i}", 9092) for i in range(1, 7)}


def run(state, *commands):
    results = []
    for c in commands:
        state, r = state.apply(c)
        results.append(r)
    return state, results


def fleet3():
    """p1..p3 joined and up, brokers 1..6, table 2/2/2: epoch 8."""
    s, rs = run(
        FleetState(),
        Join(P[1]),
        Join(P[2]),
        Join(P[3]),
        SetBrokers(B.values()),
    )
    assert [r.outcome for r in rs] == [APPLIED] * 4
    s, r = s.apply(MarkUp({"p1", "p2", "p3"}, 4, {1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2", 6: "p3"}))
    assert r.outcome == APPLIED and s.epoch == 5
    return s


# ---- apply -------------------------------------------------------------------------------


def test_join_is_idempotent_and_updates():
    s, [r1, r2] = run(FleetState(), Join(P[1]), Join(P[1]))
    assert (r1.outcome, r1.epoch) == (APPLIED, 1)
    assert (r2.outcome, r2.epoch) == (UNCHANGED, 1)
    moved = attrs.evolve(P[1], bootstrap_port=9999)
    s, r = s.apply(Join(moved))
    assert (r.outcome, r.epoch) == (APPLIED, 2)
    assert s.member_map()["p1"].bootstrap_port == 9999
    assert s.up == frozenset()  # joining does not make a node eligible: the leader marks it up


def test_join_with_conflicting_address_is_rejected():
    s, _ = run(FleetState(), Join(P[1]), SetBrokers([B[1]]))
    clash = ProxyNode("px", "127.0.0.11", 19001)  # p1 serves broker 1 at 127.0.0.11:19001
    s2, r = s.apply(Join(clash))
    assert r.outcome == REJECTED and "conflict" in r.reason
    assert s2 is s


def test_set_brokers_replaces_and_forgets_owners_of_removed_brokers():
    s = fleet3()
    s2, r = s.apply(SetBrokers([B[1], B[2], B[3], B[4], B[5]]))
    assert (r.outcome, r.epoch) == (APPLIED, 6)
    assert s2.owner_map() == {1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2"}
    assert s2.apply(SetBrokers([B[5], B[4], B[3], B[2], B[1]]))[1].outcome == UNCHANGED
    bad = SetBrokers([Broker(7, "k", 1), Broker(7, "k2", 2)])
    assert s2.apply(bad)[1].outcome == REJECTED
    # Broker id 46536 puts p1's port past 65535 (19000 + 46536).
    assert s2.apply(SetBrokers([Broker(46536, "k", 1)]))[1].outcome == REJECTED


def test_mark_down_is_conditional_and_idempotent():
    s = fleet3()
    table = {1: "p1", 2: "p2", 3: "p1", 4: "p1", 5: "p2", 6: "p2"}
    stale = MarkDown({"p3"}, 4, table)
    s_stale, r = s.apply(stale)
    assert r.outcome == REJECTED and "stale" in r.reason and s_stale is s
    cmd = MarkDown({"p3"}, 5, table)
    s2, r = s.apply(cmd)
    assert (r.outcome, r.epoch) == (APPLIED, 6)
    assert s2.up == {"p1", "p2"} and s2.owner_map() == table
    # Replay (a retried proposal, a re-applied log entry): no change.
    s3, r = s2.apply(cmd)
    assert (r.outcome, r.epoch) == (UNCHANGED, 6) and s3 is s2


def test_mark_down_must_move_the_dead_nodes_identities():
    s = fleet3()
    s2, r = s.apply(MarkDown({"p3"}, 5, s.owner_map()))  # table still names p3
    assert r.outcome == REJECTED and "p3" in r.reason
    s2, r = s.apply(MarkDown({"p9"}, 5, s.owner_map()))
    assert r.outcome == REJECTED and "unknown" in r.reason


def test_mark_up_keeps_the_table_then_reassign_rebalances():
    s = fleet3()
    s, _ = s.apply(MarkDown({"p3"}, 5, {1: "p1", 2: "p2", 3: "p1", 4: "p1", 5: "p2", 6: "p2"}))
    s, r = s.apply(MarkUp({"p3"}, 6))
    assert (r.outcome, r.epoch) == (APPLIED, 7)
    assert "p3" not in s.owner_map().values() and s.is_valid()
    s, r = s.apply(Reassign(6, {1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2", 6: "p3"}))
    assert r.outcome == REJECTED
    s, r = s.apply(Reassign(7, {1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2", 6: "p3"}))
    assert (r.outcome, r.epoch) == (APPLIED, 8)
    assert s.apply(Reassign(7, s.owner_map()))[1].outcome == UNCHANGED


def test_reassign_rejects_invalid_tables():
    s = fleet3()
    cases = [
        ({1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2"}, "without owner"),
        ({**s.owner_map(), 7: "p1"}, "unknown brokers"),
        ({**s.owner_map(), 1: "p9"}, "not eligible"),
    ]
    for table, reason in cases:
        s2, r = s.apply(Reassign(5, table))
        assert r.outcome == REJECTED and reason in r.reason, (table, r)
        assert s2 is s


def test_drain_and_undrain():
    s = fleet3()
    s, r = s.apply(Drain("p2"))
    assert (r.outcome, r.epoch) == (APPLIED, 6)
    assert s.apply(Drain("p2"))[1].outcome == UNCHANGED
    assert s.apply(Drain("p9"))[1].outcome == REJECTED
    # The committed table still names p2: invalid; every replica repairs it the same way.
    assert not s.is_valid()
    # p2's 2 and 5 move: 2 to p1 (tie with p3, lower id), 5 to p3 (p1 is full at 3).
    assert s.repaired() == {1: "p1", 2: "p1", 3: "p3", 4: "p1", 5: "p3", 6: "p3"}
    assert s.apply(Reassign(6, s.owner_map()))[1].outcome == UNCHANGED  # same table: nothing to do
    s2, r = s.apply(Reassign(6, {**s.owner_map(), 2: "p1"}))
    assert r.outcome == REJECTED and "p2" in r.reason
    s, r = s.apply(Reassign(6, s.repaired()))
    assert r.outcome == APPLIED
    s, r = s.apply(Undrain("p2"))
    assert (r.outcome, r.epoch) == (APPLIED, 8)
    assert s.apply(Undrain("p2"))[1].outcome == UNCHANGED


def test_all_drained_still_serve():
    s = fleet3()
    s, _ = run(s, Drain("p1"), Drain("p2"), Drain("p3"))
    assert s.eligible() == {"p1", "p2", "p3"}
    assert s.is_valid()


def test_unknown_command_is_rejected():
    s = fleet3()
    s2, r = s.apply("not a command")  # type: ignore[arg-type]
    assert r.outcome == REJECTED and s2 is s


# ---- random logs: invariants, replays, duplicates ---------------------------------------------

NODE_IDS = ["p1", "p2", "p3"]


@st.composite
def command_st(draw):
    kind = draw(st.sampled_from(["join", "brokers", "drain", "undrain", "down", "up", "reassign"]))
    epoch = draw(st.integers(0, 12))
    table = {
        b: draw(st.sampled_from(NODE_IDS)) for b in draw(st.sets(st.sampled_from(sorted(B)), max_size=6))
    }
    nodes = draw(st.sets(st.sampled_from(NODE_IDS), min_size=1, max_size=2))
    if kind == "join":
        return Join(P[draw(st.sampled_from([1, 2, 3]))])
    if kind == "brokers":
        return SetBrokers([B[i] for i in draw(st.sets(st.sampled_from(sorted(B)), max_size=6))])
    if kind == "drain":
        return Drain(draw(st.sampled_from(NODE_IDS)))
    if kind == "undrain":
        return Undrain(draw(st.sampled_from(NODE_IDS)))
    if kind == "down":
        return MarkDown(nodes, epoch, table)
    if kind == "up":
        return MarkUp(nodes, epoch, draw(st.none() | st.just(table)))
    return Reassign(epoch, table)


@given(st.lists(command_st(), max_size=40))
def test_random_logs_keep_the_invariants(log):
    s = FleetState()
    for cmd in log:
        new, r = s.apply(cmd)
        if r.outcome == APPLIED:
            assert new.epoch == s.epoch + 1 == r.epoch
            assert new != s
        else:
            assert new is s and r.epoch == s.epoch
        # No broker has two owners, owners only name members, up only names members.
        ids = [b for b, _ in new.owners]
        assert len(ids) == len(set(ids))
        assert new.up <= new.member_ids() and new.draining <= new.member_ids()
        assert set(new.owner_map()) <= new.broker_ids()
        # Leader decisions only ever install valid tables.
        if r.outcome == APPLIED and isinstance(cmd, (MarkDown, Reassign)):
            assert new.is_valid()
        # The repaired table is always valid.
        assert new.problem(new.repaired()) is None
        s = new
    # Replay from scratch: the same state (what a restarted replica does).
    replay, _ = run(FleetState(), *log)
    assert replay == s
    # Every command applied twice in a row (a retry after "maybe applied"): the same state.
    doubled, _ = run(FleetState(), *[c for cmd in log for c in (cmd, cmd)])
    assert doubled == s
    # States and commands survive the pickle the Raft log uses.
    assert pickle.loads(pickle.dumps(s, 2)) == s
    assert [pickle.loads(pickle.dumps(c, 2)) for c in log] == log


# ---- planner -----------------------------------------------------------------------------


def test_planner_death_is_one_command_moving_only_the_dead_nodes_identities():
    s = fleet3()
    planner = Planner(rebalance_delay=1.0)
    assert planner.next_command(s, {"p1", "p2", "p3"}, now=0.0) is None
    cmd = planner.next_command(s, {"p1", "p2"}, now=0.1)
    assert cmd == MarkDown({"p3"}, 5, {1: "p1", 2: "p2", 3: "p1", 4: "p1", 5: "p2", 6: "p2"})
    s, r = s.apply(cmd)
    assert r.outcome == APPLIED
    assert planner.next_command(s, {"p1", "p2"}, now=0.2) is None


def test_planner_rejoin_in_two_steps_after_the_delay():
    s = fleet3()
    planner = Planner(rebalance_delay=1.0)
    s, _ = s.apply(planner.next_command(s, {"p1", "p2"}, now=0.0))
    # p3 is back at t=5: marked up at once, without identities.
    cmd = planner.next_command(s, {"p1", "p2", "p3"}, now=5.0)
    assert cmd == MarkUp({"p3"}, 6)
    s, _ = s.apply(cmd)
    assert planner.next_command(s, {"p1", "p2", "p3"}, now=5.5) is None  # not live for 1 s yet
    # p3 flaps: down again, up again at t=5.8 -> the clock restarts.
    s, _ = s.apply(planner.next_command(s, {"p1", "p2"}, now=5.7))
    s, _ = s.apply(planner.next_command(s, {"p1", "p2", "p3"}, now=5.8))
    assert planner.next_command(s, {"p1", "p2", "p3"}, now=6.5) is None
    cmd = planner.next_command(s, {"p1", "p2", "p3"}, now=6.8)
    assert isinstance(cmd, Reassign) and cmd.expected_epoch == s.epoch
    s, r = s.apply(cmd)
    assert r.outcome == APPLIED
    loads = {p: list(s.owner_map().values()).count(p) for p in NODE_IDS}
    assert loads == {"p1": 2, "p2": 2, "p3": 2}


def test_planner_drain_moves_at_once_and_undrain_rebalances():
    s = fleet3()
    planner = Planner(rebalance_delay=1.0)
    live = {"p1", "p2", "p3"}
    planner.observe(live, 0.0)
    s, _ = s.apply(Drain("p1"))
    cmd = planner.next_command(s, live, now=0.1)
    assert cmd == Reassign(6, s.repaired())
    s, _ = s.apply(cmd)
    assert "p1" not in s.owner_map().values()
    s, _ = s.apply(Undrain("p1"))
    cmd = planner.next_command(s, live, now=2.0)  # p1 live since t=0: no wait
    assert isinstance(cmd, Reassign)
    s, _ = s.apply(cmd)
    assert is_balanced(s.owner_map(), NODE_IDS)


def test_planner_commits_reported_brokers_and_assigns_new_ones():
    s = fleet3()
    planner = Planner(rebalance_delay=1.0)
    live = {"p1", "p2", "p3"}
    reported = [*B.values(), Broker(7, "kafka7", 9092)]
    cmd = planner.next_command(s, live, 0.0, brokers=reported)
    assert cmd == SetBrokers(reported)
    s, _ = s.apply(cmd)
    cmd = planner.next_command(s, live, 0.1, brokers=reported)
    assert cmd == Reassign(6, {**fleet3().owner_map(), 7: "p1"})


def test_planner_on_a_fresh_fleet():
    s, _ = run(FleetState(), Join(P[1]), Join(P[2]), SetBrokers([B[1], B[2]]))
    planner = Planner(rebalance_delay=0.0)
    cmd = planner.next_command(s, {"p1"}, 0.0)
    assert cmd == MarkUp({"p1"}, 3, {1: "p1", 2: "p1"})  # table invalid (empty): assigned at once
    s, _ = s.apply(cmd)
    s, _ = s.apply(planner.next_command(s, {"p1", "p2"}, 0.1))
    cmd = planner.next_command(s, {"p1", "p2"}, 0.2)
    assert cmd == Reassign(5, {1: "p1", 2: "p2"})


# ---- effective view ------------------------------------------------------------------------


def test_effective_normal_is_the_repaired_committed_table():
    s = fleet3()
    s, _ = s.apply(Drain("p3"))
    owners = effective_owners(
        s, self_id="p1", nodes={n.id: n for n in P.values()}, reachable={"p1"}, degraded=False
    )
    assert owners == s.repaired() == {1: "p1", 2: "p2", 3: "p1", 4: "p1", 5: "p2", 6: "p2"}


def test_effective_covers_locally_known_brokers():
    s = fleet3()
    owners = effective_owners(
        s,
        self_id="p1",
        nodes={n.id: n for n in P.values()},
        reachable={"p1", "p2", "p3"},
        degraded=False,
        local_brokers=[B[1], Broker(9, "kafka9", 9092)],
    )
    assert owners == {**s.owner_map(), 9: "p1"}


def test_effective_degraded_takes_over_unreachable_owners():
    s = fleet3()
    nodes = {n.id: n for n in P.values()}
    alone = effective_owners(s, self_id="p2", nodes=nodes, reachable={"p2"}, degraded=True)
    assert alone == {b: "p2" for b in range(1, 7)}
    # p1 still reaches p3: p1 and p3 keep theirs and share p2's.
    pair = effective_owners(s, self_id="p1", nodes=nodes, reachable={"p1", "p3"}, degraded=True)
    assert pair == {1: "p1", 2: "p1", 3: "p3", 4: "p1", 5: "p3", 6: "p3"}
    # Same view from p3's side: the same answer.
    assert effective_owners(s, self_id="p3", nodes=nodes, reachable={"p1", "p3"}, degraded=True) == pair
    # Not degraded: the committed table, unreachable owners or not.
    assert effective_owners(s, self_id="p2", nodes=nodes, reachable={"p2"}, degraded=False) == s.owner_map()


def test_build_serving_map_addresses():
    s = fleet3()
    eff = build_serving_map(s, self_id="p1", configured={}, reachable={"p1"}, degraded=False)
    assert eff.epoch == 5 and eff.error is None
    assert eff.address_map()[3] == ("127.0.0.13", 19003)
    assert eff.address_map()[4] == ("127.0.0.11", 19004)


def test_committed_is_sane():
    s = fleet3()
    assert committed_is_sane(s, {"p1", "p2", "p3"})
    assert not committed_is_sane(s, {"p1", "p2"})


def test_quorum_lease_hysteresis():
    lease = QuorumLease(1.0, now=0.0)
    assert lease.update(0.5, has_quorum=False, committed_sane=False) is False
    assert lease.update(1.0, has_quorum=False, committed_sane=False) is True  # no quorum since start
    # Quorum back but the table still names dead owners: stay degraded up to the lease.
    assert lease.update(2.0, has_quorum=True, committed_sane=False) is True
    assert lease.update(2.9, has_quorum=True, committed_sane=False) is True
    assert lease.update(3.0, has_quorum=True, committed_sane=False) is False
    # Lost again at 4.0; back at 4.5 before the lease: never degraded.
    assert lease.update(4.0, has_quorum=False, committed_sane=True) is False
    assert lease.update(4.5, has_quorum=True, committed_sane=True) is False
    assert lease.update(5.2, has_quorum=False, committed_sane=True) is False
    assert lease.update(6.2, has_quorum=False, committed_sane=True) is True
    # Back with a sane table: normal at once.
    assert lease.update(6.3, has_quorum=True, committed_sane=True) is False


def test_serving_map_stand_ins_follow_the_committed_view():
    """p3 down, p2 draining: p1 (the only one serving) stands in for both on their
    bootstrap ports and on their ports of every identity p1 owns; p2 stands in for nobody."""
    s = fleet3()
    s, r = s.apply(Drain("p2"))
    assert r.outcome == APPLIED
    s, r = s.apply(MarkDown({"p3"}, s.epoch, {b: "p1" for b in range(1, 7)}))
    assert r.outcome == APPLIED
    m = build_serving_map(s, self_id="p1", configured={}, reachable={"p1", "p2"}, degraded=False)
    assert m.vacant == {"p2", "p3"} and m.draining == {"p2"}
    assert m.stand_ins_of("p2") == ()
    mine = m.stand_ins_of("p1")
    assert StandIn("p1", "p3", BOOTSTRAP, "127.0.0.13", 9092) in mine
    assert StandIn("p1", "p2", 4, "127.0.0.12", 19004) in mine
    assert len(mine) == 2 * (1 + 6)
    assert {n.id for n in m.nodes} == {"p1", "p2", "p3"}


def test_serving_map_down_but_alive_node_still_stands_in_for_others():
    s = fleet3()
    s, r = s.apply(MarkDown({"p2", "p3"}, s.epoch, {b: "p1" for b in range(1, 7)}))
    assert r.outcome == APPLIED
    m = build_serving_map(s, self_id="p2", configured={}, reachable={"p1", "p2"}, degraded=False)
    assert {(x.vacant, x.listener) for x in m.stand_ins_of("p2")} == {("p3", BOOTSTRAP)}
    assert all(x.vacant != x.node for x in m.stand_ins)


def test_serving_map_vacant_can_be_given():
    s = fleet3()
    m = build_serving_map(s, self_id="p1", configured={}, reachable={"p1"}, degraded=True, vacant={"p2"})
    assert m.vacant == {"p2"} and m.degraded
    assert {x.vacant for x in m.stand_ins} == {"p2"}


def _racked_fleet():
    """p1..p3 on rack-1..3, brokers 1..3 on the same racks, each node serving its rack's broker."""
    nodes = [attrs.evolve(P[i], rack=f"rack-{i}") for i in (1, 2, 3)]
    brokers = [Broker(i, f"kafka{i}", 9092, rack=f"rack-{i}") for i in (1, 2, 3)]
    s, _ = run(FleetState(), *(Join(n) for n in nodes), SetBrokers(brokers))
    s, r = s.apply(MarkUp({"p1", "p2", "p3"}, s.epoch, {1: "p1", 2: "p2", 3: "p3"}))
    assert r.outcome == APPLIED
    return s


def _settle(s, planner, live, now):
    for step in range(10):
        cmd = planner.next_command(s, live, now + step * 0.01)
        if cmd is None:
            return s
        s, r = s.apply(cmd)
        assert r.outcome == APPLIED, r
    raise AssertionError("the planner did not settle in 10 commands")


def test_planner_returns_identities_to_their_racks_after_drains_and_undrains():
    """Drain p1 then p2, undrain both: each node serves its own rack's broker again
    (a balanced table that only swaps racks is not left alone)."""
    s = _racked_fleet()
    planner = Planner(rebalance_delay=1.0)
    live = {"p1", "p2", "p3"}
    planner.observe(live, 0.0)
    s = _settle(s.apply(Drain("p1"))[0], planner, live, 2.0)
    s = _settle(s.apply(Drain("p2"))[0], planner, live, 3.0)
    assert set(s.owner_map().values()) == {"p3"}
    s = _settle(s.apply(Undrain("p1"))[0], planner, live, 4.0)
    s = _settle(s.apply(Undrain("p2"))[0], planner, live, 5.0)
    assert s.owner_map() == {1: "p1", 2: "p2", 3: "p3"}


def test_planner_swaps_racks_home_only_for_nodes_live_long_enough():
    s = _racked_fleet()
    s, r = s.apply(Reassign(s.epoch, {1: "p2", 2: "p1", 3: "p3"}))  # balanced, p1 and p2 off-rack
    assert r.outcome == APPLIED
    planner = Planner(rebalance_delay=1.0)
    planner.observe({"p1", "p2", "p3"}, 0.0)
    assert planner.next_command(s, {"p1", "p2", "p3"}, 0.5) is None  # p1, p2 not live for 1 s yet
    assert planner.next_command(s, {"p1", "p2", "p3"}, 1.0) == Reassign(s.epoch, {1: "p1", 2: "p2", 3: "p3"})


@given(st.data())
def test_settled_table_keeps_loads_and_only_adds_identities_on_their_racks(data):
    from membership.planner import settled_table
    from topology import assign, same_rack

    racks = st.sampled_from(["r1", "r2", "r3", None])
    nodes = [attrs.evolve(P[i], rack=data.draw(racks)) for i in (1, 2, 3)]
    brokers = [Broker(i, f"kafka{i}", 9092, rack=data.draw(racks)) for i in range(1, data.draw(st.integers(1, 7)))]
    current = {b.id: data.draw(st.sampled_from(["p1", "p2", "p3"])) for b in brokers}
    balanced = assign(brokers, nodes, current)
    settled = settled_table(brokers, nodes, current)

    def loads(t):
        return sorted(list(t.values()).count(p) for p in ("p1", "p2", "p3"))

    def home(t):
        node = {n.id: n for n in nodes}
        return sum(same_rack(b, node[t[b.id]]) for b in brokers)

    assert loads(settled) == loads(balanced) and set(settled) == set(current)
    assert home(settled) >= home(balanced)
    assert settled_table(brokers, nodes, settled) == settled  # nothing left to do once settled
