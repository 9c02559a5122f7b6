"""Drill summary: pure Python over a trace directory (the JSON lines of ``chaos.trace``).

The Spark jobs (``spark/transform.py``) compute the same measures from the same
trace for reports; the definitions here are theirs, word for word, so a drill's
verdict and a report never disagree:

fault window
    Each ``fault`` event belongs to the drill that brackets it. Boundaries are
    the run's drill_start, fault and drill_end events in time order (ties:
    drill_start, fault, drill_end); a fault's window runs from the boundary
    just before it to the one just after it. Without one, the run's first or
    last event bounds it.

RTO of one client for one fault (DESIGN §7)
    Success events are ``ack`` (producer) and ``consume`` (consumer). The gap
    runs from the client's last success at or before the fault instant to its
    first success after it. No success after it inside the window: the gap
    ends at the window end and the client did not recover. No success before
    it: the gap starts at the client's first event. A client takes part in a
    fault if its first event is at or before the fault instant and its last
    event is at or after the window start. A client is a consumer if it has
    any ``consume`` event, a producer otherwise.

percentiles
    Exact, linear interpolation between closest ranks (Spark's ``percentile``,
    numpy's "linear"): sorted values v[0..n-1], position p*(n-1).

detect / commit
    detect_ms: fault -> the first node_down in the window at or after it.
    failover_ms: fault -> the first assignment_committed in the window at or
    after the fault (for a planned move, drain or rolling restart, the new map
    is published before the node goes down).
    commit_ms: that node_down (or the fault, when nothing was detected) -> that
    commit, 0 when the commit came first.

records
    A record is (run_id, topic, key, seq). Lost: acknowledged and consumed by
    no consumer group. Duplicated: consumed more than once by one group (a
    consumer without a group is its own group); ``duplicated`` counts (record,
    group) pairs. Unacked-consumed: consumed although no ack was seen (not an
    error). In addition to the shared definitions, ``missed_by_group`` counts,
    per group, the acknowledged records of its topic that this group never read.

max gap (ours, not in the Spark jobs)
    ``max_gap_ms`` of one client for one fault: the longest interval without a
    success that overlaps the fault's *window* (not only its instant), built
    like the RTO gap (the client's first event stands in for a success before
    its first one; an open end stops at the window end). It catches what the
    undoing of a fault does to clients (a restarted node taking identities
    back, a rolling restart's SIGTERM after its drain). Always >= the RTO.

Nothing here reads a clock or a random source: the same trace gives the same
summary.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from chaos.trace import check_event

NS_PER_MS = 1_000_000
SUCCESS_EVENTS = ("ack", "consume")
_BOUNDARY_RANK = {"drill_start": 0, "fault": 1, "drill_end": 2}
MAX_KEYS_LISTED = 20


class TraceInvalid(ValueError):
    """A trace line that does not fit the schema: ``path:line: reason``."""


# ------------------------------------------------------------------ reading
def trace_files(trace_dir: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(trace_dir).glob("*.jsonl"))


def iter_events(trace_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    for path in trace_files(trace_dir):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    yield json.loads(line)


def load_events(trace_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_events(trace_dir))


def validate_trace(trace_dir: str | os.PathLike[str], max_errors: int = 20) -> list[str]:
    """Every schema violation as ``file:line: reason`` (at most ``max_errors``); [] when valid."""
    errors: list[str] = []
    files = trace_files(trace_dir)
    if not files:
        return [f"{trace_dir}: no *.jsonl files"]
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    reason = check_event(json.loads(line))
                except ValueError as exc:
                    reason = f"not JSON: {exc}"
                if reason is not None:
                    errors.append(f"{path}:{number}: {reason}")
                    if len(errors) >= max_errors:
                        return errors
    return errors


# -------------------------------------------------------------- statistics
def percentile(values: Iterable[float], p: float) -> float | None:
    """Exact percentile with linear interpolation (Spark ``percentile``); None for no values."""
    v = sorted(values)
    if not v:
        return None
    if not 0.0 <= p <= 1.0:
        raise ValueError("p must be within [0, 1]")
    pos = p * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def stats_ms(values: list[float]) -> dict[str, Any]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99),
            "max": max(values) if values else None, "n": len(values)}


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


# ------------------------------------------------------------------ faults
@attrs.frozen
class FaultWindow:
    run_id: str
    fault_idx: int
    fault: str
    node: str | None
    fault_ts_ns: int
    window_start_ns: int
    window_end_ns: int


def _nulls_first(value: str | None) -> tuple[bool, str]:
    return (value is not None, value or "")


def _by_run(events: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        runs[e["run_id"]].append(e)
    return dict(runs)


def fault_windows(events: list[dict[str, Any]]) -> list[FaultWindow]:
    """One window per ``fault`` event, per run, in (run_id, fault_idx) order."""
    out: list[FaultWindow] = []
    for run_id, evs in sorted(_by_run(events).items()):
        start_ns = min(e["ts_ns"] for e in evs)
        end_ns = max(e["ts_ns"] for e in evs)
        bounds = sorted(
            (e for e in evs if e["source"] == "fleet" and e["event"] in _BOUNDARY_RANK),
            key=lambda e: (e["ts_ns"], _BOUNDARY_RANK[e["event"]], _nulls_first(e["fault"]), _nulls_first(e["node"])),
        )
        faults = sorted((i for i, e in enumerate(bounds) if e["event"] == "fault"),
                        key=lambda i: (bounds[i]["ts_ns"], _nulls_first(bounds[i]["fault"]),
                                       _nulls_first(bounds[i]["node"])))
        for idx, i in enumerate(faults):
            e = bounds[i]
            out.append(FaultWindow(
                run_id=run_id,
                fault_idx=idx,
                fault=e["fault"] if e["fault"] is not None else "unknown",
                node=e["node"],
                fault_ts_ns=e["ts_ns"],
                window_start_ns=bounds[i - 1]["ts_ns"] if i > 0 else start_ns,
                window_end_ns=bounds[i + 1]["ts_ns"] if i + 1 < len(bounds) else end_ns,
            ))
    return out


@attrs.frozen
class ClientRto:
    run_id: str
    fault_idx: int
    fault: str
    node: str | None
    fault_ts_ns: int
    client_id: str
    family: str
    role: str
    gap_start_ns: int
    gap_end_ns: int
    rto_ms: float
    recovered: bool
    max_gap_ms: float = 0.0


def rto_per_client(events: list[dict[str, Any]], windows: list[FaultWindow]) -> list[ClientRto]:
    """One row per (fault, participating client); see the module docstring."""
    per_client: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["source"] == "client" and e["client_id"] is not None:
            per_client[(e["run_id"], e["client_id"])].append(e)
    out: list[ClientRto] = []
    for (run_id, client_id), evs in sorted(per_client.items()):
        first_ns = min(e["ts_ns"] for e in evs)
        last_ns = max(e["ts_ns"] for e in evs)
        ok = sorted(e["ts_ns"] for e in evs if e["event"] in SUCCESS_EVENTS)
        families = [e["family"] for e in evs if e["family"] is not None]
        family = min(families) if families else "unknown"
        role = "consumer" if any(e["event"] == "consume" for e in evs) else "producer"
        for w in windows:
            if w.run_id != run_id or not (first_ns <= w.fault_ts_ns and last_ns >= w.window_start_ns):
                continue
            before = [t for t in ok if t <= w.fault_ts_ns]
            after = [t for t in ok if t > w.fault_ts_ns]
            first_after = after[0] if after else None
            recovered = first_after is not None and first_after <= w.window_end_ns
            gap_start = before[-1] if before else first_ns
            gap_end = first_after if recovered else w.window_end_ns
            assert gap_end is not None
            out.append(ClientRto(run_id, w.fault_idx, w.fault, w.node, w.fault_ts_ns, client_id, family, role,
                                 gap_start, gap_end, (gap_end - gap_start) / NS_PER_MS, recovered,
                                 _max_gap_ns(first_ns, ok, w) / NS_PER_MS))
    return out


def _max_gap_ns(first_ns: int, ok: list[int], w: FaultWindow) -> int:
    """The longest interval without a success that overlaps the window: between consecutive
    successes (the client's first event standing in for a success before its first one), the
    open end after the last success ending at the window end, as for the RTO."""
    points = sorted({first_ns, *ok})
    best = 0
    for a, b in zip(points, [*points[1:], None]):
        end = w.window_end_ns if b is None else min(b, w.window_end_ns)
        if a <= w.window_end_ns and (b is None or b >= w.window_start_ns):
            best = max(best, end - a)
    return best


def rto_stats(rows: list[ClientRto]) -> dict[str, dict[str, dict[str, Any]]]:
    """{fault: {family: {p50, p99, max, clients, unrecovered}}} over clients and repeats."""
    groups: dict[tuple[str, str], list[ClientRto]] = defaultdict(list)
    for r in rows:
        groups[(r.fault, r.family)].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (fault, family), rs in sorted(groups.items()):
        values = [r.rto_ms for r in rs]
        out.setdefault(fault, {})[family] = {
            "p50": percentile(values, 0.5),
            "p99": percentile(values, 0.99),
            "max": max(values),
            "clients": len(rs),
            "unrecovered": sum(1 for r in rs if not r.recovered),
        }
    return out


@attrs.frozen
class Failover:
    window: FaultWindow
    node_down_ns: int | None
    committed_ns: int | None

    @property
    def detect_ms(self) -> float | None:
        return None if self.node_down_ns is None else _ms(self.node_down_ns - self.window.fault_ts_ns)

    @property
    def commit_ms(self) -> float | None:
        """node_down (or the fault) -> the commit; 0 when the map was published before
        the node went down (a planned move: drain, rolling restart)."""
        anchor = self.node_down_ns if self.node_down_ns is not None else self.window.fault_ts_ns
        return None if self.committed_ns is None else max(0.0, _ms(self.committed_ns - anchor))

    @property
    def failover_ms(self) -> float | None:
        return None if self.committed_ns is None else _ms(self.committed_ns - self.window.fault_ts_ns)


def failover(events: list[dict[str, Any]], windows: list[FaultWindow]) -> list[Failover]:
    marks: dict[str, dict[str, list[int]]] = defaultdict(lambda: {"node_down": [], "assignment_committed": []})
    for e in events:
        if e["source"] == "fleet" and e["event"] in ("node_down", "assignment_committed"):
            marks[e["run_id"]][e["event"]].append(e["ts_ns"])
    out = []
    for w in windows:
        m = marks[w.run_id]
        downs = [t for t in m["node_down"] if w.fault_ts_ns <= t <= w.window_end_ns]
        down = min(downs) if downs else None
        # The first commit after the fault, even one before node_down: a planned move
        # publishes the new map first and only then stops the node (DESIGN §4).
        commits = [t for t in m["assignment_committed"] if w.fault_ts_ns <= t <= w.window_end_ns]
        out.append(Failover(w, down, min(commits) if commits else None))
    return out


# ----------------------------------------------------------------- records
@attrs.frozen
class Records:
    acked: int
    consumed: int  # distinct records consumed by at least one group
    lost: list[tuple[str, str, str | None, int | None]]
    duplicated: list[tuple[tuple[str, str, str | None, int | None], str, int]]  # (record, group, times)
    unacked_consumed: int
    missed_by_group: dict[str, int]

    @property
    def duplicated_extra(self) -> int:
        return sum(times - 1 for _, _, times in self.duplicated)


def record_outcomes(events: Iterable[dict[str, Any]]) -> Records:
    acked: set[tuple[Any, ...]] = set()
    reads: dict[tuple[Any, ...], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    group_topics: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for e in events:
        if e["source"] != "client" or e["event"] not in SUCCESS_EVENTS:
            continue
        if e["key"] is None and e["seq"] is None:
            continue
        rec = (e["run_id"], e["topic"], e["key"], e["seq"])
        if e["event"] == "ack":
            acked.add(rec)
        else:
            reader = e["group"] if e["group"] is not None else f"client:{e['client_id']}"
            reads[rec][reader] += 1
            group_topics[reader].add((e["run_id"], e["topic"]))
    lost = sorted((r for r in acked if r not in reads), key=_record_order)
    duplicated = sorted(((r, g, n) for r, gs in reads.items() for g, n in gs.items() if n > 1),
                        key=lambda x: (_record_order(x[0]), x[1]))
    unacked = sum(1 for r in reads if r not in acked)
    missed = {}
    for group, topics in sorted(group_topics.items()):
        missed[group] = sum(1 for r in acked if (r[0], r[1]) in topics and group not in reads.get(r, {}))
    return Records(len(acked), len(reads), lost, duplicated, unacked, missed)


def _record_order(rec: tuple[Any, ...]) -> tuple[Any, ...]:
    run_id, topic, key, seq = rec
    return (run_id, _nulls_first(topic), _nulls_first(key), (seq is not None, seq or 0))


def _key_label(rec: tuple[Any, ...]) -> str:
    return rec[2] if rec[2] is not None else f"#{rec[3]}"


# ----------------------------------------------------------------- summary
def summarize_events(events: list[dict[str, Any]], *, fault: str | None = None, repeat: int | None = None,
                     trace_dir: str | None = None) -> dict[str, Any]:
    """The drill summary of already loaded events (see ``summarize``)."""
    windows = fault_windows(events)
    rto = rto_per_client(events, windows)
    by_fault = rto_stats(rto)
    by_family: dict[str, list[ClientRto]] = defaultdict(list)
    for r in rto:
        by_family[r.family].append(r)
    rto_ms = {
        family: {
            "p50": percentile([r.rto_ms for r in rs], 0.5),
            "p99": percentile([r.rto_ms for r in rs], 0.99),
            "max": max(r.rto_ms for r in rs),
            "clients": len(rs),
            "unrecovered": sum(1 for r in rs if not r.recovered),
        }
        for family, rs in sorted(by_family.items())
    }
    max_gap_ms = {
        family: {**stats_ms([r.max_gap_ms for r in rs]), "clients": len(rs)}
        for family, rs in sorted(by_family.items())
    }
    fo = failover(events, windows)
    records = record_outcomes(events)
    unrecovered = [r for r in rto if not r.recovered]
    fault_names = sorted({w.fault for w in windows})
    drills = sum(1 for e in events if e["source"] == "fleet" and e["event"] == "drill_start")
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        if e["source"] == "client":
            counts[e["event"]] += 1
    healthy = not records.lost and not records.duplicated and not unrecovered
    return {
        "fault": fault if fault is not None else ",".join(fault_names) or None,
        "repeat": repeat if repeat is not None else drills,
        "run_ids": sorted({e["run_id"] for e in events}),
        "trace_dir": trace_dir,
        "rto_ms": rto_ms,
        "rto_ms_by_fault": by_fault,
        "max_gap_ms": max_gap_ms,
        "lost": len(records.lost),
        "duplicated": len(records.duplicated),
        "duplicated_extra_deliveries": records.duplicated_extra,
        "unacked_consumed": records.unacked_consumed,
        "lost_keys": [_key_label(r) for r in records.lost[:MAX_KEYS_LISTED]],
        "duplicated_keys": sorted({_key_label(r) for r, _, _ in records.duplicated[:MAX_KEYS_LISTED]}),
        "missed_by_group": records.missed_by_group,
        "records": {"acked": records.acked, "consumed": records.consumed, "sent": counts["send"],
                    "consume_events": counts["consume"], "errors": counts["error"]},
        "faults": [
            {
                "run_id": f.window.run_id,
                "fault_idx": f.window.fault_idx,
                "fault": f.window.fault,
                "node": f.window.node,
                "fault_ts_ns": f.window.fault_ts_ns,
                "window_start_ns": f.window.window_start_ns,
                "window_end_ns": f.window.window_end_ns,
                "node_down_ns": f.node_down_ns,
                "committed_ns": f.committed_ns,
                "detect_ms": f.detect_ms,
                "commit_ms": f.commit_ms,
                "failover_ms": f.failover_ms,
            }
            for f in fo
        ],
        "detect_ms": stats_ms([f.detect_ms for f in fo if f.detect_ms is not None]),
        "commit_ms": stats_ms([f.commit_ms for f in fo if f.commit_ms is not None]),
        "failover_ms": stats_ms([f.failover_ms for f in fo if f.failover_ms is not None]),
        "clients": [
            {"run_id": r.run_id, "fault_idx": r.fault_idx, "client_id": r.client_id, "family": r.family,
             "role": r.role, "rto_ms": r.rto_ms, "recovered": r.recovered, "max_gap_ms": r.max_gap_ms}
            for r in rto
        ],
        "unrecovered": [{"run_id": r.run_id, "fault_idx": r.fault_idx, "client_id": r.client_id} for r in unrecovered],
        "recovered": not unrecovered,
        "events": len(events),
        "healthy": healthy,
    }


def summarize(trace_dir: str | os.PathLike[str], *, fault: str | None = None,
              repeat: int | None = None) -> dict[str, Any]:
    """The drill summary of a trace directory.

    Required keys: ``fault``, ``repeat``, ``rto_ms`` ({family: {p50, p99, max,
    clients, unrecovered}} over every fault of the trace), ``lost``,
    ``duplicated`` (counts), ``trace_dir``; plus per-fault detect/commit
    figures, per-client RTOs, and ``healthy`` (no lost, no duplicated, every
    client recovered).
    """
    return summarize_events(load_events(trace_dir), fault=fault, repeat=repeat, trace_dir=str(trace_dir))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m chaos.summary", description="Summarize a drill trace directory.")
    p.add_argument("trace_dir")
    a = p.parse_args(argv)
    errors = validate_trace(a.trace_dir)
    if errors:
        print("\n".join(errors))
        return 2
    s = summarize(a.trace_dir)
    print(json.dumps(s, indent=2))
    return 0 if s["healthy"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
