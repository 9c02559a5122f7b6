"""The table a node's data path actually uses: the *effective* assignment.

Normal mode (quorum, or quorum lost for less than the lease): the committed
table as every replica derives it (``FleetState.repaired()``), so every node
answers Metadata the same way. Brokers the local data path knows but the table
does not cover yet get an owner among the reachable nodes.

Degraded mode (quorum lost for longer than the lease, DESIGN §2.5): the last
committed table still wins for every identity whose owner this node can reach
(its heartbeats are fresh); the identities of unreachable owners are spread
over the reachable nodes, this node included, by ``topology.assign`` (so
nodes of one partition with the same view agree). Two nodes advertising one
identity for a while is harmless (DESIGN §2.3): bytes for node id B always go
to broker B.

:class:`QuorumLease` decides when a node is degraded. It enters degraded mode
after ``lease`` seconds without quorum and leaves it as soon as quorum is back
*and* the committed table is sane from here (every owner reachable), or after
quorum has been back for ``lease`` seconds, whichever comes first: the
committed table wins again without a window in which it points at nodes the
new leader has not yet marked down.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from membership.state import FleetState
from topology import AddressMap, Broker, BrokerId, ProxyId, ProxyNode, assign, freeze_owners


@attrs.frozen(slots=True)
class EffectiveAssignment:
    """One immutable snapshot of the effective table.

    ``epoch`` is the committed epoch it derives from; ``version`` increases on
    every change of this node's effective table (including changes that keep
    the epoch, such as entering degraded mode): use it, not ``epoch``, to tell
    snapshots apart. ``changed_at`` is the ``time.monotonic()`` of the change.
    """

    epoch: int
    owners: tuple[tuple[BrokerId, ProxyId], ...] = attrs.field(converter=freeze_owners)
    addresses: tuple[tuple[BrokerId, tuple[str, int]], ...] = ()
    degraded: bool = False
    version: int = 0
    changed_at: float = 0.0
    error: str | None = None

    def owner_map(self) -> dict[BrokerId, ProxyId]:
        return dict(self.owners)

    def address_map(self) -> dict[BrokerId, tuple[str, int]]:
        return dict(self.addresses)

    def same_table(self, other: EffectiveAssignment | None) -> bool:
        return (
            other is not None
            and self.epoch == other.epoch
            and self.owners == other.owners
            and self.addresses == other.addresses
            and self.degraded == other.degraded
            and self.error == other.error
        )


def effective_owners(
    state: FleetState,
    *,
    self_id: ProxyId,
    nodes: Mapping[ProxyId, ProxyNode],
    reachable: Iterable[ProxyId],
    degraded: bool,
    local_brokers: Iterable[Broker] = (),
) -> dict[BrokerId, ProxyId]:
    """``broker_id -> proxy_id`` for the data path (see the module doc).

    ``nodes`` is every node this member knows (its configuration, overridden
    by committed member records); ``reachable`` the nodes whose heartbeats are
    fresh. Always covers every committed and every locally reported broker.
    """
    reach = (frozenset(reachable) | {self_id}) & nodes.keys()
    brokers = {b.id: b for b in local_brokers}
    brokers.update((b.id, b) for b in state.brokers)  # committed records win
    draining = state.draining
    candidates = sorted(reach - draining) or sorted(reach)
    cand_nodes = [nodes[p] for p in candidates]
    base = {b: p for b, p in state.repaired().items() if b in brokers}
    if degraded:
        keep = {b: p for b, p in base.items() if p in reach}
        return assign(brokers.values(), cand_nodes, keep) if cand_nodes else keep
    missing = [brokers[b] for b in sorted(brokers.keys() - base.keys())]
    if missing and cand_nodes:
        base.update(assign(missing, cand_nodes))
    return dict(sorted(base.items()))


def build_effective(
    state: FleetState,
    *,
    self_id: ProxyId,
    configured: Mapping[ProxyId, ProxyNode],
    reachable: Iterable[ProxyId],
    degraded: bool,
    local_brokers: Iterable[Broker] = (),
    version: int = 0,
    changed_at: float = 0.0,
) -> EffectiveAssignment:
    nodes = dict(configured)
    nodes.update(state.member_map())
    local = tuple(local_brokers)
    owners = effective_owners(
        state,
        self_id=self_id,
        nodes=nodes,
        reachable=reachable,
        degraded=degraded,
        local_brokers=local,
    )
    all_ids = state.broker_ids() | {b.id for b in local}
    error = None
    try:
        addresses = AddressMap.build(owners, nodes.values(), all_ids).entries
    except ValueError as exc:  # AddressConflict included: report it, serve what we can
        error = str(exc)
        entries = []
        for b, p in owners.items():
            try:
                entries.append((b, nodes[p].address_for(b)))
            except (KeyError, ValueError):
                continue
        addresses = tuple(entries)
    return EffectiveAssignment(
        epoch=state.epoch,
        owners=owners,
        addresses=addresses,
        degraded=degraded,
        version=version,
        changed_at=changed_at,
        error=error,
    )


def committed_is_sane(state: FleetState, reachable: Iterable[ProxyId]) -> bool:
    """Every broker has an owner in the committed table and every owner is reachable."""
    owners = state.repaired()
    reach = frozenset(reachable)
    return owners.keys() >= state.broker_ids() and all(p in reach for p in owners.values())


class QuorumLease:
    """Degraded-mode switch with hysteresis; time comes from the caller."""

    def __init__(self, lease: float, now: float) -> None:
        self.lease = lease
        self.degraded = False
        self._lost_since: float | None = now  # no quorum until proven otherwise
        self._back_since: float | None = None

    def update(self, now: float, has_quorum: bool, committed_sane: bool) -> bool:
        if has_quorum:
            self._lost_since = None
            if self.degraded:
                if self._back_since is None:
                    self._back_since = now
                if committed_sane or now - self._back_since >= self.lease:
                    self.degraded = False
                    self._back_since = None
        else:
            self._back_since = None
            if self._lost_since is None:
                self._lost_since = now
            if now - self._lost_since >= self.lease:
                self.degraded = True
        return self.degraded
