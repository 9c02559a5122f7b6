"""The failover report job: extract -> transform -> load.

Library use (what ``kproxy report`` and the notebook call)::

    from spark.jobs import run_report
    report = run_report("trace/", "trace/report")        # -> dict, files written

Cluster use, unchanged code (client deploy mode; the driver needs this repo,
the executors need nothing of it: the jobs are pure Spark SQL)::

    PYSPARK_PYTHON=.venv/bin/python spark-submit --master spark://HOST:7077 \\
        spark/jobs.py TRACE_DIR --out DIR

Exit status (both ways): 0 healthy, 1 lost or duplicated records, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script (spark-submit spark/jobs.py ...)
    _repo = str(Path(__file__).resolve().parents[1])
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    if _repo not in sys.path:
        sys.path.insert(0, _repo)

import attrs
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from spark import extract, load, transform
from spark.extract import Trace, TraceFormatError
from spark.session import get_session

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_BAD_INPUT = 2


@attrs.frozen
class Tables:
    """Every job output, lazily defined; the small ones cached (see ``release``)."""

    runs: DataFrame
    faults: DataFrame
    rto: DataFrame
    rto_stats: DataFrame
    failover: DataFrame
    failover_stats: DataFrame
    problems: DataFrame
    lost: DataFrame
    duplicated: DataFrame
    unacked_consumed: DataFrame
    timeline: DataFrame
    run_summary: DataFrame
    cached: tuple[DataFrame, ...] = ()

    def release(self) -> None:
        for df in self.cached:
            df.unpersist()


def transform_all(events: DataFrame, *, cache: bool = True) -> Tables:
    """All transforms over one events DataFrame.

    With ``cache`` the small intermediate tables (runs, faults, per-client RTO,
    failover, problem records) are cached, so that collecting several outputs
    reads the trace once per measure, not once per output.
    """
    cached: list[DataFrame] = []

    def keep(df: DataFrame) -> DataFrame:
        if not cache:
            return df
        cached.append(df.persist(StorageLevel.MEMORY_AND_DISK))
        return cached[-1]

    run_table = keep(transform.runs(events))
    faults = keep(transform.fault_windows(events, run_table))
    rto = keep(transform.rto_per_client(events, faults))
    failover = keep(transform.with_clients_back(transform.failover(events, faults), rto))
    problems = keep(transform.record_problems(transform.record_outcomes(events)))
    lost, duplicated = transform.lost(problems), transform.duplicated(problems)
    return Tables(
        runs=run_table,
        faults=faults,
        rto=rto,
        rto_stats=transform.rto_stats(rto),
        failover=failover,
        failover_stats=transform.failover_stats(failover),
        problems=problems,
        lost=lost,
        duplicated=duplicated,
        unacked_consumed=transform.unacked_consumed(problems),
        timeline=transform.timeline(events, run_table, faults),
        run_summary=transform.run_summary(run_table, faults, rto, lost, duplicated),
        cached=tuple(cached),
    )


def extract_trace(spark: SparkSession, trace_dir: str | Path) -> Trace:
    """Read and validate a trace directory (raises TraceFormatError)."""
    return extract.read_trace(spark, trace_dir)


def report_from_trace(trace: Trace, out_dir: str | Path) -> dict[str, Any]:
    """Transform and load an extracted trace into ``out_dir``; returns the report."""
    tables = transform_all(trace.events)
    try:
        return load.build_report(tables, trace, Path(out_dir).resolve())
    finally:
        tables.release()


def run_report(
    trace_dir: str | Path,
    out_dir: str | Path | None = None,
    master: str | None = None,
    *,
    spark: SparkSession | None = None,
) -> dict[str, Any]:
    """Extract, transform and load one trace directory; returns the report dict.

    Uses ``spark`` if given, else the active session, else starts one on
    ``master`` (default local[2], or spark-submit's) and stops it at the end.
    ``out_dir`` defaults to ``TRACE_DIR/report``. Raises ``TraceFormatError``
    on bad input.
    """
    out = Path(out_dir) if out_dir is not None else Path(trace_dir) / "report"
    session = spark or SparkSession.getActiveSession()
    created = session is None
    if session is None:
        session = get_session(master)
    try:
        trace = extract_trace(session, trace_dir)
        try:
            return report_from_trace(trace, out)
        finally:
            trace.release()
    finally:
        if created:
            session.stop()


def exit_code(report: dict[str, Any]) -> int:
    return EXIT_OK if report["healthy"] else EXIT_UNHEALTHY


def main(argv: list[str] | None = None) -> int:
    """``spark-submit spark/jobs.py TRACE_DIR [--out DIR] [--json]``."""
    parser = argparse.ArgumentParser(prog="spark/jobs.py", description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--out", default=None, help="report directory (default TRACE_DIR/report)")
    parser.add_argument("--master", default=None, help="Spark master (default: spark-submit's, else local[2])")
    parser.add_argument("--json", action="store_true", help="print report.json instead of the summary")
    args = parser.parse_args(argv)
    try:
        report = run_report(args.trace_dir, args.out, args.master)
    except TraceFormatError as exc:
        print(f"bad trace: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from spark.report_text import to_text

        print(to_text(report), end="")
    return exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
