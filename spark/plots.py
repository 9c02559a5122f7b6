"""Plots of the job outputs (pandas frames collected from spark/transform.py).

Pure drawing: every number plotted was computed by a transform. Built on
``matplotlib.figure.Figure`` (no pyplot, no global backend state), so it works
headless, in a notebook and under spark-submit alike.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

MAX_RUNS_PLOTTED = 6
MAX_FAULTS_PLOTTED = 40
_ACK_COLOR = "tab:blue"
_CONSUME_COLOR = "tab:green"
_FAULT_COLOR = "tab:red"


def _empty(fig: Figure, ax, text: str) -> Figure:  # type: ignore[no-untyped-def]
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


def throughput(timeline: pd.DataFrame, faults: pd.DataFrame, bucket_ms: int) -> Figure:
    """Acks and consumes per bucket over time, one panel per run, a red line per fault.

    ``timeline``: run_id, t_ms, acks, consumes. ``faults``: run_id, fault,
    fault_ts_ns and the run's start_ns (as ``run_start_ns``).
    """
    run_ids = sorted(timeline["run_id"].unique()) if len(timeline) else []
    shown = run_ids[:MAX_RUNS_PLOTTED]
    rows = max(1, len(shown))
    fig = Figure(figsize=(10, 2.6 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    if not shown:
        return _empty(fig, axes[0], "no acks or consumes in the trace")
    for ax, run_id in zip(axes, shown):
        part = timeline[timeline["run_id"] == run_id]
        seconds = part["t_ms"] / 1000.0
        ax.step(seconds, part["acks"], where="post", color=_ACK_COLOR, label="acks")
        ax.step(seconds, part["consumes"], where="post", color=_CONSUME_COLOR, label="consumes")
        run_faults = faults[faults["run_id"] == run_id]
        for _, fault in run_faults.iterrows():
            at = (fault["fault_ts_ns"] - fault["run_start_ns"]) / 1e9
            ax.axvline(at, color=_FAULT_COLOR, linestyle="--", linewidth=1)
            ax.annotate(
                str(fault["fault"]),
                (at, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
                color=_FAULT_COLOR,
            )
        ax.set_title(f"run {run_id}", fontsize=10, loc="left")
        ax.set_ylabel(f"per {bucket_ms} ms")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[len(shown) - 1].set_xlabel("seconds since the run's first event")
    title = "Throughput timeline"
    if len(run_ids) > len(shown):
        title += f" (first {len(shown)} of {len(run_ids)} runs)"
    fig.suptitle(title)
    return fig


def rto_cdf(rto: pd.DataFrame) -> Figure:
    """Empirical CDF of rto_ms per client family, over all faults and clients."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    if rto.empty:
        return _empty(fig, ax, "no client took part in a fault")
    for family, part in sorted(rto.groupby("family"), key=lambda item: str(item[0])):
        values = part["rto_ms"].sort_values().to_numpy()
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", label=f"{family} (n={len(values)})")
    positive = rto["rto_ms"][rto["rto_ms"] > 0]
    if len(positive) and positive.max() / max(positive.min(), 1e-9) > 50:
        ax.set_xscale("log")
    ax.set_xlabel("RTO (ms): longest gap without success across the fault")
    ax.set_ylabel("fraction of clients")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("RTO CDF per client family")
    return fig


def failover_breakdown(failover: pd.DataFrame) -> Figure:
    """Per fault, a stacked bar: detect_ms, commit_ms, then back_ms (the clients back)."""
    shown = failover.head(MAX_FAULTS_PLOTTED)
    fig = Figure(figsize=(9, 1.2 + 0.32 * max(1, len(shown))), layout="constrained")
    ax = fig.subplots()
    if shown.empty:
        return _empty(fig, ax, "no faults in the trace")
    labels = [f"{r.run_id} #{r.fault_idx} {r.fault}" for r in shown.itertuples()]
    detect = shown["detect_ms"].fillna(0.0).to_numpy()
    commit = shown["commit_ms"].fillna(0.0).to_numpy()
    back = (shown["back_ms"] if "back_ms" in shown else shown["commit_ms"] * 0).fillna(0.0).to_numpy()
    rows = list(range(len(shown)))
    ax.barh(rows, detect, color="tab:orange", label="detect (fault -> node_down)")
    ax.barh(rows, commit, left=detect, color="tab:purple", label="commit (-> assignment_committed)")
    ax.barh(rows, back, left=detect + commit, color="tab:green", label="clients back (-> last client's first success)")
    ax.set_yticks(rows, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(fontsize=8, loc="outside lower center", ncol=3)
    title = "Fault -> detected -> committed -> clients back"
    if len(failover) > len(shown):
        title += f" (first {len(shown)} of {len(failover)})"
    ax.set_title(title)
    return fig


def save(fig: Figure, path: Path) -> str:
    fig.savefig(path, dpi=100)
    return str(path)
