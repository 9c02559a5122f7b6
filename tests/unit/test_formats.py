"""State formats (membership.formats): advertised ranges, the committed format, refusals, upgrades."""

from __future__ import annotations

import pickle
from typing import ClassVar

import attrs
import pytest

from membership.commands import Drain, Join, MarkUp, Reassign, SetFormat
from membership.config import MemberConfig, MemberSpec
from membership.control import MemberCore, RaftView, Refuse, SubmitJoin, SubmitPlan
from membership.formats import NO_FORMAT, FormatRange, next_format, parse_range, refusal
from membership.state import FleetState
from topology import ProxyNode

pytestmark = pytest.mark.unit

NODES = [ProxyNode(p, f"127.0.0.{11 + i}", 9092) for i, p in enumerate(("a", "b", "c"))]
SPECS = [MemberSpec(n, n.host, 7000) for n in NODES]
ONE, BOTH, TWO = FormatRange(1, 1), FormatRange(1, 2), FormatRange(2, 2)


def fleet(*ranges: FormatRange) -> FleetState:
    s = FleetState()
    for node, rng in zip(NODES, ranges):
        s, result = s.apply(Join(node, rng))
        assert result.outcome == "applied", result
    return s


def of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


# ---- the pure rules ------------------------------------------------------------------------------

def test_parse_range_and_its_errors():
    assert parse_range("2") == TWO
    assert parse_range("1-2") == BOTH == parse_range(" 1..2 ")
    assert str(BOTH) == "1..2" and str(TWO) == "2"
    for bad in ("", "x", "2-1", "0", "1-2-3"):
        with pytest.raises(ValueError, match="KPROXY_FORMATS"):
            parse_range(bad)


def test_refusal_names_the_supported_formats_and_the_fleets():
    assert refusal("b", NO_FORMAT, TWO) is None
    assert refusal("b", 2, BOTH) is None
    message = refusal("b", 1, TWO)
    assert message is not None
    assert "node b supports state formats 2" in message and "committed format is 1" in message


def test_next_format_waits_for_every_member_then_takes_the_highest_common():
    members = ["a", "b", "c"]
    assert next_format(1, {"a": BOTH, "b": BOTH}, members) is None  # c has not advertised
    assert next_format(1, {"a": BOTH, "b": BOTH, "c": ONE}, members) is None  # c reads 1 only
    assert next_format(1, {"a": BOTH, "b": BOTH, "c": BOTH}, members) == 2
    assert next_format(2, {"a": BOTH, "b": BOTH, "c": BOTH}, members) is None  # already there
    assert next_format(1, {"a": FormatRange(1, 3), "b": BOTH, "c": FormatRange(1, 3)}, members) == 2
    assert next_format(NO_FORMAT, {"a": BOTH}, ["a"]) is None  # the first Join sets it


# ---- the state machine ---------------------------------------------------------------------------

def test_first_join_sets_the_format_to_the_joiners_lowest():
    assert FleetState().format == NO_FORMAT
    assert fleet(BOTH).format == 1
    assert fleet(TWO).format == 2
    s = fleet(ONE, ONE, ONE)
    assert s.format == 1 and s.format_map() == {"a": ONE, "b": ONE, "c": ONE}


def test_a_node_that_cannot_read_the_fleets_format_is_refused_a_newer_one_joins():
    s = fleet(ONE, ONE)
    refused, result = s.apply(Join(NODES[2], TWO))
    assert refused is s and result.outcome == "rejected"
    assert "supports state formats 2" in result.reason and "committed format is 1" in result.reason
    s, result = s.apply(Join(NODES[2], BOTH))
    assert result.outcome == "applied" and s.format_map()["c"] == BOTH and s.format == 1


def test_a_rejoin_with_a_new_range_is_recorded_the_same_one_is_idempotent():
    s = fleet(ONE, ONE, ONE)
    again, result = s.apply(Join(NODES[0], ONE))
    assert result.outcome == "unchanged" and again is s
    upgraded, result = s.apply(Join(NODES[0], BOTH))
    assert result.outcome == "applied" and upgraded.format_map()["a"] == BOTH


def test_set_format_only_up_only_when_every_member_supports_it():
    s = fleet(BOTH, BOTH, ONE)
    _, result = s.apply(SetFormat(2, s.epoch))
    assert result.outcome == "rejected" and "not supported by members ['c']" in result.reason
    s, _ = s.apply(Join(NODES[2], BOTH))
    _, result = s.apply(SetFormat(2, s.epoch - 1))
    assert result.outcome == "rejected" and "stale epoch" in result.reason
    up, result = s.apply(SetFormat(2, s.epoch))
    assert result.outcome == "applied" and up.format == 2 and up.epoch == s.epoch + 1
    _, result = up.apply(SetFormat(2, 0))
    assert result.outcome == "unchanged"
    _, result = up.apply(SetFormat(1, up.epoch))
    assert result.outcome == "rejected" and "only goes up" in result.reason
    # Now a node of the old release (format 1 only) is refused.
    _, result = up.apply(Join(NODES[2], ONE))
    assert result.outcome == "rejected" and "committed format is 2" in result.reason


@attrs.frozen(slots=True)
class _Format2Drain(Drain):
    SINCE_FORMAT: ClassVar[int] = 2


def test_a_command_newer_than_the_committed_format_is_rejected():
    s = fleet(BOTH, BOTH, BOTH)
    _, result = s.apply(_Format2Drain("a"))
    assert result.outcome == "rejected"
    # A subclass has no handler of its own; what matters is that the format check speaks first.
    assert result.reason == "unknown command _Format2Drain"
    from membership import state as state_module

    state_module._HANDLERS[_Format2Drain] = FleetState._drain
    try:
        _, result = s.apply(_Format2Drain("a"))
        assert result.outcome == "rejected" and result.reason == "_Format2Drain needs state format 2, the fleet is at format 1"
        s2, _ = s.apply(SetFormat(2, s.epoch))
        s3, result = s2.apply(_Format2Drain("a"))
        assert result.outcome == "applied" and "a" in s3.draining
    finally:
        del state_module._HANDLERS[_Format2Drain]


def test_the_snapshot_carries_the_format_and_an_older_pickle_gets_the_defaults():
    s = fleet(BOTH, BOTH, BOTH)
    s, _ = s.apply(SetFormat(2, s.epoch))
    s, _ = s.apply(Reassign(s.epoch, {}))
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back.format == 2 and back.format_map()["b"] == BOTH
    # A state pickled before the format fields existed: they come back at their defaults.
    old = FleetState.__new__(FleetState)
    old.__setstate__({"epoch": 3, "members": (NODES[0],), "up": frozenset(), "draining": frozenset(),
                      "brokers": (), "owners": ()})
    assert old.epoch == 3 and old.format == NO_FORMAT and old.member_formats == ()
    join = Join.__new__(Join)
    join.__setstate__({"node": NODES[0]})
    assert join.formats == ONE


# ---- one member's core ---------------------------------------------------------------------------

def core(node: str, formats: FormatRange) -> MemberCore:
    return MemberCore(MemberConfig(node_id=node, members=SPECS, password="pw"), now=0.0, formats=formats)


def test_a_core_joins_with_its_range_and_refuses_a_format_it_cannot_read():
    newer = core("c", BOTH)
    joins = of(SubmitJoin, newer.tick(0.0, frozenset("c"), False, RaftView()))
    assert [j.command for j in joins] == [Join(NODES[2], BOTH)]

    only_two = core("c", TWO)
    at_one = RaftView("follower", "a", 1, fleet(ONE, ONE))
    actions = only_two.tick(0.0, frozenset("abc"), True, at_one)
    refusals = of(Refuse, actions)
    assert len(refusals) == 1 and "supports state formats 2" in refusals[0].reason
    assert of(SubmitJoin, actions) == [] and only_two.refused == refusals[0].reason
    later = only_two.tick(1.0, frozenset("abc"), True, at_one)
    assert of(Refuse, later) == [] and of(SubmitJoin, later) == []  # refused once, never joins


def test_the_leader_upgrades_the_format_once_every_configured_member_supports_it():
    leader = core("a", BOTH)
    partial = fleet(BOTH, BOTH)  # c (configured) has not joined: it might be an old node
    partial, _ = partial.apply(MarkUp({"a", "b"}, partial.epoch, {}))
    plans = of(SubmitPlan, leader.tick(2.0, frozenset("ab"), True, RaftView("leader", "a", 1, partial)))
    assert not any(isinstance(p.command, SetFormat) for p in plans)

    everyone = fleet(BOTH, BOTH, BOTH)
    settled = core("a", BOTH)
    view = RaftView("leader", "a", 1, everyone)
    commands = []
    state = everyone
    for step in range(160):  # the planner's own commands first (mark up, assign), then the format
        now = 2.0 + step * 0.25  # a tick every beat (ticks further apart are a stall: membership.control)
        plans = of(SubmitPlan, settled.tick(now, frozenset("abc"), True, view))
        for plan in plans:
            commands.append(plan.command)
            state, result = state.apply(plan.command)
            settled.plan_done(plan.token, plan.command, result, None, now)
        view = RaftView("leader", "a", 1, state)
        if commands and isinstance(commands[-1], SetFormat):
            break
    assert isinstance(commands[-1], SetFormat) and commands[-1].format == 2
    assert state.format == 2


def test_a_node_takes_its_range_from_the_release_or_the_test_hook():
    from membership.formats import SUPPORTED
    from proxy.config import ConfigError
    from proxy.runtime import node_formats

    assert node_formats({}) == SUPPORTED == ONE
    assert node_formats({"KPROXY_FORMATS": "1-2"}) == BOTH
    with pytest.raises(ConfigError, match="KPROXY_FORMATS"):
        node_formats({"KPROXY_FORMATS": "two"})


def test_replicated_method_numbers_are_pinned():
    """pysyncobj numbers the @replicated methods by their sorted names and writes the number
    into the log: a method added between existing names would make a node of the next release
    apply an old node's entries to the wrong method. New commands go through versioned_command."""
    from membership.raft import VERSIONED, RaftReplica

    names = sorted(m for m in dir(RaftReplica)
                   if getattr(getattr(RaftReplica, m), "replicated", False) and m.endswith("_v0"))
    assert names == ["drain_v0", "join_v0", "mark_down_v0", "mark_up_v0", "reassign_v0", "set_brokers_v0",
                     "undrain_v0", "versioned_command_v0"]
    assert {c.__name__ for c in VERSIONED} >= {"SetFormat", "BeginAdd", "BeginRemove", "FinishRemove"}
