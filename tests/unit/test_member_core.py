"""MemberCore's gating rules, one at a time, with a hand-driven clock."""

from __future__ import annotations

import pytest

from membership.commands import Join, MarkUp, Result
from membership.config import MemberConfig, MemberSpec
from membership.control import (DeferElection, HastenElection, KeepLinksOpen, MemberCore, RaftView, SubmitJoin,
                                SubmitPlan, majority_heard_at)
from membership.state import FleetState
from topology import ProxyNode

pytestmark = pytest.mark.unit

NODES = [ProxyNode(p, f"127.0.0.{11 + i}", 9092) for i, p in enumerate(("a", "b", "c"))]
SPECS = [MemberSpec(n, n.host, 7000) for n in NODES]


def core(node: str = "a") -> MemberCore:
    return MemberCore(MemberConfig(node_id=node, members=SPECS, password="pw"), now=0.0)


def joined() -> FleetState:
    s = FleetState()
    for n in NODES:
        s, _ = s.apply(Join(n))
    return s


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def test_join_once_until_committed_retry_after_failure():
    c = core()
    first = of(SubmitJoin, c.tick(0.0, frozenset("a"), False, RaftView()))
    assert [a.command for a in first] == [Join(NODES[0])]
    assert of(SubmitJoin, c.tick(0.1, frozenset("a"), False, RaftView())) == []  # one attempt at a time
    c.join_done(first[0].token, ok=False, now=0.1)
    assert of(SubmitJoin, c.tick(0.2, frozenset("a"), False, RaftView())) == []  # JOIN_RETRY_S later
    assert len(of(SubmitJoin, c.tick(0.31, frozenset("a"), False, RaftView()))) == 1
    assert of(SubmitJoin, c.tick(0.4, frozenset("a"), False, RaftView(state=joined()))) == []


def test_leader_waits_for_warm_up_then_keeps_one_command_in_flight():
    c = core()
    leader = RaftView("leader", "a", 1, joined())
    live = frozenset("abc")
    assert of(SubmitPlan, c.tick(0.1, live, False, leader)) == []  # peers not heard yet, < suspect_timeout
    plan = of(SubmitPlan, c.tick(0.2, live, True, leader))
    assert len(plan) == 1
    assert of(SubmitPlan, c.tick(0.5, live, True, leader)) == []  # in flight
    c.plan_done(plan[0].token, plan[0].command, Result("applied", 4), None, 0.6)
    assert len(of(SubmitPlan, c.tick(0.6, live, True, leader))) == 1  # the same stale state: asked again at once
    c2 = core()
    assert len(of(SubmitPlan, c2.tick(1.0, live, False, leader))) == 1  # suspect_timeout passed


def test_election_hastened_in_id_order_and_keepalives_scheduled():
    view = RaftView("follower", "a", 2, joined())  # an even term: b, c (an odd one turns it: c, b)
    b, c = core("b"), core("c")
    assert of(HastenElection, b.tick(0.0, frozenset("bc"), True, view)) == [HastenElection(0.0)]
    assert of(HastenElection, c.tick(0.0, frozenset("bc"), True, view)) == [HastenElection(0.1)]
    assert of(HastenElection, b.tick(0.1, frozenset("abc"), True, view)) == []
    assert of(KeepLinksOpen, b.tick(0.26, frozenset("abc"), True, view)) == [KeepLinksOpen(frozenset("ac"))]
    assert of(KeepLinksOpen, b.tick(0.3, frozenset("abc"), True, view)) == []  # every connection_timeout / 4
    assert of(KeepLinksOpen, b.tick(0.52, frozenset("ab"), True, view)) == [KeepLinksOpen(frozenset("a"))]


def test_degraded_map_keeps_the_last_committed_vacant_set():
    c = core()
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b"}, s.epoch))
    c.tick(0.0, frozenset("ab"), True, RaftView("follower", "b", 1, s))
    assert c.serving.vacant == {"c"} and not c.serving.degraded
    c.tick(5.0, frozenset("a"), True, RaftView("candidate", None, 1, s))  # quorum lost...
    assert not c.serving.degraded
    c.tick(6.6, frozenset("a"), True, RaftView("candidate", None, 1, s))  # ...for longer than the lease
    assert c.serving.degraded and c.serving.vacant == {"c"}


def test_with_no_majority_left_the_lease_counts_from_when_one_was_last_heard():
    """Two of three peers silent: no election can bring quorum back, so the lease (1.5 s) runs
    from the last datagram that completed a majority (b's, at 4.2), not from the tick that saw
    it gone (5.0). With the majority still there (a leader election), it runs from that tick."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b", "c"}, s.epoch))
    c = core()
    c.tick(0.0, frozenset("abc"), True, RaftView("follower", "b", 1, s), heard_at={"b": 0.0, "c": 0.0})
    c.tick(4.8, frozenset("ab"), True, RaftView("follower", "b", 1, s), heard_at={"b": 4.2, "c": 3.1})
    alone = RaftView("candidate", None, 1, s)
    c.tick(5.0, frozenset("a"), True, alone, heard_at={"b": 4.2, "c": 3.1})
    assert not c.serving.degraded
    c.tick(5.69, frozenset("a"), True, alone, heard_at={"b": 4.2, "c": 3.1})
    assert not c.serving.degraded  # 1.49 s after b was last heard
    c.tick(5.71, frozenset("a"), True, alone, heard_at={"b": 4.2, "c": 3.1})
    assert c.serving.degraded and c.serving.unreachable == {"b", "c"}

    electing = core()
    electing.tick(4.9, frozenset("abc"), True, RaftView("follower", "b", 1, s), heard_at={"b": 4.2, "c": 4.9})
    electing.tick(5.0, frozenset("ac"), True, RaftView("follower", None, 1, s), heard_at={"b": 4.2, "c": 5.0})
    electing.tick(6.4, frozenset("ac"), True, RaftView("follower", None, 1, s), heard_at={"b": 4.2, "c": 6.4})
    assert not electing.serving.degraded  # 1.4 s after the tick that lost the leader
    electing.tick(6.5, frozenset("ac"), True, RaftView("follower", None, 1, s), heard_at={"b": 4.2, "c": 6.5})
    assert electing.serving.degraded


def test_a_majority_lost_during_an_election_backdates_the_lease_too():
    """The leader b froze: its beat was overdue first (an election began at 4.6, the quorum lost
    with the majority still there), then b went silent for good (4.95): the lease runs from b's
    last datagram (4.2), not from the election's start."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b"}, s.epoch))
    c = core()
    c.tick(4.2, frozenset("ab"), True, RaftView("follower", "b", 1, s), heard_at={"b": 4.2, "c": 0.0})
    electing = RaftView("candidate", None, 2, s)
    c.tick(4.6, frozenset("ab"), True, electing, heard_at={"b": 4.2, "c": 0.0})
    for t in (4.95, 5.2, 5.45, 5.69):  # a tick every beat
        c.tick(t, frozenset("a"), True, electing, heard_at={"b": 4.2, "c": 0.0})
    assert not c.serving.degraded
    c.tick(5.71, frozenset("a"), True, electing, heard_at={"b": 4.2, "c": 0.0})
    assert c.serving.degraded  # 1.51 s after b's last datagram, 1.11 s after the election began


def test_after_its_own_stall_the_lease_counts_from_now():
    """A node that was frozen (no tick for 4 s) finds every peer silent: that is its own
    deafness, not their loss, so the lease runs from the tick that saw it."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b", "c"}, s.epoch))
    c = core()
    c.tick(1.0, frozenset("abc"), True, RaftView("follower", "b", 1, s), heard_at={"b": 0.9, "c": 0.95})
    thawed = RaftView("follower", "b", 1, s)
    c.tick(5.0, frozenset("a"), True, thawed, heard_at={"b": 0.9, "c": 0.95})
    c.tick(6.4, frozenset("a"), True, thawed, heard_at={"b": 0.9, "c": 0.95})
    assert not c.serving.degraded
    c.tick(6.5, frozenset("a"), True, thawed, heard_at={"b": 0.9, "c": 0.95})
    assert c.serving.degraded


def test_after_its_own_stall_a_node_neither_starts_an_election_nor_plans_until_it_relistened():
    """Thawed, a follower finds the leader "not live" (its queued beats said it no longer heard
    us): true of the freeze, stale by the next beat. It must not depose the leader for it, and
    as a leader it must not mark its peers down on the freeze's view."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b", "c"}, s.epoch))
    b = core("b")
    b.tick(1.0, frozenset("abc"), True, RaftView("follower", "a", 1, s))
    assert of(HastenElection, b.tick(5.0, frozenset("bc"), True, RaftView("follower", "a", 1, s))) == []
    assert of(HastenElection, b.tick(5.35, frozenset("bc"), True, RaftView("follower", "a", 1, s))) == []
    assert of(HastenElection, b.tick(5.41, frozenset("bc"), True, RaftView("follower", "a", 1, s))) != []

    a = core("a")
    a.tick(1.0, frozenset("abc"), True, RaftView("leader", "a", 1, s))
    thawed = RaftView("leader", "a", 1, s)
    assert of(SubmitPlan, a.tick(5.0, frozenset("ab"), True, thawed)) == []
    assert of(SubmitPlan, a.tick(5.35, frozenset("ab"), True, thawed)) == []
    plans = of(SubmitPlan, a.tick(5.41, frozenset("ab"), True, thawed))
    assert [(type(p.command).__name__, sorted(p.command.nodes)) for p in plans] == [("MarkDown", ["c"])]

    late = core("a")  # a tick 0.55 s late (a busy machine), shorter than dead_after_s (0.6): no relisten
    late.tick(1.0, frozenset("abc"), True, RaftView("leader", "a", 1, s))
    plans = of(SubmitPlan, late.tick(1.55, frozenset("ab"), True, RaftView("leader", "a", 1, s)))
    assert [type(p.command).__name__ for p in plans] == ["MarkDown"]


def test_majority_heard_at_is_the_arrival_that_completed_a_majority():
    five = {"a", "b", "c", "d", "e"}
    heard = {"b": 9.0, "c": 7.0, "d": 8.0, "e": 2.0}
    assert majority_heard_at(heard, five, "a") == 8.0  # a + b + d
    assert majority_heard_at({"b": 9.0}, five, "a") is None  # never had two peers
    assert majority_heard_at({"b": 9.0, "a": 10.0}, {"a", "b", "c"}, "a") == 9.0  # self never counts
    assert majority_heard_at({}, {"a"}, "a") is None  # a fleet of one needs nobody


def test_an_isolated_node_claims_no_unreachable_peer_in_degraded_mode():
    """A node that hears nobody because its own receive path is cut (membership.liveness) must
    not float its peers' addresses to itself: its gratuitous ARPs would still reach the clients."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b", "c"}, s.epoch))
    c = core()
    c.tick(0.0, frozenset("abc"), True, RaftView("follower", "b", 1, s))
    c.tick(5.0, frozenset("a"), True, RaftView("candidate", None, 1, s), isolated=True)
    c.tick(6.6, frozenset("a"), True, RaftView("candidate", None, 1, s), isolated=True)
    assert c.serving.degraded and c.serving.isolated and c.serving.unreachable == frozenset()
    c.tick(6.7, frozenset("a"), True, RaftView("candidate", None, 1, s))  # peers failed one by one
    assert not c.serving.isolated and c.serving.unreachable == {"b", "c"}


def test_a_node_cut_off_from_every_peer_neither_campaigns_nor_as_leader_plans():
    """One-way cut (it hears nobody, its datagrams and Raft messages still go out): as a follower
    it must not ask for votes, as a leader it must not propose its view (everyone down), since
    the followers still append its entries and the next leader would commit them."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b", "c"}, s.epoch))
    b = core("b")
    b.tick(1.0, frozenset("abc"), True, RaftView("follower", "a", 1, s), heard_at={"a": 1.0, "c": 1.0})
    for i in range(1, 11):  # a and c went silent at 1.0 (live until 1.6): its beat overdue, then dead
        now = 1.0 + 0.2 * i
        live = frozenset("abc") if now < 1.6 else frozenset("b")
        actions = b.tick(now, live, True, RaftView("follower", "a", 1, s), heard_at={"a": 1.0, "c": 1.0})
        assert of(HastenElection, actions) == []
        assert (of(DeferElection, actions) != []) == (now - 1.0 >= 0.25)  # the others unheard for the window
    healthy = core("b")  # the leader a froze; c still beats (term 2: b asks first)
    healthy.tick(1.0, frozenset("abc"), True, RaftView("follower", "a", 2, s), heard_at={"a": 1.0, "c": 1.0})
    healthy.tick(1.3, frozenset("abc"), True, RaftView("follower", "a", 2, s), heard_at={"a": 1.0, "c": 1.25})
    actions = healthy.tick(1.6, frozenset("bc"), True, RaftView("follower", "a", 2, s), heard_at={"a": 1.0, "c": 1.55})
    assert of(HastenElection, actions) == [HastenElection(0.0)] and of(DeferElection, actions) == []

    a = core("a")
    a.tick(1.0, frozenset("abc"), True, RaftView("leader", "a", 1, s))
    a.tick(1.2, frozenset("abc"), True, RaftView("leader", "a", 1, s))
    a.tick(1.4, frozenset("abc"), True, RaftView("leader", "a", 1, s))
    assert of(SubmitPlan, a.tick(1.6, frozenset("a"), True, RaftView("leader", "a", 1, s))) == []
    assert of(SubmitPlan, a.tick(1.8, frozenset("a"), True, RaftView("leader", "a", 1, s))) == []
    plans = of(SubmitPlan, a.tick(2.0, frozenset("ab"), True, RaftView("leader", "a", 1, s)))
    assert [(type(p.command).__name__, sorted(p.command.nodes)) for p in plans] == [("MarkDown", ["c"])]


def test_a_leader_whose_peers_expire_one_by_one_after_a_cut_does_not_plan_on_the_one_still_live():
    """Its receive path cut at 1.0, a leader still counts b live (heard 0.95) when c expires (heard
    0.8): a majority by suspect_timeout, but neither was heard within the campaign window."""
    s = joined()
    s, _ = s.apply(MarkUp({"a", "b", "c"}, s.epoch))
    a = core("a")
    for now in (1.0, 1.2, 1.4):
        a.tick(now, frozenset("abc"), True, RaftView("leader", "a", 1, s), heard_at={"b": 0.95, "c": 0.8})
    assert of(SubmitPlan, a.tick(1.5, frozenset("ab"), True, RaftView("leader", "a", 1, s),
                                 heard_at={"b": 0.95, "c": 0.8})) == []
    plans = of(SubmitPlan, a.tick(1.6, frozenset("ab"), True, RaftView("leader", "a", 1, s),
                                  heard_at={"b": 1.55, "c": 0.8}))  # b heard again: c is the one gone
    assert [(type(p.command).__name__, sorted(p.command.nodes)) for p in plans] == [("MarkDown", ["c"])]
