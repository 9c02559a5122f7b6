"""Live membership changes with real pysyncobj, members in this process on 127.0.0.115-119.

Grow 3 -> 5 and shrink back to 3 without restarting a member; a member started from
the old (three-member) file learns the current members from the fleet."""

from __future__ import annotations


import pytest

from membership.config import MemberConfig, MemberSpec
from membership.member import Member
from membership.roster import ChangeRefused
from tests import waiting
from tests.integration.test_raft import free_port
from topology import Broker, ProxyNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

HOSTS = {"a": "127.0.0.115", "b": "127.0.0.116", "c": "127.0.0.117", "d": "127.0.0.118", "e": "127.0.0.119"}
BROKERS = [Broker(i, f"kafka{i}", 9092) for i in (1, 2, 3, 4, 5)]
PASSWORD = "membership-secret"


def wait_until(what: str, predicate, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    waiting.wait_until(what, predicate, timeout)


def start(node_id: str, specs: list[MemberSpec]) -> Member:
    m = Member(MemberConfig(node_id=node_id, members=specs, password=PASSWORD, rebalance_delay=0.3))
    m.start()
    m.set_brokers(BROKERS)
    return m


def agreed(members: dict[str, Member], ids: set[str]) -> bool:
    """Every member: the same roster ``ids``, Raft configuration, epoch and table; every id up."""
    raft = {s.raft_address for s in members[min(ids)].roster()}
    states = [m.committed_state() for m in members.values()]
    return (all({s.id for s in m.roster()} == ids and m.raft_members() == raft for m in members.values())
            and len({s.epoch for s in states}) == 1 and states[0].change is None
            and states[0].up == ids and states[0].is_valid()
            and set(states[0].owner_map().values()) == ids)


@pytest.fixture
def specs():
    return {p: MemberSpec(ProxyNode(p, h, 9092), h, free_port(h)) for p, h in HOSTS.items()}


def test_grow_to_five_and_shrink_back(specs):
    first = [specs[p] for p in "abc"]
    members = {p: start(p, first) for p in "abc"}
    try:
        wait_until("three settled", lambda: agreed(members, {"a", "b", "c"}))
        for new in "de":
            ids = set(members) | {new}
            via = members["a"]
            via.add_member(specs[new])
            with pytest.raises(ChangeRefused, match="in flight"):  # one change at a time
                via.add_member(specs["e" if new == "d" else "d"])
            members[new] = start(new, [specs[p] for p in sorted(ids)])
            wait_until(f"{new} in and owning identities", lambda: agreed(members, ids))
        epoch = members["a"].committed_state().epoch
        for gone in "ed":
            leader = next(m for m in members.values() if m.is_leader())
            via = leader if leader.node_id != gone else members["a" if gone != "a" else "b"]
            via.remove_member(gone)
            members.pop(gone).stop()
            wait_until(f"{gone} out", lambda: agreed(members, set(members)))
        assert members["a"].committed_state().epoch > epoch
        # A member restarted from the original file learns the current members from the log.
        members.pop("c").stop()
        members["c"] = start("c", first)
        wait_until("c back", lambda: agreed(members, {"a", "b", "c"}))
    finally:
        for m in members.values():
            m.stop()


def test_refused_when_the_rest_could_not_form_a_majority(specs):
    first = [specs[p] for p in "abc"]
    members = {p: start(p, first) for p in "abc"}
    try:
        wait_until("three settled", lambda: agreed(members, {"a", "b", "c"}))
        members.pop("c").stop()
        # the change is checked against a's own liveness view, which may lag the leader's commit
        wait_until("c seen dead", lambda: "c" not in members["a"].committed_state().up
                   and "c" not in members["a"].live())
        with pytest.raises(ChangeRefused, match="lose quorum"):
            members["a"].add_member(specs["d"])
        with pytest.raises(ChangeRefused, match="lose quorum"):
            members["a"].remove_member("b")
        members["a"].remove_member("c")  # a dead member may go: a and b are a majority of two
        wait_until("c out", lambda: {s.id for s in members["b"].roster()} == {"a", "b"}
                   and members["b"].raft_members() == {specs["a"].raft_address, specs["b"].raft_address})
    finally:
        for m in members.values():
            m.stop()


def test_removing_the_leader_hands_leadership_over_first(specs):
    """pysyncobj cannot remove its own leader: the leader being removed hands over once it
    owns nothing (control.HandOver), then the member running the removal completes it."""
    four = [specs[p] for p in "abcd"]
    members = {p: start(p, four) for p in "abcd"}
    try:
        wait_until("four settled", lambda: agreed(members, set("abcd")))
        leader = next(m.node_id for m in members.values() if m.is_leader())
        via = members[next(p for p in members if p != leader)]
        via.remove_member(leader, timeout=20)
        members.pop(leader).stop()
        rest = set("abcd") - {leader}
        wait_until("the old leader out, a new one in", lambda: agreed(members, rest)
                   and any(m.is_leader() for m in members.values()))
    finally:
        for m in members.values():
            m.stop()
