"""proxy.heap.settle_heap (a worker's and a one-process node's) and proxy.profiling: the worker's garbage collector settings and timings."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.profiling import GC_ONLY_ENV, PROFILE_DIR_ENV, GcTimes, profiled
from proxy.heap import GC_THRESHOLDS, settle_heap

pytestmark = [pytest.mark.unit]


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_settle_heap_freezes_start_up_and_raises_the_full_collection_threshold(restored_gc: None) -> None:
    tracked = [[i] for i in range(1000)]  # made "at start-up": lists are tracked by the collector
    settle_heap()
    assert gc.get_threshold() == GC_THRESHOLDS == (700, 10, 100)
    assert gc.get_freeze_count() >= len(tracked)  # start-up's objects left every later pass
    frozen_ids = {id(o) for o in gc.get_objects()}
    assert not frozen_ids & {id(t) for t in tracked}  # get_objects() no longer lists them


def test_gc_times_count_passes_per_generation() -> None:
    clock = iter([1.0, 1.25, 2.0, 2.5]).__next__
    times = GcTimes(clock)
    times("start", {"generation": 0})
    times("stop", {"generation": 0, "collected": 3})
    times("start", {"generation": 2})
    times("stop", {"generation": 2, "collected": 0})
    assert times.passes == [1, 0, 1]
    assert times.seconds == [0.25, 0.0, 0.5]
    assert times.collected == [3, 0, 0]


def test_profiled_runs_plainly_without_the_variable(tmp_path: Path) -> None:
    ran = []
    profiled(lambda: ran.append(1), environ={})
    assert ran == [1] and list(tmp_path.iterdir()) == []


def test_profiled_writes_gc_times_and_a_profile(tmp_path: Path) -> None:
    profiled(lambda: gc.collect(), environ={PROFILE_DIR_ENV: str(tmp_path)})
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".prof"]
    report = json.loads(next(tmp_path.glob("*.gc.json")).read_text())
    assert report["passes"][2] >= 1  # the gc.collect() above


def test_profiled_gc_only_writes_no_profile(tmp_path: Path) -> None:
    profiled(lambda: None, environ={PROFILE_DIR_ENV: str(tmp_path), GC_ONLY_ENV: "1"})
    assert [p.name.endswith(".gc.json") for p in tmp_path.iterdir()] == [True]
