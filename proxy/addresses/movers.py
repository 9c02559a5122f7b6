"""The address movers' thin shell: runs the steps of ``proxy.addresses.plan`` (netlink through
pyroute2 for a link's addresses, subprocess for commands, an AF_PACKET socket for raw gratuitous
ARP) after the ownership check.

Netlink, not ``ip addr``: a takeover is on the failover's critical path, and a process per step
cost 3-9 ms on a quiet machine and up to ~100 ms under load (two per take: the ownership check's
read and the add), against 0.6-2 ms for the same requests over netlink. The larger cost was the
gratuitous ARP's socket (``send_frame``). The netlink socket is kept open too (:class:`Netlink`):
pyroute2's ``IPRoute()`` runs its own event loop per instance, and opening one per request (from
the loop's default executor) made a take cost 6 ms p50 on a quiet machine and 31 ms from a
process whose loop was busy 80% of the time, against 2.4 and 11 ms on one socket kept open in a
thread of its own: every blocking call hands the GIL back and forth, which a busy loop makes
dear (BENCHMARKS.md, session 27).

``AddressMover(config)`` is the one class for every kind: what differs is the plan. Each I/O
primitive is injected, so that the mover is tested without root (``tests/unit``).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs

from proxy.addresses.config import NETNS, LINUX, NONE, MoverConfig
from proxy.addresses.plan import (FloatingAddress, LinkAddress, RunCommand, SendArp, SetAddress, Step, check_owned,
                                  announce_steps, arp_announce_warning, gratuitous_arp_frame, parse_mac,
                                  release_steps, take_steps)

if TYPE_CHECKING:
    from pyroute2 import IPRoute

log = logging.getLogger("kproxy.addresses")

Runner = Callable[[RunCommand, float], "subprocess.CompletedProcess[str]"]


class MoverError(RuntimeError):
    """A step of a take or a release failed (message names the step and the reason)."""


def run_command(step: RunCommand, timeout_s: float) -> "subprocess.CompletedProcess[str]":
    env = {**os.environ, **dict(step.env)} if step.env else None
    return subprocess.run(list(step.argv), env=env, capture_output=True, text=True, timeout=timeout_s)


# ifa_flags: an address added to a network the link already has an address on.
IFA_F_SECONDARY = 0x01


def _link_index(interface: str) -> int:
    """The link's index now (an ioctl, not netlink: a link made again gets a new one)."""
    try:
        return socket.if_nametoindex(interface)
    except OSError:
        raise MoverError(f"no link named {interface} on this host") from None


T = TypeVar("T")


class Netlink:
    """One rtnetlink socket (pyroute2's ``IPRoute``), opened at the first request and kept. A
    request that fails on the socket itself (not a kernel's answer, ``NetlinkError``) closes it
    and is tried once more on a new one."""

    def __init__(self) -> None:
        self._ipr: IPRoute | None = None
        self._lock = threading.Lock()

    def call(self, interface: str, request: Callable[["IPRoute", int], T]) -> T:
        """``request(ipr, index of interface)``; raises pyroute2's ``NetlinkError`` for the kernel's
        refusals, ``MoverError`` when there is no such link."""
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with self._lock:
            index = _link_index(interface)
            for attempt in range(2):
                if self._ipr is None:
                    self._ipr = IPRoute()
                try:
                    return request(self._ipr, index)
                except NetlinkError:
                    raise
                except Exception:  # noqa: BLE001 - the socket itself: open a new one, once
                    self._close_locked()
                    if attempt:
                        raise
            raise AssertionError("unreachable")  # pragma: no cover

    def _close_locked(self) -> None:
        ipr, self._ipr = self._ipr, None
        if ipr is not None:
            try:
                ipr.close()
            except Exception:  # noqa: BLE001 - closing a broken socket
                pass


_netlink = Netlink()


def read_link_addresses(interface: str) -> list[LinkAddress]:
    """The IPv4 addresses ``interface`` holds now (netlink; what ``ip -4 addr show dev IF`` lists)."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        messages = _netlink.call(interface, lambda ipr, index: ipr.get_addr(index=index, family=socket.AF_INET))
    except NetlinkError as exc:
        raise MoverError(f"cannot read the addresses of {interface}: {exc}") from exc
    out = []
    for m in messages:
        local = m.get_attr("IFA_LOCAL") or m.get_attr("IFA_ADDRESS")
        if local is not None:
            out.append(LinkAddress(ipaddress.IPv4Address(local), int(m["prefixlen"]),
                                   bool(int(m["flags"]) & IFA_F_SECONDARY)))
    return out


def set_address(step: SetAddress) -> None:
    """Add (replace: already there is done) or delete (already gone is done) an address, by netlink."""
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        _netlink.call(step.interface, lambda ipr, index: ipr.addr(
            "replace" if step.present else "del", index=index, address=str(step.ip), prefixlen=step.prefix_len))
    except NetlinkError as exc:
        if not step.present and exc.code == errno.EADDRNOTAVAIL:
            return
        verb = "add" if step.present else "delete"
        raise MoverError(f"{verb} {step.ip}/{step.prefix_len} on {step.interface}: {exc}") from exc


def read_mac(interface: str) -> bytes:
    return parse_mac(Path(f"/sys/class/net/{interface}/address").read_text())


# One AF_PACKET socket per interface, kept open: opening, binding and closing one costs ~16 ms
# (measured in a namespace; the kernel waits out an RCU grace period), which a take paid per
# gratuitous ARP frame, twice, on the failover's critical path. Protocol 0: it sends, and
# receives nothing, so an idle one holds no buffer.
_packet_sockets: dict[str, socket.socket] = {}
_packet_lock = threading.Lock()


def _packet_socket_locked(interface: str) -> socket.socket:
    s = _packet_sockets.get(interface)
    if s is None:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        try:
            s.bind((interface, 0))
        except OSError:
            s.close()
            raise
        _packet_sockets[interface] = s
    return s


def open_packet_socket(interface: str) -> None:
    """Open (and keep) the interface's socket for gratuitous ARP frames now (needs CAP_NET_RAW)."""
    with _packet_lock:
        _packet_socket_locked(interface)


def send_frame(interface: str, frame: bytes) -> None:
    """One raw Ethernet frame out of ``interface`` (needs CAP_NET_RAW). A send that fails closes
    the interface's socket (the link may have gone or come back as another): the next opens anew."""
    with _packet_lock:
        s = _packet_socket_locked(interface)
        try:
            s.send(frame)
        except OSError:
            del _packet_sockets[interface]
            s.close()
            raise


def read_arp_announce(interface: str) -> tuple[int, int]:
    """``net.ipv4.conf.all.arp_announce`` and the interface's (this network namespace's)."""
    base = Path("/proc/sys/net/ipv4/conf")
    return (int((base / "all" / "arp_announce").read_text()),
            int((base / interface / "arp_announce").read_text()))


@attrs.define
class AddressMover:
    config: MoverConfig
    run: Runner = run_command
    set_address: Callable[[SetAddress], None] = set_address
    link_addresses: Callable[[str], list[LinkAddress]] = read_link_addresses
    mac_of: Callable[[str], bytes] = read_mac
    send: Callable[[str, bytes], None] = send_frame
    arp_announce: Callable[[str], tuple[int, int]] = read_arp_announce
    open_sender: Callable[[str], None] = open_packet_socket

    @property
    def kind(self) -> str:
        return self.config.kind

    def prepare(self) -> None:
        """Open now what a take uses (``netns``/``linux``: pyroute2, imported, and its netlink
        socket; the link's MAC; the ARP socket). A node's first take paid for them: 0.4-1.9 s in a
        node just restarted (emulated hosts, session 27's kill drills), the time between the
        survivor giving its address back and this node holding it, in which the address is
        on no host and its clients' SYNs go unanswered (retried after 1 s). Raises what they
        raise (``OSError``, ``MoverError``); the caller logs it."""
        if self.config.kind not in (NETNS, LINUX) or self.config.interface is None:
            return
        self.link_addresses(self.config.interface)
        self.mac_of(self.config.interface)
        self.open_sender(self.config.interface)

    def take(self, address: FloatingAddress) -> None:
        """Hold ``address`` on this host and announce it (``AddressRefused`` if not ours to take)."""
        self._check(address)
        self._execute(take_steps(self.config, address))
        if self.config.kind != NONE:
            log.info("took a floating address", extra={"address": address.cidr, "node": address.node,
                                                       "mover": self.config.kind})

    def announce(self, address: FloatingAddress) -> None:
        """Announce ``address`` again (gratuitous ARP); only while this host holds it."""
        self._check(address)
        self._execute(announce_steps(self.config, address))

    def release(self, address: FloatingAddress) -> None:
        """Stop holding ``address`` (done if it is already gone)."""
        self._check(address)
        self._execute(release_steps(self.config, address))
        if self.config.kind != NONE:
            log.info("released a floating address", extra={"address": address.cidr, "node": address.node,
                                                            "mover": self.config.kind})

    def held_floating(self) -> list[ipaddress.IPv4Address]:
        """The floating addresses this host's link holds now (``netns``/``linux``: its secondary
        addresses inside the configured networks, the only ones a mover takes); none for the
        other kinds, which cannot tell (a ``command`` mover's cloud call moves an address whole)."""
        if self.config.kind not in (NETNS, LINUX) or self.config.interface is None:
            return []
        return [a.ip for a in self.link_addresses(self.config.interface) if a.secondary and self.config.allows(a.ip)]

    def host_warning(self) -> str | None:
        """What in this host's settings works against moving addresses (logged at start), or None."""
        if self.config.kind not in (NETNS, LINUX) or self.config.interface is None:
            return None
        try:
            all_value, if_value = self.arp_announce(self.config.interface)
        except (OSError, ValueError) as exc:
            return f"cannot read the arp_announce of {self.config.interface}: {exc}"
        return arp_announce_warning(self.config, all_value, if_value)

    def _check(self, address: FloatingAddress) -> None:
        held = None
        if self.config.kind in (NETNS, LINUX):
            assert self.config.interface is not None
            held = self.link_addresses(self.config.interface)
        check_owned(self.config, address, held)

    def _execute(self, steps: list[Step]) -> None:
        for step in steps:
            if isinstance(step, SetAddress):
                try:
                    self.set_address(step)
                except OSError as exc:
                    raise MoverError(f"{'add' if step.present else 'delete'} {step.ip}/{step.prefix_len} on "
                                     f"{step.interface}: {exc}") from exc
                continue
            if isinstance(step, SendArp):
                frame = gratuitous_arp_frame(self.mac_of(step.interface), step.ip)
                try:
                    for _ in range(step.count):
                        self.send(step.interface, frame)
                except OSError as exc:
                    raise MoverError(f"gratuitous ARP for {step.ip} on {step.interface}: {exc}") from exc
                continue
            try:
                proc = self.run(step, self.config.timeout_s)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise MoverError(f"{' '.join(step.argv)}: {exc}") from exc
            if proc.returncode not in step.ok_codes:
                raise MoverError(f"{' '.join(step.argv)} exited {proc.returncode}: "
                                 f"{(proc.stderr or proc.stdout or '').strip()[:500]}")


def build_mover(config: MoverConfig) -> AddressMover:
    """The mover a node's config asks for, with the real I/O."""
    return AddressMover(config)
