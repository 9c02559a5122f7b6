"""Identical Metadata requests asked at once get one broker round trip (sans-IO).

In a failover, every client of the lost node bootstraps again within the same
second, and most ask the very same Metadata request (one application's clients
ask for the same topics, with the same flags, at the same version). Each one
cost a broker connection's turn, a request on a broker's network and handler
threads, and a rewrite of the answer by the node. With
``limits.coalesce_metadata`` (on by default), a connection whose whole
outstanding input is one Metadata request (nothing else in flight, no partial
frame: :mod:`proxy.connection`) *joins* the flight of an identical request
already on its way to a broker on the same listener of the same worker, if
there is one; otherwise its request *leads* a new flight and goes to the broker
as usual. When the leader's answer has been rewritten (the node's current map:
the one every client asking now would get), each joined connection is sent a
copy with its own correlation id, without a broker connection, turn or rewrite
of its own. A flight ends with its answer: the next request leads a new one, so
an answer is never older than the request that asked it plus one round trip
(Kafka clients take a broker's metadata as a view that may lag anyway).

Identical means the same listener, request version and request body (topics,
``allow_auto_topic_creation``, the authorized-operations flags): only the
request header (correlation id, client id) may differ. Not where the brokers
authenticate each client themselves (``[security.upstream_sasl]``: a Metadata
answer lists what the client's principal may see); the node's own principal is
the same for every client. A broker's request quota by client id throttles the
leader's answer only (its ``throttle_time_ms`` is copied).

If the leader's connection closes before its answer (the client left, the
broker connection was lost), each joined connection sends its own request
(:meth:`Flights.fail` hands them back).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from proxy._wire import Buffer
from proxy.framing import answer_head


Waiter = TypeVar("Waiter")


class Flight(Generic[Waiter]):
    """One request on its way to a broker, and the connections waiting for a copy of its answer
    (with each one's correlation id)."""

    __slots__ = ("key", "waiters")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.waiters: list[tuple[Waiter, int]] = []


class Flights(Generic[Waiter]):
    """The flights of one worker, by (listener, request version, request body)."""

    __slots__ = ("_flights", "enabled")

    def __init__(self, enabled: bool) -> None:
        self._flights: dict[Hashable, Flight[Waiter]] = {}
        self.enabled = enabled

    @staticmethod
    def key(listener: int, api_version: int, body: Buffer) -> Hashable:
        """What makes two requests identical: ``body`` is the request after its header."""
        return (listener, api_version, bytes(body))

    def join(self, key: Hashable, waiter: Waiter, correlation_id: int) -> bool:
        """``waiter`` asks what the flight ``key`` asked: True if it now waits for that flight's
        answer, False if there is none (then it should :meth:`lead`)."""
        flight = self._flights.get(key)
        if flight is None:
            return False
        flight.waiters.append((waiter, correlation_id))
        return True

    def lead(self, key: Hashable) -> Flight[Waiter]:
        """A new flight for ``key`` (its request goes to the broker): the next identical ones join it."""
        flight = self._flights[key] = Flight(key)
        return flight

    def land(self, flight: Flight[Waiter], payload: Sequence[Buffer]) -> list[tuple[Waiter, bytes, bytes]]:
        """The flight's answer, rewritten: its payload as ``pieces`` (correlation id first, no length
        prefix; views of a buffer about to be reused: copied once here). Returns each joined waiter
        with its response frame as two parts: its own head (length, correlation id) and the body
        every waiter shares (thousands of waiters hold no copy each). The flight is over."""
        waiters = self._end(flight)
        if not waiters:
            return []
        body = b"".join(payload)[4:]
        return [(waiter, answer_head(len(body), correlation_id), body) for waiter, correlation_id in waiters]

    def fail(self, flight: Flight[Waiter]) -> list[Waiter]:
        """The flight will get no answer (its leader's connection closed): the waiters, which must
        ask for themselves; the flight is over."""
        return [waiter for waiter, _ in self._end(flight)]

    def retune(self, enabled: bool) -> None:
        """A config reload: flights already under way still land."""
        self.enabled = enabled

    def _end(self, flight: Flight[Waiter]) -> list[tuple[Waiter, int]]:
        """Forget ``flight``; its waiters, once (a flight ends once)."""
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]
        waiters, flight.waiters = flight.waiters, []
        return waiters

    def __len__(self) -> int:
        return len(self._flights)
