"""Handing a released stand-in's clients back to the address's own node: decisions without I/O.

A node that stood in on a vacant node's address (:mod:`proxy.takeover`) keeps
the client connections it accepted there when it stops standing in: closing a
listener closes no connection. Kept for good, those clients ride on this node
into its next failure, although their address is another node's. So the shell
(:mod:`proxy.listeners`) tells :class:`StandInHandback` about every released
stand-in that still has clients, and drains them (closed at an idle moment,
:mod:`proxy.drain`; they reconnect to the address they dialled) only once the
address's own node serves again:

* the committed map says it is a member, not vacant, not draining (and the map
  is not degraded: then nobody knows);
* and something answers at the address: its own node binds the address again
  after the survivors released it (a node that drained binds when it is
  undrained), so the map saying it serves comes first. The shell probes the
  address (:class:`Probe`) every ``HANDBACK_PROBE_INTERVAL_S`` while the node
  serves, for at most ``HANDBACK_WAIT_S``.

A stand-in is also released when its node was removed from the fleet, or when
the duty moved to another survivor (the identity moved) while its node is
still vacant. Draining then would leave the clients nowhere to go at that
address: the clients stay (:class:`Keep` on removal; clients move on through
Metadata) or the handback waits for the node to serve. Standing in on the same
address again calls it off: the clients are at a held stand-in again.
"""

from __future__ import annotations

import attrs

from membership.serving import ServingMap

#: (vacant node id, listener: BOOTSTRAP or a broker id), as proxy.takeover.TakeoverKey
HandbackKey = tuple[str, int]
#: A listening socket's address as the kernel names it: (IP, port)
SocketAddress = tuple[str, int]

HANDBACK_PROBE_INTERVAL_S = 0.2
# From the map saying the node serves: its own listeners are bound within a
# second or two (an undrain learns the brokers again first); past this the
# address is not reachable from here (or not the node's any more) and the
# clients stay.
HANDBACK_WAIT_S = 30.0


@attrs.frozen(slots=True)
class Probe:
    """Does anything answer at ``address`` now? Report it with :meth:`StandInHandback.answered`."""

    key: HandbackKey
    address: SocketAddress


@attrs.frozen(slots=True)
class HandBack:
    """Drain the clients connected here to ``address``: its own node serves it again."""

    key: HandbackKey
    address: SocketAddress


@attrs.frozen(slots=True)
class Keep:
    """Stop watching ``key``: its clients stay here (``reason`` says why)."""

    key: HandbackKey
    address: SocketAddress
    reason: str


NODE_REMOVED = "the address's node left the fleet"
NO_ANSWER = "the address's node serves, but nothing answered at the address"


def serves(serving: ServingMap, node_id: str) -> bool:
    """The committed map says ``node_id`` serves its own address (see the module doc)."""
    return (serving.epoch > 0 and not serving.degraded and serving.node(node_id) is not None
            and node_id not in serving.vacant and node_id not in serving.draining
            and node_id not in serving.unreachable)


@attrs.define(slots=True)
class _Released:
    address: SocketAddress
    serving_since: float | None = None


class StandInHandback:
    """The released stand-ins whose clients are still here, and what to do about them (pure;
    the caller passes the time)."""

    __slots__ = ("wait_s", "released")

    def __init__(self, wait_s: float = HANDBACK_WAIT_S) -> None:
        self.wait_s = wait_s
        self.released: dict[HandbackKey, _Released] = {}

    @property
    def pending(self) -> bool:
        return bool(self.released)

    def stopped_standing_in(self, key: HandbackKey, address: SocketAddress, clients: int) -> None:
        """The stand-in ``key`` on ``address`` was released with ``clients`` connections on it."""
        if clients > 0:
            self.released[key] = _Released(address)

    def standing_in(self, key: HandbackKey) -> None:
        """Standing in on ``key`` again: its clients are where the map wants them."""
        self.released.pop(key, None)

    def due(self, serving: ServingMap, now: float) -> list[Probe | Keep]:
        """What to do now under ``serving``: probe the addresses whose node serves, keep (and
        forget) those whose node left the fleet or never answered within ``wait_s``. No probe
        among them: nothing to do until the next map."""
        out: list[Probe | Keep] = []
        for key, released in sorted(self.released.items()):
            node = key[0]
            if serving.epoch > 0 and not serving.degraded and serving.node(node) is None:
                out.append(Keep(key, released.address, NODE_REMOVED))
            elif not serves(serving, node):
                released.serving_since = None  # vacant again, or still: wait for it
            elif released.serving_since is None or now - released.serving_since <= self.wait_s:
                if released.serving_since is None:
                    released.serving_since = now
                out.append(Probe(key, released.address))
            else:
                out.append(Keep(key, released.address, NO_ANSWER))
        for action in out:
            if isinstance(action, Keep):
                del self.released[action.key]
        return out

    def answered(self, key: HandbackKey) -> HandBack | None:
        """The probe of ``key``'s address was answered: hand its clients back (None: it was
        called off meanwhile)."""
        released = self.released.pop(key, None)
        return HandBack(key, released.address) if released is not None else None
