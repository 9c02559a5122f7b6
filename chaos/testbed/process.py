"""Process control shared by the launchers and the workloads: no orphans, signals that
tolerate a process that is already gone."""

from __future__ import annotations

import signal
import subprocess


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
