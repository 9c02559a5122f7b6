"""The connections of one node, and the I/O shell of their drain.

:class:`ConnectionRegistry` is everything a connection (:mod:`proxy.connection`)
reaches of its node: the settings and metrics it reads, ``accept`` (refuse it,
or make its upstream connection), ``stalled`` (a response named a broker with
no listener here), ``discard`` on close, and the drain. The decisions of the
drain are :class:`proxy.drain.ConnectionDrain`'s; this module only observes
the connection, executes the actions and arms the timers they ask for.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import struct
import termios
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from membership.serving import BOOTSTRAP
from proxy.admission import Admission, RefusalReason
from proxy.config import Limits
from proxy.connection import Pair
from proxy.drain import (
    Close,
    ConnectionDrain,
    CountDeferred,
    CountDrained,
    DrainAction,
    DrainEvent,
    NodeDrain,
    Observation,
    PauseReading,
    RedirectBudget,
    ScheduleTimer,
)
from proxy.errors import UnknownBroker
from proxy.local_answers import LocalAnswers
from proxy.single_flight import Flights
from proxy.metrics import ProxyMetrics
from proxy.rewrite import ResponseRewriter
from proxy.upstream_pool import UpstreamPool

log = logging.getLogger("kproxy.proxy")


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


def observe(pair: Pair) -> Observation:
    client = pair.client
    reading = client is not None and client.is_reading()
    codec = pair.codec
    return Observation(
        idle=codec.idle, reading=reading,
        responses_done=not codec.table and codec.responses.at_frame_boundary,
        unread=(lambda: unread_bytes(client)) if client is not None else (lambda: 0))


class ConnectionRegistry:
    """The live connections of one node and the services they use (see the module doc).

    ``connect`` (make a pair's upstream connection), ``take_kept`` (give it a kept
    one now, if there is one), ``unstall`` (learn the
    brokers a response named, then resume it), ``owned_here`` (does this
    node still advertise a listener's identity) and ``served_elsewhere`` (does
    the map in effect give a listener's identity to another node) are the data
    path's, set by it.
    """

    def __init__(self, node_id: str, limits: Limits, metrics: ProxyMetrics, rewriter: ResponseRewriter | None,
                 node_drain: NodeDrain, *, tap_dir: str | None = None, max_connections: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_connections``: the node cap if lower than ``limits.max_connections``
        (proxy.listeners.client_capacity: what the descriptor limit allows)."""
        self.node_id = node_id
        self.limits = limits
        self.metrics = metrics
        self.rewriter = rewriter
        self.tap_dir = tap_dir
        self.node_drain = node_drain
        self.admission = Admission(min(limits.max_connections, max_connections or limits.max_connections),
                                   limits.accepts_per_source_per_s)
        for reason in RefusalReason:  # every reason exported from the start, at 0
            metrics.connections_refused.labels(node_id, reason.value)
        self._clock = clock
        self.pairs: set[Pair] = set()
        # Of those, how many are draining (closing at their first idle moment: their identity moved,
        # or the node drains), not closed yet.
        self.moving = 0
        # Client connections in their TLS handshake (no pair yet): raw transports (proxy.connection).
        self.handshaking: set[asyncio.BaseTransport] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Broker connections that clients left at a request boundary, for the next ones (proxy.upstream_pool).
        self.pool = UpstreamPool(limits.bootstrap_pool, on_reuse=metrics.upstream_reused.inc)
        self.clients_log_in = False  # the data path's: the brokers authenticate clients (SASL)
        # ApiVersions answers kept for connections without a broker connection (proxy.local_answers).
        self.answers = LocalAnswers(clock, limits.api_versions_answer_s)
        # Identical Metadata requests on their way to a broker (proxy.single_flight).
        self.flights: Flights[Pair] = Flights(limits.coalesce_metadata)
        self.connect: Callable[[Pair], Awaitable[None]] | None = None
        self.take_kept: Callable[[Pair], bool] | None = None
        self.unstall: Callable[[Pair, UnknownBroker], Awaitable[None]] | None = None
        self.owned_here: Callable[[int], bool] = lambda listener: True
        self.served_elsewhere: Callable[[int], bool] = lambda listener: False
        self.redirects = RedirectBudget()
        # Called at every accept and close (the client list's version, proxy.addresses.peers).
        self.on_change: Callable[[], None] | None = None

    def set_limits(self, limits: Limits, max_connections: int | None = None) -> None:
        """A config reload (proxy.reload): new connections get ``limits``; admission uses the new
        cap and rate from the next connection on. Connections held keep their settings."""
        self.limits = limits
        self.answers.retune(limits.api_versions_answer_s)
        self.flights.retune(limits.coalesce_metadata)
        self.admission.retune(min(limits.max_connections, max_connections or limits.max_connections),
                              limits.accepts_per_source_per_s)

    # ---------------------------------------------------- what a connection calls
    def admit(self, source: str) -> bool:
        """May a new connection from ``source`` (an IP address) be taken (proxy.admission)?
        A refusal is counted, and logged once per source and interval."""
        refusal = self.admission.admit(source, len(self.pairs), self._clock())
        if refusal is None:
            return True
        self.metrics.refused(refusal.reason.value)
        if refusal.log:
            admission = self.admission
            limit = admission.max_connections if refusal.reason is RefusalReason.NODE_CAP else admission.rate
            log.warning("refusing new client connections", extra={
                "source": source, "limit_name": f"limits.{refusal.reason.value}", "limit": limit,
                "refused": refusal.refused_since_log, "connections": len(self.pairs)})
        return False

    def keeps_upstream(self, listener: int) -> bool:
        """May a connection on ``listener`` leave its broker connection to the next client
        (proxy.upstream_pool)? Bootstrap connections, and every connection where they are shared
        (:meth:`shares_upstream`); none when the pool is off (``limits.bootstrap_pool`` 0)."""
        return self.pool.per_address > 0 and (listener == BOOTSTRAP or self.shares_upstream(listener))

    def shares_upstream(self, listener: int) -> bool:
        """May a connection on ``listener`` borrow a broker connection per exchange while it only
        asks (proxy.connection.Pair.shared)? With ``limits.share_upstream``, and not where clients
        log in to the brokers (the node does, ``[security.upstream_sasl]``): a SASL broker takes
        one ApiVersions per connection before the handshake and closes a connection that sends a
        second."""
        return self.limits.share_upstream and not self.clients_log_in and self.pool.per_address > 0

    def answers_locally(self, listener: int) -> bool:
        """Does a connection on ``listener`` get ApiVersions from the broker's last answer
        (proxy.local_answers, ``limits.api_versions_answer_s``) and connect to its broker at its
        first other request (proxy.connection.Pair.lazy)? On a broker identity's listener (one
        broker behind it: the answer is that broker's), not on the bootstrap one (any broker
        serves it: an answer learned from one may not suit the one that serves the connection's
        next request); not where the node
        logs in to the brokers for the clients (``[security.upstream_sasl]``)."""
        return listener != BOOTSTRAP and self.limits.api_versions_answer_s > 0 and not self.clients_log_in

    def connects_lazily(self, listener: int) -> bool:
        """Does a connection on ``listener`` connect to its broker only at its first request the node
        does not answer itself (proxy.connection.Pair.lazy)? Where ApiVersions is answered locally
        (:meth:`answers_locally`), and on the bootstrap port where Metadata requests are coalesced
        (a bootstrapping client that asks Metadata first may get a copy of another one's answer,
        proxy.single_flight: it needs no broker connection)."""
        return self.answers_locally(listener) or (listener == BOOTSTRAP and self.coalesces())

    def coalesces(self) -> bool:
        """Are identical Metadata requests coalesced (proxy.single_flight)? With
        ``limits.coalesce_metadata``, not where the brokers authenticate each client (a Metadata
        answer lists what the client's principal may see)."""
        return self.flights.enabled and not self.clients_log_in

    def keep_upstream(self, pair: Pair) -> bool:
        """``pair``'s client left at a request boundary: keep its broker connection (True), or not."""
        assert pair.upstream is not None and pair.upstream_addr is not None
        return self.pool.put(pair.upstream_addr, pair.upstream)

    def redirect_allowed(self, pair: Pair) -> bool:
        """May ``pair``'s client be sent to look its coordinator up (proxy.connection)? Not once
        its host spent its budget for the identity (proxy.drain.RedirectBudget): logged, and its
        group requests are forwarded here."""
        source = pair.peer.rsplit(":", 1)[0]
        if self.redirects.allow(source, pair.listener, self._clock()):
            return True
        self.metrics.coordinator_redirects_declined.inc()
        log.warning("a client keeps coming back for an identity another node serves: forwarding its group "
                    "requests here (the fleet's maps may disagree)", extra={"peer": pair.peer, "listener": pair.listener})
        return False

    def accept(self, pair: Pair) -> None:
        """A client connected: count it, then refuse it, or connect it upstream (its reads paused meanwhile)
        unless it gets its broker connection at its first request (shared or lazy: proxy.connection)."""
        self.pairs.add(pair)
        if self.on_change is not None:
            self.on_change()
        self.metrics.active.inc()
        self.metrics.accepted("bootstrap" if pair.listener == BOOTSTRAP else f"broker-{pair.listener}")
        for action in self.node_drain.accepted():
            pair.close(action.reason)
            return
        if not pair.shared and not pair.lazy:  # the others get a broker connection at their first request
            self.acquire(pair)

    def acquire(self, pair: Pair) -> None:
        """Get ``pair`` a broker connection; what its client sends meanwhile waits in the pair. A
        kept one is taken at once (``take_kept``); else a task waits for one or connects."""
        assert self.connect is not None
        if self.take_kept is not None and self.take_kept(pair):
            return
        pair.acquiring = True
        self.spawn(self.connect(pair))

    def release(self, pair: Pair) -> None:
        """``pair`` is shared and at a response boundary: its broker connection goes to the pool
        (the longest waiting connection, or kept), or is closed if the pool is full. Not while
        bytes to the broker are still queued (then it stays until the next boundary)."""
        upstream, address = pair.upstream, pair.upstream_addr
        assert upstream is not None and address is not None
        if upstream.get_write_buffer_size():
            return
        pair.upstream = None
        if not self.pool.put(address, upstream):
            upstream.set_protocol(asyncio.Protocol())  # let go: its close is no longer the pair's loss
            upstream.close()

    def discard(self, pair: Pair) -> None:
        """``pair`` closed."""
        self.pairs.discard(pair)
        if pair.draining:
            pair.draining = False
            self.moving -= 1
        if self.on_change is not None:
            self.on_change()
        self.metrics.active.dec()
        if pair.drain is not None:
            pair.drain.handle(DrainEvent.CLOSED, 0.0)

    def stalled(self, pair: Pair, stalled: UnknownBroker) -> None:
        assert self.unstall is not None
        self.spawn(self.unstall(pair, stalled))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def stop(self) -> None:
        self.pool.close_all()
        for pair in list(self.pairs):
            pair.close("node stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ drain
    def drain(self, listeners: set[int] | None = None) -> int:
        """Start the drain of every connection (on one of ``listeners``) not draining yet; how many."""
        count = 0
        for pair in list(self.pairs):
            if (listeners is None or pair.listener in listeners) and not pair.draining:
                self.start_drain(pair)
                count += 1
        return count

    def start_drain(self, pair: Pair) -> None:
        """Close the client's connection at its first idle moment (proxy.drain)."""
        if pair.closed:
            return
        if pair.drain is None:
            pair.drain = ConnectionDrain()
        loop = asyncio.get_running_loop()
        self._execute(pair, pair.drain.start(loop.time(), pair.group, observe(pair)))

    def drain_if_elsewhere(self, pair: Pair) -> None:
        """Drain ``pair`` if the map still gives its identity to another node (proxy.drain:
        ``DRAIN_ELSEWHERE_S``)."""
        if not pair.closed and self.served_elsewhere(pair.listener):
            self.start_drain(pair)

    def drain_progress(self, pair: Pair) -> None:
        """A response boundary (or a finished splice) of a draining connection."""
        if pair.closed or pair.drain is None:
            return
        self._execute(pair, pair.drain.progress(asyncio.get_running_loop().time(), observe(pair)))

    def _timer_due(self, pair: Pair, event: DrainEvent) -> None:
        if pair.closed or pair.drain is None:
            return
        if event is DrainEvent.DELAY_DUE_MOVE and not self.node_drain.still_to_move(self.owned_here(pair.listener)):
            event = DrainEvent.DELAY_DUE_KEEP  # an undrain, or the identity coming back, meanwhile keeps it
        self._execute(pair, pair.drain.handle(event, asyncio.get_running_loop().time(), observe(pair)))

    def _execute(self, pair: Pair, actions: list[DrainAction]) -> None:
        assert pair.drain is not None
        if pair.drain.draining != pair.draining:
            self.moving += 1 if pair.drain.draining else -1
        pair.draining = pair.drain.draining
        for action in actions:
            if isinstance(action, CountDrained):
                self.metrics.drained.labels(self.node_id).inc()
            elif isinstance(action, CountDeferred):
                self.metrics.drain_deferred.inc()
            elif isinstance(action, PauseReading):
                if pair.client is not None:
                    pair.client.pause_reading()  # no new requests
            elif isinstance(action, ScheduleTimer):
                asyncio.get_running_loop().call_at(action.at, self._timer_due, pair, action.event)
            elif isinstance(action, Close):
                pair.close(action.reason, level=logging.WARNING if action.warning else logging.DEBUG)
