"""Live membership changes: which are allowed, decided purely (no clock, no I/O).

The fleet's Raft members are the committed ``FleetState.roster`` (empty until
the first change: then every node's configured members). A change adds or
removes one member and goes through pysyncobj's dynamic membership, which
makes a change count as soon as it is in a leader's log (the single-server
changes of the Raft paper): the new configuration must be able to commit from
the start, with the nodes alive now. Hence the rules, each refusal a sentence
an operator can act on:

* **One change at a time**: none may start while ``state.change`` is set (an
  added node not yet up, a removed node not yet gone). The one exception
  undoes it: removing the node whose add is in flight.
* **Quorum**: adding a node that is not running yet makes the quorum count it;
  the members alive now must still be a majority of the grown fleet.
  Removing a node keeps the fleet at its size until the node has left, then
  shrinks it: the members alive now (the leaving one aside) must be a majority
  of the smaller fleet. A fleet is never shrunk below one member.
* **Identity**: an added node's id, Raft address, heartbeat address and
  advertised addresses are new to the fleet.

``Member.add_member`` / ``remove_member`` (membership/member.py) run the steps:
add = check, ``BeginAdd`` (the new roster), pysyncobj ``addNodeToCluster``;
the change ends when the started node is marked up, and it gets identities by
the planner's rebalance (planned moves, drained gracefully). Remove = check,
``BeginRemove`` (the node drains: its identities move away by planned moves),
wait until it owns nothing, pysyncobj ``removeNodeFromCluster``,
``FinishRemove``.
"""

from __future__ import annotations

from collections.abc import Iterable

from membership.config import MemberSpec
from membership.state import FleetState
from topology import ProxyId, validate_addresses


class ChangeRefused(ValueError):
    """A membership change that may not start now; the message says why."""


def majority(size: int) -> int:
    """Votes a Raft group of ``size`` members needs to commit."""
    return size // 2 + 1


def current_roster(state: FleetState, configured: Iterable[MemberSpec]) -> tuple[MemberSpec, ...]:
    """The Raft members as committed, or the configured ones before any change."""
    return tuple(sorted(state.roster or configured, key=lambda m: m.id))


def _in_flight(state: FleetState) -> str | None:
    if state.change is None:
        return None
    return (f"a membership change is in flight ({state.change.kind} {state.change.node}); "
            "wait until it is done (one change at a time)")


def check_add(state: FleetState, roster: tuple[MemberSpec, ...], live: Iterable[ProxyId],
              spec: MemberSpec) -> None:
    """Raise :class:`ChangeRefused` unless ``spec`` may be added now."""
    busy = _in_flight(state)
    if busy:
        raise ChangeRefused(busy)
    ids = {m.id for m in roster}
    if spec.id in ids:
        raise ChangeRefused(f"node {spec.id!r} is already a member")
    for m in roster:
        if m.raft_address == spec.raft_address:
            raise ChangeRefused(f"Raft address {spec.raft_address} is already {m.id}'s")
        if m.heartbeat_address == spec.heartbeat_address:
            raise ChangeRefused(f"heartbeat address {spec.heartbeat_address} is already {m.id}'s")
    try:
        validate_addresses([*(m.node for m in roster), spec.node], state.broker_ids())
    except ValueError as exc:
        raise ChangeRefused(f"node {spec.id!r}: {exc}") from None
    alive = len(ids & frozenset(live))
    need = majority(len(roster) + 1)
    if alive < need:
        raise ChangeRefused(
            f"adding {spec.id!r} would lose quorum: a fleet of {len(roster) + 1} needs {need} members "
            f"alive and only {alive} of the {len(roster)} are; bring the others back first")


def check_remove(state: FleetState, roster: tuple[MemberSpec, ...], live: Iterable[ProxyId],
                 node_id: ProxyId) -> None:
    """Raise :class:`ChangeRefused` unless ``node_id`` may be removed now."""
    ids = {m.id for m in roster}
    if node_id not in ids:
        raise LookupError(f"no node {node_id!r} in the fleet (members: {', '.join(sorted(ids))})")
    undoing = state.change is not None and state.change.node == node_id
    busy = _in_flight(state)
    if busy and not undoing:
        raise ChangeRefused(busy)
    if len(roster) == 1:
        raise ChangeRefused(f"{node_id!r} is the last member: a fleet cannot shrink below one node")
    live = frozenset(live)
    now_alive, now_need = len(ids & live), majority(len(ids))
    if now_alive < now_need:  # the drain that comes first commits in the fleet as it is
        raise ChangeRefused(
            f"removing {node_id!r} would need quorum now: the {len(ids)} members need {now_need} alive "
            f"and only {now_alive} are; bring the others back first")
    rest = ids - {node_id}
    alive = len(rest & live)
    need = majority(len(rest))
    if alive < need:
        raise ChangeRefused(
            f"removing {node_id!r} would lose quorum: the {len(rest)} members left need {need} alive "
            f"and only {alive} are; bring the others back first")
