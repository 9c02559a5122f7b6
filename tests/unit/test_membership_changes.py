"""Live membership's pure decisions: the quorum and one-at-a-time rules (membership.roster),
the replicated commands that carry a change (membership.state), and the rebalance a new or
leaving node gets (membership.planner)."""

from __future__ import annotations

import pytest

from membership.commands import (ADD, APPLIED, REJECTED, REMOVE, UNCHANGED, BeginAdd, BeginRemove, FinishRemove,
                                 Join, MarkUp, MemberChange, Reassign)
from membership.config import MemberSpec
from membership.planner import Planner
from membership.roster import ChangeRefused, check_add, check_remove, current_roster, majority
from membership.state import FleetState
from topology import Broker, ProxyNode

pytestmark = pytest.mark.unit


def spec(n: int) -> MemberSpec:
    host = f"127.0.0.{110 + n}"
    return MemberSpec(ProxyNode(f"p{n}", host, 9092), host, 9500)


THREE = tuple(spec(n) for n in (1, 2, 3))
FIVE = tuple(spec(n) for n in (1, 2, 3, 4, 5))
BROKERS = tuple(Broker(i, f"kafka{i}", 9092) for i in (1, 2, 3, 4))


def fleet(members=THREE, **changes) -> FleetState:
    ids = {m.id for m in members}
    owners = {b.id: sorted(ids)[i % len(ids)] for i, b in enumerate(BROKERS)}
    return FleetState(epoch=7, members=[m.node for m in members], up=ids, brokers=BROKERS, owners=owners,
                      **changes)


def test_majority():
    assert [majority(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_add_needs_a_majority_of_the_grown_fleet_alive_now():
    state = fleet()
    check_add(state, THREE, {"p1", "p2", "p3"}, spec(4))  # 3 alive >= 3 of 4
    with pytest.raises(ChangeRefused, match="adding 'p4' would lose quorum: a fleet of 4 needs 3 members alive "
                                            "and only 2 of the 3 are"):
        check_add(state, THREE, {"p1", "p2"}, spec(4))
    four = (*THREE, spec(4))
    check_add(fleet(four), four, {"p1", "p2", "p3"}, spec(5))  # 3 alive >= 3 of 5


def test_add_refuses_a_known_id_or_address():
    state = fleet()
    with pytest.raises(ChangeRefused, match="already a member"):
        check_add(state, THREE, {"p1", "p2", "p3"}, spec(2))
    clash = MemberSpec(ProxyNode("p9", "127.0.0.111", 9092), "127.0.0.111", 9500)
    with pytest.raises(ChangeRefused, match="Raft address 127.0.0.111:9500 is already p1's"):
        check_add(state, THREE, {"p1", "p2", "p3"}, clash)


def test_remove_needs_a_majority_of_the_rest_and_of_the_fleet_now():
    five = fleet(FIVE)
    check_remove(five, FIVE, {"p1", "p2", "p3"}, "p5")  # p5 is dead: 3 of 4 left
    with pytest.raises(ChangeRefused, match="removing 'p2' would lose quorum: the 4 members left need 3 alive "
                                            "and only 2 are"):
        check_remove(five, FIVE, {"p1", "p2", "p3"}, "p2")
    three = fleet()
    with pytest.raises(ChangeRefused, match="would need quorum now"):
        check_remove(three, THREE, {"p1"}, "p3")
    check_remove(three, THREE, {"p1", "p2"}, "p3")  # the dead one may go
    with pytest.raises(ChangeRefused, match="removing 'p2' would lose quorum"):
        check_remove(three, THREE, {"p1", "p2"}, "p2")  # p1 alone is not a majority of {p1, p3}
    one = (spec(1),)
    with pytest.raises(ChangeRefused, match="last member"):
        check_remove(fleet(one), one, {"p1"}, "p1")
    with pytest.raises(LookupError, match="no node 'p9'"):
        check_remove(three, THREE, {"p1", "p2", "p3"}, "p9")


def test_one_change_at_a_time():
    busy = fleet(change=MemberChange(ADD, "p4"), roster=(*THREE, spec(4)))
    roster = current_roster(busy, THREE)
    with pytest.raises(ChangeRefused, match=r"in flight \(add p4\)"):
        check_add(busy, roster, {"p1", "p2", "p3"}, spec(5))
    with pytest.raises(ChangeRefused, match=r"in flight \(add p4\)"):
        check_remove(busy, roster, {"p1", "p2", "p3"}, "p3")
    check_remove(busy, roster, {"p1", "p2", "p3"}, "p4")  # undoing the add in flight is allowed


def test_state_carries_an_add_until_the_node_is_up():
    state = fleet()
    grown = (*THREE, spec(4))
    new, result = state.apply(BeginAdd("p4", grown, state.epoch))
    assert result.outcome == APPLIED and new.change == MemberChange(ADD, "p4") and new.roster == grown
    assert new.apply(BeginAdd("p4", grown, state.epoch))[1].outcome == UNCHANGED  # a retry
    again = new.apply(BeginAdd("p5", (*grown, spec(5)), new.epoch))[1]
    assert again.outcome == REJECTED and "in flight (add p4)" in again.reason
    stale = state.apply(BeginAdd("p4", grown, state.epoch - 1))[1]
    assert stale.outcome == REJECTED and "stale epoch" in stale.reason
    joined, _ = new.apply(Join(spec(4).node))
    up, result = joined.apply(MarkUp({"p4"}, joined.epoch))
    assert result.outcome == APPLIED and up.change is None and "p4" in up.up


def test_state_drains_then_forgets_a_removed_node():
    state = fleet(FIVE)
    draining, result = state.apply(BeginRemove("p5", FIVE, state.epoch))
    assert result.outcome == APPLIED and "p5" in draining.draining and draining.change == MemberChange(REMOVE, "p5")
    assert "p5" not in draining.repaired().values()  # the drain: p5 owns nothing once repaired
    gone, result = draining.apply(FinishRemove("p5"))
    assert result.outcome == APPLIED and gone.change is None
    assert "p5" not in gone.member_ids() | gone.up | gone.draining | {m.id for m in gone.roster}
    assert gone.apply(FinishRemove("p5"))[1].outcome == UNCHANGED
    # A removed node's own Join (it may still be running) never brings it back.
    refused = gone.apply(Join(spec(5).node))[1]
    assert refused.outcome == REJECTED and "not a member" in refused.reason
    # Before any change the roster is "as configured": a FinishRemove alone cannot apply.
    assert fleet().apply(FinishRemove("p3"))[1].outcome == REJECTED


def test_a_new_node_gets_identities_by_a_planned_rebalance_after_the_delay():
    state = fleet()
    grown = (*THREE, spec(4))
    state = state.apply(BeginAdd("p4", grown, state.epoch))[0].apply(Join(spec(4).node))[0]
    planner = Planner(rebalance_delay=1.0)
    live = {"p1", "p2", "p3", "p4"}
    up = planner.next_command(state, live, now=10.0)
    assert isinstance(up, MarkUp) and up.nodes == {"p4"} and up.owners is None  # up first, no identity yet
    state = state.apply(up)[0]
    assert state.change is None
    assert planner.next_command(state, live, now=10.5) is None  # not live long enough
    move = planner.next_command(state, live, now=11.0)
    assert isinstance(move, Reassign)
    moved = {b for b, p in move.owners if state.owner_map()[b] != p}
    # Four identities on three nodes (2, 1, 1): one moves to p4, from the node holding two.
    assert len(moved) == 1 and dict(move.owners)[next(iter(moved))] == "p4"
    assert list(state.owner_map().values()).count(state.owner_map()[next(iter(moved))]) == 2
