"""The drill summary: the measures of ``chaos.measures`` over one trace directory, as the
JSON-able dict a drill writes to ``summary.json`` and prints (``python -m chaos.drills.summary DIR``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

from chaos import measures as m
from chaos.trace import load_events, validate_trace

MAX_KEYS_LISTED = 20


def _key_label(rec: tuple[Any, ...]) -> str:
    return rec[2] if rec[2] is not None else f"#{rec[3]}"


def _failover_row(f: m.Failover) -> dict[str, Any]:
    w = f.window
    return {"run_id": w.run_id, "fault_idx": w.fault_idx, "fault": w.fault, "node": w.node,
            "fault_ts_ns": w.fault_ts_ns, "window_start_ns": w.window_start_ns, "window_end_ns": w.window_end_ns,
            "node_down_ns": f.node_down_ns, "committed_ns": f.committed_ns, "detect_ms": f.detect_ms,
            "commit_ms": f.commit_ms, "failover_ms": f.failover_ms}


def _client_row(r: m.ClientRto) -> dict[str, Any]:
    return {"run_id": r.run_id, "fault_idx": r.fault_idx, "client_id": r.client_id, "family": r.family,
            "role": r.role, "rto_ms": r.rto_ms, "recovered": r.recovered, "max_gap_ms": r.max_gap_ms}


def _per_family(rto: list[m.ClientRto]) -> dict[str, Any]:
    by_family: dict[str, list[m.ClientRto]] = defaultdict(list)
    for r in rto:
        by_family[r.family].append(r)
    return {
        "rto_ms": {family: m.rto_group_stats(rs) for family, rs in sorted(by_family.items())},
        "max_gap_ms": {family: {**m.stats_ms([r.max_gap_ms for r in rs]), "clients": len(rs)}
                       for family, rs in sorted(by_family.items())},
    }


def _silences(silences: list[m.Silence]) -> dict[str, Any]:
    """{family: {p50, p99, max, clients, longest}} of the clients' longest silences over the
    whole run; ``longest`` names the client and when (to find it in the trace)."""
    by_family: dict[str, list[m.Silence]] = defaultdict(list)
    for s in silences:
        by_family[s.family].append(s)
    out: dict[str, Any] = {}
    for family, ss in sorted(by_family.items()):
        top = max(ss, key=lambda s: s.ms)
        out[family] = {**m.stats_ms([s.ms for s in ss]), "clients": len(ss),
                       "longest": {"client_id": top.client_id, "start_ns": top.start_ns, "end_ns": top.end_ns}}
    return out


def _record_fields(events: list[dict[str, Any]]) -> dict[str, Any]:
    records = m.record_outcomes(events)
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        if e["source"] == m.CLIENT:
            counts[e["event"]] += 1
    return {
        "lost": len(records.lost),
        "duplicated": len(records.duplicated),
        "duplicated_extra_deliveries": records.duplicated_extra,
        "unacked_consumed": records.unacked_consumed,
        "lost_keys": [_key_label(r) for r in records.lost[:MAX_KEYS_LISTED]],
        "duplicated_keys": sorted({_key_label(r) for r, _, _ in records.duplicated[:MAX_KEYS_LISTED]}),
        "missed_by_group": records.missed_by_group,
        "verified_topics": [topic for _, topic in records.verified_topics],
        "records": {"acked": records.acked, "consumed": records.consumed, "final_read": records.final_read,
                    "sent": counts["send"],
                    "consume_events": counts[m.CONSUME], "errors": counts["error"]},
    }


def summarize_events(events: list[dict[str, Any]], *, fault: str | None = None, repeat: int | None = None,
                     trace_dir: str | None = None) -> dict[str, Any]:
    """The drill summary of already loaded events (see ``summarize``)."""
    windows = m.fault_windows(events)
    rto = m.rto_per_client(events, windows)
    fo = m.failover(events, windows)
    records = _record_fields(events)
    unrecovered = [r for r in rto if not r.recovered]
    fault_names = sorted({w.fault for w in windows})
    drills = sum(1 for e in events if e["source"] == m.FLEET and e["event"] == m.BOUNDARY_ORDER[0])
    per_family = _per_family(rto)
    return {
        "fault": fault if fault is not None else ",".join(fault_names) or None,
        "repeat": repeat if repeat is not None else drills,
        "run_ids": sorted({e["run_id"] for e in events}),
        "trace_dir": trace_dir,
        "rto_ms": per_family["rto_ms"],
        "rto_ms_by_fault": m.rto_stats(rto),
        "max_gap_ms": per_family["max_gap_ms"],
        "longest_silence_ms": _silences(m.longest_silences(events)),
        "handback_gap_ms": _silences(m.handback_gaps(events)),
        **records,
        "faults": [_failover_row(f) for f in fo],
        "detect_ms": m.stats_ms([f.detect_ms for f in fo if f.detect_ms is not None]),
        "commit_ms": m.stats_ms([f.commit_ms for f in fo if f.commit_ms is not None]),
        "failover_ms": m.stats_ms([f.failover_ms for f in fo if f.failover_ms is not None]),
        "clients": [_client_row(r) for r in rto],
        "unrecovered": [{"run_id": r.run_id, "fault_idx": r.fault_idx, "client_id": r.client_id} for r in unrecovered],
        "recovered": not unrecovered,
        "events": len(events),
        "healthy": not records["lost"] and not records["duplicated"] and not unrecovered,
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

    p = argparse.ArgumentParser(prog="python -m chaos.drills.summary", description="Summarize a drill trace directory.")
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
