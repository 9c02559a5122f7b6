"""One proxied connection: the client's and the broker's asyncio protocols.

A client connection on broker B's port is paired (:class:`Pair`) with one
upstream connection to broker B; the bootstrap port pairs with any live
broker. On a broker's port the upstream connection is made at the client's
first request the node does not answer itself (ApiVersions is answered from the
broker's last answer: :mod:`proxy.local_answers`, ``Pair.lazy``; so is a
bootstrap connection while Metadata requests are coalesced). A Metadata request
that is all a connection has outstanding joins an identical one on its way to a
broker and gets a copy of its answer (:mod:`proxy.single_flight`). With
``limits.share_upstream``, while the client has only asked (ApiVersions,
Metadata, FindCoordinator) the pair is *shared*: it borrows a
broker connection per request from the node's pool (:mod:`proxy.upstream_pool`)
and gives it back at the answer; its first other request binds it to one for
good. Per pair, a :class:`proxy.codec.ConnectionCodec` (sans-IO) observes
request headers (to fill the correlation table) and splits the response stream
into pass-through slices and whole address-carrying frames for
:class:`proxy.rewrite.ResponseRewriter`.

Forwarding is cut-through: request chunks are written upstream as received;
response chunks are written to the client as received except frames that must
be rewritten; the rest of a large pass-through frame is spliced
(:mod:`proxy.splice`). Backpressure runs both ways: when one side's write
buffer goes above ``limits.high_water_bytes`` the other side stops reading.

Everything a connection needs from its node goes through its
:class:`proxy.registry.ConnectionRegistry`: accounting, the upstream
connection, learning unknown brokers, the drain.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, BinaryIO

from proxy.buffers import ReadBuffers, read_buffers
from proxy.codec import ConnectionCodec
from proxy.config import HostPort
from proxy.drain import GROUP_API_KEYS, ConnectionDrain
from proxy.errors import ProtocolError, RewriteError
from proxy.framing import API_VERSIONS, METADATA
from proxy.sockets import reset_on_close
from proxy.splice import AVAILABLE as SPLICE_AVAILABLE
from proxy.splice import Splice
from proxy.tls import TLS_ESTABLISHED, TlsEndpoint, describe, start_server_tls
from proxy.upstream_pool import CONNECTION_BOUND_API_KEYS, SHAREABLE_API_KEYS

if TYPE_CHECKING:
    from proxy.connect_pacing import Turn
    from proxy.registry import ConnectionRegistry
    from proxy.request_tracker import RequestHeader
    from proxy.single_flight import Flight

log = logging.getLogger("kproxy.proxy")


def reset_transport(transport: asyncio.BaseTransport) -> None:
    """Abort ``transport`` so that its peer gets an RST as soon as the socket closes (SO_LINGER 0),
    however much is queued to send: a FIN waits behind unsent bytes, and a host about to give
    the connection's address away could never send it. (uvloop closes the socket in
    ``connection_lost``, called soon after: let the loop run once before the address goes.)"""
    _reset_on_close(transport)
    transport.abort()


def _reset_on_close(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        reset_on_close(sock)


class Pair:
    """One client connection and its upstream connection.

    ``draining`` mirrors ``drain.draining`` (the flow-control and per-chunk
    checks read a plain attribute); ``drain`` exists once a drain started."""

    __slots__ = ("registry", "listener", "client", "upstream", "codec", "closed", "draining", "peer", "upstream_addr",
                 "_pending", "tap", "splice", "group", "drain", "tls", "turn", "elsewhere", "reusable", "shared",
                 "acquiring", "attached", "lazy", "flight", "joined")
    _ids = itertools.count()

    def __init__(self, registry: ConnectionRegistry, listener: int) -> None:
        self.registry = registry
        self.listener = listener
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.codec = ConnectionCodec(registry.rewriter, max_frame_size=registry.limits.max_frame_bytes)
        self.closed = False
        self.draining = False
        self.group = False  # it carried group-coordinator requests (GROUP_API_KEYS)
        # Accepted on this node's own address while the map gave its identity to another node
        # (ConnectionRegistry.served_elsewhere; a stand-in's connections never are): its group
        # requests send the client to look the coordinator up, and it is drained a while after
        # connecting (proxy.drain: DRAIN_ELSEWHERE_S).
        self.elsewhere = False
        self.drain: ConnectionDrain | None = None
        self.peer = "?"
        self.upstream_addr: HostPort | None = None
        self._pending: list[bytes] | None = None  # copies (read buffers are reused); made if ever needed
        self.splice: Splice | None = None  # a response body being spliced to the client (proxy.splice)
        self.tap: Tap | None = None
        self.tls = False  # either side is TLS: its bytes are encrypted in user space, never spliced
        # The upstream connect's turn (proxy.connect_pacing), given back at the broker's first answer.
        self.turn: Turn | None = None
        # Its broker connection may go to the next client when its client leaves at a request
        # boundary (proxy.upstream_pool): a connection that carried no SASL exchange.
        self.reusable = registry.keeps_upstream(listener)
        # With limits.share_upstream: it has sent only requests the broker answers from no
        # state of the connection (SHAREABLE_API_KEYS: ApiVersions, Metadata, FindCoordinator): it holds a broker
        # connection only from a request to its answer, borrowed from the node's pool (or
        # connected), and gives it back at each response boundary (ConnectionRegistry.release).
        # The first other request binds it: from then on it keeps the broker connection it has,
        # or gets, for good. An idle client costs the broker no connection, and a reconnect storm
        # of clients that only ask is carried by a few broker connections.
        self.shared = registry.shares_upstream(listener)
        # Not shared, but connected to its broker only at its first request the node does not
        # answer itself (proxy.local_answers: ApiVersions, every client's first): a client that only
        # asked ApiVersions costs the broker nothing; from the first other request it is bound.
        self.lazy = not self.shared and registry.connects_lazily(listener)
        self.acquiring = False  # getting a broker connection (ConnectionRegistry.acquire)
        # proxy.single_flight: the flight its lone Metadata request leads (its answer is copied to
        # the connections that joined), or the correlation id of the one it joined: until that
        # flight lands, what it sends waits in _pending, its own request first.
        self.flight: Flight[Pair] | None = None
        self.joined: int | None = None
        self.attached = False  # had a broker connection once (the drain's timers start at the first)
        if registry.tap_dir:
            self.tap = Tap(f"{registry.tap_dir}/{registry.node_id}-{os.getpid()}-{next(self._ids)}.bin")

    def learned(self, api_key: int, api_version: int, pieces: Sequence[bytes | memoryview]) -> None:
        """A response the rewriter handled (the codec's observer; a lazy pair's first only, most
        often its ApiVersions answer, and a flight leader's Metadata answer: no call per response
        for the rest of its life): ApiVersions answers are kept for the next clients
        (proxy.local_answers, which tells them apart); a flight's answer goes to the connections
        that joined it (proxy.single_flight)."""
        flight = self.flight
        if flight is not None and api_key == METADATA:
            self.flight = None
            for waiter, head, body in self.registry.flights.land(flight, pieces):
                waiter.answered(head, body)
        self.registry.answers.learn(self.listener, api_key, api_version, pieces)
        if not self.shared:
            self.codec.responses.observer = None

    def answered(self, head: bytes, body: bytes) -> None:
        """The flight it joined landed: ``head`` + ``body`` is its answer. Then what it sent
        meanwhile goes to its broker (connected for it first if it has none)."""
        correlation_id, self.joined = self.joined, None
        if self.closed or correlation_id is None:
            return
        self.codec.table.pop(correlation_id)
        registry = self.registry
        registry.metrics.coalesced.inc()
        client = self.client
        assert client is not None
        client.writelines((head, body))
        if self.tap is not None:
            self.tap.writelines((head, body))
        pending = self._pending
        assert pending
        del pending[0]  # its own request
        self._send_pending()
        if self.draining:
            registry.drain_progress(self)

    def ask_again(self) -> None:
        """The flight it joined will not land (its leader's connection closed): its own request
        goes to the broker after all."""
        self.joined = None
        if not self.closed:
            self._send_pending()

    def _send_pending(self) -> None:
        pending = self._pending
        if not pending:
            return
        upstream = self.upstream
        if upstream is not None:
            upstream.writelines(pending)
            pending.clear()
            client = self.client
            if client is not None and not self.draining:
                client.resume_reading()  # if it sent much meanwhile (ClientSide._hold)
        elif not self.acquiring:
            self.registry.acquire(self)

    def close(self, reason: str, *, level: int = logging.DEBUG, client_left: bool = False) -> None:
        """``client_left``: the client closed its side; a reusable pair at a request boundary
        leaves its broker connection to the registry's pool instead of closing it."""
        if self.closed:
            return
        self.closed = True
        if self.turn is not None:
            self.turn.abandon()
            self.turn = None
        if self.flight is not None:  # no answer will come: the connections that joined ask for themselves
            flight, self.flight = self.flight, None
            for waiter in self.registry.flights.fail(flight):
                waiter.ask_again()
        log.log(level, "closing connection", extra={"peer": self.peer, "listener": self.listener, "reason": reason})
        if (client_left and self.reusable and self.upstream is not None and self.splice is None
                and self.codec.idle and self.codec.responses.stalled is None and self.registry.keep_upstream(self)):
            self.upstream = None  # the pool's now
        if self.splice is not None:  # before the transports: it holds dup'ed fds of both sockets
            self.splice.cancel()
            self.splice = None
        for t in (self.client, self.upstream):
            if t is not None and not t.is_closing():
                t.close()  # flushes what is buffered, then FIN
        self.registry.discard(self)
        if self.tap is not None:
            self.tap.close()

    def hold(self) -> None:
        """Read nothing more from either side (proxy.datapath ``_fenced`` while isolated)."""
        for t in (self.client, self.upstream):
            if t is not None and not t.is_closing():
                t.pause_reading()

    def abort(self, reason: str) -> None:
        if not self.closed:
            self.close(reason, level=logging.WARNING)
        for t in (self.client, self.upstream):
            if t is not None:
                t.abort()

    def reset(self, reason: str) -> None:
        """:meth:`abort`, the client getting an RST (:func:`reset_transport`): for a connection at
        an address this host gives away or may have lost. A client already closing gracefully
        (a drain's close, bytes still queued) is reset too: its FIN would wait behind them."""
        if self.client is not None:
            _reset_on_close(self.client)
        self.abort(reason)


class Tap:
    """Tests only (``[debug] tap_dir``): a copy of every byte written to one
    client, in its own file, opened at the first write (a connection that is
    never answered costs no file)."""

    __slots__ = ("path", "_file")

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: BinaryIO | None = None

    def writelines(self, chunks: Iterable[bytes | memoryview]) -> None:
        if self._file is None:
            self._file = open(self.path, "wb")
        self._file.writelines(chunks)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class ClientSide(asyncio.BufferedProtocol):
    """Client -> broker. Reads into the loop's shared buffer (proxy.buffers).

    The :class:`Pair` (its codec, its place in the registry) is made once the
    node admitted the connection (proxy.admission): a refused connection costs
    this object and its transport, closed at once. On a TLS listener (``tls``)
    the handshake comes between (proxy.tls.start_server_tls): ``connection_made``
    is called again with the TLS layer's transport, and the pair is made then."""

    __slots__ = ("registry", "listener", "pair", "_buffers", "_view", "tls", "stand_in")

    def __init__(self, registry: ConnectionRegistry, listener: int,
                 tls: TlsEndpoint | object | None = None, *, stand_in: bool = False) -> None:
        self.registry = registry
        self.listener = listener
        self.tls = tls
        # Accepted on a vacant node's address (proxy.listeners stand-ins): a client that kept that
        # address, its group coordinator's above all, is served there whoever owns the identity.
        self.stand_in = stand_in
        self.pair: Pair | None = None  # made in connection_made, unless the connection is refused
        self._buffers: ReadBuffers = read_buffers()
        self._view: memoryview = self._buffers.view

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        registry = self.registry
        peer = transport.get_extra_info("peername")
        endpoint = self.tls
        if endpoint is TLS_ESTABLISHED:  # the TLS layer's transport, after the handshake: admitted already
            self._paired(transport, peer, tls=True)
            return
        if not registry.admit(peer[0] if peer else "?"):
            transport.abort()  # nothing was read or written: the client sees the connection closed
            return
        if endpoint is not None:
            self.tls = TLS_ESTABLISHED
            registry.handshaking.add(transport)  # no pair until the handshake is done (proxy.datapath._vacate)
            handshake = start_server_tls(transport, self, endpoint.context)
            handshake.add_done_callback(lambda done: self._handshake_done(done, endpoint, transport, peer))
            return
        self._paired(transport, peer)

    def _handshake_done(self, done: asyncio.Future[None], endpoint: TlsEndpoint, transport: asyncio.BaseTransport,
                        peer: tuple[str, int] | None) -> None:
        """A failed handshake is counted and logged, and closes this connection only."""
        self.registry.handshaking.discard(transport)
        exc = None if done.cancelled() else done.exception()
        if exc is None:
            return
        reason = endpoint.failures.failed("client", exc)
        log.log(logging.INFO if reason == "closed" else logging.WARNING,
                "TLS handshake with a client failed, closing its connection",
                extra={"peer": f"{peer[0]}:{peer[1]}" if peer else "?", "listener": self.listener,
                       "reason": reason, "error": describe(exc)})
        transport.abort()

    def _paired(self, transport: asyncio.BaseTransport, peer: tuple[str, int] | None, tls: bool = False) -> None:
        registry = self.registry
        pair = self.pair = Pair(registry, self.listener)
        pair.tls = tls
        pair.client = transport  # type: ignore[assignment]
        pair.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        transport.set_write_buffer_limits(high=registry.limits.high_water_bytes)
        if pair.shared or pair.lazy:
            if pair.shared or registry.answers_locally(self.listener):  # else it learns no ApiVersions answer
                pair.codec.responses.observer = pair.learned
        else:
            transport.pause_reading()  # until the upstream connection is made
        pair.elsewhere = not self.stand_in and registry.served_elsewhere(self.listener)
        registry.accept(pair)

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._view = self._buffers.view
        return view

    def buffer_updated(self, nbytes: int) -> None:
        pair = self.pair
        data = self._view[:nbytes]
        try:
            headers = pair.codec.requests.feed(data)
        except ProtocolError as exc:
            self.registry.metrics.protocol_error("client")
            # A TLS record starts 0x16 0x03: a client configured for TLS on a plaintext listener.
            hint = " (a TLS handshake on a plaintext listener)" if bytes(data[:2]) == b"\x16\x03" else ""
            log.warning("protocol error from client, closing its connection" + hint,
                        extra={"peer": pair.peer, "listener": pair.listener, "reason": str(exc)})
            pair.abort(f"protocol error: {exc}")
            return
        metrics = self.registry.metrics
        if headers:
            metrics.count_requests(headers)
            if pair.reusable and any(h.api_key in CONNECTION_BOUND_API_KEYS for h in headers):
                pair.reusable = False  # the broker authenticates this client on this connection
            if pair.shared and any(h.api_key not in SHAREABLE_API_KEYS for h in headers):
                pair.shared = False  # bound: it keeps the broker connection it has or gets
            if not pair.group:
                pair.group = any(h.api_key in GROUP_API_KEYS for h in headers)
                if pair.group:
                    if self.registry.on_change is not None:
                        self.registry.on_change()  # the client lists name group connections (tickled last)
                    if pair.elsewhere and self.registry.served_elsewhere(pair.listener) \
                            and self.registry.redirect_allowed(pair):
                        self._send_to_coordinator_lookup(pair)
                        return
        if pair.joined is not None:  # waiting for another connection's answer: what follows waits too
            metrics.bytes_to_broker += nbytes
            self._hold(pair, data)
            return
        upstream = pair.upstream
        if len(headers) == 1 and not pair.acquiring and not pair._pending:
            api_key = headers[0].api_key
            if api_key == METADATA:
                if self._coalesce(pair, headers[0], data):
                    return
            elif upstream is None and api_key == API_VERSIONS and (pair.shared or pair.lazy) \
                    and self._answer(pair, headers[0].api_version, headers[0].correlation_id):
                return
        metrics.bytes_to_broker += nbytes
        if upstream is not None:
            upstream.write(data)
            if upstream.get_write_buffer_size():  # it may keep a view of the buffer
                self._buffers.release(upstream)
        else:  # a shared connection between exchanges (or, for safety, one not connected yet)
            self._hold(pair, data, connect=True)

    def _coalesce(self, pair: Pair, header: RequestHeader, data: memoryview) -> bool:
        """A Metadata request, the whole of what the client sent since its last answer (nothing
        else in flight, no response half written): join the flight of an identical request on its
        way to a broker (True: it waits for that answer, proxy.single_flight), or lead a new one
        (False: it goes to the broker as usual, and its answer is copied to those that join)."""
        registry = self.registry
        flights = registry.flights
        codec = pair.codec
        if (not registry.coalesces() or len(codec.table) != 1 or header.frame_size != len(data)
                or not codec.requests.at_frame_boundary or not codec.responses.at_frame_boundary
                or codec.responses.stalled is not None or pair.splice is not None):
            return False
        key = flights.key(pair.listener, header.api_version, data[4 + header.header_size:])
        if flights.join(key, pair, header.correlation_id):
            pair.joined = header.correlation_id
            pair._pending = [bytes(data)]  # asked again if the flight fails (Pair.ask_again)
            return True
        pair.flight = flights.lead(key)
        codec.responses.observer = pair.learned
        return False

    def _hold(self, pair: Pair, data: memoryview, *, connect: bool = False) -> None:
        """``data`` waits in ``pair`` for the answer of the flight it joined, or (``connect``) for
        its broker connection, asked for now if it is not yet (a kept one is attached at once, and
        takes what waits). Reading goes on (a client that leaves is heard) unless it sends much
        meanwhile."""
        pending = pair._pending
        if pending is None:
            pending = pair._pending = []
        pending.append(bytes(data))
        if connect and not pair.acquiring:
            self.registry.acquire(pair)
        if sum(map(len, pending)) >= self.registry.limits.high_water_bytes:
            pair.client.pause_reading()

    def _answer(self, pair: Pair, api_version: int, correlation_id: int) -> bool:
        """Answer the ApiVersions request of a connection without a broker connection (shared, or
        lazy and not connected yet; the request is the whole of what the client sent since its last
        answer) from the answer kept for its listener (proxy.local_answers), if there is one: no
        broker connection is borrowed or made."""
        codec = pair.codec
        if not codec.requests.at_frame_boundary or len(codec.table) != 1:
            return False
        frame = self.registry.answers.answer(pair.listener, api_version, correlation_id)
        if frame is None:
            return False
        codec.table.pop(correlation_id)
        self.registry.metrics.local_answers.inc()
        client = pair.client
        assert client is not None
        client.write(frame)
        if pair.tap is not None:
            pair.tap.writelines((frame,))
        return True

    def _send_to_coordinator_lookup(self, pair: Pair) -> None:
        """A group-coordinator request on a connection made to this node's own address for an
        identity the map gives to another node. Clients keep the coordinator's address from
        FindCoordinator, not from Metadata (librdkafka's and Java's coordinator connection,
        aiokafka's coordination group): after the identity moved on, a connection closed at an
        idle moment comes back to the same address, and this node would go on carrying the
        group's commits and heartbeats for an identity it does not serve, so a fault of this node
        would then stall every consumer of the group. The request is not forwarded; the
        connection is closed with it in flight, which clients treat as a dead coordinator: they
        look it up again at once (FindCoordinator, answered with the owner's address) and send
        the request there."""
        self.registry.metrics.coordinator_redirects.inc()
        log.info("group request for an identity another node serves: closing, the client looks its coordinator up",
                 extra={"peer": pair.peer, "listener": pair.listener})
        pair.close("group request for an identity served elsewhere", level=logging.DEBUG)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pair is not None:  # None: refused
            self.pair.close("client gone", client_left=True)

    def pause_writing(self) -> None:
        if self.pair.upstream is not None:
            self.pair.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.pair.upstream is not None and not self.pair.closed:
            self.pair.upstream.resume_reading()


class UpstreamSide(asyncio.BufferedProtocol):
    """Broker -> client. Reads into the loop's shared buffer (proxy.buffers);
    the rest of a large pass-through frame is spliced instead (proxy.splice)."""

    __slots__ = ("pair", "_buffers", "_view", "_splice_min")

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self._buffers: ReadBuffers = read_buffers()
        self._view: memoryview = self._buffers.view
        # The tap records what is written to the client: with it, never splice. Nor with TLS on
        # either side: the bytes on one socket are not the bytes on the other.
        limit = pair.registry.limits.splice_min_bytes
        self._splice_min = limit if SPLICE_AVAILABLE and pair.tap is None and not pair.tls else 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.set_write_buffer_limits(high=self.pair.registry.limits.high_water_bytes)

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self._view = self._buffers.view
        return view

    def buffer_updated(self, nbytes: int) -> None:
        pair = self.pair
        if pair.turn is not None:  # the broker's first answer: it accepted the connection
            pair.turn.answered()
            pair.turn = None
        registry = pair.registry
        responses = pair.codec.responses
        try:
            out = responses.feed(self._view[:nbytes])
        except ProtocolError as exc:
            registry.metrics.protocol_error("broker")
            log.warning("protocol error from broker, closing the pair",
                        extra={"peer": pair.peer, "listener": pair.listener, "reason": str(exc)})
            pair.abort(f"broker protocol error: {exc}")
            return
        except RewriteError as exc:
            log.error("cannot rewrite response, closing the pair",
                      extra={"peer": pair.peer, "listener": pair.listener, "reason": str(exc)})
            pair.abort(f"rewrite error: {exc}")
            return
        registry.metrics.bytes_to_client += nbytes
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
            registry.stalled(pair, stalled)
        elif pair.shared and pair.codec.idle and not pair.closed:
            registry.release(pair)  # the exchange is over: its broker connection goes to the next one
            if pair.draining:
                registry.drain_progress(pair)
        elif (self._splice_min and responses.remaining_pass_through >= self._splice_min and client is not None
              and not client.get_write_buffer_size() and not pair.closed):
            # Everything written to the client so far is in the kernel: the
            # rest of this frame's body may go around user space.
            self._splice(client, responses.remaining_pass_through)
        elif pair.draining:
            registry.drain_progress(pair)

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
        metrics = self.pair.registry.metrics
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
            pair.registry.drain_progress(pair)

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
