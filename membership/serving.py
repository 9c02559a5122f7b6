"""The one map: what a node serves and advertises, as one immutable value.

A :class:`ServingMap` is computed in one place, by membership's pure core
(:func:`build_serving_map`), and is the only input of the data path: who owns
every broker identity, the host:port at which every identity is advertised,
which nodes are vacant (down or draining in the committed view) and which
addresses each node stands in on for them. A node without a fleet builds the
same type with :func:`standalone_map` (it owns every identity itself).

The data path keeps one local filter of its own: it never advertises an
identity before its listener is bound on this node (kroxylicious'
"no address before the listener is up").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from topology import AddressMap, BrokerId, ProxyId, ProxyNode, freeze_owners

#: The listener key of a node's bootstrap port in :class:`StandIn` (broker ids are >= 0).
BOOTSTRAP = -1


@attrs.frozen(slots=True)
class StandIn:
    """``node`` also listens on ``host:port`` — ``listener`` of the vacant node ``vacant``.

    A client that kept a vacant node's address (librdkafka's group-coordinator
    connection, a bootstrap list) reaches the right broker instead of a refused
    connection. Bytes for identity B go to broker B whoever accepts them
    (DESIGN §2.3), so several nodes sharing a bootstrap port is harmless.
    """

    node: ProxyId
    vacant: ProxyId
    listener: int  # BOOTSTRAP or a broker id
    host: str
    port: int


def _nodes(value: Iterable[ProxyNode]) -> tuple[ProxyNode, ...]:
    return tuple(sorted(value, key=lambda n: n.id))


def _addresses(
    value: Mapping[int, tuple[str, int]] | Iterable[tuple[int, tuple[str, int]]],
) -> tuple[tuple[BrokerId, tuple[str, int]], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((BrokerId(int(b)), (str(h), int(p))) for b, (h, p) in items))


@attrs.frozen(slots=True)
class ServingMap:
    """One snapshot of what the fleet serves, as seen by one node.

    ``epoch`` is the committed epoch it derives from; ``version`` grows on
    every change of this node's map (also changes that keep the epoch, such as
    entering degraded mode): use it, not ``epoch``, to order snapshots.
    ``changed_at`` is the ``time.monotonic()`` of the change. ``error`` says
    why some address could not be computed (the map serves what it can).
    """

    epoch: int = 0
    owners: tuple[tuple[BrokerId, ProxyId], ...] = attrs.field(default=(), converter=freeze_owners)
    addresses: tuple[tuple[BrokerId, tuple[str, int]], ...] = attrs.field(default=(), converter=_addresses)
    nodes: tuple[ProxyNode, ...] = attrs.field(default=(), converter=_nodes)
    vacant: frozenset[ProxyId] = frozenset()
    draining: frozenset[ProxyId] = frozenset()
    stand_ins: tuple[StandIn, ...] = ()
    degraded: bool = False
    # Degraded mode only: the nodes this one cannot reach (the addresses of those float to
    # it or a peer it reaches: proxy.takeover); empty while the fleet has quorum.
    unreachable: frozenset[ProxyId] = frozenset()
    # This node hears none of its peers and they all fell silent at once: more likely its own
    # receive path is cut (a one-way partition) than every peer failing together. Its peers
    # declare it down and take its address; it takes none of theirs (``unreachable`` stays empty).
    isolated: bool = False
    # Peers whose host refused this node's heartbeat since it last heard them (their process
    # is gone, membership.liveness ``refused_peers``): their addresses float before the commit
    # that marks them down (proxy.takeover.down_nodes); owners and stand-in duties still follow
    # the committed view.
    refused: frozenset[ProxyId] = frozenset()
    version: int = 0
    changed_at: float = 0.0
    error: str | None = None

    # ---- lookups (the data path's per-response reads go through owner_map/address_map copies)
    def owner_map(self) -> dict[BrokerId, ProxyId]:
        return dict(self.owners)

    def address_map(self) -> dict[BrokerId, tuple[str, int]]:
        return dict(self.addresses)

    def node(self, node_id: str) -> ProxyNode | None:
        for n in self.nodes:
            if n.id == node_id:
                return n
        return None

    def owned_by(self, node_id: str) -> frozenset[BrokerId]:
        return frozenset(b for b, p in self.owners if p == node_id)

    def stand_ins_of(self, node_id: str) -> tuple[StandIn, ...]:
        return tuple(s for s in self.stand_ins if s.node == node_id)

    def same_table(self, other: ServingMap | None) -> bool:
        """Equal in everything the data path acts on (``version``/``changed_at`` aside)."""
        return other is not None and attrs.evolve(self, version=0, changed_at=0.0) == attrs.evolve(
            other, version=0, changed_at=0.0
        )


def stand_in_duties(
    owners: Mapping[BrokerId, ProxyId],
    nodes: Iterable[ProxyNode],
    vacant: Iterable[ProxyId],
    idle: Iterable[ProxyId] | None = None,
) -> tuple[StandIn, ...]:
    """Every node that is not ``idle`` (default: not vacant) stands in on each
    other vacant node's bootstrap port, and on that node's port of every
    identity it owns itself. A draining node is idle: it is sending its
    clients away. A node that is down in the committed view but alive (it is
    about to be marked up) is vacant, yet not idle when ``idle`` is the
    draining set."""
    by_id = {n.id: n for n in nodes}
    gone = sorted(p for p in set(vacant) if p in by_id)
    resting = set(gone) if idle is None else set(idle)
    duties = []
    for me in sorted(by_id.keys() - resting):
        mine = sorted(b for b, p in owners.items() if p == me)
        for v in gone:
            if v == me:
                continue
            host = by_id[v].host
            duties.append(StandIn(me, v, BOOTSTRAP, host, by_id[v].bootstrap_port))
            for b in mine:
                try:
                    duties.append(StandIn(me, v, b, host, by_id[v].ports.port_for(b)))
                except ValueError:  # no port for b in v's scheme: nothing to stand in on
                    continue
    return tuple(duties)


def addresses_for(
    owners: Mapping[BrokerId, ProxyId],
    nodes: Iterable[ProxyNode],
    all_broker_ids: Iterable[int],
) -> tuple[tuple[tuple[BrokerId, tuple[str, int]], ...], str | None]:
    """(advertised addresses, error): the whole node table is validated first;
    on a conflict the error is reported and every address that can be computed
    is still served."""
    node_list = list(nodes)
    try:
        return AddressMap.build(owners, node_list, all_broker_ids).entries, None
    except ValueError as exc:  # AddressConflict included
        by_id = {n.id: n for n in node_list}
        entries = []
        for b, p in sorted(owners.items()):
            try:
                entries.append((b, by_id[p].address_for(b)))
            except (KeyError, ValueError):
                continue
        return tuple(entries), str(exc)


def standalone_map(node: ProxyNode, brokers: Iterable[int], *, version: int = 0, changed_at: float = 0.0) -> ServingMap:
    """A node without a fleet: it owns, and advertises itself for, every identity in ``brokers``."""
    ids = sorted(set(brokers))
    owners = {BrokerId(b): node.id for b in ids}
    addresses, error = addresses_for(owners, [node], ids)
    return ServingMap(epoch=0, owners=owners, addresses=addresses, nodes=(node,), version=version,
                      changed_at=changed_at, error=error)

