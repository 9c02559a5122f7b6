"""Where a data-path worker's CPU goes, for benchmarks: off unless ``KPROXY_PROFILE_DIR`` is set.

With ``KPROXY_PROFILE_DIR=dir`` in a node's environment, each of its data-path workers
(proxy.worker) runs under cProfile and times its garbage collector's passes
(``gc.callbacks``), and writes both when it stops: ``dir/worker-<pid>.prof`` (read it with
``python -m pstats``) and ``dir/worker-<pid>.gc.json`` (per generation: passes, seconds,
objects collected; the live objects tracked at the end). cProfile slows the worker down
(roughly 1.5-2x on the connection path): compare profiles with each other, never with an
unprofiled run's timings; ``KPROXY_PROFILE_GC_ONLY=1`` times the collector alone (no
cProfile: its figures hold for an ordinary run). Without ``KPROXY_PROFILE_DIR`` nothing here runs.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any

PROFILE_DIR_ENV = "KPROXY_PROFILE_DIR"
GC_ONLY_ENV = "KPROXY_PROFILE_GC_ONLY"


class GcTimes:
    """Passes, time and objects collected per generation, from ``gc.callbacks``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started: float | None = None
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        generation = info["generation"]
        self.passes[generation] += 1
        self.seconds[generation] += self._clock() - self._started
        self.collected[generation] += info.get("collected", 0)
        self._started = None

    def to_json(self) -> dict[str, Any]:
        return {"passes": self.passes, "seconds": [round(s, 4) for s in self.seconds], "collected": self.collected,
                "tracked_objects_at_end": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
                "thresholds": list(gc.get_threshold())}


def profiled(run: Callable[[], None], environ: dict[str, str] | None = None) -> None:
    """``run()``, profiled if ``KPROXY_PROFILE_DIR`` names a directory (see the module doc)."""
    environ = dict(os.environ) if environ is None else environ
    directory = environ.get(PROFILE_DIR_ENV)
    if not directory:
        run()
        return
    os.makedirs(directory, exist_ok=True)
    gc_times = GcTimes()
    gc.callbacks.append(gc_times)
    profile = None if environ.get(GC_ONLY_ENV) == "1" else cProfile.Profile()
    if profile is not None:
        profile.enable()
    try:
        run()
    finally:
        gc.callbacks.remove(gc_times)
        base = os.path.join(directory, f"worker-{os.getpid()}")
        if profile is not None:
            profile.disable()
            profile.dump_stats(base + ".prof")
        with open(base + ".gc.json", "w") as f:
            json.dump(gc_times.to_json(), f)
