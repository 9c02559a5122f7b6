"""The replicated fleet state: a pure, immutable value and its ``apply``.

``FleetState.apply(command) -> (new_state, Result)`` reads no clock, no
randomness, no ``hash()``: every replica applying the same log reaches the same
state. It never raises for a well-typed command; a command that cannot apply
returns a ``rejected`` result and leaves the state as it was.

The epoch counts accepted changes: every ``applied`` command increments it by
one, so epochs never decrease and one epoch names exactly one state (and so
one owners table) in every replica.

Eligibility: the members that may own identities are ``up`` and not
``draining``. If that leaves nobody, the up members serve anyway, draining or
not (serving beats refusing). A table is *valid* when it covers exactly the
known brokers with eligible owners (or is empty when nobody is eligible).
Intent commands may leave the table invalid for a moment; :meth:`repaired` is
the table every replica derives from it until the leader commits one, so all
data paths agree even then.

Format: the state carries the fleet's committed state format and the range
each member advertised in its Join (membership.formats); pysyncobj's snapshot
pickles the whole value, so the snapshot carries them too. A command newer than
the committed format, and a Join from a node that cannot read it, are rejected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from membership.commands import (
    ADD,
    APPLIED,
    REJECTED,
    REMOVE,
    UNCHANGED,
    BeginAdd,
    BeginRemove,
    Command,
    Drain,
    FinishRemove,
    Join,
    MarkDown,
    MarkUp,
    MemberChange,
    Reassign,
    Result,
    SetBrokers,
    SetFormat,
    Undrain,
)
from membership.config import MemberSpec
from membership.formats import NO_FORMAT, FormatRange, readable_across_formats, refusal
from topology import (
    AddressConflict,
    Broker,
    BrokerId,
    ProxyId,
    ProxyNode,
    assign,
    freeze_owners,
    validate_addresses,
)


def _members(value: Iterable[ProxyNode]) -> tuple[ProxyNode, ...]:
    return tuple(sorted(value, key=lambda n: n.id))


def _brokers(value: Iterable[Broker]) -> tuple[Broker, ...]:
    return tuple(sorted(value, key=lambda b: b.id))


def _formats(value: Iterable[tuple[ProxyId, FormatRange]]) -> tuple[tuple[ProxyId, FormatRange], ...]:
    return tuple(sorted(dict(value).items()))


@readable_across_formats
@attrs.frozen(slots=True)
class FleetState:
    epoch: int = 0
    members: tuple[ProxyNode, ...] = attrs.field(default=(), converter=_members)
    up: frozenset[ProxyId] = frozenset()
    draining: frozenset[ProxyId] = frozenset()
    brokers: tuple[Broker, ...] = attrs.field(default=(), converter=_brokers)
    owners: tuple[tuple[BrokerId, ProxyId], ...] = attrs.field(default=(), converter=freeze_owners)
    # The committed state format (NO_FORMAT until the first Join) and each member's advertised range.
    format: int = NO_FORMAT
    member_formats: tuple[tuple[ProxyId, FormatRange], ...] = attrs.field(default=(), converter=_formats)
    # The Raft members and their endpoints once a membership change was made
    # (empty: the members every node was configured with), and the change in flight.
    roster: tuple[MemberSpec, ...] = attrs.field(default=(), converter=tuple)
    change: MemberChange | None = None

    # ---- queries ---------------------------------------------------------------------------

    def member_map(self) -> dict[ProxyId, ProxyNode]:
        return {n.id: n for n in self.members}

    def member_ids(self) -> frozenset[ProxyId]:
        return frozenset(n.id for n in self.members)

    def broker_ids(self) -> frozenset[BrokerId]:
        return frozenset(b.id for b in self.brokers)

    def owner_map(self) -> dict[BrokerId, ProxyId]:
        return dict(self.owners)

    def format_map(self) -> dict[ProxyId, FormatRange]:
        return dict(self.member_formats)

    def eligible(self) -> frozenset[ProxyId]:
        live = self.up & self.member_ids()
        return (live - self.draining) or live

    def eligible_nodes(self) -> list[ProxyNode]:
        ids = self.eligible()
        return [n for n in self.members if n.id in ids]

    def problem(self, owners: Mapping[BrokerId, ProxyId]) -> str | None:
        """Why ``owners`` is not a valid table for this state, or None."""
        eligible = self.eligible()
        if not eligible:
            return None if not owners else "no member is eligible, so the table must be empty"
        missing = self.broker_ids() - owners.keys()
        if missing:
            return f"brokers without owner: {sorted(missing)}"
        extra = owners.keys() - self.broker_ids()
        if extra:
            return f"unknown brokers: {sorted(extra)}"
        bad = {p for p in owners.values() if p not in eligible}
        if bad:
            return f"owners not eligible: {sorted(bad)}"
        return None

    def is_valid(self) -> bool:
        return self.problem(self.owner_map()) is None

    def repaired(self) -> dict[BrokerId, ProxyId]:
        """The committed table if valid, else what ``assign`` makes of it."""
        owners = self.owner_map()
        if self.problem(owners) is None:
            return owners
        nodes = self.eligible_nodes()
        if not nodes:
            return {}
        return assign(self.brokers, nodes, owners)

    # ---- apply -----------------------------------------------------------------------------

    def apply(self, command: Command) -> tuple[FleetState, Result]:
        handler = _HANDLERS.get(type(command))
        if handler is None:
            return self, self._reject(f"unknown command {type(command).__name__}")
        since = getattr(type(command), "SINCE_FORMAT", NO_FORMAT)
        if self.format != NO_FORMAT and since > self.format:
            return self, self._reject(f"{type(command).__name__} needs state format {since}, "
                                      f"the fleet is at format {self.format}")
        return handler(self, command)

    def _reject(self, reason: str) -> Result:
        return Result(REJECTED, self.epoch, reason)

    def _unchanged(self) -> tuple[FleetState, Result]:
        return self, Result(UNCHANGED, self.epoch)

    def _next(self, **changes) -> tuple[FleetState, Result]:
        new = attrs.evolve(self, epoch=self.epoch + 1, **changes)
        return new, Result(APPLIED, new.epoch)

    def _join(self, cmd: Join) -> tuple[FleetState, Result]:
        node = cmd.node
        if not isinstance(node, ProxyNode) or not isinstance(cmd.formats, FormatRange):
            return self, self._reject("Join needs a ProxyNode and a FormatRange")
        if self.roster and node.id not in {m.id for m in self.roster}:
            return self, self._reject(f"{node.id!r} is not a member of the fleet (removed, or not added yet)")
        refused = refusal(node.id, self.format, cmd.formats)
        if refused is not None:
            return self, self._reject(refused)
        current, formats = self.member_map(), self.format_map()
        if current.get(node.id) == node and formats.get(node.id) == cmd.formats:
            return self._unchanged()
        current[node.id] = node
        formats[node.id] = cmd.formats
        try:
            validate_addresses(current.values(), self.broker_ids())
        except (AddressConflict, ValueError) as exc:
            return self, self._reject(f"address conflict: {exc}")
        # The first Join starts the fleet at the joiner's lowest format: every node of its
        # release or the next can read it; SetFormat raises it once all members can go higher.
        fmt = cmd.formats.lo if self.format == NO_FORMAT else self.format
        return self._next(members=current.values(), member_formats=formats.items(), format=fmt)

    def _set_format(self, cmd: SetFormat) -> tuple[FleetState, Result]:
        if cmd.format == self.format:
            return self._unchanged()
        if cmd.expected_epoch != self.epoch:
            return self, self._reject(f"stale epoch {cmd.expected_epoch}, state is at {self.epoch}")
        if cmd.format < self.format:
            return self, self._reject(f"the state format only goes up: {self.format} to {cmd.format} refused")
        advertised = self.format_map()
        unable = sorted(m for m in self.member_ids() if advertised.get(m) is None or cmd.format not in advertised[m])
        if unable:
            return self, self._reject(f"format {cmd.format} is not supported by members {unable}")
        return self._next(format=cmd.format)

    def _set_brokers(self, cmd: SetBrokers) -> tuple[FleetState, Result]:
        if cmd.brokers == self.brokers:
            return self._unchanged()
        ids = [b.id for b in cmd.brokers]
        if len(set(ids)) != len(ids):
            return self, self._reject("duplicate broker ids")
        try:
            validate_addresses(self.members, ids)
        except (AddressConflict, ValueError) as exc:
            return self, self._reject(f"address conflict: {exc}")
        keep = frozenset(ids)
        return self._next(brokers=cmd.brokers, owners=[(b, p) for b, p in self.owners if b in keep])

    def _drain(self, cmd: Drain) -> tuple[FleetState, Result]:
        if cmd.node_id not in self.member_ids():
            return self, self._reject(f"unknown node {cmd.node_id!r}")
        if cmd.node_id in self.draining:
            return self._unchanged()
        return self._next(draining=self.draining | {cmd.node_id})

    def _undrain(self, cmd: Undrain) -> tuple[FleetState, Result]:
        if cmd.node_id not in self.member_ids():
            return self, self._reject(f"unknown node {cmd.node_id!r}")
        if cmd.node_id not in self.draining:
            return self._unchanged()
        return self._next(draining=self.draining - {cmd.node_id})

    def _decide(
        self, expected_epoch: int, up: frozenset[ProxyId], owners, check: bool = True, **extra
    ) -> tuple[FleetState, Result]:
        """Shared tail of the leader's conditional commands: idempotence first
        (the effect is already in place), then the epoch, then validity of the
        table (skipped only for a MarkUp that keeps the table as it is)."""
        if up == self.up and owners == self.owners:
            return self._unchanged()
        if expected_epoch != self.epoch:
            return self, self._reject(f"stale epoch {expected_epoch}, state is at {self.epoch}")
        candidate = attrs.evolve(self, up=up, owners=owners)
        if check:
            problem = candidate.problem(candidate.owner_map())
            if problem is not None:
                return self, self._reject(problem)
        return self._next(up=up, owners=owners, **extra)

    def _mark_down(self, cmd: MarkDown) -> tuple[FleetState, Result]:
        unknown = cmd.nodes - self.member_ids()
        if unknown:
            return self, self._reject(f"unknown nodes {sorted(unknown)}")
        return self._decide(cmd.expected_epoch, self.up - cmd.nodes, cmd.owners)

    def _mark_up(self, cmd: MarkUp) -> tuple[FleetState, Result]:
        unknown = cmd.nodes - self.member_ids()
        if unknown:
            return self, self._reject(f"unknown nodes {sorted(unknown)}")
        # A node being added is in once it is up: the change is no longer in flight.
        done = self.change is not None and self.change.kind == ADD and self.change.node in cmd.nodes
        extra = {"change": None} if done else {}
        if cmd.owners is None:
            return self._decide(cmd.expected_epoch, self.up | cmd.nodes, self.owners, check=False, **extra)
        return self._decide(cmd.expected_epoch, self.up | cmd.nodes, cmd.owners, **extra)

    def _reassign(self, cmd: Reassign) -> tuple[FleetState, Result]:
        return self._decide(cmd.expected_epoch, self.up, cmd.owners)

    # ---- membership changes (membership/roster.py decides whether one may start) -------------

    def _begin_add(self, cmd: BeginAdd) -> tuple[FleetState, Result]:
        if self.change == MemberChange(ADD, cmd.node_id) and self.roster == cmd.roster:
            return self._unchanged()
        if self.change is not None:
            return self, self._reject(f"a membership change is in flight ({self.change.kind} {self.change.node})")
        if cmd.expected_epoch != self.epoch:
            return self, self._reject(f"stale epoch {cmd.expected_epoch}, state is at {self.epoch}")
        ids = [m.id for m in cmd.roster]
        if cmd.node_id not in ids or len(set(ids)) != len(ids):
            return self, self._reject(f"the new roster must hold {cmd.node_id!r} once")
        if cmd.node_id in {m.id for m in self.roster} | self.member_ids():
            return self, self._reject(f"{cmd.node_id!r} is already a member")
        new = next(m.node for m in cmd.roster if m.id == cmd.node_id)
        try:
            validate_addresses([*self.members, new], self.broker_ids())
        except (AddressConflict, ValueError) as exc:
            return self, self._reject(f"address conflict: {exc}")
        return self._next(roster=cmd.roster, change=MemberChange(ADD, cmd.node_id))

    def _begin_remove(self, cmd: BeginRemove) -> tuple[FleetState, Result]:
        target = MemberChange(REMOVE, cmd.node_id)
        if self.change == target:
            return self._unchanged()
        # The one change that may replace another: removing a node whose add is in flight.
        if self.change is not None and self.change != MemberChange(ADD, cmd.node_id):
            return self, self._reject(f"a membership change is in flight ({self.change.kind} {self.change.node})")
        if cmd.expected_epoch != self.epoch:
            return self, self._reject(f"stale epoch {cmd.expected_epoch}, state is at {self.epoch}")
        if cmd.node_id not in {m.id for m in cmd.roster}:
            return self, self._reject(f"unknown node {cmd.node_id!r}")
        draining = self.draining | {cmd.node_id} if cmd.node_id in self.member_ids() else self.draining
        return self._next(roster=cmd.roster, change=target, draining=draining)

    def _finish_remove(self, cmd: FinishRemove) -> tuple[FleetState, Result]:
        gone = cmd.node_id
        change = None if self.change is not None and self.change.node == gone else self.change
        if gone not in self.member_ids() and gone not in {m.id for m in self.roster} and change == self.change:
            return self._unchanged()
        if not self.roster:  # an empty roster means "as configured": it would bring the node back
            return self, self._reject(f"no removal of {gone!r} was begun")
        return self._next(roster=[m for m in self.roster if m.id != gone],
                          members=[n for n in self.members if n.id != gone],
                          member_formats=[(n, f) for n, f in self.member_formats if n != gone],
                          up=self.up - {gone}, draining=self.draining - {gone}, change=change)


_HANDLERS = {
    Join: FleetState._join,
    SetBrokers: FleetState._set_brokers,
    Drain: FleetState._drain,
    Undrain: FleetState._undrain,
    MarkDown: FleetState._mark_down,
    MarkUp: FleetState._mark_up,
    Reassign: FleetState._reassign,
    SetFormat: FleetState._set_format,
    BeginAdd: FleetState._begin_add,
    BeginRemove: FleetState._begin_remove,
    FinishRemove: FleetState._finish_remove,
}
