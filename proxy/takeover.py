"""Address takeover as a pure reconciler: which vacant nodes' addresses this node listens on.

A node that is down or draining leaves its host:ports behind; clients that
cached them (librdkafka's group coordinator, a bootstrap list) keep dialling
them. The map (``membership.serving.ServingMap.stand_ins``) says which of those
addresses each node stands in on: a vacant node's bootstrap port, and its port
of every identity the standing-in node owns. Bytes for identity B go to broker
B whoever accepts them (DESIGN §2.3), so two nodes sharing a port for a moment
is harmless. The shell binds with SO_REUSEPORT, so the vacant node can bind
again when it comes back.

:class:`TakeoverReconciler` compares what is wanted with what is held and
returns :class:`Bind` / :class:`Release` actions; the I/O shell executes them
and reports each bind's outcome. A failed bind (the address is not bindable
here: no floating IP) is logged once per vacancy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import attrs

from membership.serving import BOOTSTRAP, ServingMap, StandIn, stand_in_duties
from topology import ProxyNode

#: (vacant node id, listener: BOOTSTRAP or a broker id)
TakeoverKey = tuple[str, int]


@attrs.frozen(slots=True)
class Bind:
    key: TakeoverKey
    host: str
    port: int


@attrs.frozen(slots=True)
class Release:
    key: TakeoverKey


def wanted_stand_ins(serving: ServingMap, node_id: str, bound: Iterable[int], *, draining: bool) -> tuple[StandIn, ...]:
    """The stand-ins ``node_id`` should hold now: the map's duties for it, on the
    bootstrap port or on an identity whose own listener is bound here; none
    while it drains."""
    if draining:
        return ()
    here = set(bound)
    return tuple(s for s in serving.stand_ins_of(node_id) if s.listener == BOOTSTRAP or s.listener in here)


# A node removed from the fleet is stood in for this long at its old address (loopback
# stand-ins, the `none` mover): a client may keep an identity's old address while the identity
# id stays the same (librdkafka's group coordinator reconnects to the address it was given,
# whatever later Metadata says), and would be refused there forever once the node is gone.
REMOVED_STAND_IN_S = 300.0


def removed_stand_ins(serving: ServingMap, node_id: str, bound: Iterable[int], removed: Iterable[ProxyNode], *,
                      draining: bool) -> tuple[StandIn, ...]:
    """The stand-ins ``node_id`` should hold at the addresses of recently ``removed`` nodes:
    the same duties as for a vacant node (its bootstrap port and the ports of the identities
    this node owns), none while it drains."""
    gone = [n for n in removed if serving.node(n.id) is None and n.id != node_id]
    if draining or not gone:
        return ()
    duties = stand_in_duties(serving.owner_map(), [*serving.nodes, *gone], {n.id for n in gone},
                             idle=serving.vacant | serving.draining)
    here = set(bound)
    return tuple(s for s in duties if s.node == node_id and (s.listener == BOOTSTRAP or s.listener in here))


class TakeoverReconciler:
    """What to bind and release; remembers failed binds to log each once."""

    __slots__ = ("held", "_failed")

    def __init__(self) -> None:
        self.held: set[TakeoverKey] = set()
        self._failed: set[TakeoverKey] = set()

    def plan(self, wanted: Iterable[StandIn]) -> list[Bind | Release]:
        """Release what is no longer wanted (first), then bind what is wanted and not held."""
        by_key = {(s.vacant, s.listener): s for s in wanted}
        actions: list[Bind | Release] = [Release(k) for k in sorted(self.held - by_key.keys())]
        self._failed &= by_key.keys()  # a vacancy that ended: a new one logs again
        actions += [Bind(k, s.host, s.port) for k, s in sorted(by_key.items()) if k not in self.held]
        return actions

    def bound(self, key: TakeoverKey) -> None:
        self.held.add(key)

    def released(self, key: TakeoverKey) -> None:
        self.held.discard(key)

    def bind_failed(self, key: TakeoverKey) -> bool:
        """The bind of ``key`` failed; True the first time for this vacancy (log it)."""
        if key in self._failed:
            return False
        self._failed.add(key)
        return True

    def clear(self) -> list[Release]:
        """Release everything (the node drains or stops)."""
        actions = [Release(k) for k in sorted(self.held)]
        return actions


# ------------------------------------------------------------ floating addresses
# With a mover that moves addresses (proxy.addresses: netns, linux, command) a down node's
# advertised address is held by exactly one survivor, which listens on every port of it; the
# node's own host holds it only while the node is up in the committed map and not fenced.
# A draining node keeps its address: it refuses new connections itself and flushes the ones it
# has, which moving the address would reset.


def down_nodes(serving: ServingMap) -> frozenset[str]:
    """Vacant or refused (its process is gone: the address floats at once, not after the commit
    that marks it down), and not draining, or (degraded mode) out of reach: the nodes whose
    address floats to a survivor. Without quorum a node cannot tell a dead peer from a cut-off
    one; taking the address of one that is alive after all is undone by the fence when quorum
    returns. A refusal is no such guess: a host answers "port unreachable" only when nothing
    listens on the heartbeat's port."""
    return ((serving.vacant | serving.refused) - serving.draining) | serving.unreachable


def address_holder(serving: ServingMap, vacant: str) -> str | None:
    """The one survivor that holds ``vacant``'s address: of the nodes standing in for it (in
    degraded mode, or while it is refused but not yet vacant in the committed view: every node
    not draining, the same set the stand-in duties give once it is) that are not down
    themselves, the first by a hash of (vacant, node), so that the addresses of several down
    nodes spread over the survivors, every node computes the same one, and the commit that
    marks a refused node down leaves its address where it is."""
    down = down_nodes(serving)
    if vacant not in down:
        return None  # draining (keeps its address) or not vacant at all
    candidates = {s.node for s in serving.stand_ins if s.vacant == vacant and s.listener == BOOTSTRAP}
    if serving.degraded or vacant not in serving.vacant:
        candidates |= {n.id for n in serving.nodes} - serving.draining
    candidates -= down
    if not candidates:
        return None
    return min(sorted(candidates), key=lambda n: hashlib.sha256(f"{vacant}\0{n}".encode()).digest())


def wanted_addresses(serving: ServingMap, node_id: str, *, fleet: bool, fenced: bool, draining: bool) -> frozenset[str]:
    """The nodes whose floating address ``node_id``'s host should hold now (its own included).

    Its own: not while fenced; with a fleet, only once a committed map (epoch > 0) says it is
    not down. A down node's: when this node is its holder, not fenced and not draining."""
    if fenced:
        return frozenset()
    down = down_nodes(serving)
    own = not fleet or (serving.epoch > 0 and node_id not in down)
    held = {node_id} if own else set()
    if fleet and not draining and node_id not in down:
        held |= {v for v in down if v != node_id and address_holder(serving, v) == node_id}
    return frozenset(held)


def floating_stand_ins(serving: ServingMap, node_id: str, bound: Iterable[int], held: Iterable[str]) -> tuple[StandIn, ...]:
    """The listeners on the addresses of down nodes ``node_id`` holds: the bootstrap port and
    the port of every identity bound here (any node can serve any identity, DESIGN §2.2)."""
    out = []
    for v in sorted(set(held) - {node_id}):
        node = serving.node(v)
        if node is None:
            continue
        out.append(StandIn(node_id, v, BOOTSTRAP, node.host, node.bootstrap_port))
        for b in sorted(bound):
            try:
                out.append(StandIn(node_id, v, b, node.host, node.ports.port_for(b)))
            except ValueError:  # no port for b in v's scheme
                continue
    return tuple(out)


@attrs.frozen(slots=True)
class TakeAddress:
    node: str  # whose floating address
    host: str


@attrs.frozen(slots=True)
class ReleaseAddress:
    node: str
    host: str


class AddressReconciler:
    """What to take and release so that the host holds exactly the wanted addresses."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[str, str] = {}  # node id -> its address, held here

    def plan(self, wanted: Iterable[str], serving: ServingMap, own: tuple[str, str]) -> list[TakeAddress | ReleaseAddress]:
        """Releases first (a fenced node gives back before anything else), then takes.
        ``own``: (this node's id, its floating address), known even before a map is."""
        hosts = {n.id: n.host for n in serving.nodes}
        hosts[own[0]] = own[1]
        want = {n: hosts[n] for n in wanted if n in hosts}
        actions: list[TakeAddress | ReleaseAddress] = [
            ReleaseAddress(n, h) for n, h in sorted(self.held.items()) if want.get(n) != h]
        actions += [TakeAddress(n, h) for n, h in sorted(want.items()) if self.held.get(n) != h]
        return actions

    def taken(self, action: TakeAddress) -> None:
        self.held[action.node] = action.host

    def released(self, action: ReleaseAddress) -> None:
        self.held.pop(action.node, None)


class Fence:
    """When a node must give back every floating address before serving again (pure; the
    caller passes the time).

    A host that was frozen (every process stopped) or cut off for ``stall_s`` (the fleet's
    ``dead_after_s``) may have been declared down, and a survivor may hold its address now:
    two hosts answering one address would reset each other's connections. So after a stall
    (``tick`` finds a gap of ``stall_s`` or more) or a quorum regained after a degraded spell
    (``map_seen``), the node is fenced: it releases its addresses and drops its connections.
    It unfences once it has quorum and its map carries a committed epoch newer than the one it
    was fenced at (a fleet that declared it down committed a new epoch), or once it has had
    quorum for ``confirm_s`` (Raft's election timeout: by then the leader's appends told it the
    committed epoch, unchanged); its map then says whether it is down.
    """

    __slots__ = ("stall_s", "confirm_s", "fenced", "fenced_at", "fenced_epoch", "_last_tick", "_degraded",
                 "_quorum_since")

    def __init__(self, stall_s: float, confirm_s: float, now: float) -> None:
        self.stall_s = stall_s
        self.confirm_s = confirm_s
        self.fenced = False
        self.fenced_at = 0.0
        self.fenced_epoch = 0
        self._last_tick = now
        self._degraded = False
        self._quorum_since: float | None = None

    def _fence(self, now: float, epoch: int) -> bool:
        first = not self.fenced
        self.fenced, self.fenced_at, self.fenced_epoch, self._quorum_since = True, now, epoch, None
        return first

    def start_ticking(self, now: float) -> None:
        """Ticks count from ``now``: a gap before it (the node starting) is no stall."""
        self._last_tick = now

    def tick(self, now: float, epoch: int) -> bool:
        """Called every fraction of ``stall_s`` (``epoch``: the map's in effect); True when this
        tick fenced the node (a stall)."""
        gap, self._last_tick = now - self._last_tick, now
        return self._fence(now, epoch) if gap >= self.stall_s else False

    def map_seen(self, now: float, degraded: bool, epoch: int, isolated: bool = False) -> bool:
        """A new map is in effect; True when it fenced the node: quorum back after a degraded
        spell, or ``isolated`` (every peer fell silent at once: this host is the one cut off,
        and its peers, which stopped hearing it as it stopped hearing them, are taking its
        address now). An isolated host gives its own address up at once: held until the heal,
        its kernel would announce it (ARP for the clients it still has packets for, sent from
        that address) as the link comes back, pointing the clients' caches at a host that is
        about to learn it is down and drop the address; they would send into the void until
        their entries fail (~10 s, seen after every two-way heal on emulated hosts)."""
        was, self._degraded = self._degraded, degraded or isolated
        if isolated:
            return self._fence(now, epoch)
        return self._fence(now, epoch) if was and not degraded else False

    def may_unfence(self, now: float, has_quorum: bool, epoch: int) -> bool:
        """True (and unfenced) once the node knows the committed epoch (see the class doc)."""
        if not self.fenced:
            return True
        if not has_quorum or self._degraded:
            self._quorum_since = None
            return False
        if self._quorum_since is None:
            self._quorum_since = now
        if epoch > self.fenced_epoch or now - self._quorum_since >= self.confirm_s:
            self.fenced = False
            return True
        return False
