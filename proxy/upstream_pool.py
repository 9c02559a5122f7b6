"""Idle upstream connections kept for the next client connection.

A client's bootstrap connection asks one or two things (ApiVersions, Metadata)
and closes, and each one cost a broker connection: its accept, its place on one
of the broker's network threads, its close. In a failover every recovering
client bootstraps again, so thousands of broker connections come in the same
second, into the accept queues of the brokers the real clients are
reconnecting to at that moment (Kafka's ``socket.listen.backlog.size``: 50).

When a bootstrap client leaves at a request boundary, its upstream connection
holds nothing of that client: the broker keeps no per-connection state for
ApiVersions, Metadata, FindCoordinator and the like (quotas and ACLs go by the
connection's principal, which is the node's). It is kept here, at most
``limits.bootstrap_pool`` per broker address in each worker, for ``IDLE_S``,
and the next bootstrap connection to that broker takes it instead of
connecting. In a storm none is idle for long: a bootstrap connection that waits
for its turn to connect (:mod:`proxy.connect_pacing`) also waits here
(:meth:`UpstreamPool.wait`), and a connection let go goes straight to the
longest waiting one, whichever broker it asked first; so a few connections per
broker carry a storm's bootstrap requests one after the other, and the turns
toward each broker are left to the connections that must be new (a broker
identity's). Never kept (:meth:`proxy.connection.Pair.close`): a connection that
carried a SASL exchange (the broker authenticated that client on it), one with
a request unanswered or a frame half sent or half received, a response being
spliced or waiting for an unknown broker, and the connection of any pair the
proxy closed itself (drain, error, fence, stop). A kept connection that the
broker closes (``connections.max.idle.ms``, a restart) or that receives a byte
unasked leaves the pool.

With ``limits.share_upstream`` (off by default), any client connection that has only asked
(ApiVersions, Metadata, FindCoordinator: ``SHAREABLE_API_KEYS``) is *shared* (:attr:`proxy.connection.Pair.shared`): it gets a broker
connection at its first request, from here or connected, and gives it back here at each
response boundary, so it holds none while idle (a client keeps a connection to every broker it
may need; most of them idle) and the clients of a failed node that reconnect to a survivor and
ask their ApiVersions are carried by a few broker connections instead of one connect each. Its
first other request binds it to the broker connection it has or gets next, for good. Not where
the node logs in to the brokers (SASL brokers: a connection takes one ApiVersions before its
handshake).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("kproxy.proxy")

IDLE_S = 30.0  # a kept connection unused this long is closed (Kafka's own idle close is 10 min)
# Requests that bind the connection to one client: the broker authenticates the client on it.
CONNECTION_BOUND_API_KEYS = frozenset({17, 36})  # SaslHandshake, SaslAuthenticate
# Requests a client connection may send over a broker connection it borrows for the one exchange
# (proxy.connection.Pair.shared): the broker answers them from no state of the connection.
SHAREABLE_API_KEYS = frozenset({3, 10, 18})  # Metadata, FindCoordinator, ApiVersions

Address = TypeVar("Address")


class _Kept(asyncio.Protocol):
    """The protocol of a kept connection: nothing is asked, so anything heard ends it."""

    __slots__ = ("pool", "address", "transport", "since")

    def __init__(self, pool: UpstreamPool, address: object, transport: asyncio.Transport, since: float) -> None:
        self.pool = pool
        self.address = address
        self.transport = transport
        self.since = since

    def data_received(self, data: bytes) -> None:
        log.info("a kept broker connection received bytes unasked: closing it", extra={"broker": f"{self.address}"})
        self.pool.forget(self)
        self.transport.abort()

    def eof_received(self) -> bool | None:
        return False  # close

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.forget(self)


class Waiter(Generic[Address]):
    """A client connection waiting for a broker connection let go (:meth:`UpstreamPool.wait`).
    The one let go is given to ``on_handover(transport, address)`` there and then, which says
    whether it took it (False: its pair closed meanwhile; the next waiter is asked); ``future``
    is then done, with that answer."""

    __slots__ = ("candidates", "future", "on_handover")

    def __init__(self, candidates: Collection[Address], future: asyncio.Future[bool],
                 on_handover: Callable[[asyncio.Transport, Address], bool]) -> None:
        self.candidates = candidates
        self.future = future
        self.on_handover = on_handover


class UpstreamPool:
    """Idle broker connections by address, at most ``per_address`` each (0: none kept).

    ``put`` gives one to the longest waiting :class:`Waiter` that would take its
    address, else keeps it (or says no); ``take`` gives back the most recently
    kept one of the first address in ``candidates`` that has one. ``on_reuse``
    is called at each connection reused (a metric)."""

    def __init__(self, per_address: int, *, idle_s: float = IDLE_S,
                 on_reuse: Callable[[], None] | None = None) -> None:
        self.per_address = per_address
        self.idle_s = idle_s
        self.on_reuse = on_reuse
        self._kept: dict[object, list[_Kept]] = {}
        self._waiters: dict[Waiter[object], None] = {}  # in arrival order
        # The same waiters by each address they would take, in arrival order: a connection let go
        # finds the longest waiting one for its address without passing the others (in a storm,
        # hundreds wait for one broker identity's address).
        self._by_address: dict[object, dict[Waiter[object], None]] = {}
        self._sweep: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def put(self, address: object, transport: asyncio.Transport) -> bool:
        """Keep ``transport`` (its pair let it go at a request boundary); False: not kept, the
        caller closes it."""
        if self.per_address <= 0 or transport.is_closing():
            return False
        if self._hand_over(address, transport):
            return True
        kept = self._kept.setdefault(address, [])
        if len(kept) >= self.per_address:
            return False
        loop = asyncio.get_running_loop()
        entry = _Kept(self, address, transport, loop.time())
        transport.set_protocol(entry)
        if not transport.is_reading():  # paused by its last client's backpressure: a close must be heard
            transport.resume_reading()
        kept.append(entry)
        log.debug("broker connection kept", extra={"broker": f"{address}", "kept": len(kept)})
        if self._sweep is None:
            self._sweep = loop.call_later(self.idle_s, self._expire)
        return True

    def take(self, candidates: Sequence[Address]) -> tuple[asyncio.Transport, Address] | None:
        """A kept connection to one of ``candidates`` (in their order), now the caller's; None: none."""
        for address in candidates:
            kept = self._kept.get(address)
            while kept:
                entry = kept.pop()
                if not entry.transport.is_closing():
                    log.debug("kept broker connection taken", extra={"broker": f"{address}", "kept": len(kept)})
                    if self.on_reuse is not None:
                        self.on_reuse()
                    return entry.transport, address
        return None

    def wait(self, candidates: Collection[Address],
             on_handover: Callable[[asyncio.Transport, Address], bool]) -> Waiter[Address]:
        """Wait for a connection to one of ``candidates`` let go from now on (first come, first
        served), given to ``on_handover``; :meth:`stop_waiting` once it is not needed any more."""
        waiter: Waiter[Address] = Waiter(candidates, asyncio.get_running_loop().create_future(), on_handover)
        self._waiters[waiter] = None  # type: ignore[index]
        for address in candidates:
            self._by_address.setdefault(address, {})[waiter] = None  # type: ignore[index]
        return waiter

    def stop_waiting(self, waiter: Waiter[Address]) -> None:
        """``waiter`` is done waiting (its pair got a turn, or closed): cancel it if need be."""
        self._forget_waiter(waiter)  # type: ignore[arg-type]
        waiter.future.cancel()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _hand_over(self, address: object, transport: asyncio.Transport) -> bool:
        while True:
            line = self._by_address.get(address)
            waiter = next(iter(line), None) if line else None
            if waiter is None:
                return False
            self._forget_waiter(waiter)
            if not transport.is_reading():  # paused by its last client's backpressure
                transport.resume_reading()
            took = waiter.on_handover(transport, address)
            if not waiter.future.done():
                waiter.future.set_result(took)
            if took:
                if self.on_reuse is not None:
                    self.on_reuse()
                return True

    def _forget_waiter(self, waiter: Waiter[object]) -> None:
        if self._waiters.pop(waiter, 0) is None:  # it was waiting
            for address in waiter.candidates:
                line = self._by_address.get(address)
                if line is not None:
                    line.pop(waiter, None)
                    if not line:
                        del self._by_address[address]

    def forget(self, entry: _Kept) -> None:
        kept = self._kept.get(entry.address)
        if kept is not None and entry in kept:
            kept.remove(entry)

    def close_all(self) -> None:
        for waiter in list(self._waiters):
            waiter.future.cancel()
        self._waiters.clear()
        self._by_address.clear()
        for kept in self._kept.values():
            for entry in kept:
                entry.transport.close()
        self._kept.clear()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    def _expire(self) -> None:
        self._sweep = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() - self.idle_s
        oldest = None
        for kept in self._kept.values():
            for entry in [e for e in kept if e.since <= deadline]:
                kept.remove(entry)
                entry.transport.close()
            for entry in kept:
                oldest = entry.since if oldest is None else min(oldest, entry.since)
        if oldest is not None:
            self._sweep = loop.call_at(oldest + self.idle_s, self._expire)
