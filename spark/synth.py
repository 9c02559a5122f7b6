"""Synthetic traces with planted gaps, losses and duplicates, and their truth.

``generate(spec)`` builds a trace in memory (a pyarrow Table with every
``chaos.trace`` field) and a ``Truth`` computed from what it planted, with
plain numpy, independently of the Spark jobs:

* producers ack one record per ``period_ms``; around every fault each producer
  gets a planted gap (records whose ack would fall inside it fail with an
  ``error`` event instead), some gaps outlast the drill (``unrecovered``);
* consumers of every group read each acked record shortly after its ack, with
  a planted gap of their own per fault (deliveries held back until its end);
* ``lost`` acked records are read by no group; ``duplicated`` records are read
  twice by one group;
* every drill is bracketed by drill_start/drill_end, with node_down and
  assignment_committed at planted delays after the fault (and a decoy commit
  before the fault that must be ignored).

Used by the ground-truth tests (small traces, JSONL or Parquet) and the
benchmark (1M / 10M events, Parquet). Deterministic for a given spec (seed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from chaos.trace import CLIENT_FAMILIES, FIELDS, make_event

NS_PER_MS = 1_000_000
BASE_NS = 1_700_000_000_000 * NS_PER_MS  # 2023-11-14, an arbitrary fixed epoch
FAMILIES = tuple(sorted(CLIENT_FAMILIES))
PARTITIONS = 3
_ARROW = {"long": pa.int64(), "int": pa.int32(), "string": pa.string()}
_CLIENT_EVENTS = ("send", "ack", "error", "consume")  # event codes 0..3


@attrs.frozen
class SynthSpec:
    seed: int = 7
    runs: int = 1
    drills: int = 2  # per run
    faults: tuple[str, ...] = ("kill", "freeze", "partition", "leader-kill")  # cycled over drills
    producers: int = 2
    groups: int = 1
    consumers_per_group: int = 2
    period_ms: float = 10.0  # per producer: one record per period
    drill_ms: int = 3000  # drill_start -> drill_end
    lead_ms: int = 1000  # drill_start -> fault
    idle_ms: int = 500  # before, between and after drills
    max_gap_ms: int = 600  # planted gaps: up to this much on each side of the fault
    # per run:
    lost: int = 2  # acked records no group reads
    duplicated: int = 2  # records one group reads twice
    unrecovered: int = 1  # (producer, drill) gaps that last past drill_end
    topic: str = "synth"

    def __attrs_post_init__(self) -> None:
        if self.max_gap_ms >= min(self.lead_ms, self.drill_ms - self.lead_ms):
            raise ValueError("max_gap_ms must fit between drill_start, the fault and drill_end")
        if self.period_ms * 4 > self.max_gap_ms:
            raise ValueError("period_ms is too long for the planted gaps")
        if min(self.runs, self.drills, self.producers, self.groups, self.consumers_per_group) < 1:
            raise ValueError("runs, drills, producers, groups and consumers_per_group must be >= 1")

    @property
    def run_ms(self) -> int:
        return self.idle_ms + self.drills * (self.drill_ms + self.idle_ms)

    def records_per_producer(self) -> int:
        return int(self.run_ms // self.period_ms) - 1

    def approx_events(self) -> int:
        return self.runs * self.producers * self.records_per_producer() * (2 + self.groups)


def spec_for_events(events: int, seed: int = 7) -> SynthSpec:
    """A spec of about ``events`` events: 8 producers at 1 ms, one group of 4
    consumers, as many 10 s drills as it takes (up to 3 runs of them)."""
    producers, period_ms, drill_ms, idle_ms = 8, 1.0, 10_000, 1_000
    per_ms = producers / period_ms * 3  # send + ack + consume per record
    total_ms = events / per_ms
    runs = 1 if total_ms < 120_000 else 3
    drills = max(1, round((total_ms / runs - idle_ms) / (drill_ms + idle_ms)))
    return SynthSpec(
        seed=seed,
        runs=runs,
        drills=drills,
        producers=producers,
        groups=1,
        consumers_per_group=4,
        period_ms=period_ms,
        drill_ms=drill_ms,
        lead_ms=3_000,
        idle_ms=idle_ms,
        max_gap_ms=1_500,
        lost=5,
        duplicated=5,
        unrecovered=1,
    )


@attrs.frozen
class Truth:
    """What the generator planted, in the units of the job outputs."""

    rto: tuple[dict[str, Any], ...]  # run_id, fault_idx, fault, client_id, family, role, gap_start_ns, gap_end_ns, rto_ms, recovered
    failover: tuple[dict[str, Any], ...]  # run_id, fault_idx, fault, node, fault_ts_ns, node_down_ns, committed_ns, detect_ms, commit_ms
    lost: frozenset[tuple[str, str, str, int]]  # (run_id, topic, key, seq)
    duplicated: dict[tuple[str, str, str, str, int], int]  # (run_id, topic, group, key, seq) -> times
    producer_gaps: dict[tuple[str, int, str], tuple[int, int]]  # (run_id, fault_idx, client) -> planted (last ack, first ack)
    events: int


def generate(spec: SynthSpec) -> tuple[pa.Table, Truth]:
    rng = np.random.default_rng(spec.seed)
    tables: list[pa.Table] = []
    truth_rto: list[dict[str, Any]] = []
    truth_failover: list[dict[str, Any]] = []
    lost: set[tuple[str, str, str, int]] = set()
    duplicated: dict[tuple[str, str, str, str, int], int] = {}
    producer_gaps: dict[tuple[str, int, str], tuple[int, int]] = {}
    for run in range(spec.runs):
        run_id = f"run-{run}"
        run_start = BASE_NS + run * (spec.run_ms + 60_000) * NS_PER_MS
        built = _build_run(spec, rng, run_id, run_start)
        tables.append(built.pop("table"))
        truth_rto.extend(built["rto"])
        truth_failover.extend(built["failover"])
        lost |= built["lost"]
        duplicated.update(built["duplicated"])
        producer_gaps.update(built["producer_gaps"])
    table = pa.concat_tables(tables)
    truth = Truth(
        rto=tuple(truth_rto),
        failover=tuple(truth_failover),
        lost=frozenset(lost),
        duplicated=duplicated,
        producer_gaps=producer_gaps,
        events=table.num_rows,
    )
    return table, truth


def _build_run(spec: SynthSpec, rng: np.random.Generator, run_id: str, run_start: int) -> dict[str, Any]:
    period = int(spec.period_ms * NS_PER_MS)
    n = spec.records_per_producer()
    drill_starts = [run_start + (spec.idle_ms + d * (spec.drill_ms + spec.idle_ms)) * NS_PER_MS for d in range(spec.drills)]
    drill_ends = [s + spec.drill_ms * NS_PER_MS for s in drill_starts]
    # Off the ack grid by half a period: no ack ever lands on a fault instant.
    fault_ts = [s + spec.lead_ms * NS_PER_MS + period // 2 for s in drill_starts]
    fault_names = [spec.faults[d % len(spec.faults)] for d in range(spec.drills)]

    fleet_rows, failover_truth = _fleet_events(spec, rng, run_id, drill_starts, drill_ends, fault_ts, fault_names)

    producer_ids, ack_grid, acked, producer_gaps = _producer_acks(spec, rng, run_id, run_start, period, fault_ts,
                                                                  drill_ends)

    # Records: index r = p * n + i; key "<producer>-<i>", seq i.
    rec_producer = np.repeat(np.arange(spec.producers), n)
    rec_seq = np.tile(np.arange(n, dtype=np.int64), spec.producers)
    rec_ack = np.tile(ack_grid, spec.producers)
    rec_acked = acked.reshape(-1)
    latency = period // 2

    consumers = _consumer_deliveries(spec, rng, run_id, rec_producer, rec_seq, rec_ack, rec_acked, latency, fault_ts)

    # -- client event arrays
    n_rec = len(rec_seq)
    rec_idx = np.arange(n_rec)
    d_rec, d_cons, d_ts = consumers.record, consumers.consumer, consumers.ts
    ev_rec = np.concatenate([rec_idx, rec_idx, d_rec])
    ev_code = np.concatenate([np.zeros(n_rec, np.int8), np.where(rec_acked, 1, 2).astype(np.int8), np.full(len(d_rec), 3, np.int8)])
    ev_ts = np.concatenate([rec_ack - latency, rec_ack, d_ts])
    # client index: producers 0..P-1, consumers P..
    ev_client = np.concatenate([rec_producer, rec_producer, spec.producers + d_cons])
    clients = producer_ids + consumers.ids
    families = [FAMILIES[p % len(FAMILIES)] for p in range(spec.producers)] + consumers.families
    client_group = [-1] * spec.producers + consumers.groups
    order = np.lexsort((ev_ts, ev_client))
    ev_rec, ev_code, ev_ts, ev_client = ev_rec[order], ev_code[order], ev_ts[order], ev_client[order]

    table = pa.concat_tables(
        [
            _client_table(spec, run_id, clients, families, client_group, rec_producer, rec_seq, producer_ids, ev_rec, ev_code, ev_ts, ev_client),
            pa.Table.from_pylist(fleet_rows, schema=arrow_schema()),
        ]
    )

    rto_truth = _rto_truth(spec, run_id, clients, families, ev_client, ev_ts, ev_code, fault_ts, drill_starts,
                           drill_ends, fault_names)
    lost_truth = {(run_id, spec.topic, f"{producer_ids[rec_producer[r]]}-{rec_seq[r]}", int(rec_seq[r])) for r in consumers.lost}
    dup_truth = {
        (run_id, spec.topic, f"g{g}", f"{producer_ids[rec_producer[r]]}-{rec_seq[r]}", int(rec_seq[r])): 2
        for r, g in zip(consumers.duplicated, consumers.duplicated_groups)
    }
    return {
        "table": table,
        "rto": rto_truth,
        "failover": failover_truth,
        "lost": lost_truth,
        "duplicated": dup_truth,
        "producer_gaps": producer_gaps,
    }


@attrs.frozen
class _Consumers:
    """The consumers of every group and what they read: one delivery per (record, consumer, ts)."""

    ids: list[str]
    groups: list[int]  # group index of each consumer
    families: list[str]
    record: np.ndarray  # per delivery: record index
    consumer: np.ndarray  # per delivery: consumer index (into ids)
    ts: np.ndarray  # per delivery
    lost: np.ndarray  # acked records no group reads
    duplicated: np.ndarray  # records one group reads twice …
    duplicated_groups: np.ndarray  # … and which group


def _consumer_deliveries(spec: SynthSpec, rng: np.random.Generator, run_id: str, rec_producer: np.ndarray,
                         rec_seq: np.ndarray, rec_ack: np.ndarray, rec_acked: np.ndarray, latency: int,
                         fault_ts: list[int]) -> _Consumers:
    """Every acked record but the lost ones to one consumer per group, each consumer holding its
    deliveries back over a planted gap around every fault; the duplicated ones twice to one group."""
    consumer_ids: list[str] = []
    consumer_group: list[int] = []
    consumer_family: list[str] = []
    deliveries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (record, consumer, ts)
    acked_records = np.flatnonzero(rec_acked)
    lost_records = rng.choice(acked_records, size=min(spec.lost, len(acked_records)), replace=False)
    kept = np.setdiff1d(acked_records, lost_records)
    dup_records = rng.choice(kept, size=min(spec.duplicated, len(kept)), replace=False)
    dup_groups = rng.integers(0, spec.groups, size=len(dup_records))
    for g in range(spec.groups):
        base = len(consumer_ids)
        for c in range(spec.consumers_per_group):
            consumer_ids.append(f"{run_id}-g{g}-consumer-{c}")
            consumer_group.append(g)
            consumer_family.append(FAMILIES[(c + g + 1) % len(FAMILIES)])
        owner = base + (rec_producer[kept] + rec_seq[kept]) % spec.consumers_per_group
        ts = rec_ack[kept] + latency // 2 + g * 1_000
        for c in range(spec.consumers_per_group):
            mine = owner == base + c
            for d in range(spec.drills):
                hold_from = fault_ts[d] - int(rng.integers(0, spec.max_gap_ms // 2)) * NS_PER_MS
                release = fault_ts[d] + int(rng.integers(1, spec.max_gap_ms // 2)) * NS_PER_MS
                held = mine & (ts > hold_from) & (ts < release)
                ts = np.where(held, release, ts)
        extra = dup_records[dup_groups == g]
        extra_owner = base + (rec_producer[extra] + rec_seq[extra]) % spec.consumers_per_group
        extra_ts = ts[np.searchsorted(kept, extra)] + 1_000
        deliveries.append(
            (np.concatenate([kept, extra]), np.concatenate([owner, extra_owner]), np.concatenate([ts, extra_ts]))
        )
    return _Consumers(
        ids=consumer_ids,
        groups=consumer_group,
        families=consumer_family,
        record=np.concatenate([x[0] for x in deliveries]),
        consumer=np.concatenate([x[1] for x in deliveries]),
        ts=np.concatenate([x[2] for x in deliveries]),
        lost=lost_records,
        duplicated=dup_records,
        duplicated_groups=dup_groups,
    )


def _fleet_events(spec: SynthSpec, rng: np.random.Generator, run_id: str, drill_starts: list[int],
                  drill_ends: list[int], fault_ts: list[int],
                  fault_names: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The fleet events of every drill, and the failover figures they plant."""
    fleet_rows: list[dict[str, Any]] = []
    failover_truth: list[dict[str, Any]] = []
    for d in range(spec.drills):
        node = f"proxy-{d % 3 + 1}"
        detect = int(rng.integers(5_000, 300_000)) * 1_000  # 5..300 ms, µs resolution
        commit = int(rng.integers(1_000, 80_000)) * 1_000
        down_ts = fault_ts[d] + detect
        commit_ts = down_ts + commit
        fleet_rows += [
            make_event("fleet", "drill_start", ts_ns=drill_starts[d], run_id=run_id, fault=fault_names[d]),
            make_event("fleet", "assignment_committed", ts_ns=drill_starts[d] + 1, run_id=run_id, epoch=2 * d, detail="{}"),
            make_event("fleet", "fault", ts_ns=fault_ts[d], run_id=run_id, fault=fault_names[d], node=node),
            make_event("fleet", "node_down", ts_ns=down_ts, run_id=run_id, node=node, epoch=2 * d + 1),
            make_event("fleet", "assignment_committed", ts_ns=commit_ts, run_id=run_id, epoch=2 * d + 2, detail="{}"),
            make_event("fleet", "node_back", ts_ns=commit_ts + 500 * NS_PER_MS, run_id=run_id, node=node),
            make_event("fleet", "drill_end", ts_ns=drill_ends[d], run_id=run_id, fault=fault_names[d]),
        ]
        failover_truth.append(
            {
                "run_id": run_id,
                "fault_idx": d,
                "fault": fault_names[d],
                "node": node,
                "fault_ts_ns": fault_ts[d],
                "node_down_ns": down_ts,
                "committed_ns": commit_ts,
                "detect_ms": detect / NS_PER_MS,
                "commit_ms": commit / NS_PER_MS,
            }
        )
    return fleet_rows, failover_truth


def _producer_acks(spec: SynthSpec, rng: np.random.Generator, run_id: str, run_start: int, period: int,
                   fault_ts: list[int], drill_ends: list[int]
                   ) -> tuple[list[str], np.ndarray, np.ndarray, dict[tuple[str, int, str], tuple[int, int]]]:
    """Producer ids, the ack grid, which grid acks happen (a planted gap around every fault,
    some never recovered before drill_end) and each planted gap."""
    n = spec.records_per_producer()
    max_gap_periods = int(spec.max_gap_ms * NS_PER_MS // period)
    unrecovered = set()
    pairs = [(p, d) for p in range(spec.producers) for d in range(spec.drills)]
    for index in rng.choice(len(pairs), size=min(spec.unrecovered, len(pairs)), replace=False):
        unrecovered.add(pairs[int(index)])
    producer_ids = [f"{run_id}-producer-{p}" for p in range(spec.producers)]
    ack_grid = run_start + np.arange(1, n + 1, dtype=np.int64) * period
    acked = np.ones((spec.producers, n), dtype=bool)
    producer_gaps: dict[tuple[str, int, str], tuple[int, int]] = {}
    for p in range(spec.producers):
        for d in range(spec.drills):
            at_fault = int((fault_ts[d] - ack_grid[0]) // period)  # last grid index <= fault
            last_ok = at_fault - int(rng.integers(0, max_gap_periods // 2 + 1))
            if (p, d) in unrecovered:
                first_ok = int((drill_ends[d] - ack_grid[0]) // period) + 1  # first ack after drill_end
            else:
                first_ok = at_fault + int(rng.integers(1, max_gap_periods // 2 + 1))
            acked[p, last_ok + 1 : first_ok] = False
            producer_gaps[(run_id, d, producer_ids[p])] = (int(ack_grid[last_ok]), int(ack_grid[first_ok]))
    return producer_ids, ack_grid, acked, producer_gaps


def _rto_truth(spec: SynthSpec, run_id: str, clients: list[str], families: list[str], ev_client: np.ndarray,
               ev_ts: np.ndarray, ev_code: np.ndarray, fault_ts: list[int], drill_starts: list[int],
               drill_ends: list[int], fault_names: list[str]) -> list[dict[str, Any]]:
    """The RTO of every (fault, participating client), from the planted arrays (numpy, not Spark)."""
    success = ev_code != 0
    success &= ev_code != 2
    rto_truth: list[dict[str, Any]] = []
    for ci, client in enumerate(clients):
        mine = ev_client == ci
        all_ts = ev_ts[mine]
        ok_ts = np.sort(ev_ts[mine & success])
        first, last = int(all_ts.min()), int(all_ts.max())
        for d in range(spec.drills):
            if not (first <= fault_ts[d] and last >= drill_starts[d]):
                continue
            pos = int(np.searchsorted(ok_ts, fault_ts[d], side="right"))
            start = int(ok_ts[pos - 1]) if pos > 0 else first
            after = int(ok_ts[pos]) if pos < len(ok_ts) else None
            recovered = after is not None and after <= drill_ends[d]
            end = after if recovered else drill_ends[d]
            assert end is not None
            rto_truth.append(
                {
                    "run_id": run_id,
                    "fault_idx": d,
                    "fault": fault_names[d],
                    "client_id": client,
                    "family": families[ci],
                    "role": "consumer" if ci >= spec.producers else "producer",
                    "gap_start_ns": start,
                    "gap_end_ns": end,
                    "rto_ms": (end - start) / NS_PER_MS,
                    "recovered": recovered,
                }
            )
    return rto_truth


def arrow_schema() -> pa.Schema:
    return pa.schema([pa.field(name, _ARROW[kind]) for name, kind in FIELDS])


def _take(values: list[Any], codes: np.ndarray, type_: pa.DataType = pa.string()) -> pa.Array:
    """values[codes] as an Arrow array; negative codes become nulls."""
    mask = codes < 0
    indices = pa.array(np.where(mask, 0, codes).astype(np.int32), mask=mask)
    return pa.array(values, type=type_).take(indices)


def _client_table(
    spec: SynthSpec,
    run_id: str,
    clients: list[str],
    families: list[str],
    client_group: list[int],
    rec_producer: np.ndarray,
    rec_seq: np.ndarray,
    producer_ids: list[str],
    ev_rec: np.ndarray,
    ev_code: np.ndarray,
    ev_ts: np.ndarray,
    ev_client: np.ndarray,
) -> pa.Table:
    n = len(ev_ts)
    seq = rec_seq[ev_rec]
    prefix = _take(producer_ids, rec_producer[ev_rec])
    key = pc.binary_join_element_wise(prefix, pc.cast(pa.array(seq), pa.string()), "-")
    placed = ev_code != 0  # ack, error and consume carry partition/offset
    group_codes = np.asarray(client_group, dtype=np.int64)[ev_client]
    columns = {
        "ts_ns": pa.array(ev_ts, pa.int64()),
        "run_id": pa.repeat(pa.scalar(run_id), n),
        "source": pa.repeat(pa.scalar("client"), n),
        "event": _take(list(_CLIENT_EVENTS), ev_code.astype(np.int64)),
        "client_id": _take(clients, ev_client),
        "family": _take(families, ev_client),
        "topic": pa.repeat(pa.scalar(spec.topic), n),
        "partition": pa.array((seq % PARTITIONS).astype(np.int32), pa.int32(), mask=~placed),
        "offset": pa.array(seq, pa.int64(), mask=~placed),
        "key": key,
        "seq": pa.array(seq, pa.int64()),
        "group": _take([f"g{g}" for g in range(spec.groups)], group_codes),
        "fault": pa.nulls(n, pa.string()),
        "node": pa.nulls(n, pa.string()),
        "epoch": pa.nulls(n, pa.int64()),
        "detail": pa.nulls(n, pa.string()),
    }
    return pa.table([columns[name] for name, _ in FIELDS], schema=arrow_schema())


# -- writing ----------------------------------------------------------------------


def _by_process(table: pa.Table) -> Iterable[tuple[str, pa.Table]]:
    """One table per writing process: each client, and the fleet per run."""
    names = pc.if_else(
        pc.equal(table["source"], "client"),
        table["client_id"],
        pc.binary_join_element_wise(table["run_id"], pa.scalar("fleet"), "-"),
    )
    table = table.append_column("_proc", names)
    for name in sorted(set(names.to_pylist())):
        part = table.filter(pc.equal(table["_proc"], name)).drop_columns(["_proc"])
        yield name, part.sort_by("ts_ns")


def write_parquet(table: pa.Table, trace_dir: str | Path, row_group_size: int = 1_000_000) -> list[Path]:
    root = Path(trace_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in _by_process(table):
        path = root / f"{name}.parquet"
        pq.write_table(part, path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def write_jsonl(table: pa.Table, trace_dir: str | Path) -> list[Path]:
    """JSON lines as ``chaos.trace.TraceWriter`` writes them (one file per process)."""
    root = Path(trace_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in _by_process(table):
        path = root / f"{name}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for row in part.to_pylist():
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")
        paths.append(path)
    return paths


def write_trace(spec: SynthSpec, trace_dir: str | Path, fmt: str = "parquet") -> Truth:
    table, truth = generate(spec)
    if fmt == "parquet":
        write_parquet(table, trace_dir)
    elif fmt == "jsonl":
        write_jsonl(table, trace_dir)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return truth


DEMO_SPEC = SynthSpec(seed=11, drills=3, producers=3, groups=2, consumers_per_group=2, period_ms=20.0)


def write_demo_trace(trace_dir: str | Path) -> Path:
    """A small JSONL trace (about 4,000 events) for trying the report and the notebook."""
    write_trace(DEMO_SPEC, trace_dir, fmt="jsonl")
    return Path(trace_dir)
