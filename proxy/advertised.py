"""The host:port this node tells clients for each broker identity.

The addresses come from one place, the :class:`membership.serving.ServingMap`
the node serves (the fleet's, or :func:`membership.serving.standalone_map` for
a node without a fleet). The data path adds one local rule: it never
advertises an identity before its listener is bound here. An identity bound
here that the map does not cover yet is advertised at this node's own address
for it (the map's node table, else the node as configured).
"""

from __future__ import annotations

from collections.abc import Iterable

from membership.serving import ServingMap
from topology import ProxyNode


class AdvertisedAddresses:
    """broker id -> (host, port), recomputed when the map or the bound set
    changes; :meth:`address_of` is a dict read (it runs per broker per
    address-carrying response)."""

    __slots__ = ("own", "serving", "bound", "_addresses")

    def __init__(self, own: ProxyNode) -> None:
        self.own = own
        self.serving = ServingMap()
        self.bound: frozenset[int] = frozenset()  # identities this node has listeners for
        self._addresses: dict[int, tuple[str, int]] = {}

    def apply(self, serving: ServingMap) -> None:
        self.serving = serving
        self._recompute()

    def set_bound(self, bound: Iterable[int]) -> None:
        self.bound = frozenset(bound)
        self._recompute()

    def address_of(self, broker_id: int) -> tuple[str, int] | None:
        return self._addresses.get(broker_id)

    def as_dict(self) -> dict[int, tuple[str, int]]:
        return dict(self._addresses)

    def _recompute(self) -> None:
        mapped = self.serving.address_map()
        me = self.serving.node(self.own.id) or self.own
        addresses = {}
        for b in sorted(self.bound):
            address = mapped.get(b)
            if address is None:
                try:
                    address = me.address_for(b)
                except ValueError:  # no port for b in this node's scheme: it cannot be bound either
                    continue
            addresses[b] = address
        self._addresses = addresses
