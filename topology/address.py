"""The address map: which ``host:port`` clients are told for each broker id.

Broker ``b`` owned by proxy node ``P`` is advertised at
``(P.host, P.ports.port_for(b))``. Every node binds a port for *every* known
broker (DESIGN §2.2), so the whole table of ``node x broker`` ports plus every
bootstrap port must be collision free, not only the ports the current
assignment uses: otherwise a later reassignment could give one ``host:port``
to two broker ids. :func:`validate_addresses` checks exactly that (hosts are
compared as case-insensitive strings; two spellings of one host are not
detected).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs

from topology.model import BrokerId, ProxyId, ProxyNode


class AddressConflict(ValueError):
    """Two listeners of the fleet would share one ``host:port``."""


def validate_addresses(nodes: Iterable[ProxyNode], broker_ids: Iterable[int]) -> None:
    """Raise :class:`AddressConflict` (or ``ValueError`` for a port out of range)
    unless every bootstrap port and every ``(node, broker)`` port is distinct."""
    broker_list = sorted(set(broker_ids))
    seen: dict[tuple[str, int], str] = {}
    node_ids: set[str] = set()

    def claim(host: str, port: int, what: str) -> None:
        key = (host.lower(), port)
        other = seen.get(key)
        if other is not None:
            raise AddressConflict(f"{host}:{port} is both {other} and {what}")
        seen[key] = what

    for node in sorted(nodes, key=lambda n: n.id):
        if node.id in node_ids:
            raise ValueError(f"node id {node.id!r} appears twice")
        node_ids.add(node.id)
        claim(node.host, node.bootstrap_port, f"the bootstrap port of {node.id}")
        for b in broker_list:
            claim(node.host, node.ports.port_for(b), f"the port of broker {b} on {node.id}")


@attrs.frozen(slots=True)
class AddressMap:
    """``broker_id -> (host, port)`` for one assignment; build with :meth:`build`."""

    entries: tuple[tuple[BrokerId, tuple[str, int]], ...] = ()

    @classmethod
    def build(
        cls,
        owners: Mapping[BrokerId, ProxyId],
        nodes: Iterable[ProxyNode],
        all_broker_ids: Iterable[int] | None = None,
        *,
        check: bool = True,
    ) -> AddressMap:
        """Addresses for ``owners``. With ``check`` (the default) first validates
        the whole node table against ``all_broker_ids`` (default: the brokers of
        ``owners``) with :func:`validate_addresses`."""
        node_list = list(nodes)
        by_id = {n.id: n for n in node_list}
        if check:
            ids = set(owners) if all_broker_ids is None else set(all_broker_ids) | set(owners)
            validate_addresses(node_list, ids)
        entries = []
        for b, p in sorted(owners.items()):
            node = by_id.get(p)
            if node is None:
                raise ValueError(f"broker {b} is owned by {p!r}, which is not in the node table")
            entries.append((b, node.address_for(b)))
        return cls(tuple(entries))

    def advertised_address(self, broker_id: int) -> tuple[str, int]:
        for b, addr in self.entries:
            if b == broker_id:
                return addr
        raise KeyError(broker_id)

    def as_dict(self) -> dict[BrokerId, tuple[str, int]]:
        return dict(self.entries)
