"""One node's data path: listeners, upstream brokers and client connections, wired.

Theory of operation
-------------------
A :class:`DataPath` binds, on its own address, one bootstrap port plus one
port per broker identity (eagerly, for every broker discovered upstream:
:mod:`proxy.discovery`, :mod:`proxy.listeners`). Each client connection is
paired with an upstream connection (:mod:`proxy.connection`; with
``limits.share_upstream``, borrowed per request while the client only asks:
:mod:`proxy.upstream_pool`) and lives in the node's
:class:`proxy.registry.ConnectionRegistry`.

Which proxy advertises which broker identity is *not* decided here: the one
input is a :class:`membership.serving.ServingMap`, pushed in by
:meth:`DataPath.apply_map` (the fleet's), or, for a node without a fleet,
rebuilt with :func:`membership.serving.standalone_map` whenever the bound
listeners change. :class:`proxy.advertised.AdvertisedAddresses` turns it into
what clients are told. When an identity moves away from this node, the
clients connected to it here are drained (:mod:`proxy.drain`): closed at an
idle moment so the client refreshes metadata and reconnects to the new owner
(DESIGN §4). The map's ``draining`` drains or undrains the whole node, and its
stand-in duties drive address takeover (:mod:`proxy.takeover`); the clients a
released stand-in accepted go back to the address's node once it serves again
(:mod:`proxy.handback`). With an
``[addresses]`` mover the node's advertised address floats instead
(:mod:`proxy.addresses.floating`): the one survivor that holds a down node's
address listens on all of its ports, and a node that stalled fences itself.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable

import attrs

from membership.serving import BOOTSTRAP, ServingMap, standalone_map
from proxy.addresses.config import NONE as NO_MOVER
from proxy.addresses.floating import FloatingAddresses
from proxy.addresses.tickle import ClientPair
from proxy.advertised import AdvertisedAddresses
from proxy.config import Config, HostPort, proxy_node
from proxy.connect_pacing import ConnectTurns, Turn, pacing_for_workers
from proxy.connection import Pair, UpstreamSide, reset_transport
from proxy.discovery import BrokerDiscovery
from proxy.drain import CloseListeners, DrainAt, DrainConnections, NodeDrain, Rebind
from proxy.errors import ProtocolError, RewriteError, UnknownBroker
from proxy.fleet_metrics import FleetCollector, FleetSample
from proxy.hosts import join_host_port, source_address
from proxy.listeners import Listeners, client_capacity
from proxy.logs import describe_error
from proxy.metrics import ProxyMetrics
from proxy.registry import ConnectionRegistry
from proxy.rewrite import BrokerAddress, ResponseRewriter
from proxy.sockets import SYN_RESEND_S, create_connection_from, first_connection
from proxy.status import BrokerRow
from proxy.takeover import REMOVED_STAND_IN_S, floating_stand_ins, removed_stand_ins, wanted_stand_ins
from proxy.tls import HANDSHAKE_TIMEOUT_S, CertificateReloader, HandshakeFailures, TlsEndpoint, describe
from proxy.tls import listener_context, upstream_context
from proxy.upstream import PLAINTEXT, UpstreamBroker, UpstreamSecurity
from topology import ProxyNode

log = logging.getLogger("kproxy.proxy")
FETCH = 1
# A broker connect that timed out is tried again this often (proxy.sockets.first_connection):
# a broker's full accept queue drops SYNs in a storm; its clients would have waited on.
UPSTREAM_TIMEOUT_RETRIES = 2


@attrs.frozen
class DataPathStatus:
    """What the data path reports in ``/status`` (the runtime adds the fleet's part)."""

    node: str
    bootstrap: str
    listeners: tuple[int, ...]
    unbound: tuple[int, ...]
    standing_in: tuple[str, ...]
    connections: int
    draining: bool
    brokers: tuple[BrokerRow, ...]
    floating: dict[str, object] | None = None  # FloatingAddresses.status(); None: no address mover
    moving: int = 0  # connections draining, not closed yet (proxy.registry)

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "bootstrap": self.bootstrap, "listeners": list(self.listeners),
                "unbound": list(self.unbound), "standing_in": list(self.standing_in),
                "connections": self.connections, "draining": self.draining,
                "brokers": [b.to_json() for b in self.brokers], "floating": self.floating, "moving": self.moving}


class DataPath:
    """One proxy node's data path. ``await start()``, ``await stop()``."""

    def __init__(self, config: Config, node_id: str, *, fleet: bool = False,
                 metrics: ProxyMetrics | None = None, reuse_port: bool = False) -> None:
        """``fleet=False``: this node advertises every identity it has bound
        itself. With a fleet, the map comes from ``apply_map``. ``reuse_port``:
        the node's own listeners are shared with its other worker processes."""
        self.config = config
        self.local = config.node(node_id)
        self.node = proxy_node(config, node_id)
        self.fleet = fleet
        self.metrics = metrics or ProxyMetrics(node_id)
        # Address takeover (fleet only): listeners on the addresses of vacant nodes.
        self.takeover_enabled = fleet and config.fleet is not None and config.fleet.address_takeover
        self.floating = self._floating(config, node_id, fleet)
        self._removed: dict[str, tuple[ProxyNode, float]] = {}  # node id -> (node, stand in until)
        # Fenced while isolated: the connections held silent until the fence lifts (_fenced).
        self._held: list[Pair] = []
        if self.floating is not None:
            self.floating.before_release = self._vacate
        self.node_drain = NodeDrain(self.takeover_enabled)
        self.advertised = AdvertisedAddresses(self.node)
        self._owners: dict[int, str] = {}
        self.rewriter = ResponseRewriter(self.advertised.address_of, on_brokers=self._brokers_seen,
                                         version_caps={FETCH: config.limits.fetch_max_version})
        self.metrics.watch_rewrites(self.rewriter.counts)
        self.registry = ConnectionRegistry(node_id, config.limits, self.metrics, self.rewriter, self.node_drain,
                                           tap_dir=config.tap_dir,
                                           max_connections=client_capacity(config.limits.max_connections,
                                                                           self.local.workers))
        self.registry.connect = self._connect_upstream
        self.registry.take_kept = self._take_kept
        # Per broker address, a bounded number of this worker's connects in flight (proxy.connect_pacing).
        self.connect_turns = ConnectTurns(pacing_for_workers(self.local.workers),
                                          on_wait=self.metrics.upstream_connect_waits.inc,
                                          on_given_back=_trace_turn)
        self.registry.unstall = self._unstall
        self.registry.owned_here = self._owned_here
        self.registry.served_elsewhere = self._served_elsewhere
        self._setup_tls(config)
        self.registry.clients_log_in = self.upstream_security.login is not None
        self.listeners = Listeners(self.node, self.registry, reuse_port=self.takeover_enabled or reuse_port,
                                   on_bound=self._bound_changed, tls=self.listener_tls,
                                   plaintext=self._plaintext_listeners,
                                   bind_host=self.local.floating_host or self.local.host)
        self.discovery = BrokerDiscovery(config, self.local.host, self.listeners, self.registry,
                                         security=self.upstream_security)
        if fleet:  # a forgotten broker's listener stays while the fleet's map still lists it
            self.discovery.held = lambda: self._owners.keys()
        # Upstream connections leave from this node's own bound address (like a separate host)
        # when it is one IP of the broker's family (proxy.config.source_address); with floating
        # addresses, from the host's own one, which never moves.
        self._bind_host = self.local.host
        self.started_at = time.time()
        self.metrics.registry.register(FleetCollector(node_id, self._fleet_sample))

    def _floating(self, config: Config, node_id: str, fleet: bool) -> FloatingAddresses | None:
        """The floating-address shell when ``[addresses]`` has a mover. A stall as long as the
        fleet's ``dead_after_s`` fences the node; Raft's longest election timeout with quorum
        lifts the fence."""
        if config.addresses.kind == NO_MOVER:
            return None
        f = config.fleet
        stall_s = f.dead_after_s if f is not None else 1.0
        confirm_s = f.raft_max_timeout_s if f is not None else 0.0
        floating = FloatingAddresses(config.addresses, node_id, self.node.host, fleet=fleet and f is not None,
                                     stall_s=stall_s, confirm_s=confirm_s)
        warning = floating.mover.host_warning()
        if warning is not None:
            log.warning("floating addresses: %s", warning, extra={"node": node_id})
        return floating

    def _setup_tls(self, config: Config) -> None:
        """The TLS contexts of ``[security]`` (proxy.tls), or none: plaintext both ways."""
        security = config.security
        self.tls_failures = HandshakeFailures(self.metrics.registry, self.node.id)
        self.listener_tls: TlsEndpoint | None = None
        self.certificates: CertificateReloader | None = None
        self._plaintext_listeners: frozenset[int] = frozenset()
        self.upstream_security: UpstreamSecurity = PLAINTEXT
        if security is None:
            return
        if security.listeners is not None:
            context = listener_context(security.listeners)
            self.listener_tls = TlsEndpoint(context, self.tls_failures)
            self.certificates = CertificateReloader(context, security.listeners.cert, security.listeners.key)
            self._plaintext_listeners = security.listeners.plaintext
        tls = upstream_context(security.upstream_tls) if security.upstream_tls is not None else None
        self.upstream_security = UpstreamSecurity(tls, security.upstream_sasl)

    def reload_certificates(self) -> bool:
        """SIGHUP: load the listeners' certificate and key again (new handshakes use them)."""
        return self.certificates.reload() if self.certificates is not None else False

    def reconfigure(self, config: Config) -> None:
        """A config reload (proxy.reload.plan_reload's config): limits for new connections and
        admission, the broker connect timeout, the discovery interval. On the loop."""
        self.config = config
        self.discovery.config = config
        self.registry.set_limits(config.limits, client_capacity(config.limits.max_connections, self.local.workers))

    async def _watch_certificates(self, interval: float) -> None:
        assert self.certificates is not None
        while True:
            await asyncio.sleep(interval)
            self.certificates.check()

    # ----------------------------------------------------------- lifecycle
    async def start(self, discovery_timeout: float = 60.0) -> None:
        if self.floating is not None:
            self.floating.warm_up()  # in the mover's thread, beside the discovery
        await self.discovery.first(discovery_timeout)
        await self.listeners.bind_bootstrap()
        self.registry.spawn(self.discovery.refresh_loop())
        security = self.config.security
        if self.certificates is not None and security is not None and security.listeners is not None \
                and security.listeners.reload_interval_s > 0:
            self.registry.spawn(self._watch_certificates(security.listeners.reload_interval_s))
        log.info("proxy node serving", extra={"node": self.node.id, "bootstrap": self.bootstrap_address,
                                              "brokers": sorted(self.brokers)})

    async def _vacate(self, node: str, host: str) -> None:
        """Before giving ``node``'s address back (proxy.addresses.floating): stop standing in
        there, then reset the clients connected to it here, so they reconnect to the address's
        next holder instead of waiting on a connection this host can no longer answer on.

        Once the address is gone this host can send those clients nothing, so every connection
        at it must be reset on the wire first. Two of uvloop's "soon"s stand in the way, each
        seen to leave a client waiting out its 10 s request timeout after a heal: a connection
        accepted just before the listener closed gets ``connection_made`` (its pair) on the
        loop's next pass, and a closed transport's socket is closed on the next pass too. So:
        close the listeners, let one pass make the pairs, reset them (an RST, whatever they had
        queued; TLS handshakes as well), and let one pass close their sockets."""
        assert self.floating is not None
        await self.listeners.stand_in(floating_stand_ins(self.serving, self.node.id, self.listeners.bound,
                                                         self.floating.held - {node}))
        await asyncio.sleep(0)  # the pairs of connections accepted before the listeners closed
        pairs = [p for p in self.registry.pairs if p.client is not None and _local_host(p.client) == host]
        for pair in pairs:
            pair.reset("its address goes back to its node")
        handshakes = [t for t in self.registry.handshaking if _local_host(t) == host]
        for transport in handshakes:
            self.registry.handshaking.discard(transport)
            reset_transport(transport)
        await asyncio.sleep(0)  # their sockets close: the RSTs leave while the address is still here
        log.info("giving a floating address back: its clients here were reset",
                 extra={"node": node, "address": host, "connections": len(pairs) + len(handshakes)})

    def watch_stalls(self) -> None:
        """With floating addresses: from now on a stall fences the node (call once it is up:
        starting, imports and Raft's start may hold the loop for a second)."""
        if self.floating is not None:
            self.registry.spawn(self.floating.watch(lambda: self.serving, self._fenced, self._sync_takeover))

    async def stop(self) -> None:
        if self.floating is not None:
            await self.floating.release_all()
        self.listeners.close_all()
        await self.registry.stop()

    def _fleet_sample(self) -> FleetSample:  # scrape thread: immutable map, copied ids
        return FleetSample(self.serving, tuple(self.brokers), tuple(self.unbound), self.draining)

    @property
    def brokers(self) -> dict[int, UpstreamBroker]:
        return self.discovery.brokers

    @property
    def serving(self) -> ServingMap:
        """The map in effect."""
        return self.advertised.serving

    @property
    def draining(self) -> bool:
        return self.node_drain.draining

    @property
    def connections(self) -> int:
        return len(self.registry.pairs)

    @property
    def bootstrap_address(self) -> str:
        return join_host_port(self.node.host, self.node.bootstrap_port)

    @property
    def unbound(self) -> list[int]:
        return self.discovery.unbound

    def on_brokers_changed(self, callback: Callable[[list[UpstreamBroker]], None]) -> None:
        self.discovery.on_changed(callback)

    def _brokers_seen(self, api_key: int, brokers: tuple[BrokerAddress, ...], complete: bool) -> None:
        self.discovery.brokers_seen(api_key, brokers, complete)

    # --------------------------------------------------------- the map
    def apply_map(self, serving: ServingMap) -> int:
        """A new map is in effect: advertise it, drain the clients of identities
        that moved away from this node, drain or undrain the whole node as the
        map says (fleet), and stand in as it says. Returns connections drained."""
        me = self.node.id
        old = self.advertised.serving
        self._note_removed(old, serving)
        moved_away = old.owned_by(me) - serving.owned_by(me)
        self.advertised.apply(serving)
        self._owners = serving.owner_map()
        if old.epoch != serving.epoch or moved_away:
            log.info("assignment in effect", extra={"epoch": serving.epoch, "owners": dict(serving.owners),
                                                    "moved_away": sorted(moved_away)})
        drained = self.registry.drain(set(moved_away)) if moved_away else 0
        if self.floating is not None and self.floating.map_seen(serving):
            self._fenced(isolated=serving.isolated)
        if self.fleet and old.owners != serving.owners:
            self.registry.spawn(self.discovery.release_unheld())
        if self.fleet:
            if me in serving.draining and not self.draining:
                drained += self.drain_all()
            elif me not in serving.draining and self.draining:
                self.registry.spawn(self.undrain())
        if self.takeover_enabled or self.floating is not None:
            self.registry.spawn(self._sync_takeover())
        return drained

    def _note_removed(self, old: ServingMap, new: ServingMap) -> None:
        """Nodes the new map no longer has: stood in for at their old address for
        ``REMOVED_STAND_IN_S`` (loopback stand-ins only; proxy.takeover.removed_stand_ins)."""
        if not self.fleet or self.floating is not None:
            return
        now = time.monotonic()
        for n in old.nodes:
            if n.id != self.node.id and new.node(n.id) is None:
                self._removed[n.id] = (n, now + REMOVED_STAND_IN_S)
                try:  # to give the address up once the time is over
                    asyncio.get_running_loop().call_later(REMOVED_STAND_IN_S + 0.1,
                                                          lambda: self.registry.spawn(self._sync_takeover()))
                except RuntimeError:
                    pass  # no loop (a map applied before serving): the next map's sync gives it up
        for node_id in [i for i in self._removed if new.node(i) is not None]:
            del self._removed[node_id]  # added back: its own node serves there

    def _recently_removed(self) -> list[ProxyNode]:
        now = time.monotonic()
        for node_id in [i for i, (_, until) in self._removed.items() if until <= now]:
            del self._removed[node_id]
        return [n for n, _ in self._removed.values()]

    def _bound_changed(self, bound: frozenset[int]) -> None:
        self.advertised.set_bound(bound)
        if not self.fleet:
            self.apply_map(standalone_map(self.node, bound, version=self.serving.version + 1,
                                          changed_at=time.monotonic()))

    def _owned_here(self, listener: int) -> bool:
        return listener == BOOTSTRAP or self._owners.get(listener) == self.node.id

    def _served_elsewhere(self, listener: int) -> bool:
        """The map in effect gives this listener's identity to another node (a fleet map: a
        standalone node owns what it binds; an identity nobody owns is served where asked)."""
        owner = self._owners.get(listener)
        return self.fleet and owner is not None and owner != self.node.id

    async def _sync_takeover(self) -> None:
        if self.floating is None:
            wanted = (*wanted_stand_ins(self.serving, self.node.id, self.listeners.bound, draining=self.draining),
                      *removed_stand_ins(self.serving, self.node.id, self.listeners.bound, self._recently_removed(),
                                         draining=self.draining))
        else:
            held = await self.floating.sync(self.serving, draining=self.draining)
            wanted = () if self.draining else floating_stand_ins(self.serving, self.node.id, self.listeners.bound,
                                                                 held)
        await self.listeners.stand_in(wanted)
        if self.floating is not None:
            if self._held and not self.floating.fence.fenced:
                self._drop_held()
            self.floating.tickle_taken()  # now that the taken addresses' ports listen
        self.listeners.hand_back_soon(lambda: self.serving)

    def _fenced(self, isolated: bool = False) -> None:
        """The node stalled or was cut off: a survivor may hold its address and serve its
        clients now; drop every connection (their clients were reset or moved already).

        ``isolated`` (this host hears no peer: its receive path is cut, it may still send): the
        connections are held silent instead (nothing read or forwarded) and dropped when the
        fence lifts. Dropped now, the FIN or RST would reach the clients at once, well before a
        survivor holds the address (the peers declare this node down a beat later, then take):
        they reconnected into an address no host answered, and the SYN's retransmission one
        second later was their recovery (1.1-1.7 s on emulated hosts). Held, they wait for the
        survivor's tickle ACKs, which reset them once the address answers."""
        pairs = list(self.registry.pairs)
        if isolated:
            for pair in pairs:
                pair.hold()
            self._held.extend(pairs)
            log.warning("fenced while isolated: connections held silent until the fence lifts",
                        extra={"node": self.node.id, "connections": len(pairs)})
            return
        for pair in pairs:
            pair.reset("fenced: this node stalled or was cut off and may have lost its address")
        log.warning("fenced: connections dropped", extra={"node": self.node.id, "connections": len(pairs)})

    def _drop_held(self) -> None:
        held, self._held = self._held, []
        live = [p for p in held if not p.closed]
        for pair in live:
            pair.reset("fenced while isolated: dropped as the fence lifts")
        log.info("fence lifted: connections held since the isolation dropped",
                 extra={"node": self.node.id, "connections": len(live)})

    def client_pairs(self) -> list[ClientPair]:
        """The IPv4 clients of this node (shared with the peers for tickle ACKs): those of its own
        address, and those of the vacant nodes' addresses it stands in for (with that address:
        should this node freeze, whoever takes the address next resets them too)."""
        out = []
        own = self.node.host
        for pair in self.registry.pairs:
            client = pair.client
            if client is None:
                continue
            local, peer = client.get_extra_info("sockname"), client.get_extra_info("peername")
            if local and peer and ":" not in peer[0] and ":" not in local[0]:
                out.append(ClientPair(local[1], peer[0], peer[1], None if local[0] == own else local[0],
                                      group=pair.group))
        return out

    # ----------------------------------------------------------- drain
    def drain_identities(self, moved_away: set[int]) -> int:
        """Drain client connections on identities this node no longer advertises."""
        return self.registry.drain(moved_away)

    def drain_all(self) -> int:
        """Graceful node drain: move every client away, stop accepting (proxy.drain.NodeDrain)."""
        now = asyncio.get_running_loop().time()
        count = 0
        for action in self.node_drain.drain_all(now):
            if isinstance(action, CloseListeners):
                self.listeners.release_stand_ins()
                self.listeners.close_own(action.at - now)
            elif isinstance(action, DrainConnections):
                count += self.registry.drain()
        return count

    async def undrain(self) -> None:
        """Serve again after ``drain_all``: bind every listener again."""
        for action in self.node_drain.undrain():
            assert isinstance(action, Rebind)
            await self.discovery.learn(list(self.brokers.values()))
            await self.listeners.bind_bootstrap()
            if self.takeover_enabled or self.floating is not None:
                self.registry.spawn(self._sync_takeover())
            log.info("node serving again", extra={"node": self.node.id})

    # -------------------------------------------------------- upstream
    async def _connect_upstream(self, pair: Pair) -> None:
        errors = []
        tls = self.upstream_security.tls
        if tls is not None:
            pair.tls = True  # before UpstreamSide is made: it decides on splicing

        def resent() -> None:
            if turn is not None:
                turn.syn_resent()

        async def connect(address: HostPort) -> asyncio.Transport:
            local = source_address(self._bind_host, address.host)
            if tls is None:
                transport, _ = await create_connection_from(lambda: UpstreamSide(pair), address.host, address.port,
                                                            local, resend_s=SYN_RESEND_S, on_resend=resent)
            else:
                transport, _ = await create_connection_from(
                    lambda: UpstreamSide(pair), address.host, address.port, local,
                    resend_s=SYN_RESEND_S, on_resend=resent,
                    ssl=tls, server_hostname=address.host, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
            return transport

        turn: Turn | None = None
        source = pair.peer.rpartition(":")[0]  # the client's address: its line for a turn

        async def wait_turn(address: HostPort) -> None:
            nonlocal turn
            if pooled:
                turn = await self._turn_or_kept(pair, address, source, candidates)
            else:
                turn = await self.connect_turns.wait(address, source)

        def failed(address: HostPort, exc: BaseException) -> None:
            nonlocal turn
            if turn is not None:
                turn.failed(timed_out=isinstance(exc, TimeoutError))
                turn = None
            if tls is not None and isinstance(exc, ssl.SSLError):
                reason = self.tls_failures.failed("broker", exc)
                log.warning("TLS handshake with a broker failed", extra={
                    "broker": f"{address}", "reason": reason, "error": describe(exc)})
            errors.append(f"{address}: {describe_error(exc)}")

        candidates = self.discovery.upstream_for(pair.listener)
        if len(candidates) > 1:  # a bootstrap connection: to the broker it waits least for
            candidates = self.connect_turns.pacer.least_loaded_first(candidates)
        # A connection takes a broker connection another client left, if one is kept, or is let
        # go while it waits for a turn (even one that will not give it back: a SASL exchange may
        # be read already).
        pooled = self.registry.keeps_upstream(pair.listener)
        try:
            kept = self.registry.pool.take(candidates) if pooled and not pair.closed else None
            if kept is not None:
                raise _TookKept(*kept)
            reached = await first_connection(connect, candidates,
                                             timeout_s=self.config.limits.connect_timeout_s,
                                             timeout_retries=UPSTREAM_TIMEOUT_RETRIES, stop=lambda: pair.closed,
                                             failed=failed, wait_turn=wait_turn)
        except _TookKept as took:
            if pair.closed:  # meanwhile: for the next one
                if not self.registry.pool.put(took.address, took.transport):
                    took.transport.close()
                return
            self._attach_kept(pair, took.transport, took.address)
            return
        except _Attached:
            return
        except BaseException:
            if turn is not None:
                turn.abandon()
            raise
        if reached is None:
            if turn is not None:
                turn.abandon()
            if not pair.closed:
                self.metrics.upstream_errors.labels(self.node.id).inc()
                pair.close(f"no upstream reachable: {'; '.join(errors) or 'broker unknown'}", level=logging.WARNING)
            return
        transport, address = reached
        assert turn is not None
        turn.connected()  # held until the broker's first answer (UpstreamSide), or the pair closes
        if pair.closed:
            turn.abandon()
            transport.close()
            return
        pair.turn = turn
        self._attach(pair, transport, address)

    def _take_kept(self, pair: Pair) -> bool:
        """Attach a kept broker connection to ``pair`` now, if the pool has one for its listener
        (no task, no wait: a shared connection's next exchange, most often)."""
        if pair.closed or not self.registry.keeps_upstream(pair.listener):
            return False
        candidates = self.discovery.upstream_for(pair.listener)
        if len(candidates) > 1:
            candidates = self.connect_turns.pacer.least_loaded_first(candidates)
        kept = self.registry.pool.take(candidates)
        if kept is None:
            return False
        self._attach_kept(pair, *kept)
        return True

    def _attach_kept(self, pair: Pair, transport: asyncio.Transport, address: HostPort) -> None:
        """``pair``'s broker connection is ``transport``, one another client let go."""
        if self.upstream_security.tls is not None:
            pair.tls = True  # before UpstreamSide is made: it decides on splicing
        side = UpstreamSide(pair)
        transport.set_protocol(side)
        side.connection_made(transport)
        self._attach(pair, transport, address)

    async def _turn_or_kept(self, pair: Pair, address: HostPort, source: str, candidates: list[HostPort]) -> Turn:
        """A turn to connect to ``address``, unless a broker connection to one of ``candidates``
        is let go first (proxy.upstream_pool): it is attached to ``pair`` there and then, in the
        callback that lets it go (in a storm a connection carries the next waiting client's
        request at once, not a turn of the loop later), and :class:`_Attached` is raised."""
        turns = self.connect_turns
        pool = self.registry.pool
        asking = asyncio.ensure_future(turns.wait(address, source))

        def handed(transport: asyncio.Transport, to: HostPort) -> bool:
            if pair.closed or pair.upstream is not None:
                return False
            self._attach_kept(pair, transport, to)
            return True

        waiter = pool.wait(candidates, on_handover=handed)
        try:
            await asyncio.wait((asking, waiter.future), return_when=asyncio.FIRST_COMPLETED)
            if not waiter.future.done():
                pool.stop_waiting(waiter)
                return asking.result()
        except BaseException:  # the pair's task cancelled (the node stops)
            pool.stop_waiting(waiter)  # a connection handed over meanwhile is the pair's: closed with it
            _drop_turn(asking)
            raise
        _drop_turn(asking)  # a turn that came at the same moment goes to the next connect
        raise _Attached()  # or the pair closed: handed() took nothing then

    def _attach(self, pair: Pair, transport: asyncio.Transport, address: HostPort) -> None:
        """``pair``'s broker connection is ``transport``: forward what the client sent, read on."""
        loop = asyncio.get_running_loop()
        pair.upstream = transport
        pair.upstream_addr = address
        pair.acquiring = False
        if pair._pending:
            transport.writelines(pair._pending)
            pair._pending.clear()
        assert pair.client is not None
        if not pair.draining:  # a drain reads no new request
            pair.client.resume_reading()
        if pair.attached:  # a shared connection's next exchange
            return
        pair.attached = True
        for action in self.node_drain.connected(loop.time(), pair.elsewhere):
            assert isinstance(action, DrainAt)
            loop.call_at(action.at, self.registry.drain_if_elsewhere if action.if_elsewhere
                         else self.registry.start_drain, pair)

    async def _unstall(self, pair: Pair, stalled: UnknownBroker) -> None:
        """A response named a broker we have no listener for: learn it, bind, resume."""
        new = [UpstreamBroker(b.node_id, b.host, b.port, b.rack) for b in stalled.brokers]
        try:
            await self.discovery.learn(new)
        except Exception as exc:  # never leave the pair paused: close it, say why
            pair.abort(f"learning brokers {[b.node_id for b in new]} failed: {exc!r}")
            raise
        if pair.closed:
            return
        try:
            out = pair.codec.responses.resume()
        except (ProtocolError, RewriteError) as exc:
            pair.abort(f"rewrite failed after learning brokers: {exc}")
            return
        if pair.codec.responses.stalled is not None:
            pair.abort(f"still cannot rewrite: {pair.codec.responses.stalled}")
            return
        if out and pair.client is not None:
            pair.client.writelines(out)
            if pair.tap is not None:
                pair.tap.writelines(out)
        if pair.upstream is not None:
            pair.upstream.resume_reading()
            if pair.shared and pair.codec.idle:
                self.registry.release(pair)

    # ---------------------------------------------------------- status
    def status(self) -> DataPathStatus:
        address_of = self.advertised.address_of
        return DataPathStatus(
            node=self.node.id,
            bootstrap=self.bootstrap_address,
            listeners=tuple(sorted(k for k in self.listeners.own if k != BOOTSTRAP)),
            unbound=tuple(self.unbound),
            standing_in=tuple(self.listeners.stand_in_addresses),
            connections=self.connections,
            moving=self.registry.moving,
            draining=self.draining,
            brokers=tuple(BrokerRow(b.node_id, b.host, b.port, b.rack,
                                       "%s:%d" % a if (a := address_of(b.node_id)) else None)
                          for b in sorted(self.brokers.values())),
            floating=None if self.floating is None else self.floating.status(),
        )


def _drop_turn(asking: asyncio.Future[Turn]) -> None:
    """Stop asking for a turn; give it back if it came."""
    if not asking.done():
        asking.cancel()  # ConnectTurns.wait gives back a turn that came with the cancellation
    elif not asking.cancelled() and asking.exception() is None:
        asking.result().abandon()


class _Attached(Exception):
    """A connection another client let go was attached to the pair while it waited (or the pair
    closed meanwhile): nothing more to do."""


class _TookKept(Exception):
    """A bootstrap connection got a broker connection another client let go (proxy.upstream_pool)."""

    def __init__(self, transport: asyncio.Transport, address: HostPort) -> None:
        super().__init__(f"{address}")
        self.transport = transport
        self.address = address


def _local_host(transport: asyncio.BaseTransport) -> str:
    """The address a client connected to (its socket's local address)."""
    return (transport.get_extra_info("sockname") or ("",))[0]


def _trace_turn(turn: Turn, how: str) -> None:
    """Per upstream connect (at DEBUG): how long it waited in line for a turn, how long the
    connect took, and how long the turn was held after it; by client source address."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    now = turn.clock_now()
    connected = turn.connected_at
    log.debug("upstream connect turn", extra={
        "source": turn.source, "broker": f"{turn.key}", "how": how, "limit": turn.limit(),
        "waited_ms": round((turn.began - turn.asked) * 1000, 1),
        "connect_ms": None if connected is None else round((connected - turn.began) * 1000, 1),
        "held_ms": None if connected is None else round((now - connected) * 1000, 1)})
