"""The measures are defined once (chaos.measures) and implemented twice: in pure Python for the
drill summary and in Spark SQL for the reports. Both run here on the same hand-made trace and
must give the figures worked out by hand in the comments.

The trace (one run, times in ms) covers the parameters of the definitions: the boundary tie
order (a fault at the same instant as its drill_start), a success at the fault instant (counts
as before it), a client without a success before the fault, a client that never recovers, a
client that joins after a fault (takes no part in it), a planned move (commit before
node_down: commit 0), a consumer without a group (its own reader), lost, duplicated and
unacked-consumed records.
"""

from __future__ import annotations

from typing import Any

import pytest

from chaos import measures
from chaos.trace import make_event
from spark import transform
from spark.schema import TRACE_SCHEMA

pytestmark = pytest.mark.spark

MS = 1_000_000
T0_MS = 1_700_000_000_000


def ns(ms: int) -> int:
    return (T0_MS + ms) * MS


def fleet(at: int, event: str, **fields: Any) -> dict[str, Any]:
    return make_event("fleet", event, ts_ns=ns(at), run_id="r1", **fields)


def client(at: int, event: str, cid: str, family: str, key: str | None = None, topic: str = "t",
           **fields: Any) -> dict[str, Any]:
    seq = None if key is None else int(key.split(".")[1])
    return make_event("client", event, ts_ns=ns(at), run_id="r1", client_id=cid, family=family, topic=topic,
                      key=key, seq=seq, **fields)


def final_read(at: int, key: str, offset: int) -> dict[str, Any]:
    return make_event("verifier", "read", ts_ns=ns(at), run_id="r1", topic="v", partition=0, offset=offset,
                      key=key, seq=int(key.split(".")[1]))


TRACE = [
    # drill 1: kill p1 at 2000; window [1000, 6000]; detect 150, commit 250, failover 400
    fleet(1000, "drill_start", fault="kill"),
    fleet(2000, "fault", fault="kill", node="p1"),
    fleet(2150, "node_down", node="p1", epoch=2),
    fleet(2400, "assignment_committed", epoch=3, detail="{}"),
    fleet(6000, "drill_end", fault="kill"),
    # drill 2: drain p2 at 7000, the instant of its drill_start: drill_start sorts first, so the
    # window starts at 7000 (not at the drill_end at 6000); window [7000, 9000].
    # Planned move: commit at 7100 before node_down at 7300: detect 300, failover 100, commit 0.
    fleet(7000, "drill_start", fault="drain"),
    fleet(7000, "fault", fault="drain", node="p2"),
    fleet(7100, "assignment_committed", epoch=4, detail="{}"),
    fleet(7300, "node_down", node="p2", epoch=4),
    fleet(9000, "drill_end", fault="drain"),
    # ap (aiokafka producer): fault 0: 1900 -> 2500 = 600; fault 1: the ack AT 7000 is before it,
    # then 7600: 600.
    *(client(at, "ack", "ap", "aiokafka", f"1.{i}", partition=0, offset=i)
      for i, at in enumerate((500, 1900, 2500, 7000, 7600, 8000))),
    # kc (kafka-python consumer, group g): fault 0: 1500 -> 2900 = 1400; fault 1: 2900 -> 7500 = 4600.
    # Reads 1.1 twice: one duplicated (record, group) pair.
    client(1500, "consume", "kc", "kafka-python", "1.0", group="g", partition=0, offset=0),
    client(2900, "consume", "kc", "kafka-python", "1.1", group="g", partition=0, offset=1),
    client(7500, "consume", "kc", "kafka-python", "1.1", group="g", partition=0, offset=1),
    # jp (java producer): first event 2300 > fault 0: takes no part in it. Fault 1: last success
    # 6500, none after, last event (an error) 7200 >= window start: gap 6500 -> 9000 = 2500, not recovered.
    client(2300, "ack", "jp", "java", "2.0", partition=1, offset=0),
    client(6500, "ack", "jp", "java", "2.1", partition=1, offset=1),
    client(7200, "error", "jp", "java", detail="timeout"),
    # cc (confluent consumer, no group: reader "client:cc"): no success before fault 0, so the gap
    # starts at its first event 1800 -> 2600 = 800. Last event 2600 < 7000: not in fault 1.
    # Reads 1.2, and 3.0 that nobody acknowledged (unacked-consumed).
    client(1800, "error", "cc", "confluent", detail="connect"),
    client(2600, "consume", "cc", "confluent", "1.2", partition=0, offset=2),
    client(2600, "consume", "cc", "confluent", "3.0", partition=2, offset=0),
    # Topic v, after the drills (its clients take part in no fault), read to the end by the final
    # read: acked 5.0-5.3; group gv read 5.0 and 5.1; the final read found 5.0, 5.2 twice and 9.9.
    # Lost: 5.1 (a group read it, the log has it not) and 5.3. Duplicated: 5.2 by the final read.
    # 9.9 (unacked, read only by the final read) is not unacked-consumed: no group consumed it.
    *(client(9500 + i, "ack", "vp", "aiokafka", f"5.{i}", topic="v", partition=0, offset=i) for i in range(4)),
    client(9600, "consume", "vc", "confluent", "5.0", topic="v", group="gv", partition=0, offset=0),
    client(9600, "consume", "vc", "confluent", "5.1", topic="v", group="gv", partition=0, offset=1),
    final_read(9700, "5.0", 0), final_read(9700, "5.2", 2), final_read(9700, "5.2", 3), final_read(9700, "9.9", 4),
    make_event("verifier", "read_end", ts_ns=ns(9701), run_id="r1", topic="v", detail='{"0": 5}'),
]

EXPECTED_WINDOWS = {0: (ns(1000), ns(6000)), 1: (ns(7000), ns(9000))}
EXPECTED_RTO = {  # (fault_idx, client) -> (rto_ms, recovered, role, family)
    (0, "ap"): (600.0, True, "producer", "aiokafka"),
    (0, "kc"): (1400.0, True, "consumer", "kafka-python"),
    (0, "cc"): (800.0, True, "consumer", "confluent"),
    (1, "ap"): (600.0, True, "producer", "aiokafka"),
    (1, "kc"): (4600.0, True, "consumer", "kafka-python"),
    (1, "jp"): (2500.0, False, "producer", "java"),
}
EXPECTED_FAILOVER = {0: (150.0, 250.0, 400.0), 1: (300.0, 0.0, 100.0)}  # detect, commit, failover
# Clients back: the latest first success after the fault of the recovered clients, from the commit.
# Fault 0: ap 2500, kc 2900, cc 2600 -> 2900, commit 2400: 500. Fault 1: ap 7600, kc 7500 (jp never
# recovered) -> 7600, commit 7100: 500.
EXPECTED_BACK = {0: (ns(2900), 500.0), 1: (ns(7600), 500.0)}
# Topic t (no final read): acked 1.0-1.5, 2.0, 2.1. Read: 1.0, 1.1 (g), 1.2 (client:cc). Lost:
# the other five. Topic v: see above.
EXPECTED_LOST = {"1.3", "1.4", "1.5", "2.0", "2.1", "5.1", "5.3"}
EXPECTED_DUPLICATED = {("1.1", "g", 2), ("5.2", measures.FINAL_READ, 2)}
EXPECTED_UNACKED = {"3.0"}


def test_pure_python_measures_give_the_hand_computed_figures():
    windows = measures.fault_windows(TRACE)
    assert {w.fault_idx: (w.window_start_ns, w.window_end_ns) for w in windows} == EXPECTED_WINDOWS
    rto = measures.rto_per_client(TRACE, windows)
    assert {(r.fault_idx, r.client_id): (r.rto_ms, r.recovered, r.role, r.family) for r in rto} == EXPECTED_RTO
    fo = measures.failover(TRACE, windows)
    assert {f.window.fault_idx: (f.detect_ms, f.commit_ms, f.failover_ms) for f in fo} == EXPECTED_FAILOVER
    assert all(f.back_ms is None for f in fo)  # without the clients' rows
    fo = measures.failover(TRACE, windows, rto)
    assert {f.window.fault_idx: (f.clients_back_ns, f.back_ms) for f in fo} == EXPECTED_BACK
    records = measures.record_outcomes(TRACE)
    assert {r[2] for r in records.lost} == EXPECTED_LOST
    assert {(r[2], group, times) for r, group, times in records.duplicated} == EXPECTED_DUPLICATED
    assert records.unacked_consumed == len(EXPECTED_UNACKED)


def test_spark_measures_give_the_same_figures(spark_session):  # type: ignore[no-untyped-def]
    events = spark_session.createDataFrame(TRACE, TRACE_SCHEMA)
    faults = transform.fault_windows(events)
    assert {r["fault_idx"]: (r["window_start_ns"], r["window_end_ns"]) for r in faults.collect()} == EXPECTED_WINDOWS
    rto = transform.rto_per_client(events, faults).collect()
    assert {(r["fault_idx"], r["client_id"]): (r["rto_ms"], r["recovered"], r["role"], r["family"])
            for r in rto} == EXPECTED_RTO
    fo = transform.failover(events, faults).collect()
    assert {r["fault_idx"]: (r["detect_ms"], r["commit_ms"], r["failover_ms"]) for r in fo} == EXPECTED_FAILOVER
    back = transform.with_clients_back(transform.failover(events, faults),
                                       transform.rto_per_client(events, faults)).collect()
    assert {r["fault_idx"]: (r["clients_back_ns"], r["back_ms"]) for r in back} == EXPECTED_BACK
    outcomes = transform.record_outcomes(events)
    assert {r["key"] for r in transform.lost(outcomes).collect()} == EXPECTED_LOST
    assert {(r["key"], r["group"], r["times"]) for r in transform.duplicated(outcomes).collect()} == EXPECTED_DUPLICATED
    assert {r["key"] for r in transform.unacked_consumed(outcomes).collect()} == EXPECTED_UNACKED


def test_spark_records_the_same_in_the_two_pass_plan(spark_session):  # type: ignore[no-untyped-def]
    events = spark_session.createDataFrame(TRACE, TRACE_SCHEMA)
    outcomes = transform.record_outcomes(events, max_pivot=0)
    assert {r["key"] for r in transform.lost(outcomes).collect()} == EXPECTED_LOST
    assert {(r["key"], r["group"], r["times"]) for r in transform.duplicated(outcomes).collect()} == EXPECTED_DUPLICATED
    assert {r["key"] for r in transform.unacked_consumed(outcomes).collect()} == EXPECTED_UNACKED
