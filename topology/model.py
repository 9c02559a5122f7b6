"""Pure data of the fleet: ids, brokers, proxy nodes, port schemes, assignments.

Every class is an attrs frozen, slotted class whose fields are themselves
immutable (tuples, frozensets), so values can be shared between threads,
pickled into the Raft log and compared for equality without copying.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NewType

import attrs

#: A Kafka broker's node id (``broker.id`` / ``node.id``); clients see it as is.
BrokerId = NewType("BrokerId", int)
#: The name of one proxy node of the fleet (``"p1"``, ``"proxy-a"``, ...).
ProxyId = NewType("ProxyId", str)

MIN_PORT = 1
MAX_PORT = 65535


def _check_port(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PORT <= value <= MAX_PORT:
        raise ValueError(f"{what} must be an int in {MIN_PORT}..{MAX_PORT}, got {value!r}")


def _check_broker_id(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"broker id must be an int >= 0, got {value!r}")


def _check_proxy_id(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value or value != value.strip():
        raise ValueError(f"proxy id must be a non-empty string without surrounding spaces, got {value!r}")


def _check_host(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"host must be a non-empty string without spaces, got {value!r}")


def _check_port_attr(_inst: object, attr: attrs.Attribute, value: int) -> None:
    _check_port(value, attr.name)


def _check_rack(_inst: object, _attr: attrs.Attribute, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"rack must be None or a non-empty string, got {value!r}")


def _freeze_ports(value: Mapping[int, int] | Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((int(b), int(p)) for b, p in items))


@attrs.frozen(slots=True)
class Broker:
    """One upstream Kafka broker as its Metadata describes it."""

    id: BrokerId = attrs.field(validator=_check_broker_id)
    host: str = attrs.field(validator=_check_host)
    port: int = attrs.field(validator=_check_port_attr)
    rack: str | None = attrs.field(default=None, validator=_check_rack)


@attrs.frozen(slots=True)
class PortScheme:
    """How one proxy node numbers the port it binds for each broker identity.

    ``port_for(b)`` is ``explicit[b]`` when the explicit map names ``b``,
    otherwise ``base + b``. A scheme with neither cannot serve any broker.
    Ports outside 1..65535 (``base`` too large for a broker id) are an error
    reported by :func:`port_for` and by ``topology.address.validate_addresses``.
    """

    base: int | None = None
    explicit: tuple[tuple[int, int], ...] = attrs.field(default=(), converter=_freeze_ports)

    def __attrs_post_init__(self) -> None:
        if self.base is not None:
            _check_port(self.base, "port base")
        seen_b: set[int] = set()
        seen_p: set[int] = set()
        for b, p in self.explicit:
            _check_broker_id(None, None, b)  # type: ignore[arg-type]
            _check_port(p, f"explicit port of broker {b}")
            if b in seen_b:
                raise ValueError(f"broker {b} appears twice in the explicit port map")
            if p in seen_p:
                raise ValueError(f"port {p} appears twice in the explicit port map")
            seen_b.add(b)
            seen_p.add(p)

    @classmethod
    def offset(cls, base: int) -> PortScheme:
        return cls(base=base)

    @classmethod
    def explicit_map(cls, ports: Mapping[int, int], base: int | None = None) -> PortScheme:
        return cls(base=base, explicit=ports)

    def port_for(self, broker_id: int) -> int:
        for b, p in self.explicit:
            if b == broker_id:
                return p
        if self.base is None:
            raise ValueError(f"port scheme {self!r} has no port for broker {broker_id}")
        port = self.base + broker_id
        _check_port(port, f"port of broker {broker_id} (base {self.base} + id)")
        return port


def _default_ports(node: ProxyNode) -> PortScheme:
    return PortScheme(base=node.bootstrap_port + 1)


@attrs.frozen(slots=True)
class ProxyNode:
    """One proxy of the fleet as clients see it.

    ``host`` is the address it advertises: what clients and the other nodes dial
    (the node may bind another, such as 0.0.0.0 behind NAT: ``nodes[].host``
    in proxy.config; ``nodes[].advertised_host`` becomes this), ``bootstrap_port`` the port clients bootstrap on, and
    ``ports`` the port it binds for each broker identity. The default scheme is
    ``bootstrap_port + 1 + broker_id``.
    """

    id: ProxyId = attrs.field(validator=_check_proxy_id)
    host: str = attrs.field(validator=_check_host)
    bootstrap_port: int = attrs.field(validator=_check_port_attr)
    rack: str | None = attrs.field(default=None, validator=_check_rack)
    ports: PortScheme = attrs.field(
        default=attrs.Factory(_default_ports, takes_self=True),
        validator=attrs.validators.instance_of(PortScheme),
    )

    def address_for(self, broker_id: int) -> tuple[str, int]:
        return (self.host, self.ports.port_for(broker_id))


def freeze_owners(
    value: Mapping[int, str] | Iterable[tuple[int, str]],
) -> tuple[tuple[BrokerId, ProxyId], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    pairs = tuple(sorted((BrokerId(int(b)), ProxyId(str(p))) for b, p in items))
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if a == b:
            raise ValueError(f"broker {a} has two owners")
    return pairs


@attrs.frozen(slots=True)
class Assignment:
    """``broker_id -> proxy_id`` at one epoch. Immutable; ``as_dict()`` copies."""

    epoch: int
    owners: tuple[tuple[BrokerId, ProxyId], ...] = attrs.field(default=(), converter=freeze_owners)

    def as_dict(self) -> dict[BrokerId, ProxyId]:
        return dict(self.owners)

    def owner(self, broker_id: int) -> ProxyId | None:
        for b, p in self.owners:
            if b == broker_id:
                return p
        return None

    def loads(self) -> dict[ProxyId, int]:
        counts: dict[ProxyId, int] = {}
        for _, p in self.owners:
            counts[p] = counts.get(p, 0) + 1
        return counts
