"""Benchmark of the report job on synthetic traces (figures, not pass/fail).

    python -m spark.bench --events 1000000 10000000 --json
    python -m spark.bench --events 1000000 --standalone --json

For each size, a Parquet trace from ``spark.synth.spec_for_events`` is
generated once under ``--data-dir`` (reused when present), then the whole job
(extract, validate, transform, collect, write report.json, CSVs and plots) is
timed on a session already started: wall seconds, and CPU seconds of this
process plus its JVMs (the driver; in standalone mode also the executor, but
not the master and worker daemons). The first size run in a fresh JVM also
pays the JIT warm-up.
Session start-up is reported apart. ``--standalone`` starts a local
standalone master and worker (``spark.standalone``) and runs the same job on
it, after the local runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from spark import synth
from spark.jobs import run_report
from spark.session import configure_environment, get_session
from spark.standalone import LocalStandalone

DEFAULT_DATA_DIR = Path(tempfile.gettempdir()) / "kproxy-bench-traces"


def ensure_trace(events: int, data_dir: Path, seed: int = 7) -> tuple[Path, int, float]:
    """(trace dir, event count, seconds spent generating it now: 0 when reused)."""
    spec = synth.spec_for_events(events, seed=seed)
    trace_dir = data_dir / f"synth-{events}-seed{seed}"
    marker = trace_dir / "_complete.json"
    if marker.is_file():
        return trace_dir, int(json.loads(marker.read_text())["events"]), 0.0
    started = time.perf_counter()
    table, truth = synth.generate(spec)
    synth.write_parquet(table, trace_dir)
    marker.write_text(json.dumps({"events": truth.events, "spec": str(spec)}))
    return trace_dir, truth.events, time.perf_counter() - started


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _measured(exclude: set[int]) -> list[psutil.Process]:
    """This process and its descendants (the driver JVM; in standalone mode the
    executor, a child of the worker we started), without the ``exclude`` PIDs
    (the standalone master and worker daemons)."""
    me = psutil.Process()
    return [p for p in [me, *me.children(recursive=True)] if p.pid not in exclude]


def _wait_for_executors(spark: Any, count: int, timeout_s: float = 120.0) -> None:
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()  # driver + executors
    deadline = time.monotonic() + timeout_s
    while status.size() < count + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} executor(s) did not register within {timeout_s:.0f} s")
        time.sleep(0.25)  # poll interval; the condition is the loop test
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()


def run_mode(
    mode: str,
    traces: list[tuple[int, Path, int]],
    master: str,
    daemons: set[int],
    conf: dict[str, str],
    driver_memory: str,
    repeat: int = 1,
) -> list[dict[str, Any]]:
    started = time.perf_counter()
    spark = get_session(master, app_name=f"kproxy-bench-{mode}", driver_memory=driver_memory, extra_conf=conf)
    if mode == "standalone":
        _wait_for_executors(spark, 1)
    session_s = time.perf_counter() - started
    results = []
    try:
        for attempt, (target, trace_dir, events) in ((a, t) for t in traces for a in range(1, repeat + 1)):
            with tempfile.TemporaryDirectory(prefix="kproxy-bench-out-") as out:
                procs = _measured(daemons)
                cpu0, wall0 = _cpu_seconds(procs), time.perf_counter()
                report = run_report(trace_dir, out, spark=spark)
                wall = time.perf_counter() - wall0
                cpu = _cpu_seconds(procs) - cpu0
            results.append(
                {
                    "mode": mode,
                    "master": master,
                    "target_events": target,
                    "attempt": attempt,
                    "events": events,
                    "wall_s": round(wall, 2),
                    "cpu_s": round(cpu, 2),
                    "events_per_s": round(events / wall),
                    "session_start_s": round(session_s, 2),
                    "faults": len(report["faults"]),
                    "lost": report["lost"]["count"],
                    "duplicated": report["duplicated"]["count"],
                }
            )
            print(f"{mode:10s} {events:>11,d} events  #{attempt}  wall {wall:6.1f} s  cpu {cpu:6.1f} s", file=sys.stderr)
    finally:
        spark.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spark.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="where generated traces are kept")
    parser.add_argument("--standalone", action="store_true", help="also run on a local standalone cluster")
    parser.add_argument("--no-local", action="store_true", help="skip the local-mode runs")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--executor-memory", default="2g", help="standalone executor heap")
    parser.add_argument("--shuffle-partitions", type=int, default=4)
    parser.add_argument("--jvm-options", default=None, help="driver/executor JVM options (default: spark.session's)")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark setting (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per size (the first pays JIT warm-up)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = parser.parse_args(argv)
    configure_environment()

    traces = []
    generation = {}
    for target in args.events:
        trace_dir, events, gen_s = ensure_trace(target, args.data_dir)
        traces.append((target, trace_dir, events))
        generation[str(target)] = round(gen_s, 2)
        print(f"trace {trace_dir}: {events:,d} events (generated in {gen_s:.1f} s)" if gen_s else f"trace {trace_dir}: {events:,d} events (reused)", file=sys.stderr)

    conf = {"spark.sql.shuffle.partitions": str(args.shuffle_partitions)}
    if args.jvm_options is not None:
        conf["spark.driver.extraJavaOptions"] = conf["spark.executor.extraJavaOptions"] = args.jvm_options
    for item in args.conf:
        key, _, value = item.partition("=")
        conf[key] = value
    results: list[dict[str, Any]] = []
    if not args.no_local:
        results += run_mode("local", traces, "local[2]", set(), conf, args.driver_memory, args.repeat)
    if args.standalone:
        with tempfile.TemporaryDirectory(prefix="kproxy-standalone-") as work:
            cluster = LocalStandalone(work, cores=2, memory=args.executor_memory)
            with cluster:
                standalone_conf = {**conf, "spark.executor.memory": args.executor_memory, "spark.cores.max": "2"}
                results += run_mode(
                    "standalone", traces, cluster.url, set(cluster.pids), standalone_conf, args.driver_memory, args.repeat
                )

    summary = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_1m": round(os.getloadavg()[0], 2)},
        "generation_s": generation,
        "conf": conf,
        "results": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
