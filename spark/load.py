"""Load: the job outputs -> report.json, summary.txt, CSV tables and PNG plots.

Collects only small results to the driver (per-fault and per-client rows,
statistics, the first ``max_listed`` lost/duplicated records, the timeline)
and writes them under the output directory. Computes no measure of its own.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark import plots, report_text
from spark.transform import BUCKET_MS, RECORD_KEY

if TYPE_CHECKING:
    from spark.extract import Trace
    from spark.jobs import Tables

REPORT_VERSION = 1
MAX_LISTED = 1000

PLOT_FILES = {
    "throughput": "throughput.png",
    "rto_cdf": "rto_cdf.png",
    "failover": "failover_breakdown.png",
}
TABLE_FILES = {"rto": "rto.csv", "faults": "faults.csv", "timeline": "timeline.csv"}


_NULLABLE = {pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(), pa.bool_(): pd.BooleanDtype()}


def _to_pandas(df: DataFrame) -> pd.DataFrame:
    """toPandas that keeps nullable integers exact (Int64, not float64 with NaN:
    a nanosecond timestamp does not fit a double)."""
    return df.toArrow().to_pandas(types_mapper=_NULLABLE.get)


def _clean(value: Any) -> Any:
    """JSON-safe scalars: numpy/pandas types to Python, NaN/NA to None, ms to 3 decimals."""
    if value is None or value is pd.NA:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) else round(value, 3)
    return value


def _records(pdf: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in row.items()} for row in pdf.to_dict(orient="records")]


def _row_dicts(df: DataFrame) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in row.asDict().items()} for row in df.collect()]


def _listing(df: DataFrame, order: list[str], max_listed: int) -> tuple[list[dict[str, Any]], int, bool]:
    """(first ``max_listed`` rows, exact row count, truncated); counts only when truncated."""
    rows = _row_dicts(df.orderBy(*order).limit(max_listed + 1))
    if len(rows) <= max_listed:
        return rows, len(rows), False
    return rows[:max_listed], df.count(), True


def _keys(records: list[dict[str, Any]]) -> list[str]:
    return sorted({r["key"] if r["key"] is not None else f"#{r['seq']}" for r in records})


def build_report(tables: Tables, trace: Trace, out_dir: Path, *, max_listed: int = MAX_LISTED) -> dict[str, Any]:
    """Collect the tables, write every output file, return the report dict."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _row_dicts(tables.run_summary)
    starts = {r["run_id"]: r["start_ns"] for r in runs}

    failover_pdf = _to_pandas(tables.failover.orderBy("run_id", "fault_idx"))
    rto_pdf = _to_pandas(tables.rto.orderBy("run_id", "fault_idx", "client_id"))
    timeline_pdf = _to_pandas(tables.timeline.orderBy("run_id", "bucket"))

    rto_ms: dict[str, dict[str, dict[str, Any]]] = {}
    for row in _row_dicts(tables.rto_stats):
        rto_ms.setdefault(row["fault"], {})[row["family"]] = {
            "p50": row["p50_ms"],
            "p99": row["p99_ms"],
            "max": row["max_ms"],
            "clients": row["clients"],
            "unrecovered": row["unrecovered"],
        }
    phases: dict[str, dict[str, dict[str, Any]]] = {"detect_ms": {}, "commit_ms": {}, "failover_ms": {}}
    for row in _row_dicts(tables.failover_stats):
        counts = {"detect_ms": row["detected"], "commit_ms": row["committed"], "failover_ms": row["committed"]}
        for phase, table in phases.items():
            prefix = phase.removesuffix("_ms")
            table[row["fault"]] = {
                "p50": row[f"{prefix}_p50_ms"],
                "p99": row[f"{prefix}_p99_ms"],
                "max": row[f"{prefix}_max_ms"],
                "n": counts[phase],
                "faults": row["faults"],
            }

    lost_rows, lost_count, lost_cut = _listing(tables.lost, list(RECORD_KEY), max_listed)
    dup_rows, dup_count, dup_cut = _listing(tables.duplicated, ["run_id", "topic", "group", "key", "seq"], max_listed)
    if dup_cut:
        extra = tables.duplicated.agg(F.sum(F.col("times") - 1).alias("extra")).first()
        dup_extra = int(extra["extra"]) if extra else 0
    else:
        dup_extra = sum(r["times"] - 1 for r in dup_rows)
    unacked_count = tables.unacked_consumed.count()

    unrecovered = rto_pdf[~rto_pdf["recovered"].astype(bool)] if len(rto_pdf) else rto_pdf
    faults_with_start = failover_pdf.assign(run_start_ns=failover_pdf["run_id"].map(starts))

    plot_paths = {
        "throughput": plots.save(
            plots.throughput(timeline_pdf, faults_with_start, BUCKET_MS), out_dir / PLOT_FILES["throughput"]
        ),
        "rto_cdf": plots.save(plots.rto_cdf(rto_pdf), out_dir / PLOT_FILES["rto_cdf"]),
        "failover": plots.save(plots.failover_breakdown(failover_pdf), out_dir / PLOT_FILES["failover"]),
    }
    table_paths = {}
    for name, pdf in (("rto", rto_pdf), ("faults", failover_pdf), ("timeline", timeline_pdf)):
        path = out_dir / TABLE_FILES[name]
        pdf.to_csv(path, index=False)
        table_paths[name] = str(path)

    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "trace_dir": trace.root,
        "format": trace.format,
        "files": len(trace.files),
        "events": trace.count,
        "runs": runs,
        "faults": _records(failover_pdf),
        "rto_ms": rto_ms,
        "unrecovered": _records(
            unrecovered[["run_id", "fault_idx", "fault", "client_id", "family", "role", "rto_ms"]]
        )
        if len(unrecovered)
        else [],
        **phases,
        "lost": {"count": lost_count, "keys": _keys(lost_rows), "records": lost_rows, "truncated": lost_cut},
        "duplicated": {
            "count": dup_count,
            "extra_deliveries": dup_extra,
            "keys": _keys(dup_rows),
            "records": dup_rows,
            "truncated": dup_cut,
        },
        "unacked_consumed": {"count": unacked_count},
        "healthy": lost_count == 0 and dup_count == 0,
        "bucket_ms": BUCKET_MS,
        "plots": plot_paths,
        "tables": table_paths,
        "out_dir": str(out_dir),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    (out_dir / "summary.txt").write_text(report_text.to_text(report), encoding="utf-8")
    return report

