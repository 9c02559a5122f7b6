"""The ``[addresses]`` table of a node's config: which mover, on which link, for which networks.

Pure: parses a mapping (as ``tomllib`` gives it) into a ``MoverConfig`` or raises
``MoverConfigError`` naming the key at fault.

    [addresses]
    mover = "linux"                 # none | netns | linux | command
    interface = "eth0"              # netns, linux: the link that carries the floating addresses
    networks = ["10.0.1.0/24"]      # linux, command: the only networks a mover may take from
    announce = "arping"             # netns, linux: arping | raw | none (gratuitous ARP)
    announce_count = 2              # gratuitous ARPs sent per take
    command = ["/usr/local/bin/move-ip"]   # command: argv of the operator's script
    timeout_s = 10.0                # one step (a command, an arping) at most this long
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Mapping
from typing import Any

import attrs

NONE, NETNS, LINUX, COMMAND = "none", "netns", "linux", "command"
MOVER_KINDS = (NONE, NETNS, LINUX, COMMAND)
ARPING, RAW, NO_ANNOUNCE = "arping", "raw", "none"
ANNOUNCE_KINDS = (ARPING, RAW, NO_ANNOUNCE)
# The emulated hosts' range (RFC 2544 benchmarking addresses): the netns mover takes nothing else.
TEST_RANGE = ipaddress.ip_network("198.18.0.0/24")
NETNS_INTERFACE = "eth0"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_ANNOUNCE_COUNT = 2
MAX_ANNOUNCE_COUNT = 10
KEYS = frozenset({"mover", "interface", "networks", "announce", "announce_count", "command", "timeout_s"})


class MoverConfigError(ValueError):
    """The ``[addresses]`` table is wrong (message names the key)."""


@attrs.frozen
class MoverConfig:
    kind: str = NONE
    interface: str | None = None
    networks: tuple[ipaddress.IPv4Network, ...] = ()
    announce: str = NO_ANNOUNCE
    announce_count: int = DEFAULT_ANNOUNCE_COUNT
    command: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S

    def allows(self, ip: ipaddress.IPv4Address) -> bool:
        """``ip`` lies in one of the configured networks."""
        return any(ip in net for net in self.networks)


def parse_mover_config(table: Mapping[str, Any] | None) -> MoverConfig:
    """The mover of an ``[addresses]`` table; no table is the ``none`` mover."""
    if not table:
        return MoverConfig()
    unknown = sorted(set(table) - KEYS)
    if unknown:
        raise MoverConfigError(f"addresses: unknown keys {unknown} (known: {sorted(KEYS)})")
    kind = table.get("mover", NONE)
    if kind not in MOVER_KINDS:
        raise MoverConfigError(f"addresses.mover: {kind!r} is not one of {', '.join(MOVER_KINDS)}")
    timeout_s = _positive_float(table, "timeout_s", DEFAULT_TIMEOUT_S)
    count = table.get("announce_count", DEFAULT_ANNOUNCE_COUNT)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_ANNOUNCE_COUNT:
        raise MoverConfigError(f"addresses.announce_count: an integer from 1 to {MAX_ANNOUNCE_COUNT}, got {count!r}")
    if kind == NONE:
        extra = sorted(set(table) - {"mover"})
        if extra:
            raise MoverConfigError(f"addresses: mover 'none' moves nothing; remove {extra}")
        return MoverConfig()
    networks = _networks(table.get("networks"))
    if kind == NETNS:
        networks = networks or (TEST_RANGE,)
        outside = [str(n) for n in networks if not n.subnet_of(TEST_RANGE)]
        if outside:
            raise MoverConfigError(f"addresses.networks: the netns mover takes only {TEST_RANGE}, not {outside}")
        return MoverConfig(NETNS, _interface(table, NETNS_INTERFACE), networks, _announce(table, RAW), count,
                           (), timeout_s)
    if not networks:
        raise MoverConfigError(f"addresses.networks: the {kind} mover needs the networks it may take addresses from")
    if kind == LINUX:
        return MoverConfig(LINUX, _interface(table, None), networks, _announce(table, ARPING), count, (), timeout_s)
    command = table.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
        raise MoverConfigError("addresses.command: the operator's script as a list of strings (or one string)")
    return MoverConfig(COMMAND, table.get("interface"), networks, NO_ANNOUNCE, count, tuple(command), timeout_s)


def _positive_float(table: Mapping[str, Any], key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise MoverConfigError(f"addresses.{key}: a positive number, got {value!r}")
    return float(value)


def _interface(table: Mapping[str, Any], default: str | None) -> str:
    name = table.get("interface", default)
    # Linux interface names: 1 to 15 bytes, no slash, no whitespace (dev_valid_name).
    if not isinstance(name, str) or not 0 < len(name) <= 15 or "/" in name or any(c.isspace() for c in name):
        raise MoverConfigError(f"addresses.interface: a network interface name, got {name!r}")
    return name


def _announce(table: Mapping[str, Any], default: str) -> str:
    value = table.get("announce", default)
    if value not in ANNOUNCE_KINDS:
        raise MoverConfigError(f"addresses.announce: {value!r} is not one of {', '.join(ANNOUNCE_KINDS)}")
    return value


def _networks(value: Any) -> tuple[ipaddress.IPv4Network, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MoverConfigError(f"addresses.networks: a list of IPv4 networks (\"10.0.1.0/24\"), got {value!r}")
    out = []
    for v in value:
        try:
            out.append(ipaddress.IPv4Network(v))
        except ValueError as exc:
            raise MoverConfigError(f"addresses.networks: {v!r}: {exc}") from None
    return tuple(out)
