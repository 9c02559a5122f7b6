"""Process control shared by the launchers and the workloads: no orphans, signals that
tolerate a process that is already gone."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send ``sig`` to this process when its parent dies (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def signal_if_running(proc: subprocess.Popen[str], sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def raise_priority(pid: int, nice: int) -> tuple[bool, bool]:
    """Run process ``pid`` at ``nice``: its own nice value and, where the kernel groups
    processes by session for scheduling (``kernel.sched_autogroup_enabled``), its session's
    autogroup's. Under autogroup a nice value only ranks a process among its own session's:
    every session competes as one, so the process must lead a session of its own
    (``start_new_session=True``), else this raises its parent's whole session with it.
    Returns (nice set, autogroup's nice set); what is not allowed (not root) stays as it was."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        nice_set = True
    except OSError:
        nice_set = False
    autogroup_set = False
    try:
        if AUTOGROUP_SWITCH.read_text().strip() == "1" and os.getsid(pid) == pid:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            autogroup_set = True
    except OSError:
        pass
    return nice_set, autogroup_set
