"""The sockets a node listens on: its own (bootstrap and one per broker
identity) and the vacant nodes' addresses it stands in on.

Ports come from the node's ``topology.ProxyNode`` (``proxy.config.proxy_node``);
its ``host`` is what clients are told, while the node's own listeners bind
``bind_host`` (``nodes[].host``: the same address, or a wildcard such as 0.0.0.0
behind NAT or in a container; ``nodes[].floating_host`` where addresses float). A stand-in binds the vacant node's *advertised*
host, the address its clients kept dialling: that works where the address can be
bound here (any 127/8 address on loopback, a floating IP moved to this host, a
DNS name resolving to one); elsewhere (a name or a NAT address of the vacant
node's own host) the bind fails, is logged once, and clients move on Metadata
alone. With address takeover every listener uses SO_REUSEPORT: the node and its
stand-ins share ports while it comes back. What to stand in on is decided by
:class:`proxy.takeover.TakeoverReconciler`; this module executes its actions.
The clients a released stand-in accepted are handed back to the address's own
node once it serves again (:mod:`proxy.handback` decides when; this module
probes the address and drains them).

Every listener gets the accept queue ``limits.listen_backlog`` asks for, capped
by the kernel's ``net.core.somaxconn`` (the kernel would cap it silently; the
cap is logged once): when a node dies, its clients reconnect to the survivors
in the same second, and a SYN that finds the queue full waits out a
retransmit (1, 3, 7 s ...). The loop (uvloop: libuv) accepts until the queue is
empty on every wake-up, and a connection's upstream connect runs as its own
task (``ConnectionRegistry.spawn``), so accepting never waits on a broker.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import resource
import socket
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from prometheus_client import Gauge

from membership.serving import BOOTSTRAP, ServingMap, StandIn
from proxy.accept_lines import AcceptLines
from proxy.connection import ClientSide, Pair
from proxy.handback import HANDBACK_PROBE_INTERVAL_S, HandBack, Keep, SocketAddress, StandInHandback
from proxy.hosts import join_host_port
from proxy.logs import describe_error
from proxy.registry import ConnectionRegistry
from proxy.sockets import listening_socket, reset_on_close
from proxy.takeover import Bind, Release, TakeoverReconciler
from proxy.tls import TlsEndpoint
from topology import ProxyNode

log = logging.getLogger("kproxy.proxy")
SOMAXCONN_PATH = "/proc/sys/net/core/somaxconn"
# Descriptors a node needs besides two per client connection: listeners, the
# admin endpoint, Raft, splice pipes, logs, the interpreter's own.
RESERVED_DESCRIPTORS = 256
# How long a probe of a released stand-in's address waits for the connect (loopback or the
# node's own network: an answer takes far less).
HANDBACK_PROBE_TIMEOUT_S = 1.0
# limits.fair_accept (proxy.accept_lines): connections opened per turn of the loop from the lines,
# accepts per readiness of a listener, accepted connections waiting at most (past it the listeners
# pause and the kernel's queue holds the rest, until half of them are opened), and how long a
# listener pauses after the process ran out of descriptors.
OPEN_PER_TURN = 64
ACCEPTS_PER_WAKE = 1024
MAX_WAITING = 8192
ACCEPT_RETRY_S = 0.05


def somaxconn(path: str = SOMAXCONN_PATH) -> int | None:
    """The kernel's cap on a listener's accept queue; None where it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def worker_share(max_connections: int, workers: int) -> int:
    """One worker's part of the node's ``limits.max_connections``: the workers share the node's
    listeners and the kernel spreads new connections evenly over them (SO_REUSEPORT), so
    each admits its share, rounded up (the node holds at most ``workers - 1`` more than the
    cap; near the cap one worker may refuse while another still has room)."""
    return -(-max_connections // max(1, workers))


def client_capacity(max_connections: int, workers: int = 1) -> int:
    """The client connections this process can hold: its share of ``max_connections`` (a node's
    cap, split over its ``workers``: :func:`worker_share`), at most what its descriptors allow.

    Raises the soft RLIMIT_NOFILE to the hard one (what Kafka's JVM does too),
    then counts two descriptors per client (its socket and the upstream one).
    The limit is per process: each worker has its own. Below its share, the
    process refuses connections cleanly at that number instead of failing
    accepts and upstream connects with EMFILE. That is logged at INFO, not
    WARNING: a default cap above what a small host's limit allows is normal,
    and the refusals are logged when they happen."""
    share = worker_share(max_connections, workers)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    allowed = max(1, (soft - RESERVED_DESCRIPTORS) // 2)
    if allowed < share:
        log.info("limits.max_connections lowered to what the descriptor limit allows: raise RLIMIT_NOFILE"
                 " (ulimit -n) for more", extra={"max_connections": max_connections, "workers": workers,
                                                  "nofile": soft, "clients": allowed})
        return allowed
    return share


class FairAcceptor:
    """The accept lines of one worker (proxy.accept_lines) and the listeners that fill them:
    every listener of the worker, own and stand-in, so a host with few connections waiting
    is served first across all of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, waiting: Gauge | None = None) -> None:
        """``waiting``: a gauge that reports how many connections wait in the lines."""
        self.loop = loop
        self.lines: AcceptLines[tuple[socket.socket, Callable[[], ClientSide]]] = AcceptLines()
        if waiting is not None:
            waiting.set_function(lambda: len(self.lines))
        self.servers: set[FairServer] = set()
        self._scheduled = False
        self.paused = False

    def accepted(self, sock: socket.socket, source: str, factory: Callable[[], ClientSide]) -> None:
        self.lines.put(source, (sock, factory))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._open)
        if len(self.lines) >= MAX_WAITING and not self.paused:
            self.paused = True
            for server in self.servers:
                server.pause()

    def _open(self) -> None:
        """Open up to OPEN_PER_TURN waiting connections; the rest in the next turns, after the
        loop has served the connections already open."""
        self._scheduled = False
        for sock, factory in self.lines.take(OPEN_PER_TURN):
            _drive(self.loop.connect_accepted_socket(factory, sock), sock)
        if self.lines:
            self._scheduled = True
            self.loop.call_soon(self._open)
        if self.paused and len(self.lines) <= MAX_WAITING // 2:
            self.paused = False
            for server in self.servers:
                server.resume()


def _drive(coro: Coroutine[Any, Any, object], sock: socket.socket, _: object = None) -> None:
    """Run ``coro`` (the loop's ``connect_accepted_socket``) up to its first wait now, and on
    from there when what it waits for is done: what a task does, without a task's first step
    in the next turn of the loop (its transport exists, its ``connection_made`` is scheduled,
    one turn sooner: a turn is tens of milliseconds in a storm) nor a task's cost. It waits only
    on futures of this loop. Failed: ``sock`` is closed."""
    try:
        waiting = coro.send(None)
    except StopIteration:
        return
    except (KeyboardInterrupt, SystemExit):
        sock.close()
        raise
    except BaseException as exc:  # an error or a cancelled wait: this one connection is not opened
        log.debug("accepted connection not opened: %s", describe_error(exc))
        sock.close()
        return
    if not isinstance(waiting, asyncio.Future):  # not the loop's coroutine we know: give this one up
        log.error("accepted connection not opened: connect_accepted_socket waited on %r", waiting)
        coro.close()
        sock.close()
        return
    waiting._asyncio_future_blocking = False  # taken, as a task would
    waiting.add_done_callback(functools.partial(_drive, coro, sock))


class FairServer:
    """A listening socket whose connections go through the worker's accept lines
    (:class:`FairAcceptor`); what the listeners use of the loop's server: ``close`` and
    ``sockets``."""

    def __init__(self, acceptor: FairAcceptor, sock: socket.socket, factory: Callable[[], ClientSide]) -> None:
        self.acceptor = acceptor
        self.sock = sock
        self.factory = factory
        self.sockets = [sock]
        self._reading = False
        self._retry: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        acceptor.servers.add(self)
        if not acceptor.paused:
            self.resume()

    def resume(self) -> None:
        if not self._reading and self.sockets:
            self.acceptor.loop.add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True

    def pause(self) -> None:
        if self._reading:
            self.acceptor.loop.remove_reader(self.sock.fileno())
            self._reading = False

    def _on_readable(self) -> None:
        acceptor = self.acceptor
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the kernel keeps the rest queued; try again shortly.
                    log.debug("accept paused: %s", exc)
                    self.pause()
                    self._retry = acceptor.loop.call_later(ACCEPT_RETRY_S, self._retry_accept)
                else:
                    log.warning("accept failed", extra={"reason": describe_error(exc)})
                return
            conn.setblocking(False)
            acceptor.accepted(conn, address[0], self.factory)
            if acceptor.paused:
                return

    def _retry_accept(self) -> None:
        self._retry = None
        if not self.acceptor.paused:
            self.resume()

    def close(self) -> None:
        if not self.sockets:
            return
        self.pause()
        if self._retry is not None:
            self._retry.cancel()
        self.acceptor.servers.discard(self)
        self.sock.close()
        self.sockets = []
        # What this listener accepted but did not open yet is reset, as the kernel resets the
        # connections still in a closed listener's queue: none is opened after its listener closed.
        for conn, _ in self.acceptor.lines.drop(lambda item: item[1] is self.factory):
            reset_on_close(conn)
            conn.close()


def listen_backlog(wanted: int, cap: int | None) -> int:
    """The backlog to ask for: ``wanted``, or the kernel's cap if lower (logged)."""
    if cap is not None and 0 < cap < wanted:
        log.warning("listen backlog capped by the kernel: raise net.core.somaxconn for the full queue",
                    extra={"listen_backlog": wanted, "somaxconn": cap})
        return cap
    return wanted


class Listeners:
    def __init__(self, node: ProxyNode, registry: ConnectionRegistry, *, reuse_port: bool,
                 on_bound: Callable[[frozenset[int]], None], tls: TlsEndpoint | None = None,
                 plaintext: frozenset[int] = frozenset(), bind_host: str | None = None) -> None:
        """``tls``: every listener but those in ``plaintext`` (BOOTSTRAP or broker ids) speaks TLS,
        own and stand-in alike (proxy.connection runs the handshake). ``bind_host``: where the
        node's own listeners bind (default: ``node.host``, the advertised host)."""
        self.node = node
        self.bind_host = node.host if bind_host is None else bind_host
        self.tls = tls
        self.plaintext = plaintext
        self.registry = registry
        self.reuse_port = reuse_port
        self._on_bound = on_bound  # the set of bound identities changed
        self.own: dict[int, asyncio.AbstractServer] = {}  # BOOTSTRAP or broker id -> server
        self.bound: frozenset[int] = frozenset()  # identities with a listener here
        self.lock = asyncio.Lock()  # one bind sequence at a time
        self.takeover = TakeoverReconciler()
        self._stand_ins: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self.handback = StandInHandback()
        self._handing_back = False  # the probe loop runs
        self._lingering: list[asyncio.AbstractServer] = []  # a draining node's listeners, closing soon
        self.backlog = listen_backlog(registry.limits.listen_backlog, somaxconn())
        self._acceptor: FairAcceptor | None = None  # limits.fair_accept: the worker's accept lines

    def _factory(self, listener: int, *, stand_in: bool = False) -> Callable[[], ClientSide]:
        registry = self.registry
        tls = None if listener in self.plaintext else self.tls
        return lambda: ClientSide(registry, listener, tls, stand_in=stand_in)

    async def _serve(self, factory: Callable[[], ClientSide], host: str, port: int, *,
                     reuse_port: bool) -> asyncio.AbstractServer:
        """``loop.create_server(factory, host, port, ...)`` with this node's backlog, the listening
        socket on a high descriptor (proxy.sockets.listening_socket: a killed node stops accepting
        first). A host of several addresses (a name, no host) is left to ``create_server``."""
        sock = self._listening(host, port, reuse_port=reuse_port)
        if sock is None:
            loop = asyncio.get_running_loop()
            infos = {(family, address) for family, _, _, _, address in
                     await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)}
            if len(infos) != 1:
                return await loop.create_server(factory, host, port, reuse_address=True, reuse_port=reuse_port,
                                                backlog=self.backlog)
            [(family, address)] = infos
            sock = listening_socket(address, family, reuse_port=reuse_port)
            sock.listen(self.backlog)
        return await self._server_on(factory, sock)

    def _listening(self, host: str, port: int, *, reuse_port: bool) -> socket.socket | None:
        """A socket bound to ``host``:``port`` and listening, made here and now, if ``host`` is an
        IP address (no lookup: no turn of the loop, which in a reconnect storm is tens of ms
        long); None for a name or no host. From ``listen`` on, the kernel completes the clients'
        connects and queues them, before the loop serves the socket: a client that kept a vacant
        node's address is no longer refused (and its reconnect backoff no longer doubles) while
        the server is being made (:meth:`stand_in`)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
        except (socket.gaierror, UnicodeError):
            return None
        if not host or len({(family, address) for family, _, _, _, address in infos}) != 1:
            return None
        family, _, _, _, address = infos[0]
        sock = listening_socket(address, family, reuse_port=reuse_port)
        try:
            sock.listen(self.backlog)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _server_on(self, factory: Callable[[], ClientSide], sock: socket.socket) -> asyncio.AbstractServer:
        """The loop's server on ``sock`` (bound and listening), or with ``limits.fair_accept``
        our own (:class:`FairServer`); or ``sock`` closed."""
        try:
            if self.registry.limits.fair_accept:
                if self._acceptor is None:
                    self._acceptor = FairAcceptor(asyncio.get_running_loop(), self.registry.metrics.accept_waiting)
                return FairServer(self._acceptor, sock, factory)  # type: ignore[return-value]
            return await asyncio.get_running_loop().create_server(factory, sock=sock, backlog=self.backlog)
        except BaseException:
            sock.close()
            raise

    async def bind_bootstrap(self) -> None:
        if BOOTSTRAP not in self.own:
            try:
                self.own[BOOTSTRAP] = await self._serve(self._factory(BOOTSTRAP), self.bind_host,
                                                        self.node.bootstrap_port, reuse_port=self.reuse_port)
            except OSError as exc:  # one line naming the listener and its address, not a traceback
                address = join_host_port(self.bind_host, self.node.bootstrap_port)
                raise OSError(exc.errno, f"bootstrap listener {address}: "
                                         f"{os.strerror(exc.errno or 0).lower()}") from None

    async def bind_identities(self, broker_ids: Iterable[int]) -> None:
        """A listener for each identity not bound yet (call under ``lock``).

        One identity whose listener cannot be bound (port taken, no port for its
        id) stays unadvertised (the rewriter stalls on it: that client's
        connection is closed); the others and later refreshes go on."""
        added = []
        for b in broker_ids:
            if b in self.own:
                continue
            host, port = self.bind_host, None
            try:
                port = self.node.ports.port_for(b)
                self.own[b] = await self._serve(self._factory(b), host, port, reuse_port=self.reuse_port)
            except (OSError, ValueError) as exc:
                log.error("listener bind failed", extra={"broker": b, "address": join_host_port(host, port),
                                                         "reason": describe_error(exc)})
                continue
            added.append(b)
            log.info("listener bound", extra={"broker": b, "address": join_host_port(host, port)})
        if added:
            self.bound = self.bound | frozenset(added)
            self._on_bound(self.bound)

    def release_identities(self, broker_ids: Iterable[int]) -> None:
        """Stop listening for identities of brokers that left the cluster (call under ``lock``).

        New connections are refused from now on; the caller drains the ones
        still open. Whether the listener was open (a draining node closed its
        own already) or not, the identity is no longer bound here."""
        gone = frozenset(broker_ids) & self.bound
        for b in sorted(gone):
            server = self.own.pop(b, None)
            if server is not None:
                server.close()
            log.info("listener released", extra={"broker": b})
        if gone:
            self.bound = self.bound - gone
            self._on_bound(self.bound)

    def close_own(self, at_delay: float) -> None:
        """Stop accepting on the node's own listeners, at once or ``at_delay`` seconds from now."""
        own = list(self.own.values())
        self.own.clear()  # ``bound`` stays: what draining connections are told does not change
        if at_delay > 0:
            self._lingering.extend(own)
            asyncio.get_running_loop().call_later(at_delay, self._close, own)
        else:
            self._close(own)

    def _close(self, servers: list[asyncio.AbstractServer]) -> None:
        for server in servers:
            server.close()
            if server in self._lingering:
                self._lingering.remove(server)

    # ------------------------------------------------------------ stand-ins
    async def stand_in(self, wanted: Iterable[StandIn]) -> None:
        """Bind and release to hold exactly ``wanted``. The binds are made together: made one
        after the other, each waited for a turn of a loop busy with the dead node's reconnecting
        clients (60-90 ms each at W = 2 in a storm, BENCHMARKS.md session 33), and the clients
        that kept the last address were refused that much longer."""
        async with self.lock:
            binds: list[Bind] = []
            for action in self.takeover.plan(wanted):
                if isinstance(action, Release):
                    self._release(action)
                else:
                    assert isinstance(action, Bind)
                    binds.append(action)
            # Every address whose host is an IP listens before the first await (_listening).
            ready: list[socket.socket | BaseException | None] = []
            for action in binds:
                try:
                    ready.append(self._listening(action.host, action.port, reuse_port=True))
                except OSError as exc:
                    ready.append(exc)
            servers = await asyncio.gather(*(self._stand_in_server(action, listening)
                                             for action, listening in zip(binds, ready)), return_exceptions=True)
            unexpected: BaseException | None = None
            for action, server in zip(binds, servers):
                if isinstance(server, OSError):
                    if self.takeover.bind_failed(action.key):  # log once per vacancy
                        log.warning("cannot stand in for a vacant node's address",
                                    extra={"node": action.key[0], "address": join_host_port(action.host, action.port),
                                           "reason": str(server)})
                    continue
                if isinstance(server, BaseException):
                    unexpected = unexpected or server  # raised once the others are recorded
                    continue
                self._stand_ins[action.key] = server
                self.takeover.bound(action.key)
                self.handback.standing_in(action.key)
                log.info("standing in for a vacant node", extra={"node": action.key[0], "listener": action.key[1],
                                                                 "address": join_host_port(action.host, action.port)})
            if unexpected is not None:
                raise unexpected

    async def _stand_in_server(self, action: Bind, listening: socket.socket | BaseException | None
                               ) -> asyncio.AbstractServer:
        """The server of one stand-in: on the socket already listening, or the bind's error, or (a
        name for a host: ``listening`` None) bound here."""
        if isinstance(listening, BaseException):
            raise listening
        factory = self._factory(action.key[1], stand_in=True)
        if listening is None:
            return await self._serve(factory, action.host, action.port, reuse_port=True)
        return await self._server_on(factory, listening)

    def _release(self, action: Release, *, hand_back: bool = True) -> None:
        """Stop accepting there. The clients it accepted stay until the address's own node
        serves again (``hand_back``; proxy.handback): then they are drained to it."""
        server = self._stand_ins.pop(action.key)
        address = server.sockets[0].getsockname()[:2] if server.sockets else None
        server.close()
        self.takeover.released(action.key)
        clients = len(self._clients_at(address)) if address is not None else 0
        if hand_back and address is not None:
            self.handback.stopped_standing_in(action.key, address, clients)
        log.info("stopped standing in", extra={"node": action.key[0], "listener": action.key[1], "clients": clients})

    def release_stand_ins(self) -> None:
        """The node drains (it drains every client itself) or stops."""
        for action in self.takeover.clear():
            self._release(action, hand_back=False)

    def _clients_at(self, address: SocketAddress) -> list[Pair]:
        """The connections here, not draining, that a client made to ``address``."""
        out = []
        for pair in self.registry.pairs:
            client = pair.client
            if client is not None and not pair.closed and not pair.draining \
                    and tuple((client.get_extra_info("sockname") or ())[:2]) == address:
                out.append(pair)
        return out

    def hand_back_soon(self, serving: Callable[[], ServingMap]) -> None:
        """Start the handback loop if released stand-ins have clients here (``serving``: the
        map in effect, read on every round)."""
        if self.handback.pending and not self._handing_back:
            self._handing_back = True
            self.registry.spawn(self._hand_back(serving))

    async def _hand_back(self, serving: Callable[[], ServingMap]) -> None:
        """Probe the addresses whose node serves until each answers or is given up; ends when
        no address is to be probed (the next map starts it again)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                actions = self.handback.due(serving(), loop.time())
                probing = False
                for action in actions:
                    if isinstance(action, Keep):
                        log.info("clients of a released stand-in stay here", extra={
                            "node": action.key[0], "listener": action.key[1],
                            "address": join_host_port(*action.address), "reason": action.reason})
                        continue
                    probing = True
                    if await answers(action.address, HANDBACK_PROBE_TIMEOUT_S):
                        handback = self.handback.answered(action.key)
                        if handback is not None:
                            self._drain_handed_back(handback)
                if not probing or not self.handback.pending:
                    return
                await asyncio.sleep(HANDBACK_PROBE_INTERVAL_S)
        finally:
            self._handing_back = False

    def _drain_handed_back(self, handback: HandBack) -> None:
        pairs = self._clients_at(handback.address)
        for pair in pairs:
            # No coordinator delay (proxy.drain.DRAIN_COORDINATOR_DELAY_S): the client goes back to
            # the address it dialled, not to one a new map names; and the delayed drain keeps a
            # connection whose listener this node still owns, which a stand-in's always is.
            pair.group = False
            self.registry.start_drain(pair)
        log.info("handing a released stand-in's clients back to their node", extra={
            "node": handback.key[0], "listener": handback.key[1], "address": join_host_port(*handback.address),
            "drained": len(pairs)})

    @property
    def stand_in_addresses(self) -> list[str]:
        return sorted(join_host_port(*s.sockets[0].getsockname()[:2])
                      for s in self._stand_ins.values() if s.sockets)

    def close_all(self) -> None:
        for server in [*self.own.values(), *self._stand_ins.values(), *self._lingering]:
            server.close()
        self.own.clear()
        self._stand_ins.clear()
        self._lingering.clear()
        self.takeover = TakeoverReconciler()
        self.handback = StandInHandback()


async def answers(address: SocketAddress, timeout: float) -> bool:
    """Does something accept a TCP connection at ``address`` within ``timeout``? (Closed at once.)"""
    try:
        async with asyncio.timeout(timeout):
            transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, *address)
    except (OSError, TimeoutError):
        return False
    transport.close()
    return True

