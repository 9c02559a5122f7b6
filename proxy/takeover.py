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

from collections.abc import Iterable

import attrs

from membership.serving import BOOTSTRAP, ServingMap, StandIn

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
