"""Idle cost of a fleet: the CPU each node process of an idle fleet uses over a window.

An idle node still runs its Raft tick and its heartbeat (membership): issue 12
wants that under 0.5% of a core per node without slowing failure detection.
:func:`measure_idle_cpu` starts ``nodes`` proxy nodes (a fleet, no clients)
against existing brokers, waits until the fleet is healthy and balanced, then
reads each node process' user+system CPU time (``/proc/PID/stat``, through
psutil) at the start and the end of ``window_s``. The fleet's Raft leader is
reported apart: it sends the append_entries, so it costs more than the others.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import attrs
import psutil

from chaos.testbed.fleet import LocalFleet

IDLE_NODES = 5
FIRST_IDLE_IP = 81  # 127.0.0.81 ... : apart from the storm's nodes and the test fleets
DEFAULT_IDLE_WINDOW_S = 60.0


@attrs.frozen
class IdleCpu:
    """CPU of each idle node, as a fraction of one core over ``window_s``."""

    window_s: float
    per_node: Mapping[str, float]
    leader: str | None

    @property
    def mean(self) -> float:
        return sum(self.per_node.values()) / len(self.per_node)

    @property
    def max(self) -> float:
        return max(self.per_node.values())

    def to_json(self) -> dict[str, object]:
        return {"idle_cpu_fraction": round(self.mean, 5), "idle_cpu_fraction_max": round(self.max, 5),
                "idle_cpu_fraction_per_node": {n: round(f, 5) for n, f in sorted(self.per_node.items())},
                "idle_leader": self.leader, "idle_window_s": self.window_s, "idle_nodes": len(self.per_node)}


def cpu_fractions(before: Mapping[str, float], after: Mapping[str, float], elapsed_s: float) -> dict[str, float]:
    """Per node: CPU seconds used between two readings over the wall-clock seconds between them."""
    if elapsed_s <= 0:
        raise ValueError("elapsed_s must be > 0")
    return {n: (after[n] - before[n]) / elapsed_s for n in before if n in after}


def _cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    out = {}
    for node, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        out[node] = times.user + times.system
    return out


def measure_idle_cpu(bootstrap: list[str], state_dir: Path, *, window_s: float = DEFAULT_IDLE_WINDOW_S,
                     nodes: int = IDLE_NODES, first_ip: int = FIRST_IDLE_IP) -> IdleCpu:
    fleet = LocalFleet.up(state_dir, proxies=nodes, kafka_bootstrap=bootstrap, first_ip=first_ip)
    try:
        pids = {n: p.pid for n, p in fleet.nodes.items() if p.pid is not None}
        before, t0 = _cpu_seconds(pids), time.monotonic()
        time.sleep(window_s)  # the measurement window itself: nothing to wait for
        after, elapsed = _cpu_seconds(pids), time.monotonic() - t0
        leaders = [n for n, s in fleet.statuses().items() if s is not None and s.role == "leader"]
        return IdleCpu(window_s, cpu_fractions(before, after, elapsed), leaders[0] if leaders else None)
    finally:
        fleet.down()
