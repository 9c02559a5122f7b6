"""The data path's I/O shell: asyncio Protocol/Transport on uvloop, cut-through.

Theory of operation
-------------------
A :class:`ProxyNode` binds, on its own address, one bootstrap port plus one
port per broker identity (eagerly, for every broker discovered upstream). A
client connection on broker B's port is paired with one upstream connection to
broker B; the bootstrap port pairs with any live broker. Per pair, a
:class:`proxy.codec.ConnectionCodec` (sans-IO) observes request headers (to
fill the correlation table) and splits the response stream into pass-through
slices and whole address-carrying frames for :class:`proxy.rewrite.Rewriter`.

Forwarding is cut-through: request chunks are written upstream as received;
response chunks are written to the client as received except frames that must
be rewritten. Backpressure runs both ways: when one side's write buffer goes
above ``limits.high_water_bytes`` the other side stops reading.

Which proxy advertises which broker identity is *not* decided here: the owner
table is pushed in by ``apply_assignment`` (the fleet's committed table), or,
for a node without a fleet, this node owns every identity it has bound; the
:class:`AddressBook` turns owner + port scheme into the advertised host:port. When an identity moves away from this
node, the clients connected to it here are drained: reading stops, in-flight
responses are flushed, then the socket is closed (FIN) so the client refreshes
metadata and reconnects to the new owner (DESIGN §4).
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import struct
import termios
import time
from typing import Callable, Mapping

from proxy.buffers import ReadBuffers, read_buffers
from proxy.codec import ConnectionCodec
from proxy.config import Config, ConfigError, HostPort, NodeConfig
from proxy.errors import ProtocolError, RewriteError, UnknownBroker
from proxy.metrics import ProxyMetrics
from proxy.rewrite import BrokerAddress, ResponseRewriter
from proxy.splice import AVAILABLE as SPLICE_AVAILABLE
from proxy.splice import Splice
from proxy.upstream import DiscoveryError, UpstreamBroker, discover

log = logging.getLogger("kproxy.proxy")
BOOTSTRAP = -1  # listener key of the bootstrap port
FETCH = 1
DRAIN_TIMEOUT_S = 5.0
# A draining connection keeps forwarding requests for up to this long, waiting
# for a moment with nothing in flight to close at; then reads stop (DESIGN §4).
DRAIN_IDLE_GRACE_S = 0.25
# With address takeover a draining node keeps its listeners this long (until the
# stand-ins are listening too) and serves what it accepts for a moment before
# draining it.
DRAIN_LISTENER_LINGER_S = 1.0
DRAIN_NEW_CONNECTION_S = 0.1
# A connection that carried group-coordinator requests is drained this much
# later than the others. Its close makes the client look the coordinator up
# again (FindCoordinator on another of its connections); librdkafka drops a
# connection itself once Metadata shows its broker at a new address, failing
# what was in flight there, and a failed lookup is retried only at its 1 s
# coordinator-query interval (measured: 0.9-1 s without deliveries). Moved
# last, the lookup goes out after the client has followed the new map.
DRAIN_COORDINATOR_DELAY_S = 0.2
# OffsetCommit, OffsetFetch, JoinGroup, Heartbeat, LeaveGroup, SyncGroup,
# TxnOffsetCommit, ConsumerGroupHeartbeat, ShareGroupHeartbeat.
GROUP_API_KEYS = frozenset({8, 9, 11, 12, 13, 14, 28, 68, 76})


class AddressBook:
    """broker id -> the host:port clients are told, from the owner table and port scheme.

    The owner table is pushed in (``update``) by whoever owns it: the fleet's
    committed assignment, or, for a node without a fleet, "this node owns every
    identity it has bound". Lookups are a dict read: they run per broker per
    address-carrying response.
    """

    def __init__(self, config: Config, local: NodeConfig) -> None:
        self.config = config
        self.local = local
        self._hosts = {n.id: n.host for n in config.nodes}
        self.bound: set[int] = set()  # identities this node has listeners for
        self.epoch = 0
        self.owners: dict[int, str] = {}

    def update(self, epoch: int, owners: Mapping[int, str]) -> None:
        self.epoch = epoch
        self.owners = dict(owners)

    def address_of(self, broker_id: int) -> tuple[str, int] | None:
        if broker_id not in self.bound:
            return None  # never advertise an identity before its listener is bound here
        owner = self.owners.get(broker_id)
        host = self._hosts.get(owner) if owner is not None else None
        if host is None:
            host = self.local.host  # not in the table (yet): this node serves it
        return host, self.config.broker_port(broker_id)


def unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for ``transport``'s socket that it has not read
    yet (FIONREAD); 0 when that cannot be told."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):  # closed meanwhile
        return 0


class _Pair:
    """One client connection and its upstream connection."""

    __slots__ = ("node", "listener", "client", "upstream", "codec", "closed", "draining", "peer", "upstream_addr",
                 "_pending", "tap", "splice", "group", "drain_due")
    _ids = itertools.count()

    def __init__(self, node: "ProxyNode", listener: int) -> None:
        self.node = node
        self.listener = listener
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.codec = ConnectionCodec(node.rewriter, max_frame_size=node.config.limits.max_frame_bytes)
        self.closed = False
        self.draining = False
        self.group = False  # it carried group-coordinator requests (GROUP_API_KEYS)
        self.drain_due = False  # a drain put off by DRAIN_COORDINATOR_DELAY_S is pending
        self.peer = "?"
        self.upstream_addr: HostPort | None = None
        self._pending: list[bytes] = []  # copies: read buffers are reused
        self.tap = None
        self.splice: Splice | None = None  # a response body being spliced to the client (proxy.splice)
        if node.config.tap_dir:
            path = f"{node.config.tap_dir}/{node.local.id}-{os.getpid()}-{next(self._ids)}.bin"
            self.tap = open(path, "wb")

    def close(self, reason: str, *, level: int = logging.DEBUG) -> None:
        if self.closed:
            return
        self.closed = True
        log.log(level, "closing connection", extra={"peer": self.peer, "listener": self.listener, "reason": reason})
        if self.splice is not None:  # before the transports: it holds dup'ed fds of both sockets
            self.splice.cancel()
            self.splice = None
        for t in (self.client, self.upstream):
            if t is not None and not t.is_closing():
                t.close()  # flushes what is buffered, then FIN
        self.node._pairs.discard(self)
        self.node.metrics.active.dec()
        if self.tap is not None:
            self.tap.close()

    def abort(self, reason: str) -> None:
        if not self.closed:
            self.close(reason, level=logging.WARNING)
        for t in (self.client, self.upstream):
            if t is not None:
                t.abort()


class ClientSide(asyncio.BufferedProtocol):
    """Client -> broker. Reads into the loop's shared buffer (proxy.buffers)."""

    def __init__(self, node: "ProxyNode", listener: int) -> None:
        self.node = node
        self.pair = _Pair(node, listener)
        self._buffers: ReadBuffers = read_buffers()
        self._view: memoryview = self._buffers.view

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pair = self.pair
        pair.client = transport
        peer = transport.get_extra_info("peername")
        pair.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        transport.set_write_buffer_limits(high=self.node.config.limits.high_water_bytes)
        self.node._pairs.add(pair)
        self.node.metrics.active.inc()
        self.node.metrics.accepted("bootstrap" if pair.listener == BOOTSTRAP else f"broker-{pair.listener}")
        if self.node.draining and not self.node.takeover_enabled:
            pair.close("node is draining")
            return
        transport.pause_reading()
        self.node._spawn(self.node._connect_upstream(pair))

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._view = self._buffers.view
        return view

    def buffer_updated(self, nbytes: int) -> None:
        pair = self.pair
        data = self._view[:nbytes]
        try:
            headers = pair.codec.requests.feed(data)
        except ProtocolError as exc:
            self.node.metrics.protocol_error("client")
            log.warning("protocol error from client, closing its connection",
                        extra={"peer": pair.peer, "listener": pair.listener, "reason": str(exc)})
            pair.abort(f"protocol error: {exc}")
            return
        metrics = self.node.metrics
        if headers:
            metrics.count_requests(headers)
            if not pair.group:
                pair.group = any(h.api_key in GROUP_API_KEYS for h in headers)
        metrics.bytes_to_broker += nbytes
        upstream = pair.upstream
        if upstream is not None:
            upstream.write(data)
            if upstream.get_write_buffer_size():  # it may keep a view of the buffer
                self._buffers.release(upstream)
        else:  # cannot happen while paused, kept for safety
            pair._pending.append(bytes(data))

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.close("client gone")

    def pause_writing(self) -> None:
        if self.pair.upstream is not None:
            self.pair.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.pair.upstream is not None and not self.pair.closed:
            self.pair.upstream.resume_reading()


class UpstreamSide(asyncio.BufferedProtocol):
    """Broker -> client. Reads into the loop's shared buffer (proxy.buffers);
    the rest of a large pass-through frame is spliced instead (proxy.splice)."""

    def __init__(self, pair: _Pair) -> None:
        self.pair = pair
        self._buffers: ReadBuffers = read_buffers()
        self._view: memoryview = self._buffers.view
        # The tap records what is written to the client: with it, never splice.
        limit = pair.node.config.limits.splice_min_bytes
        self._splice_min = limit if SPLICE_AVAILABLE and pair.tap is None else 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.set_write_buffer_limits(high=self.pair.node.config.limits.high_water_bytes)

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._view = self._buffers.view
        return view

    def buffer_updated(self, nbytes: int) -> None:
        pair = self.pair
        node = pair.node
        responses = pair.codec.responses
        try:
            out = responses.feed(self._view[:nbytes])
        except ProtocolError as exc:
            node.metrics.protocol_error("broker")
            log.warning("protocol error from broker, closing the pair",
                        extra={"peer": pair.peer, "listener": pair.listener, "reason": str(exc)})
            pair.abort(f"broker protocol error: {exc}")
            return
        except RewriteError as exc:
            log.error("cannot rewrite response, closing the pair",
                      extra={"peer": pair.peer, "listener": pair.listener, "reason": str(exc)})
            pair.abort(f"rewrite error: {exc}")
            return
        node.metrics.bytes_to_client += nbytes
        client = pair.client
        if out and client is not None:
            if len(out) == 1:  # the common case: one pass-through slice; write() avoids a join
                client.write(out[0])
            else:
                client.writelines(out)
            if pair.tap is not None:
                pair.tap.writelines(out)
            if client.get_write_buffer_size():  # it may keep a view of the buffer
                self._buffers.release(client)
        stalled = responses.stalled
        if stalled is not None:
            assert pair.upstream is not None
            pair.upstream.pause_reading()
            node._spawn(node._unstall(pair, stalled))
        elif (self._splice_min and responses.remaining_pass_through >= self._splice_min and client is not None
              and not client.get_write_buffer_size() and not pair.closed):
            # Everything written to the client so far is in the kernel: the
            # rest of this frame's body may go around user space.
            self._splice(client, responses.remaining_pass_through)
        elif pair.draining:
            node._maybe_finish_drain(pair)

    def _splice(self, client: asyncio.Transport, count: int) -> None:
        pair = self.pair
        upstream = pair.upstream
        if upstream is None or upstream.is_closing() or client.is_closing():
            return
        try:
            job = Splice(asyncio.get_running_loop(), upstream.get_extra_info("socket").fileno(),
                         client.get_extra_info("socket").fileno(), count,
                         on_read=self._spliced, on_done=self._splice_done, on_error=self._splice_failed)
        except OSError as exc:  # out of fds, most likely: copy as usual
            log.warning("cannot splice, copying", extra={"peer": pair.peer, "listener": pair.listener,
                                                          "reason": str(exc)})
            return
        upstream.pause_reading()  # nothing else is read (nor written to the client) until it is done
        pair.splice = job
        job.start()

    def _spliced(self, n: int) -> None:
        metrics = self.pair.node.metrics
        metrics.bytes_to_client += n
        metrics.spliced_bytes += n

    def _splice_done(self) -> None:
        pair = self.pair
        job = pair.splice
        assert job is not None
        pair.splice = None
        pair.codec.responses.skip(job.count)
        if pair.closed:
            return
        if pair.upstream is not None:
            pair.upstream.resume_reading()
        if pair.draining:
            pair.node._maybe_finish_drain(pair)

    def _splice_failed(self, reason: str) -> None:
        self.pair.splice = None
        self.pair.abort(reason)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.close("broker connection lost")

    def pause_writing(self) -> None:
        if self.pair.client is not None:
            self.pair.client.pause_reading()

    def resume_writing(self) -> None:
        if self.pair.client is not None and not self.pair.closed and not self.pair.draining:
            self.pair.client.resume_reading()


class ProxyNode:
    """One proxy node's data path. ``await start()``, ``await stop()``."""

    def __init__(self, config: Config, node_id: str, *, fleet: bool = False,
                 metrics: ProxyMetrics | None = None) -> None:
        """``fleet=False``: this node advertises every identity itself. With a
        fleet, the owner table comes from ``apply_assignment``."""
        self.config = config
        self.local = config.node(node_id)
        self.fleet = fleet
        self.metrics = metrics or ProxyMetrics(node_id)
        self.book = AddressBook(config, self.local)
        self.rewriter = ResponseRewriter(self.book.address_of, on_brokers=self._brokers_seen,
                                         version_caps={FETCH: config.limits.fetch_max_version})
        self.metrics.watch_rewrites(self.rewriter.counts)
        self.brokers: dict[int, UpstreamBroker] = {}
        self._servers: dict[int, asyncio.AbstractServer] = {}
        self._pairs: set[_Pair] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._rr = itertools.count()
        self._bind_lock = asyncio.Lock()
        self._listeners_changed: list[Callable[[list[UpstreamBroker]], None]] = []
        self.draining = False
        self.started_at = time.time()
        # Upstream connections leave from this node's own address (like a separate host).
        self._source = (self.local.host, 0)
        # Address takeover (fleet only): listeners on the addresses of vacant nodes.
        # With takeover, own listeners use SO_REUSEPORT too: the node and its stand-ins share ports while it
        # comes back.
        self.takeover_enabled = fleet and config.fleet is not None and config.fleet.address_takeover
        self._vacant: tuple[NodeConfig, ...] = ()
        self._takeover: dict[tuple[str, int], asyncio.AbstractServer] = {}  # (node id, listener) -> server
        self._takeover_failed: set[tuple[str, int]] = set()
        self._lingering: list[asyncio.AbstractServer] = []  # a draining node's listeners, closing soon

    # ----------------------------------------------------------- lifecycle
    async def start(self, discovery_timeout: float = 60.0) -> None:
        deadline = time.monotonic() + discovery_timeout
        while True:
            try:
                brokers = await discover(self.config.upstream, self.config.limits.connect_timeout_s,
                                         source=self.local.host)
                break
            except DiscoveryError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("upstream not reachable yet", extra={"reason": str(exc)})
                await asyncio.sleep(0.5)
        await self._learn(brokers)
        await self._bind_bootstrap()
        self._spawn(self._refresh_loop())
        log.info("proxy node serving", extra={"node": self.local.id, "bootstrap": self.bootstrap_address,
                                              "brokers": sorted(self.brokers)})

    async def _bind_bootstrap(self) -> None:
        if BOOTSTRAP not in self._servers:
            self._servers[BOOTSTRAP] = await asyncio.get_running_loop().create_server(
                lambda: ClientSide(self, BOOTSTRAP), self.local.host, self.local.bootstrap_port, reuse_address=True,
                reuse_port=self.takeover_enabled)

    async def undrain(self) -> None:
        """Serve again after ``drain_all``: bind every listener again."""
        self.draining = False
        await self._learn(list(self.brokers.values()))
        await self._bind_bootstrap()
        if self.takeover_enabled:
            self._spawn(self._sync_takeover())
        log.info("node serving again", extra={"node": self.local.id})

    async def stop(self) -> None:
        for server in [*self._servers.values(), *self._takeover.values(), *self._lingering]:
            server.close()
        self._takeover.clear()
        self._lingering.clear()
        for pair in list(self._pairs):
            pair.close("node stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._servers.clear()

    @property
    def connections(self) -> int:
        return len(self._pairs)

    @property
    def bootstrap_address(self) -> str:
        return f"{self.local.host}:{self.local.bootstrap_port}"

    def on_brokers_changed(self, callback: Callable[[list[UpstreamBroker]], None]) -> None:
        self._listeners_changed.append(callback)

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # ------------------------------------------------------------ upstream
    async def _learn(self, brokers: list[UpstreamBroker]) -> None:
        """Bind a listener for every new broker *before* anything advertises it."""
        async with self._bind_lock:
            changed = False
            for b in brokers:
                if self.brokers.get(b.node_id) != b:
                    self.brokers[b.node_id] = b
                    changed = True
                if b.node_id not in self._servers:
                    # One broker whose listener cannot be bound (port taken, no port for its id)
                    # stays unadvertised (the rewriter stalls on it: that client's connection is
                    # closed); the other brokers and later refreshes go on.
                    try:
                        port = self.config.broker_port(b.node_id)
                        self._servers[b.node_id] = await asyncio.get_running_loop().create_server(
                            lambda bid=b.node_id: ClientSide(self, bid), self.local.host, port, reuse_address=True,
                            reuse_port=self.takeover_enabled)
                    except (OSError, ConfigError) as exc:
                        log.error("listener bind failed", extra={"broker": b.node_id, "reason": str(exc)})
                        continue
                    self.book.bound.add(b.node_id)
                    if not self.fleet:
                        self.book.owners[b.node_id] = self.local.id
                    log.info("listener bound", extra={"broker": b.node_id, "address": f"{self.local.host}:{port}"})
            if changed:
                for cb in self._listeners_changed:
                    cb(sorted(self.brokers.values()))

    def _brokers_seen(self, api_key: int, brokers: tuple[BrokerAddress, ...], complete: bool) -> None:
        """A response passing through named brokers: learn any we do not know (listener first)."""
        new = [UpstreamBroker(b.node_id, b.host, b.port, b.rack) for b in brokers
               if (old := self.brokers.get(b.node_id)) is None or (old.host, old.port) != (b.host, b.port)]
        if new:
            self._spawn(self._learn(new))

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            try:
                candidates = [b.address for b in self.brokers.values()] + list(self.config.upstream)
                await self._learn(await discover(candidates, self.config.limits.connect_timeout_s,
                                                 source=self.local.host))
            except DiscoveryError as exc:
                log.warning("upstream refresh failed", extra={"reason": str(exc)})
            except Exception:  # a bug must not end discovery for the node's lifetime
                log.exception("upstream refresh failed unexpectedly")

    def _upstream_for(self, listener: int) -> list[HostPort]:
        if listener != BOOTSTRAP:
            b = self.brokers.get(listener)
            return [b.address] if b else []
        live = sorted(self.brokers.values())
        if not live:
            return list(self.config.upstream)
        start = next(self._rr) % len(live)
        return [b.address for b in live[start:] + live[:start]]

    async def _connect_upstream(self, pair: _Pair) -> None:
        loop = asyncio.get_running_loop()
        errors = []
        for address in self._upstream_for(pair.listener):
            if pair.closed:
                return
            try:
                transport, _ = await asyncio.wait_for(
                    loop.create_connection(lambda: UpstreamSide(pair), address.host, address.port,
                                           local_addr=self._source),
                    self.config.limits.connect_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                errors.append(f"{address}: {exc!r}")
                continue
            if pair.closed:
                transport.close()
                return
            pair.upstream = transport  # type: ignore[assignment]
            pair.upstream_addr = address
            if pair._pending:
                transport.writelines(pair._pending)  # type: ignore[attr-defined]
                pair._pending.clear()
            assert pair.client is not None
            pair.client.resume_reading()
            if self.draining:  # accepted while stand-ins take over: serve a moment, then move it
                asyncio.get_running_loop().call_later(DRAIN_NEW_CONNECTION_S, self._start_drain, pair)
            return
        self.metrics.upstream_errors.labels(self.local.id).inc()
        pair.close(f"no upstream reachable: {'; '.join(errors) or 'broker unknown'}", level=logging.WARNING)

    async def _unstall(self, pair: _Pair, stalled: UnknownBroker) -> None:
        """A response named a broker we have no listener for: learn it, bind, resume."""
        new = [UpstreamBroker(b.node_id, b.host, b.port, b.rack) for b in stalled.brokers]
        try:
            await self._learn(new)
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

    # -------------------------------------------------------------- drain
    def apply_assignment(self, epoch: int, owners: Mapping[int, str]) -> int:
        """A new owner table is in effect: use it, and drain the clients of
        identities that moved away from this node. Returns connections drained."""
        me = self.local.id
        moved_away = {b for b, owner in self.book.owners.items() if owner == me and owners.get(b) != me}
        old_epoch = self.book.epoch
        self.book.update(epoch, owners)
        if old_epoch != epoch or moved_away:
            log.info("assignment in effect", extra={"epoch": epoch, "owners": dict(sorted(owners.items())),
                                                    "moved_away": sorted(moved_away)})
        if self.takeover_enabled:
            self._spawn(self._sync_takeover())
        return self.identities_moved(moved_away) if moved_away else 0

    # ----------------------------------------------------- address takeover
    def stand_in_for(self, vacant: list[NodeConfig]) -> None:
        """Record the vacant (down or draining) nodes; the next
        ``apply_assignment`` binds or releases to match. This node serves their
        bootstrap port, and the port of every identity this node owns. A client
        that kept a vacant node's address (librdkafka's group coordinator, a
        bootstrap list) then reaches the right broker instead of a refused
        connection. Bytes for identity B go to broker B whoever accepts them
        (DESIGN §2.3), so two nodes sharing a port for a moment is harmless."""
        if not self.takeover_enabled:
            return
        self._vacant = tuple(sorted((n for n in vacant if n.id != self.local.id), key=lambda n: n.id))

    def _takeover_wanted(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(node id, listener) -> (host, port) this node should stand in on now."""
        if self.draining:
            return {}
        me = self.local.id
        mine = sorted(b for b in self.book.bound if self.book.owners.get(b) == me)
        wanted = {}
        for n in self._vacant:
            wanted[(n.id, BOOTSTRAP)] = (n.host, n.bootstrap_port)
            for b in mine:
                wanted[(n.id, b)] = (n.host, self.config.broker_port(b))
        return wanted

    async def _sync_takeover(self) -> None:
        async with self._bind_lock:
            wanted = self._takeover_wanted()
            for key in [k for k in self._takeover if k not in wanted]:
                server = self._takeover.pop(key)
                server.close()
                log.info("stopped standing in", extra={"node": key[0], "listener": key[1]})
            self._takeover_failed &= set(wanted)
            loop = asyncio.get_running_loop()
            for key, (host, port) in sorted(wanted.items()):
                if key in self._takeover:
                    continue
                try:
                    self._takeover[key] = await loop.create_server(
                        lambda listener=key[1]: ClientSide(self, listener), host, port, reuse_address=True,
                        reuse_port=True)
                except OSError as exc:
                    if key not in self._takeover_failed:  # log once per vacancy
                        self._takeover_failed.add(key)
                        log.warning("cannot stand in for a vacant node's address",
                                    extra={"node": key[0], "address": f"{host}:{port}", "reason": str(exc)})
                    continue
                log.info("standing in for a vacant node", extra={"node": key[0], "listener": key[1],
                                                                 "address": f"{host}:{port}"})

    @property
    def takeover_addresses(self) -> list[str]:
        return sorted(f"{s.sockets[0].getsockname()[0]}:{s.sockets[0].getsockname()[1]}"
                      for s in self._takeover.values() if s.sockets)

    def identities_moved(self, moved_away: set[int]) -> int:
        """Drain client connections on identities this node no longer advertises."""
        count = 0
        for pair in list(self._pairs):
            if pair.listener in moved_away and not pair.draining:
                self._start_drain(pair)
                count += 1
        return count

    def drain_all(self) -> int:
        """Graceful node drain: move every client away, stop accepting.

        Without address takeover, new connections are refused at once (DESIGN
        §4). With it, the other nodes start standing in on this node's ports
        when they apply the same commit, a few ms from now or more; refusing
        before that would turn the reconnect of every drained client into a
        connection error and a backoff. So the listeners stay open for
        ``DRAIN_LISTENER_LINGER_S`` (sharing the ports with the stand-ins), and
        a connection accepted meanwhile is served and then drained like the rest.
        """
        self.draining = True
        for server in self._takeover.values():
            server.close()
        self._takeover.clear()
        own = list(self._servers.values())
        self._servers.clear()
        if self.takeover_enabled:
            self._lingering.extend(own)
            asyncio.get_running_loop().call_later(DRAIN_LISTENER_LINGER_S, self._close_servers, own)
        else:
            self._close_servers(own)
        count = 0
        for pair in list(self._pairs):
            if not pair.draining:
                self._start_drain(pair)
                count += 1
        return count

    def _close_servers(self, servers: list[asyncio.AbstractServer]) -> None:
        for server in servers:
            server.close()
            if server in self._lingering:
                self._lingering.remove(server)

    def _start_drain(self, pair: _Pair) -> None:
        """Close the client's connection at its first idle moment: every response
        it waits for delivered, no request cut in half. Closing there costs the
        client only a reconnect; a request it wrote into a socket we no longer
        read would instead fail and wait for the client's retry backoff (100 ms
        in librdkafka and Java). After ``DRAIN_IDLE_GRACE_S`` without such a
        moment (a client that always has requests in flight), reads stop and the
        in-flight responses are flushed before the close."""
        if pair.closed or pair.draining or pair.drain_due:
            return
        if pair.group:
            pair.drain_due = True
            asyncio.get_running_loop().call_later(DRAIN_COORDINATOR_DELAY_S, self._start_group_drain, pair)
            return
        self._begin_drain(pair)

    def _start_group_drain(self, pair: _Pair) -> None:
        pair.drain_due = False
        # Still to move? An undrain, or the identity coming back, meanwhile keeps it.
        if not pair.closed and not pair.draining and (
                self.draining or (pair.listener != BOOTSTRAP and self.book.owners.get(pair.listener) != self.local.id)):
            self._begin_drain(pair)

    def _begin_drain(self, pair: _Pair) -> None:
        pair.draining = True
        self.metrics.drained.labels(self.local.id).inc()
        self._maybe_finish_drain(pair)
        if not pair.closed:
            loop = asyncio.get_running_loop()
            loop.call_later(DRAIN_IDLE_GRACE_S, self._drain_stop_reading, pair)
            loop.call_later(DRAIN_TIMEOUT_S, self._drain_deadline, pair)

    def _drain_stop_reading(self, pair: _Pair) -> None:
        if pair.closed:
            return
        if pair.client is not None:
            pair.client.pause_reading()  # no new requests
        self._maybe_finish_drain(pair)

    def _maybe_finish_drain(self, pair: _Pair) -> None:
        if pair.closed:
            return
        if pair.codec.idle:
            if pair.client is not None and pair.client.is_reading() and unread_bytes(pair.client):
                # A request is in the kernel, not read yet: closing now would
                # lose it (and reset the connection, the unread bytes make
                # close() send RST). A lost OffsetCommit costs librdkafka a
                # coordinator lookup (~0.75 s measured). Read and forward it;
                # its response brings the next idle moment.
                self.metrics.drain_deferred.inc()
                return
            pair.close("identity moved: drained")
        elif (pair.client is None or not pair.client.is_reading()) and not pair.codec.table \
                and pair.codec.responses.at_frame_boundary:
            # Reads stopped: the request tracker may be mid-frame (a partial
            # request the broker never answers); only responses matter now.
            pair.close("identity moved: drained")

    def _drain_deadline(self, pair: _Pair) -> None:
        if not pair.closed:
            pair.close("identity moved: drain deadline reached", level=logging.WARNING)

    @property
    def unbound(self) -> list[int]:
        """Known brokers whose listener could not be bound yet (never advertised meanwhile;
        every refresh tries again). A node with any is not ready."""
        return sorted(set(self.brokers) - self.book.bound)

    def status(self) -> dict:
        return {
            "node": self.local.id,
            "bootstrap": self.bootstrap_address,
            "listeners": sorted(k for k in self._servers if k != BOOTSTRAP),
            "unbound": self.unbound,
            "standing_in": self.takeover_addresses,
            "connections": len(self._pairs),
            "draining": self.draining,
            "brokers": [
                {"id": b.node_id, "host": b.host, "port": b.port, "rack": b.rack,
                 "advertised": "%s:%d" % a if (a := self.book.address_of(b.node_id)) else None}
                for b in sorted(self.brokers.values())
            ],
        }
