"""A readable summary of a report dict: rich renderables, and the same as plain text."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

MAX_KEYS_SHOWN = 10
TEXT_WIDTH = 110


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}"


def _keys(keys: list[str], count: int) -> str:
    shown = ", ".join(keys[:MAX_KEYS_SHOWN])
    more = count - min(len(keys), MAX_KEYS_SHOWN)
    return shown + (f", ... ({more} more)" if more > 0 else "")


def render(report: dict[str, Any]) -> RenderableType:
    runs = report["runs"]
    head = Text.assemble(
        ("kproxy failover report", "bold"),
        f"  {report['trace_dir']}\n",
        f"{report['events']} events in {report['files']} {report['format']} file(s), "
        f"{len(runs)} run(s), {len(report['faults'])} fault(s)",
    )

    per_run = _runs_table(runs)

    rto = Table(title="RTO (ms) per fault and client family", title_justify="left")
    for name in ("fault", "family", "clients", "p50", "p99", "max", "unrecovered"):
        rto.add_column(name, justify="left" if name in ("fault", "family") else "right")
    for fault, families in sorted(report["rto_ms"].items()):
        for family, s in sorted(families.items()):
            rto.add_row(fault, family, str(s["clients"]), _ms(s["p50"]), _ms(s["p99"]), _ms(s["max"]), str(s["unrecovered"]))

    phases = Table(title="Detection and commit (ms) per fault type", title_justify="left")
    for name in ("fault", "phase", "n", "p50", "p99", "max"):
        phases.add_column(name, justify="left" if name in ("fault", "phase") else "right")
    labels = {"detect_ms": "detect", "commit_ms": "commit", "failover_ms": "fault->commit"}
    for fault in sorted(report["detect_ms"]):
        for phase, label in labels.items():
            s = report[phase][fault]
            phases.add_row(fault, label, f"{s['n']}/{s['faults']}", _ms(s["p50"]), _ms(s["p99"]), _ms(s["max"]))

    lost, dup = report["lost"], report["duplicated"]
    records = Table(title="Records", title_justify="left", show_header=False)
    records.add_column("what")
    records.add_column("count", justify="right")
    records.add_column("keys")
    records.add_row("lost (acked, never read back)", str(lost["count"]), _keys(lost["keys"], lost["count"]))
    records.add_row(
        "duplicated (consumed twice by one group)", str(dup["count"]), _keys(dup["keys"], dup["count"])
    )
    records.add_row("consumed without an ack (not an error)", str(report["unacked_consumed"]["count"]), "")

    parts: list[RenderableType] = [head, per_run, rto, phases, records]
    if report["unrecovered"]:
        parts.append(
            Text(
                f"{len(report['unrecovered'])} client(s) did not recover inside their drill: "
                + ", ".join(f"{u['client_id']} (run {u['run_id']} #{u['fault_idx']})" for u in report["unrecovered"][:5]),
                style="yellow",
            )
        )
    parts.append(Text("plots: " + ", ".join(report["plots"].values())))
    if report["healthy"]:
        parts.append(Text("HEALTHY: no lost and no duplicated records", style="bold green"))
    else:
        parts.append(
            Text(f"UNHEALTHY: {lost['count']} lost, {dup['count']} duplicated record(s)", style="bold red")
        )
    return Group(*parts)


def _runs_table(runs: list[dict[str, Any]]) -> Table:
    """A row per run and the totals (RTO max over every run; p50/p99 only per run)."""
    table = Table(title="Runs", title_justify="left")
    for name in ("run", "faults", "clients", "RTO p50", "RTO p99", "RTO max", "lost", "duplicated"):
        table.add_column(name, justify="left" if name in ("run", "faults") else "right")
    for r in runs:
        kinds = r.get("fault_types") or "none"
        table.add_row(str(r["run_id"]), f"{r['faults']} {kinds}", str(r["clients"]), _ms(r.get("rto_p50_ms")),
                      _ms(r.get("rto_p99_ms")), _ms(r.get("rto_max_ms")), str(r.get("lost", 0)),
                      str(r.get("duplicated", 0)))
    maxima = [r["rto_max_ms"] for r in runs if r.get("rto_max_ms") is not None]
    table.add_section()
    table.add_row(f"total ({len(runs)} run{'s' if len(runs) != 1 else ''})", str(sum(r["faults"] for r in runs)),
                  str(sum(r["clients"] for r in runs)), "", "", _ms(max(maxima) if maxima else None),
                  str(sum(r.get("lost", 0) for r in runs)), str(sum(r.get("duplicated", 0) for r in runs)))
    return table


def to_text(report: dict[str, Any]) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=TEXT_WIDTH, color_system=None, force_terminal=False).print(render(report))
    return buffer.getvalue()
