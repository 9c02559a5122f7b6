"""The owners a node's data path actually uses (the *effective* table) and its :class:`ServingMap`.

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
after ``lease`` seconds without quorum (counted from the last time a majority was heard when
there is none left: no election can bring quorum back) and leaves it as soon as quorum is back
*and* the committed table is sane from here (every owner reachable), or after
quorum has been back for ``lease`` seconds, whichever comes first: the
committed table wins again without a window in which it points at nodes the
new leader has not yet marked down.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from membership.serving import ServingMap, addresses_for, stand_in_duties
from membership.state import FleetState
from topology import Broker, BrokerId, ProxyId, ProxyNode, assign


def committed_vacant(state: FleetState) -> frozenset[ProxyId]:
    """Members that are down or draining in the committed view."""
    return frozenset(p for p in state.member_ids() if p not in state.up or p in state.draining)


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


def build_serving_map(
    state: FleetState,
    *,
    self_id: ProxyId,
    configured: Mapping[ProxyId, ProxyNode],
    reachable: Iterable[ProxyId],
    degraded: bool,
    local_brokers: Iterable[Broker] = (),
    vacant: Iterable[ProxyId] | None = None,
    version: int = 0,
    changed_at: float = 0.0,
    isolated: bool = False,
    hearing: Iterable[ProxyId] | None = None,
    refused: Iterable[ProxyId] = (),
) -> ServingMap:
    """This node's :class:`ServingMap` (see the module doc for the owners).

    ``vacant`` defaults to the committed view's (:func:`committed_vacant`).
    Stand-in duties follow the committed view only: in degraded mode a node
    cannot tell a dead peer from a partitioned one, so the caller passes the
    vacant set of its last map that was not degraded (:class:`MemberCore` does).
    A draining node stands in for nobody. An ``isolated`` node (membership.liveness) lists no
    peer as unreachable: it is the one cut off, and must not claim its peers' addresses.
    Otherwise, degraded, a node lists as unreachable (to claim their addresses) only the peers
    it does not hear at all (``hearing``, default ``reachable``): a peer it hears that does not
    hear it yet is one whose link just came back, or one it cannot reach while the clients
    can (a broken send path): claiming its address would take it from a host that serves.
    ``refused``: the peers whose host refused a heartbeat since they were last heard (dead
    processes), passed on as the map's ``refused``.
    """
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
    addresses, error = addresses_for(owners, nodes.values(), all_ids)
    gone = committed_vacant(state) if vacant is None else frozenset(vacant)
    return ServingMap(
        epoch=state.epoch,
        owners=owners,
        addresses=addresses,
        nodes=nodes.values(),
        vacant=gone,
        draining=state.draining,
        stand_ins=stand_in_duties(owners, nodes.values(), gone, idle=state.draining),
        degraded=degraded,
        unreachable=(frozenset(nodes) - frozenset(reachable if hearing is None else hearing) - {self_id}
                     if degraded and not isolated else frozenset()),
        isolated=isolated,
        refused=frozenset(refused) & nodes.keys() - {self_id},
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

    def update(self, now: float, has_quorum: bool, committed_sane: bool, lost_at: float | None = None) -> bool:
        """``lost_at``: when the quorum was last proven, if the caller knows it is gone for good
        (no majority to elect a leader with): the lease counts from there, not from now."""
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
            if lost_at is not None:
                # Also when the quorum was already lost a moment ago (a leader overdue: an
                # election began while the majority was still there) and the majority went after.
                self._lost_since = min(self._lost_since, lost_at)
            if now - self._lost_since >= self.lease:
                self.degraded = True
        return self.degraded
