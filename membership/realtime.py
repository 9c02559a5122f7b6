"""The member's threads run ahead of every data path (SCHED_RR), where the process may.

A node's failure detection, its Raft commits and the pushes of each new map to
the data path are a few milliseconds of CPU each, and every client's recovery
waits for them. When a node dies, its clients reconnect to the survivors in
the same second: the survivors' data paths (and, on a shared host, brokers and
clients) keep every core busy, and under the kernel's fair scheduler a member
thread woken by a beat or a Raft message waits its turn behind them (measured:
a fault's commit 150-350 ms after the kill with a reconnect storm of 5,000
clients on a 2-core host, 10-30 ms without). Clustering daemons run their
membership at a real-time priority for this reason (corosync: SCHED_RR).

:func:`run_realtime` puts the calling thread under SCHED_RR at ``priority``:
the threads it starts afterwards inherit the policy (pysyncobj's tick thread,
started by the member thread), unless ``spawns`` says the thread starts
processes that must not (the supervisor starts the data-path workers:
SCHED_RESET_ON_FORK, which the kernel applies to new threads too). Allowed to root, to
CAP_SYS_NICE, or up to ``RLIMIT_RTPRIO``; elsewhere the thread runs as before
and the refusal is logged once. The kernel keeps 5% of every second for the
others (``kernel.sched_rt_runtime_us``), so a member thread that spun could not
freeze its host.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("kproxy.membership")

_refused_logged = False
_lock = threading.Lock()


def run_realtime(priority: int, what: str, *, spawns: bool = False) -> bool:
    """Run the calling thread under SCHED_RR at ``priority`` (1-99; 0: leave it as it is); with
    ``spawns``, what it starts (threads and processes) runs as usual. True if it now does; a
    refusal is logged once per process."""
    global _refused_logged
    if priority <= 0 or not hasattr(os, "SCHED_RR"):
        return False
    try:
        policy = os.SCHED_RR | (getattr(os, "SCHED_RESET_ON_FORK", 0) if spawns else 0)
        os.sched_setscheduler(0, policy, os.sched_param(priority))
    except OSError as exc:
        with _lock:
            first, _refused_logged = not _refused_logged, True
        if first:
            log.warning("cannot run the member at a real-time priority: it competes with the data path for the CPU "
                        "(allow it with CAP_SYS_NICE or RLIMIT_RTPRIO, or set fleet.member_priority = 0)",
                        extra={"thread": what, "priority": priority, "reason": os.strerror(exc.errno or 0)})
        return False
    return True
