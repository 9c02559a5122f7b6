"""Commands of the replicated fleet state and the result of applying one.

Commands are plain immutable data: they travel pickled through the Raft log
and every replica applies the same sequence. Two kinds:

* **Intent** (anyone may propose; unconditional, idempotent): ``Join``,
  ``SetBrokers``, ``Drain``, ``Undrain``. They change facts only, never the
  owners table (except that ``SetBrokers`` forgets owners of removed brokers).
* **Leader decisions** (conditional on ``expected_epoch``, idempotent):
  ``MarkDown``, ``MarkUp``, ``Reassign``.
* **Membership changes** (one at a time, membership/roster.py decides when one is
  allowed): ``BeginAdd`` (conditional on the epoch; the new Raft member list),
  ``BeginRemove`` (conditional; the node starts draining), ``FinishRemove``
  (idempotent; the node leaves the state). They carry the owners table the
  leader computed with ``topology.assign``, so the log holds data, not a
  recomputation that could differ between code versions. A decision based on
  a stale epoch is rejected and the leader re-plans from the fresh state.
  ``SetFormat`` (the leader's too) raises the fleet's state format.

Every command names the state format that introduced it (``SINCE_FORMAT``,
membership.formats): the state rejects a command newer than its committed
format, so a node of a newer release never writes what an older member cannot
read. A field added to a command later needs a default (old entries lack it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import attrs

from membership.config import MemberSpec
from membership.formats import FIRST_FORMAT, SUPPORTED, FormatRange, readable_across_formats
from topology import Broker, BrokerId, ProxyId, ProxyNode, freeze_owners

Owners = tuple[tuple[BrokerId, ProxyId], ...]


def _ids(value: Iterable[str]) -> frozenset[ProxyId]:
    if isinstance(value, str):
        return frozenset([ProxyId(value)])
    return frozenset(ProxyId(v) for v in value)


def _brokers(value: Iterable[Broker]) -> tuple[Broker, ...]:
    return tuple(sorted(value, key=lambda b: b.id))


def _opt_owners(value) -> Owners | None:
    return None if value is None else freeze_owners(value)


@readable_across_formats
@attrs.frozen(slots=True)
class Join:
    """A node announces itself, its advertised addresses and the state formats it
    reads and writes. Unconditional, but refused if ``formats`` excludes the
    fleet's committed format (the node could not read the state)."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    node: ProxyNode
    formats: FormatRange = SUPPORTED


@readable_across_formats
@attrs.frozen(slots=True)
class SetBrokers:
    """The upstream brokers are exactly these. Unconditional; replaces the set."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    brokers: tuple[Broker, ...] = attrs.field(converter=_brokers)


@readable_across_formats
@attrs.frozen(slots=True)
class Drain:
    """Exclude a member from the assignment (it stays a member). Unconditional."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    node_id: ProxyId


@readable_across_formats
@attrs.frozen(slots=True)
class Undrain:
    """Make a drained member eligible again. Unconditional."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    node_id: ProxyId


@readable_across_formats
@attrs.frozen(slots=True)
class MarkDown:
    """Leader: these members are dead; install ``owners`` in the same step."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    nodes: frozenset[ProxyId] = attrs.field(converter=_ids)
    expected_epoch: int
    owners: Owners = attrs.field(converter=freeze_owners)


@readable_across_formats
@attrs.frozen(slots=True)
class MarkUp:
    """Leader: these members are alive again. ``owners`` None keeps the table
    (the node gets identities later by a ``Reassign``)."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    nodes: frozenset[ProxyId] = attrs.field(converter=_ids)
    expected_epoch: int
    owners: Owners | None = attrs.field(default=None, converter=_opt_owners)


@readable_across_formats
@attrs.frozen(slots=True)
class Reassign:
    """Leader: install a new owners table."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    expected_epoch: int
    owners: Owners = attrs.field(converter=freeze_owners)


@readable_across_formats
@attrs.frozen(slots=True)
class SetFormat:
    """Leader: the fleet's state format is now ``format`` (only ever up; every
    member must support it: membership.formats.next_format)."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT
    format: int
    expected_epoch: int


ADD = "add"
REMOVE = "remove"


@readable_across_formats
@attrs.frozen(slots=True)
class MemberChange:
    """The membership change in flight: ``kind`` ADD or REMOVE of ``node``."""

    kind: str
    node: ProxyId


@readable_across_formats
@attrs.frozen(slots=True)
class BeginAdd:
    """A node is added: the Raft members are now ``roster`` (the current ones and
    ``roster``'s new entry); the change stays in flight until the node is marked up."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT

    node_id: ProxyId
    roster: tuple[MemberSpec, ...] = attrs.field(converter=tuple)
    expected_epoch: int


@readable_across_formats
@attrs.frozen(slots=True)
class BeginRemove:
    """A node is removed: it starts draining at once (its identities move away
    by the planner's next table); ``roster`` is the member list it is removed from."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT

    node_id: ProxyId
    roster: tuple[MemberSpec, ...] = attrs.field(converter=tuple)
    expected_epoch: int


@readable_across_formats
@attrs.frozen(slots=True)
class FinishRemove:
    """The node being removed has left Raft: forget it (members, roster, up, draining)."""

    SINCE_FORMAT: ClassVar[int] = FIRST_FORMAT

    node_id: ProxyId


Command = (Join | SetBrokers | Drain | Undrain | MarkDown | MarkUp | Reassign | SetFormat | BeginAdd | BeginRemove
           | FinishRemove)


APPLIED = "applied"
UNCHANGED = "unchanged"
REJECTED = "rejected"


@readable_across_formats
@attrs.frozen(slots=True)
class Result:
    """``applied`` (state changed, epoch is the new epoch), ``unchanged`` (the
    command's effect was already in place: idempotent replay) or ``rejected``
    (stale epoch or invalid; ``reason`` says which). ``epoch`` is the state's
    epoch after the command."""

    outcome: str
    epoch: int
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome != REJECTED
