"""The drill measures, defined once: the text below, the parameters under it and a
pure-Python implementation. ``spark/transform.py`` computes the same measures in
Spark SQL (no UDFs: executors need no copy of our code) from the parameters here;
``tests/spark/test_measures_agree.py`` runs both on the same traces.

Input: the events of ``chaos.trace`` (one dict per event, every field present).

fault window
    Each ``fault`` event belongs to the drill that brackets it. Boundaries are
    the run's ``drill_start``, ``fault`` and ``drill_end`` events (source
    ``fleet``) in time order; ties at one instant go drill_start, fault,
    drill_end (``BOUNDARY_ORDER``), then by fault name and node, nulls first.
    A fault's window runs from the boundary just before it to the one just
    after it. Without one, the run's first or last event bounds it. Faults are
    numbered 0, 1, ... per run in time order (``fault_idx``); a fault without
    a name is ``UNKNOWN``.

RTO of one client for one fault (DESIGN §7)
    Success events are ``ack`` for a producer and ``consume`` for a consumer
    (``SUCCESS_EVENT``). The gap runs from the client's last success at or
    before the fault instant to its first success after it. No success after
    it inside the window: the gap ends at the window end and the client did
    not recover. No success before it: the gap starts at the client's first
    event. A client takes part in a fault if its first event is at or before
    the fault instant and its last event is at or after the window start. A
    client is a consumer if it has any ``consume`` event, a producer
    otherwise; its family is the least family name it reported (``UNKNOWN``
    without one).

max gap (the drill summary only; the Spark jobs do not compute it)
    ``max_gap_ms`` of one client for one fault: the longest interval without a
    success that overlaps the fault's *window* (not only its instant), built
    like the RTO gap (the client's first event stands in for a success before
    its first one; an open end stops at the window end). It catches what the
    undoing of a fault does to clients (a restarted node taking identities
    back, a rolling restart's SIGTERM after its drain). Always >= the RTO.

percentiles
    Exact, linear interpolation between closest ranks (Spark's ``percentile``,
    numpy's "linear"): sorted values v[0..n-1], position p*(n-1). Reports give
    ``PERCENTILES`` (p50, p99) and the max.

detect / commit
    detect_ms: fault -> the first ``node_down`` in the window at or after it.
    failover_ms: fault -> the first ``assignment_committed`` in the window at
    or after the fault (for a planned move, drain or rolling restart, the new
    map is published before the node goes down).
    commit_ms: that node_down (or the fault, when nothing was detected) -> that
    commit, 0 when the commit came first.

records: lost, duplicated
    A record is (run_id, topic, key, seq) (``RECORD_KEY``), counted from the
    client success events and the verifier's ``read`` events that carry a key
    or a seq. A topic is *verified* when the trace holds a ``read_end`` of the
    final read (source ``verifier``) for its (run_id, topic): the verifier read
    every partition from the start to its end after the drills.
    Lost: acknowledged and, in a verified topic, not in the final read; in a
    topic without a final read (older traces, a verifier that failed),
    consumed by no consumer group. Duplicated: read more than once by one
    reader. Readers are the consumer groups (a consumer without a group is its
    own group, named ``"client:" + client_id``) and the final read
    (``FINAL_READ``: a record twice in the log); ``duplicated`` counts (record,
    reader) pairs. Unacked-consumed: consumed by a group although no ack was
    seen (an at-least-once retry whose ack was lost; not an error). The drill
    summary also counts, per group, the acknowledged records of its topic that
    this group never read (``missed_by_group``).

Nothing here reads a clock or a random source: the same trace gives the same
measures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import attrs

NS_PER_MS = 1_000_000

CLIENT = "client"  # the ``source`` of client events
FLEET = "fleet"  # the ``source`` of fleet events
VERIFIER = "verifier"  # the ``source`` of the final read's events
VERIFIED_READ = "read"  # one record found by the final read
VERIFIED_END = "read_end"  # the final read of a topic reached the end of every partition
FINAL_READ = "final-read"  # the reader name of the final read in ``duplicated``
SUCCESS_EVENT = {"producer": "ack", "consumer": "consume"}  # per role
ACK = SUCCESS_EVENT["producer"]
CONSUME = SUCCESS_EVENT["consumer"]
SUCCESS_EVENTS = (ACK, CONSUME)
FAULT = "fault"
BOUNDARY_ORDER = ("drill_start", FAULT, "drill_end")  # window boundaries; ties at one instant in this order
BOUNDARY_RANK = {name: rank for rank, name in enumerate(BOUNDARY_ORDER)}
NODE_DOWN = "node_down"
COMMITTED = "assignment_committed"
UNKNOWN = "unknown"  # a fault without a name, a client without a family
NO_GROUP_READER = "client:"  # + client_id: the reader of a consume event without a group
RECORD_KEY = ("run_id", "topic", "key", "seq")
PERCENTILES = (0.5, 0.99)
FAULT_KEY = ("run_id", "fault_idx", "fault", "node", "fault_ts_ns", "window_start_ns", "window_end_ns")


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


def percentile_label(p: float) -> str:
    """0.5 -> "p50", 0.99 -> "p99": the keys and column prefixes of ``PERCENTILES``."""
    return f"p{round(p * 100)}"


def _percentiles(values: list[float]) -> dict[str, float | None]:
    return {percentile_label(p): percentile(values, p) for p in PERCENTILES}


def stats_ms(values: list[float]) -> dict[str, Any]:
    return {**_percentiles(values), "max": max(values) if values else None, "n": len(values)}


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
            (e for e in evs if e["source"] == FLEET and e["event"] in BOUNDARY_RANK),
            key=lambda e: (e["ts_ns"], BOUNDARY_RANK[e["event"]], _nulls_first(e["fault"]), _nulls_first(e["node"])),
        )
        faults = sorted((i for i, e in enumerate(bounds) if e["event"] == FAULT),
                        key=lambda i: (bounds[i]["ts_ns"], _nulls_first(bounds[i]["fault"]),
                                       _nulls_first(bounds[i]["node"])))
        for idx, i in enumerate(faults):
            e = bounds[i]
            out.append(FaultWindow(
                run_id=run_id,
                fault_idx=idx,
                fault=e["fault"] if e["fault"] is not None else UNKNOWN,
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
        if e["source"] == CLIENT and e["client_id"] is not None:
            per_client[(e["run_id"], e["client_id"])].append(e)
    out: list[ClientRto] = []
    for (run_id, client_id), evs in sorted(per_client.items()):
        first_ns = min(e["ts_ns"] for e in evs)
        last_ns = max(e["ts_ns"] for e in evs)
        ok = sorted(e["ts_ns"] for e in evs if e["event"] in SUCCESS_EVENTS)
        families = [e["family"] for e in evs if e["family"] is not None]
        family = min(families) if families else UNKNOWN
        role = "consumer" if any(e["event"] == CONSUME for e in evs) else "producer"
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


@attrs.frozen
class Silence:
    """A client's longest interval without a success over a whole run, heals and the time
    between faults included (what fault windows do not see: a stall after a heal)."""

    run_id: str
    client_id: str
    family: str
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_MS


def _successes(events: Iterable[dict[str, Any]]) -> tuple[dict[tuple[str, str], list[int]], dict[tuple[str, str], str]]:
    """Per (run, client): the sorted times of its successes, and its family."""
    per_client: dict[tuple[str, str], list[int]] = defaultdict(list)
    families: dict[tuple[str, str], str] = {}
    for e in events:
        if e["source"] == CLIENT and e["client_id"] is not None:
            key = (e["run_id"], e["client_id"])
            if e["family"] is not None:
                families[key] = min(families.get(key, e["family"]), e["family"])
            if e["event"] in SUCCESS_EVENTS:
                per_client[key].append(e["ts_ns"])
    for ok in per_client.values():
        ok.sort()
    return per_client, families


def longest_silences(events: list[dict[str, Any]]) -> list[Silence]:
    """Per client of each run: the longest interval between two of its consecutive successes
    (a client with fewer than two has none)."""
    per_client, families = _successes(events)
    out = []
    for (run_id, client_id), ok in sorted(per_client.items()):
        if len(ok) < 2:
            continue
        a, b = max(zip(ok, ok[1:]), key=lambda pair: pair[1] - pair[0])
        out.append(Silence(run_id, client_id, families.get((run_id, client_id), UNKNOWN), a, b))
    return out


NODE_BACK = "node_back"


def handback_gaps(events: list[dict[str, Any]]) -> list[Silence]:
    """Per node that came back (the fleet's ``node_back``: restarted, thawed, healed) and client
    of its run: the longest interval between two consecutive successes of the client that ends
    after the node came back and no later than the run's next fault (or its end): what the
    fleet's handback costs a client (the node taking its address and identities back, the
    survivors letting go; the map that marks the node up comes before ``node_back``, so an
    interval that began before it counts). One that spans a fault is that fault's RTO."""
    per_client, families = _successes(events)
    out: list[Silence] = []
    for run_id, evs in sorted(_by_run(events).items()):
        end_ns = max(e["ts_ns"] for e in evs)
        faults = sorted(e["ts_ns"] for e in evs if e["source"] == FLEET and e["event"] == FAULT)
        backs = sorted(e["ts_ns"] for e in evs if e["source"] == FLEET and e["event"] == NODE_BACK)
        clients = sorted((key, times) for key, times in per_client.items() if key[0] == run_id)
        for back in backs:
            until = next((f for f in faults if f > back), end_ns)
            since = max((f for f in faults if f <= back), default=0)
            for key, times in clients:
                gaps = [(a, b) for a, b in zip(times, times[1:]) if a >= since and back < b <= until]
                if gaps:
                    a, b = max(gaps, key=lambda pair: pair[1] - pair[0])
                    out.append(Silence(run_id, key[1], families.get(key, UNKNOWN), a, b))
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
        out.setdefault(fault, {})[family] = rto_group_stats(rs)
    return out


def rto_group_stats(rows: list[ClientRto]) -> dict[str, Any]:
    """{p50, p99, max, clients, unrecovered} of the RTOs of ``rows`` (at least one)."""
    values = [r.rto_ms for r in rows]
    return {**_percentiles(values), "max": max(values), "clients": len(rows),
            "unrecovered": sum(1 for r in rows if not r.recovered)}


@attrs.frozen
class Failover:
    window: FaultWindow
    node_down_ns: int | None
    committed_ns: int | None
    clients_back_ns: int | None = None  # the latest first success after the fault of its recovered clients

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

    @property
    def back_ms(self) -> float | None:
        """The commit (else node_down, else the fault) -> the clients back; 0 when they were back
        first (librdkafka moves by itself; a planned move), None when no client recovered."""
        if self.clients_back_ns is None:
            return None
        anchor = next(t for t in (self.committed_ns, self.node_down_ns, self.window.fault_ts_ns) if t is not None)
        return max(0.0, _ms(self.clients_back_ns - anchor))


def failover(events: list[dict[str, Any]], windows: list[FaultWindow],
             rto: list[ClientRto] | None = None) -> list[Failover]:
    """One row per fault; with ``rto`` (its clients' rows) also when the clients were back."""
    back: dict[tuple[str, int], int] = {}
    for r in rto or ():
        if r.recovered:
            back[(r.run_id, r.fault_idx)] = max(back.get((r.run_id, r.fault_idx), r.gap_end_ns), r.gap_end_ns)
    marks: dict[str, dict[str, list[int]]] = defaultdict(lambda: {NODE_DOWN: [], COMMITTED: []})
    for e in events:
        if e["source"] == FLEET and e["event"] in (NODE_DOWN, COMMITTED):
            marks[e["run_id"]][e["event"]].append(e["ts_ns"])
    out = []
    for w in windows:
        m = marks[w.run_id]
        downs = [t for t in m[NODE_DOWN] if w.fault_ts_ns <= t <= w.window_end_ns]
        down = min(downs) if downs else None
        # The first commit after the fault, even one before node_down: a planned move
        # publishes the new map first and only then stops the node (DESIGN §4).
        commits = [t for t in m[COMMITTED] if w.fault_ts_ns <= t <= w.window_end_ns]
        out.append(Failover(w, down, min(commits) if commits else None, back.get((w.run_id, w.fault_idx))))
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
    final_read: int = 0  # distinct records the final read found
    verified_topics: list[tuple[str, str]] = attrs.Factory(list)  # (run_id, topic) read to the end

    @property
    def duplicated_extra(self) -> int:
        return sum(times - 1 for _, _, times in self.duplicated)


def record_outcomes(events: Iterable[dict[str, Any]]) -> Records:
    acked: set[tuple[Any, ...]] = set()
    reads: dict[tuple[Any, ...], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    final_reads: dict[tuple[Any, ...], int] = defaultdict(int)
    verified: set[tuple[str, str]] = set()
    group_topics: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for e in events:
        if e["source"] == VERIFIER:
            if e["event"] == VERIFIED_END:
                verified.add((e["run_id"], e["topic"]))
            elif e["key"] is not None or e["seq"] is not None:
                final_reads[(e["run_id"], e["topic"], e["key"], e["seq"])] += 1
            continue
        if e["source"] != CLIENT or e["event"] not in SUCCESS_EVENTS:
            continue
        if e["key"] is None and e["seq"] is None:
            continue
        rec = (e["run_id"], e["topic"], e["key"], e["seq"])
        if e["event"] == ACK:
            acked.add(rec)
        else:
            reader = e["group"] if e["group"] is not None else NO_GROUP_READER + str(e["client_id"])
            reads[rec][reader] += 1
            group_topics[reader].add((e["run_id"], e["topic"]))

    def is_lost(r: tuple[Any, ...]) -> bool:
        return r not in final_reads if (r[0], r[1]) in verified else r not in reads

    lost = sorted((r for r in acked if is_lost(r)), key=_record_order)
    per_reader = [(r, g, n) for r, gs in reads.items() for g, n in gs.items()]
    per_reader += [(r, FINAL_READ, n) for r, n in final_reads.items()]
    duplicated = sorted(((r, g, n) for r, g, n in per_reader if n > 1), key=lambda x: (_record_order(x[0]), x[1]))
    unacked = sum(1 for r in reads if r not in acked)
    missed = {}
    for group, topics in sorted(group_topics.items()):
        missed[group] = sum(1 for r in acked if (r[0], r[1]) in topics and group not in reads.get(r, {}))
    return Records(len(acked), len(reads), lost, duplicated, unacked, missed, len(final_reads),
                   sorted(verified))


def _record_order(rec: tuple[Any, ...]) -> tuple[Any, ...]:
    run_id, topic, key, seq = rec
    return (run_id, _nulls_first(topic), _nulls_first(key), (seq is not None, seq or 0))


# ------------------------------------------------------------ per family
@attrs.frozen
class FamilyOutcome:
    """One client family over a trace: its clients' RTOs (every fault) and the records it lost
    (acked by one of its producers, read by no group) or duplicated (read twice by a group whose
    consumers are of this family)."""

    family: str
    clients: int
    rto_p50_ms: float | None
    rto_p99_ms: float | None
    rto_max_ms: float | None
    lost: int
    duplicated: int


def family_outcomes(events: list[dict[str, Any]]) -> list[FamilyOutcome]:
    """A row per client family (sorted by name), from the trace alone."""
    rto = rto_per_client(events, fault_windows(events))
    records = record_outcomes(events)
    acked_by: dict[tuple[Any, ...], str] = {}
    reader_family: dict[tuple[str, str], str] = {}
    clients: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for e in events:
        if e["source"] != CLIENT or e["client_id"] is None:
            continue
        family = e["family"] or UNKNOWN
        clients[family].add((e["run_id"], e["client_id"]))
        if e["event"] == ACK:
            acked_by[(e["run_id"], e["topic"], e["key"], e["seq"])] = family
        elif e["event"] == CONSUME:
            reader = e["group"] if e["group"] is not None else NO_GROUP_READER + str(e["client_id"])
            reader_family[(e["run_id"], reader)] = family
    lost: dict[str, int] = defaultdict(int)
    for rec in records.lost:
        lost[acked_by.get(rec, UNKNOWN)] += 1
    duplicated: dict[str, int] = defaultdict(int)
    for rec, group, _ in records.duplicated:
        duplicated[reader_family.get((rec[0], group), UNKNOWN)] += 1
    out = []
    for family in sorted(set(clients) | set(lost) | set(duplicated)):
        values = [r.rto_ms for r in rto if r.family == family]
        p = _percentiles(values) if values else {}
        out.append(FamilyOutcome(family, len(clients[family]), p.get("p50"), p.get("p99"),
                                 max(values) if values else None, lost[family], duplicated[family]))
    return out
