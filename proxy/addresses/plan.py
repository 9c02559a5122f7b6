"""What taking or releasing a floating address means for each mover, as data (pure).

``take_steps``/``release_steps`` give the steps a mover's shell runs in order: ``SetAddress``
(add or remove an address on a link, by netlink: what ``ip addr replace``/``ip addr del`` do,
without a process per step), ``RunCommand`` (an argv, extra environment, the exit codes that
count as done) and ``SendArp`` (gratuitous ARP frames out of an interface, built by
``gratuitous_arp_frame``). ``check_owned`` is the refusal:
an address outside the configured networks, or (``netns``, ``linux``) not on the network of
an address the interface holds, or the interface's own primary address, is never touched.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterable

import attrs

from proxy.addresses.config import ARPING, COMMAND, LINUX, NETNS, NONE, RAW, MoverConfig

TAKE, RELEASE = "take", "release"
ETH_BROADCAST = b"\xff" * 6
ETH_P_ARP = 0x0806
ETH_P_IP = 0x0800
ARP_REQUEST = 1
MIN_FRAME = 60  # Ethernet minimum without the FCS; a short frame is padded with zeros


class AddressRefused(ValueError):
    """A mover was asked to take or release an address it does not own (message says why)."""


@attrs.frozen
class FloatingAddress:
    ip: ipaddress.IPv4Address
    prefix_len: int
    node: str  # the node whose advertised address this is

    @classmethod
    def parse(cls, text: str, node: str) -> "FloatingAddress":
        """``"198.18.0.11/24"`` (the prefix is the link's network, as ``ip addr`` wants it)."""
        iface = ipaddress.IPv4Interface(text)
        return cls(iface.ip, iface.network.prefixlen, node)

    @property
    def cidr(self) -> str:
        return f"{self.ip}/{self.prefix_len}"


@attrs.frozen
class LinkAddress:
    """One IPv4 address an interface holds (read by netlink, as ``ip -4 addr show dev IF`` lists it)."""

    ip: ipaddress.IPv4Address
    prefix_len: int
    secondary: bool = False

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.ip}/{self.prefix_len}", strict=False)


@attrs.frozen
class RunCommand:
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    ok_codes: tuple[int, ...] = (0,)


@attrs.frozen
class SetAddress:
    """Hold (``present``) or stop holding ``ip/prefix_len`` on ``interface``: an add that finds
    the address there, and a removal that finds it gone, are done, not errors."""

    interface: str
    ip: ipaddress.IPv4Address
    prefix_len: int
    present: bool


@attrs.frozen
class SendArp:
    interface: str
    ip: ipaddress.IPv4Address
    count: int


Step = SetAddress | RunCommand | SendArp


def on_link(ip: ipaddress.IPv4Address, held: Iterable[LinkAddress]) -> bool:
    """``ip`` lies in the network of an address the interface holds."""
    return any(ip in a.network for a in held)


def check_owned(config: MoverConfig, address: FloatingAddress, held: Iterable[LinkAddress] | None) -> None:
    """Raise ``AddressRefused`` unless ``config``'s mover may take or release ``address``;
    ``held``: the addresses of ``config.interface`` now (netns, linux)."""
    if config.kind == NONE:
        return
    if not config.allows(address.ip):
        raise AddressRefused(f"{address.ip} is outside the networks the {config.kind} mover may take "
                             f"({', '.join(map(str, config.networks))})")
    if config.kind in (NETNS, LINUX):
        held = list(held or [])
        if not on_link(address.ip, held):
            raise AddressRefused(f"{address.ip} is not on a link this host holds ({config.interface}: "
                                 f"{', '.join(str(a.network) for a in held) or 'no address'})")
        if any(a.ip == address.ip and not a.secondary for a in held):
            raise AddressRefused(f"{address.ip} is the primary address of {config.interface}, not a floating one")
        if address.prefix_len != next(a.prefix_len for a in held if address.ip in a.network):
            raise AddressRefused(f"{address.cidr}: the prefix differs from the link's network")


# net.ipv4.conf.*.arp_announce = 2: the kernel's ARP requests name the interface's primary
# address as their sender, never a floating one. At 0 (Linux's default) a host asks with the
# source address of the packet that needs resolving: a host that still holds a floating
# address while someone else took it over (a frozen node's kernel retransmitting to its
# clients, a cut-off node at the heal) would point every client's ARP cache back at itself.
ARP_ANNOUNCE_PRIMARY = 2


def arp_announce_warning(config: MoverConfig, all_value: int, interface_value: int) -> str | None:
    """Why this host's ARP settings let a floating address be pulled back, or None. The kernel
    applies the higher of ``all`` and the interface's value."""
    if config.kind not in (NETNS, LINUX) or config.interface is None:
        return None
    value = max(all_value, interface_value)
    if value >= ARP_ANNOUNCE_PRIMARY:
        return None
    return (f"net.ipv4.conf.{config.interface}.arp_announce is {value}: set it to {ARP_ANNOUNCE_PRIMARY} "
            f"(sysctl -w net.ipv4.conf.{config.interface}.arp_announce={ARP_ANNOUNCE_PRIMARY}), or this "
            "host's ARP requests may send the clients of a floating address it no longer serves back to it")


def take_steps(config: MoverConfig, address: FloatingAddress) -> list[Step]:
    """Add ``address`` on this host and announce it."""
    if config.kind == NONE:
        return []
    if config.kind == COMMAND:
        return [_script(config, TAKE, address)]
    assert config.interface is not None
    return [SetAddress(config.interface, address.ip, address.prefix_len, present=True),
            *announce_steps(config, address)]


def announce_steps(config: MoverConfig, address: FloatingAddress) -> list[Step]:
    """Announce ``address`` (gratuitous ARP) on the link that holds it; nothing for the command
    mover (the operator's script announces, if its network needs it) and for none."""
    if config.kind in (NONE, COMMAND) or config.interface is None:
        return []
    if config.announce == ARPING:
        return [RunCommand(("arping", "-U", "-c", str(config.announce_count), "-I", config.interface,
                            str(address.ip)))]
    if config.announce == RAW:
        return [SendArp(config.interface, address.ip, config.announce_count)]
    return []


def release_steps(config: MoverConfig, address: FloatingAddress) -> list[Step]:
    """Remove ``address`` from this host (nothing to announce: its owner announces it)."""
    if config.kind == NONE:
        return []
    if config.kind == COMMAND:
        return [_script(config, RELEASE, address)]
    assert config.interface is not None
    return [SetAddress(config.interface, address.ip, address.prefix_len, present=False)]


def _script(config: MoverConfig, action: str, address: FloatingAddress) -> RunCommand:
    env = (("KPROXY_ACTION", action), ("KPROXY_ADDRESS", str(address.ip)),
           ("KPROXY_PREFIX_LEN", str(address.prefix_len)), ("KPROXY_NODE", address.node),
           ("KPROXY_INTERFACE", config.interface or ""))
    return RunCommand((*config.command, action, address.cidr, address.node), env)


def gratuitous_arp_frame(mac: bytes, ip: ipaddress.IPv4Address) -> bytes:
    """A broadcast ARP request for ``ip`` from ``ip`` (sender = target: RFC 5227's announcement),
    so that every neighbour updates its cache to ``mac``; padded to the Ethernet minimum."""
    if len(mac) != 6:
        raise ValueError(f"a MAC address has 6 bytes, got {len(mac)}")
    addr = ip.packed
    ethernet = ETH_BROADCAST + mac + struct.pack("!H", ETH_P_ARP)
    arp = struct.pack("!HHBBH", 1, ETH_P_IP, 6, 4, ARP_REQUEST) + mac + addr + b"\x00" * 6 + addr
    frame = ethernet + arp
    return frame + b"\x00" * (MIN_FRAME - len(frame))


def parse_mac(text: str) -> bytes:
    """``"02:fc:00:00:00:01"`` -> 6 bytes."""
    parts = text.strip().split(":")
    if len(parts) != 6:
        raise ValueError(f"not a MAC address: {text!r}")
    return bytes(int(p, 16) for p in parts)
