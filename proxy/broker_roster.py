"""Which upstream brokers a node keeps: new ones at once, gone ones only after a grace period.

A pure object (no clock, no I/O): :class:`proxy.discovery.BrokerDiscovery` feeds it
what Kafka says and the time, and executes its answer (bind listeners for the
added brokers, release the gone ones).

Kafka's Metadata lists the brokers that are registered and not fenced, so a
broker that restarts (a rolling upgrade) or stalls for a moment vanishes from
it for a while and comes back. Releasing it then would close its listeners and
move its clients for nothing. A broker is therefore forgotten only once it has
been missing from *complete* answers (the periodic refresh's Metadata) for
``release_after`` seconds **and** from at least ``misses_to_release``
consecutive ones: one missed poll never releases, whatever the interval. A
refresh that fails (no broker answered) is no answer and counts nothing. A
partial sighting (a broker named by a response passing through, or by another
worker) proves the broker is there and resets its count.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from proxy.upstream import UpstreamBroker

#: Missing from this many consecutive complete answers at least, besides the grace period.
MISSES_TO_RELEASE = 2


@attrs.frozen
class RosterChange:
    """What a sighting changed: brokers new or at a new address (bind first), brokers released."""

    learnt: tuple[UpstreamBroker, ...] = ()
    released: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.learnt or self.released)


@attrs.define
class _Missing:
    since: float
    polls: int = 1


class BrokerRoster:
    def __init__(self, release_after: float, misses_to_release: int = MISSES_TO_RELEASE) -> None:
        if release_after < 0:
            raise ValueError("release_after must be >= 0")
        if misses_to_release < 1:
            raise ValueError("misses_to_release must be >= 1")
        self.release_after = release_after
        self.misses_to_release = misses_to_release
        self.brokers: dict[int, UpstreamBroker] = {}
        self._missing: dict[int, _Missing] = {}

    def missing_for(self, broker_id: int, now: float) -> float:
        """Seconds since ``broker_id`` was last in a complete answer (0 when it was in the last one)."""
        m = self._missing.get(broker_id)
        return 0.0 if m is None else now - m.since

    def sighted(self, brokers: Iterable[UpstreamBroker]) -> RosterChange:
        """Brokers named by a partial answer: kept (added if new), never a release."""
        learnt = []
        for b in brokers:
            self._missing.pop(b.node_id, None)
            if self.brokers.get(b.node_id) != b:
                self.brokers[b.node_id] = b
                learnt.append(b)
        return RosterChange(tuple(sorted(learnt)))

    def polled(self, brokers: Iterable[UpstreamBroker], now: float) -> RosterChange:
        """The complete broker list Kafka answered at ``now``: learn the new, count the missing,
        release those missing long enough. An empty list is no answer (Kafka never lists zero)."""
        listed = list(brokers)
        if not listed:
            return RosterChange()
        change = self.sighted(listed)
        present = {b.node_id for b in listed}
        released = []
        for bid in sorted(self.brokers.keys() - present):
            m = self._missing.get(bid)
            if m is None:
                m = self._missing[bid] = _Missing(now)
            else:
                m.polls += 1
            if m.polls >= self.misses_to_release and now - m.since >= self.release_after:
                released.append(bid)
        for bid in released:
            del self.brokers[bid]
            del self._missing[bid]
        return RosterChange(change.learnt, tuple(released))
