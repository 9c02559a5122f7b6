"""Emulated hosts: Linux network namespaces on one bridge, so that each proxy node, the Kafka
brokers and the drill clients live on a "host" of their own (``kproxy fleet up --hosts netns``).

Theory of operation
-------------------
``plan_hosts`` is pure: from a tag (short, derived from the fleet's state dir) and the node ids
it names one namespace per host, the veth pair that plugs it into the bridge, and its address.
Addresses come only from the benchmarking range ``SUBNET`` (198.18.0.0/24, RFC 2544):

  .1    the bridge itself, in the root namespace: the harness (admin calls, the final read)
  .2    ``kafka``: every broker, one port each (as on loopback)
  .3    ``clients``: the drill's workload processes
  .11+  ``p1``, ``p2``, …: each node's floating address, the one it advertises (the nodes take
        them with the ``netns`` address mover, proxy.addresses; a survivor takes a down node's)
  .111+ ``p1``, ``p2``, …: each node's host's own address (Raft, admin, upstream connections)

A node's host lets processes bind addresses it does not hold (``net.ipv4.ip_nonlocal_bind``), so
that a node binds its listeners before its floating address is on its link.

``HostNet`` is the thin I/O shell: it runs the plan's ``ip`` commands (``setup_commands``,
``teardown_commands``), refuses to start when any link already carries an address of the range
(another fleet, or something that is not ours), rolls back what it made when a step fails, and
reports what is still left of a plan (``leftovers``) so that tests can show ``fleet down``
removed every namespace, link and address. A process runs on a host through
``exec_prefix(host)`` (``ip netns exec NS …``: it execs the command, so the PID is the
command's). Each namespace gets its own ``lo`` up and its end of the veth, renamed ``eth0``.

``require_owned`` is the guard: the launcher refuses an address that is not on a link this plan
creates, so nothing is ever sent to an address outside the range the test made.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from proxy.addresses.config import TEST_RANGE
from proxy.addresses.plan import ARP_ANNOUNCE_PRIMARY

SUBNET = TEST_RANGE  # the netns address mover takes addresses of this range only
BRIDGE_HOST = 1
KAFKA_HOST = 2
CLIENTS_HOST = 3
FIRST_NODE_HOST = 11  # the nodes' floating addresses
FIRST_NODE_OWN = 111  # the nodes' hosts' own addresses
KAFKA = "kafka"
CLIENTS = "clients"
IFNAMSIZ = 15  # longest Linux interface name
INNER_LINK = "eth0"  # the namespace's end of its veth pair
REMOVE_TIMEOUT_S = 10.0

LOOPBACK = "loopback"
NETNS = "netns"
HOST_MODES = (LOOPBACK, NETNS)


class HostsError(RuntimeError):
    """The emulated hosts could not be planned, made or removed (message says why)."""


@attrs.frozen
class Host:
    name: str  # "kafka", "clients", or a node id
    namespace: str
    veth: str  # the root namespace's end of the pair, a port of the bridge
    address: str
    floating: str | None = None  # a node's advertised address (moves between node hosts)


@attrs.frozen
class HostPlan:
    tag: str
    bridge: str
    bridge_address: str
    hosts: tuple[Host, ...]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise HostsError(f"no host {name!r} in the plan (hosts: {[h.name for h in self.hosts]})")

    @property
    def addresses(self) -> frozenset[str]:
        """Every address on a link this plan creates."""
        return frozenset({self.bridge_address, *(h.address for h in self.hosts),
                          *(h.floating for h in self.hosts if h.floating)})

    def require_owned(self, address: str) -> str:
        """``address`` (a bare IP or ``host:port``) if it is on a link of this plan, else HostsError."""
        ip = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
        if ip not in self.addresses:
            raise HostsError(f"refusing {address}: not an address on a link the launcher created "
                             f"({', '.join(sorted(self.addresses, key=ipaddress.ip_address))})")
        return address

    def exec_prefix(self, name: str) -> tuple[str, ...]:
        """The command prefix that runs a process on host ``name``."""
        return ("ip", "netns", "exec", self.host(name).namespace)

    def setup_commands(self) -> list[list[str]]:
        plen = SUBNET.prefixlen
        cmds = [["ip", "link", "add", self.bridge, "type", "bridge"],
                ["ip", "addr", "add", f"{self.bridge_address}/{plen}", "dev", self.bridge],
                ["ip", "link", "set", self.bridge, "up"]]
        for h in self.hosts:
            cmds += [["ip", "netns", "add", h.namespace],
                     ["ip", "-n", h.namespace, "link", "set", "lo", "up"],
                     ["ip", "link", "add", h.veth, "type", "veth", "peer", "name", INNER_LINK, "netns", h.namespace],
                     ["ip", "link", "set", h.veth, "master", self.bridge],
                     ["ip", "link", "set", h.veth, "up"],
                     ["ip", "-n", h.namespace, "addr", "add", f"{h.address}/{plen}", "dev", INNER_LINK],
                     ["ip", "-n", h.namespace, "link", "set", INNER_LINK, "up"]]
            if h.floating:  # a node's host: what README's "Floating addresses" asks of a real one
                cmds.append(["ip", "netns", "exec", h.namespace, "sysctl", "-qw", "net.ipv4.ip_nonlocal_bind=1",
                             f"net.ipv4.conf.all.arp_announce={ARP_ANNOUNCE_PRIMARY}"])
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Each veth pair first (deleting one end deletes both, at once; a deleted namespace
        frees its links only later, in the kernel's own time), then the namespaces, then the
        bridge, which takes its address with it."""
        return [*(["ip", "link", "delete", h.veth] for h in self.hosts),
                *(["ip", "netns", "delete", h.namespace] for h in self.hosts),
                ["ip", "link", "delete", self.bridge]]

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HostPlan":
        return cls(data["tag"], data["bridge"], data["bridge_address"], tuple(Host(**h) for h in data["hosts"]))


def tag_for(state_dir: str | os.PathLike[str]) -> str:
    """A short tag naming one fleet's namespaces and links: ``kp`` + 5 hex digits of its state dir."""
    return "kp" + hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:5]


def plan_hosts(tag: str, node_ids: Sequence[str]) -> HostPlan:
    """The namespaces, links and addresses of a fleet (see the module docstring)."""
    if not node_ids:
        raise HostsError("no proxy nodes to place")
    if FIRST_NODE_HOST + len(node_ids) > FIRST_NODE_OWN or FIRST_NODE_OWN + len(node_ids) >= SUBNET.num_addresses - 1:
        raise HostsError(f"{len(node_ids)} nodes do not fit in {SUBNET}")
    names = [(KAFKA, KAFKA_HOST, None), (CLIENTS, CLIENTS_HOST, None),
             *((n, FIRST_NODE_OWN + i, FIRST_NODE_HOST + i) for i, n in enumerate(node_ids))]
    hosts = []
    for name, offset, floating in names:
        link = f"{tag}-{name}"
        if len(link) > IFNAMSIZ:
            raise HostsError(f"link name {link!r} is longer than {IFNAMSIZ} characters")
        hosts.append(Host(name, namespace=link, veth=link, address=str(SUBNET[offset]),
                          floating=str(SUBNET[floating]) if floating is not None else None))
    bridge = f"{tag}-br"
    if len({h.name for h in hosts}) != len(hosts) or bridge in {h.veth for h in hosts}:
        raise HostsError(f"host names collide: {[h.name for h in hosts]}")
    return HostPlan(tag, bridge, str(SUBNET[BRIDGE_HOST]), tuple(hosts))


# --------------------------------------------------------------------- I/O
Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def run_command(cmd: list[str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@attrs.define
class HostNet:
    """Makes and removes the hosts of a plan with the ``ip`` command (needs CAP_NET_ADMIN)."""

    plan: HostPlan
    run: Runner = run_command
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def _ip_json(self, *args: str) -> list[dict[str, Any]]:
        proc = self.run(["ip", "-j", *args])
        if proc.returncode != 0:
            raise HostsError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
        return json.loads(proc.stdout or "[]")

    def _range_in_use(self, links: set[str] | None = None) -> list[str]:
        """``link address`` for every address of ``SUBNET`` on a link of the root namespace (of
        ``links`` only, when given)."""
        out = []
        for link in self._ip_json("addr", "show"):
            if links is not None and link["ifname"] not in links:
                continue
            for a in link.get("addr_info", []):
                if a.get("family") == "inet" and ipaddress.ip_address(a["local"]) in SUBNET:
                    out.append(f"{link['ifname']} {a['local']}")
        return out

    def namespaces(self) -> set[str]:
        return {n["name"] for n in self._ip_json("netns", "list")}

    def links(self) -> set[str]:
        return {link["ifname"] for link in self._ip_json("link", "show")}

    def create(self) -> "HostNet":
        """Every namespace, link and address of the plan; on failure, nothing of it is left."""
        taken = self._range_in_use()
        if taken:
            raise HostsError(f"addresses of {SUBNET} are already in use ({', '.join(taken)}): another emulated "
                             "fleet is up (kproxy fleet down) or the range is used by something not ours")
        clash = ({h.namespace for h in self.plan.hosts} & self.namespaces()) | (
            ({h.veth for h in self.plan.hosts} | {self.plan.bridge}) & self.links())
        if clash:
            raise HostsError(f"namespaces or links {sorted(clash)} already exist: left from an earlier fleet "
                             "(kproxy fleet down --state-dir …) or not ours")
        try:
            for cmd in self.plan.setup_commands():
                proc = self.run(cmd)
                if proc.returncode != 0:
                    raise HostsError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self, timeout_s: float = REMOVE_TIMEOUT_S) -> list[str]:
        """Delete what the plan made (what is already gone is fine); return what is still left
        after ``timeout_s`` (the kernel frees a deleted namespace's links asynchronously)."""
        namespaces, links = self.namespaces(), self.links()
        for cmd in self.plan.teardown_commands():
            name = cmd[-1]
            if (cmd[1] == "netns" and name in namespaces) or (cmd[1] == "link" and name in links):
                self.run(cmd)
        deadline = self.clock() + timeout_s
        while (left := self.leftovers()) and self.clock() < deadline:
            self.sleep(0.05)
        return left

    def holders(self) -> dict[str, list[str]]:
        """Each floating address of the plan -> the node hosts whose link holds it now (the
        truth the address movers act on: one host each, except for a moment during a move).
        One shell for every host (about 15 ms): fault-to-moved times are polled with it."""
        nodes = [h for h in self.plan.hosts if h.floating]
        script = "; ".join(f"echo @{h.name}; ip -n {h.namespace} -o -4 addr show dev {INNER_LINK}" for h in nodes)
        proc = self.run(["sh", "-c", script])
        out: dict[str, list[str]] = {str(h.floating): [] for h in nodes}
        host = None
        for line in proc.stdout.splitlines():
            if line.startswith("@"):
                host = line[1:]
                continue
            words = line.split()
            if host is not None and "inet" in words:
                ip = words[words.index("inet") + 1].split("/")[0]
                if ip in out:
                    out[ip].append(host)
        return out

    def mac_of(self, name: str) -> str:
        """The MAC address of host ``name``'s link (to tell which host answered ARP)."""
        links = self._ip_json("-n", self.plan.host(name).namespace, "link", "show", "dev", INNER_LINK)
        return str(links[0]["address"])

    def pids(self, name: str) -> list[int]:
        """Every process running on host ``name`` (``ip netns pids``)."""
        proc = self.run(["ip", "netns", "pids", self.plan.host(name).namespace])
        if proc.returncode != 0:
            raise HostsError(f"ip netns pids {self.plan.host(name).namespace}: {proc.stderr.strip()}")
        return [int(p) for p in proc.stdout.split()]

    def signal_host(self, name: str, sig: int) -> list[int]:
        """Signal every process of host ``name`` (SIGSTOP: the host freezes, as a stalled VM
        does; its kernel still answers ARP and holds its sockets). Returns the PIDs signalled."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
        return pids

    def set_link(self, name: str, up: bool) -> None:
        """Cut host ``name`` off the bridge, or plug it back: its veth's bridge end down or up
        (its own end then has no carrier; its addresses stay)."""
        cmd = ["ip", "link", "set", self.plan.host(name).veth, "up" if up else "down"]
        proc = self.run(cmd)
        if proc.returncode != 0:
            raise HostsError(f"{' '.join(cmd)}: {proc.stderr.strip()}")

    def one_way(self, name: str, drop: bool) -> None:
        """Drop (or stop dropping) every packet host ``name`` receives on its link, with an
        nftables table inside its namespace: it still sends (heartbeats, Raft) but hears nothing."""
        ns = self.plan.host(name).namespace
        table = f"{self.plan.tag}_oneway"
        if drop:
            script = (f"add table inet {table}\n"
                      f"add chain inet {table} input {{ type filter hook input priority -300; policy accept; }}\n"
                      f"add rule inet {table} input iifname {INNER_LINK} drop\n")
            cmd = ["ip", "netns", "exec", ns, "nft", "-f", "-"]
            proc = subprocess.run(cmd, input=script, capture_output=True, text=True, timeout=30)
        else:
            cmd = ["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", table]
            proc = self.run(cmd)
        if proc.returncode != 0:
            raise HostsError(f"{' '.join(cmd)}: {proc.stderr.strip()[:300]}")

    def leftovers(self) -> list[str]:
        """The namespaces, links and addresses of the plan that exist now."""
        namespaces, links = self.namespaces(), self.links()
        ours = {self.plan.bridge, *(h.veth for h in self.plan.hosts)}
        left = [f"netns {h.namespace}" for h in self.plan.hosts if h.namespace in namespaces]
        left += [f"link {name}" for name in sorted(ours & links)]
        left += [f"address {a}" for a in self._range_in_use(ours)]
        return left


def unavailable_reason(run: Runner = run_command) -> str | None:
    """Why emulated hosts cannot be made here (no ``ip``, no CAP_NET_ADMIN), or None if they can:
    a probe namespace is added and deleted."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"kpprobe{os.getpid() % 100000}"
    proc = run(["ip", "netns", "add", probe])
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip() or 'ip netns add failed'}"
    run(["ip", "netns", "delete", probe])
    return None
