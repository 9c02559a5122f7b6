"""Network partition of one loopback address with nftables (the ``partition`` fault).

A proxy node owns one loopback address (127.0.0.12, ...). Isolating it means
dropping, silently, every packet from or to that address: clients and peers
see a host that stopped answering (no RST, no FIN), exactly as on a real
network partition. Loopback traffic passes the ``output`` hook once, so one
chain there with two rules (``ip saddr A drop``, ``ip daddr A drop``) cuts both
directions, established connections included.

Each partition lives in its own nftables table, ``inet kproxy_drill_<pid>_<a_b_c_d>``,
so healing deletes exactly what this process added and nothing else, and a
leftover of a crashed run is easy to find (``nft list tables``).

Caveat: the rules match addresses, so they cut only what uses the victim's
address. A socket of the victim process with another local address (an
outgoing connection the kernel gave the source 127.0.0.1, a listener on
0.0.0.0) is not cut: the victim is then only half partitioned.
``foreign_connections`` lists such sockets; the partition fault reports the ones
that reach fleet peers as an error (the fix belongs to the node: bind outgoing
sockets to the node's own address, as a real host would).

Needs the ``nft`` binary (Debian package ``nftables``) and CAP_NET_ADMIN.
``partition_support()`` probes both by creating and deleting an empty table;
when it says no, the partition drill is SKIPPED, never faked.
Only 127.0.0.0/8 addresses other than 127.0.0.1 (where Kafka and everything
else listen) are accepted.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess

TABLE_PREFIX = "kproxy_drill"
NFT_TIMEOUT_S = 10.0
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
RESERVED = ipaddress.ip_address("127.0.0.1")


class PartitionError(RuntimeError):
    """The partition could not be applied or healed (message says why)."""


def _nft() -> str | None:
    return shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.path.exists(p)), None)


def _run(nft: str, *args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([nft, *args], input=script, capture_output=True, text=True, timeout=NFT_TIMEOUT_S)


def partition_support() -> tuple[bool, str]:
    """(True, "nft") if this machine lets us partition an address, else (False, why not)."""
    nft = _nft()
    if nft is None:
        return False, "the `nft` binary (Debian package nftables) is not installed"
    table = f"{TABLE_PREFIX}_probe_{os.getpid()}"
    try:
        proc = _run(nft, "-f", "-", script=f"add table inet {table}\n"
                    f"add chain inet {table} out {{ type filter hook output priority -10; policy accept; }}\n")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"nft failed to run: {exc}"
    if proc.returncode != 0:
        return False, f"nft cannot add a table here (CAP_NET_ADMIN?): {proc.stderr.strip()[:300]}"
    _run(nft, "delete", "table", "inet", table)
    return True, "nft"


def check_address(address: str) -> str:
    ip = ipaddress.ip_address(address)
    if ip not in LOOPBACK or ip == RESERVED:
        raise PartitionError(f"refusing to partition {address}: only 127.0.0.0/8 other than 127.0.0.1")
    return str(ip)


class Partition:
    """Isolate ``address``: ``apply()``, then ``heal()`` (idempotent). Also a context manager."""

    def __init__(self, address: str) -> None:
        self.address = check_address(address)
        self.table = f"{TABLE_PREFIX}_{os.getpid()}_{self.address.replace('.', '_')}"
        self.applied = False

    def apply(self) -> None:
        nft = _nft()
        if nft is None:
            raise PartitionError("the `nft` binary is not installed")
        script = (
            f"add table inet {self.table}\n"
            f"add chain inet {self.table} out {{ type filter hook output priority -10; policy accept; }}\n"
            f"add rule inet {self.table} out ip saddr {self.address} drop\n"
            f"add rule inet {self.table} out ip daddr {self.address} drop\n"
        )
        proc = _run(nft, "-f", "-", script=script)
        if proc.returncode != 0:
            self.heal()
            raise PartitionError(f"nft failed to partition {self.address}: {proc.stderr.strip()[:300]}")
        self.applied = True

    def heal(self) -> None:
        nft = _nft()
        if nft is None:
            return
        proc = _run(nft, "delete", "table", "inet", self.table)
        if proc.returncode != 0 and "No such file" not in proc.stderr and self.applied:
            raise PartitionError(f"nft failed to heal {self.address}: {proc.stderr.strip()[:300]}")
        self.applied = False

    def __enter__(self) -> "Partition":
        self.apply()
        return self

    def __exit__(self, *exc: object) -> None:
        self.heal()


def foreign_connections(pid: int, address: str) -> list[tuple[str, str, str]]:
    """TCP sockets of process ``pid`` that an address partition of ``address`` cannot cut:
    connections or listeners whose local address is not ``address`` (e.g. an outgoing
    connection the kernel gave the source 127.0.0.1). Each as (status, local, remote)."""
    import psutil

    out = []
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if not c.laddr or c.laddr.ip == address:
            continue
        remote = f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else ""
        out.append((c.status, f"{c.laddr.ip}:{c.laddr.port}", remote))
    return sorted(out)
