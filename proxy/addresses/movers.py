"""The address movers' thin shell: runs the steps of ``proxy.addresses.plan`` (subprocess for
commands, an AF_PACKET socket for raw gratuitous ARP) after the ownership check.

``AddressMover(config)`` is the one class for every kind: what differs is the plan. Each I/O
primitive is injected, so that the mover is tested without root (``tests/unit``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import attrs

from proxy.addresses.config import NETNS, LINUX, NONE, MoverConfig
from proxy.addresses.plan import (FloatingAddress, LinkAddress, RunCommand, SendArp, Step, check_owned,
                                  announce_steps, arp_announce_warning, gratuitous_arp_frame, parse_mac,
                                  release_steps, take_steps)

log = logging.getLogger("kproxy.addresses")

Runner = Callable[[RunCommand, float], "subprocess.CompletedProcess[str]"]


class MoverError(RuntimeError):
    """A step of a take or a release failed (message names the step and the reason)."""


def run_command(step: RunCommand, timeout_s: float) -> "subprocess.CompletedProcess[str]":
    env = {**os.environ, **dict(step.env)} if step.env else None
    return subprocess.run(list(step.argv), env=env, capture_output=True, text=True, timeout=timeout_s)


def read_link_addresses(interface: str) -> list[LinkAddress]:
    """The IPv4 addresses ``interface`` holds now (``ip -j addr show dev IF``)."""
    proc = subprocess.run(["ip", "-j", "-4", "addr", "show", "dev", interface], capture_output=True, text=True,
                          timeout=10)
    if proc.returncode != 0:
        raise MoverError(f"cannot read the addresses of {interface}: {proc.stderr.strip()}")
    out = []
    for link in json.loads(proc.stdout or "[]"):
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                out.append(LinkAddress(ipaddress.IPv4Address(a["local"]), int(a["prefixlen"]),
                                       bool(a.get("secondary", False))))
    return out


def read_mac(interface: str) -> bytes:
    return parse_mac(Path(f"/sys/class/net/{interface}/address").read_text())


def send_frame(interface: str, frame: bytes) -> None:
    """One raw Ethernet frame out of ``interface`` (needs CAP_NET_RAW)."""
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
        s.bind((interface, 0))
        s.send(frame)


def read_arp_announce(interface: str) -> tuple[int, int]:
    """``net.ipv4.conf.all.arp_announce`` and the interface's (this network namespace's)."""
    base = Path("/proc/sys/net/ipv4/conf")
    return (int((base / "all" / "arp_announce").read_text()),
            int((base / interface / "arp_announce").read_text()))


@attrs.define
class AddressMover:
    config: MoverConfig
    run: Runner = run_command
    link_addresses: Callable[[str], list[LinkAddress]] = read_link_addresses
    mac_of: Callable[[str], bytes] = read_mac
    send: Callable[[str, bytes], None] = send_frame
    arp_announce: Callable[[str], tuple[int, int]] = read_arp_announce

    @property
    def kind(self) -> str:
        return self.config.kind

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
