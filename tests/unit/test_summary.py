"""chaos.measures over hand-made traces; every expected figure was worked out by hand (see comments)."""

from __future__ import annotations

import json

import pytest

from chaos import measures, trace
from chaos.drills import summary
from chaos.trace import TraceWriter, make_event

pytestmark = pytest.mark.unit

MS = 1_000_000


def ev(ts_ms: float, source: str, event: str, run_id: str = "r1", **fields):
    return make_event(source, event, ts_ns=int(ts_ms * MS), run_id=run_id, **fields)


def fleet(ts_ms, event, **fields):
    return ev(ts_ms, "fleet", event, **fields)


def ack(ts_ms, client, family, key, **kw):
    return ev(ts_ms, "client", "ack", client_id=client, family=family, topic="t", key=key,
              seq=int(key.split(".")[1]), partition=0, offset=0, **kw)


def consume(ts_ms, client, family, key, group):
    return ev(ts_ms, "client", "consume", client_id=client, family=family, topic="t", key=key,
              seq=int(key.split(".")[1]), partition=0, offset=0, group=group)


def error(ts_ms, client, family, **kw):
    return ev(ts_ms, "client", "error", client_id=client, family=family, topic="t", detail="boom", **kw)


# One drill, one kill fault at t=2000 ms; window [1000, 9000].
TRACE_A = [
    fleet(1000, "drill_start", fault="kill"),
    fleet(2000, "fault", fault="kill", node="p1"),
    fleet(2150, "node_down", node="p1", epoch=7),
    fleet(2400, "assignment_committed", epoch=8, detail="{}"),
    fleet(9000, "drill_end", fault="kill"),
    # ap (aiokafka producer): last ack <= 2000 is 1900, first after is 2500 -> RTO 600
    ack(500, "ap", "aiokafka", "1.0"), ack(1000, "ap", "aiokafka", "1.1"), ack(1900, "ap", "aiokafka", "1.2"),
    ack(2500, "ap", "aiokafka", "1.3"), ack(3000, "ap", "aiokafka", "1.4"),
    # ac (aiokafka consumer, group g): 1950 -> 3100 = 1150; reads 1.2 twice (one duplicate);
    # reads 9.9 that nobody acked (unacked-consumed)
    consume(600, "ac", "aiokafka", "1.0", "g"), consume(700, "ac", "aiokafka", "4.0", "g"),
    consume(1950, "ac", "aiokafka", "1.1", "g"), consume(3100, "ac", "aiokafka", "1.2", "g"),
    consume(3200, "ac", "aiokafka", "1.2", "g"), consume(3300, "ac", "aiokafka", "1.3", "g"),
    consume(3400, "ac", "aiokafka", "9.9", "g"),
    # cp (confluent producer): 1800 -> 7000 = 5200
    ack(1200, "cp", "confluent", "2.0"), ack(1800, "cp", "confluent", "2.1"), ack(7000, "cp", "confluent", "2.2"),
    # cc (confluent consumer, group h): first event 2500 is after the fault -> takes no part
    consume(2500, "cc", "confluent", "2.0", "h"), consume(4000, "cc", "confluent", "1.4", "h"),
    consume(4100, "cc", "confluent", "2.1", "h"), consume(7100, "cc", "confluent", "2.2", "h"),
    # kp (kafka-python producer): ack 1500, then only an error after drill_end -> unrecovered,
    # gap 1500 -> window end 9000 = 7500; 3.0 is acked and never consumed (lost)
    ack(1500, "kp", "kafka-python", "3.0"), error(9500, "kp", "kafka-python", key="3.1", seq=1),
    # jp (java producer): events only at 100 and 200, before the window start 1000 -> takes no part;
    # 4.1 is acked and never consumed (lost)
    ack(100, "jp", "java", "4.0"), ack(200, "jp", "java", "4.1"),
]


def test_fault_window_a():
    (w,) = measures.fault_windows(TRACE_A)
    assert (w.fault, w.node, w.fault_ts_ns, w.window_start_ns, w.window_end_ns) == (
        "kill", "p1", 2000 * MS, 1000 * MS, 9000 * MS)


def test_rto_per_client_a():
    rows = {r.client_id: r for r in measures.rto_per_client(TRACE_A, measures.fault_windows(TRACE_A))}
    assert sorted(rows) == ["ac", "ap", "cp", "kp"]
    assert rows["ap"].rto_ms == 600 and rows["ap"].recovered and rows["ap"].role == "producer"
    assert rows["ac"].rto_ms == 1150 and rows["ac"].recovered and rows["ac"].role == "consumer"
    assert rows["cp"].rto_ms == 5200 and rows["cp"].recovered
    assert rows["kp"].rto_ms == 7500 and not rows["kp"].recovered
    assert (rows["kp"].gap_start_ns, rows["kp"].gap_end_ns) == (1500 * MS, 9000 * MS)


def test_summary_a():
    s = summary.summarize_events(TRACE_A, fault="kill", repeat=1, trace_dir="x")
    assert s["fault"] == "kill" and s["repeat"] == 1 and s["trace_dir"] == "x"
    # aiokafka: [600, 1150]: p50 = 600 + 0.5*550 = 875, p99 = 600 + 0.99*550 = 1144.5
    assert s["rto_ms"]["aiokafka"] == {"p50": 875.0, "p99": 1144.5, "max": 1150.0, "clients": 2, "unrecovered": 0}
    assert s["rto_ms"]["confluent"] == {"p50": 5200.0, "p99": 5200.0, "max": 5200.0, "clients": 1, "unrecovered": 0}
    assert s["rto_ms"]["kafka-python"] == {"p50": 7500.0, "p99": 7500.0, "max": 7500.0, "clients": 1,
                                           "unrecovered": 1}
    assert "java" not in s["rto_ms"]
    assert s["rto_ms_by_fault"]["kill"]["aiokafka"]["p50"] == 875.0
    # lost: 3.0 and 4.1; duplicated: (1.2, g); unacked-consumed: 9.9
    assert s["lost"] == 2 and s["lost_keys"] == ["3.0", "4.1"]
    assert s["duplicated"] == 1 and s["duplicated_keys"] == ["1.2"] and s["duplicated_extra_deliveries"] == 1
    assert s["unacked_consumed"] == 1
    # acked: 1.0-1.4, 2.0-2.2, 3.0, 4.0, 4.1 = 11. g read 1.0-1.3, 4.0 -> misses 1.4, 2.0-2.2, 3.0, 4.1 = 6;
    # h read 1.4, 2.0-2.2 -> misses 1.0-1.3, 3.0, 4.0, 4.1 = 7
    assert s["missed_by_group"] == {"g": 6, "h": 7}
    assert s["records"]["acked"] == 11 and s["records"]["consumed"] == 10
    # detect 2000 -> 2150, commit 2150 -> 2400, failover 2000 -> 2400
    (f,) = s["faults"]
    assert (f["detect_ms"], f["commit_ms"], f["failover_ms"]) == (150.0, 250.0, 400.0)
    assert s["detect_ms"] == {"p50": 150.0, "p99": 150.0, "max": 150.0, "n": 1}
    assert s["unrecovered"] == [{"run_id": "r1", "fault_idx": 0, "client_id": "kp"}]
    assert s["recovered"] is False and s["healthy"] is False


# One drill with two faults (a rolling restart): drill_start 1000, faults 2000 (p1) and 5000 (p2),
# drill_end 8000. Windows: fault 0 = [1000, 5000], fault 1 = [2000, 8000].
TRACE_B = [
    fleet(1000, "drill_start", fault="rolling-restart"),
    fleet(2000, "fault", fault="rolling-restart", node="p1"),
    fleet(2100, "node_down", node="p1", epoch=3),
    fleet(2300, "assignment_committed", epoch=4, detail="{}"),
    fleet(5000, "fault", fault="rolling-restart", node="p2"),
    fleet(5200, "node_down", node="p2", epoch=5),
    fleet(8000, "drill_end", fault="rolling-restart"),
    # x: fault 0: 1500 -> 2600 = 1100; fault 1: 4000 -> 6500 = 2500
    ack(1500, "x", "aiokafka", "1.0"), ack(2600, "x", "aiokafka", "1.1"), ack(4000, "x", "aiokafka", "1.2"),
    ack(6500, "x", "aiokafka", "1.3"),
    # y: next success 8500 is after both windows: fault 0: 1800 -> 5000 = 3200, fault 1: 1800 -> 8000 = 6200
    ack(1800, "y", "confluent", "2.0"), ack(8500, "y", "confluent", "2.1"),
    # z: no success before fault 0: gap starts at its first event (error at 1200): 1200 -> 2500 = 1300;
    # fault 1: 2500 -> window end 8000 = 5500, unrecovered
    error(1200, "z", "java"), ack(2500, "z", "java", "3.0"), error(8600, "z", "java"),
    # w: an ack exactly at the fault instant counts as before it: 2000 -> 3000 = 1000 (not 1000 -> 3000);
    # fault 1: 3000 -> 8000 = 5000, unrecovered
    ack(1000, "w", "kafka-python", "4.0"), ack(2000, "w", "kafka-python", "4.1"),
    ack(3000, "w", "kafka-python", "4.2"),
]


def test_windows_b():
    ws = measures.fault_windows(TRACE_B)
    assert [(w.fault_idx, w.node, w.window_start_ns // MS, w.window_end_ns // MS) for w in ws] == [
        (0, "p1", 1000, 5000), (1, "p2", 2000, 8000)]


def test_rto_b():
    rows = {(r.fault_idx, r.client_id): r for r in measures.rto_per_client(TRACE_B, measures.fault_windows(TRACE_B))}
    expected = {
        (0, "x"): (1100, True), (1, "x"): (2500, True),
        (0, "y"): (3200, False), (1, "y"): (6200, False),
        (0, "z"): (1300, True), (1, "z"): (5500, False),
        (0, "w"): (1000, True), (1, "w"): (5000, False),
    }
    assert {k: (r.rto_ms, r.recovered) for k, r in rows.items()} == expected


def test_failover_b():
    fo = measures.failover(TRACE_B, measures.fault_windows(TRACE_B))
    # fault 0: down 2100 (100), commit 2300 (200 after the down), failover 300
    assert (fo[0].detect_ms, fo[0].commit_ms, fo[0].failover_ms) == (100.0, 200.0, 300.0)
    # fault 1: down 5200 (200); no commit at or after 5200 inside [2000, 8000]
    assert (fo[1].detect_ms, fo[1].commit_ms, fo[1].failover_ms) == (200.0, None, None)
    s = summary.summarize_events(TRACE_B)
    assert s["fault"] == "rolling-restart" and s["repeat"] == 1
    # detect over faults: [100, 200]: p50 150, p99 = 100 + 0.99*100 = 199
    assert s["detect_ms"] == {"p50": 150.0, "p99": 199.0, "max": 200.0, "n": 2}
    assert s["commit_ms"]["n"] == 1 and s["failover_ms"]["max"] == 300.0
    # aiokafka (x): [1100, 2500] -> p50 1800, p99 = 1100 + 0.99*1400 = 2486
    assert s["rto_ms"]["aiokafka"]["p50"] == 1800.0
    assert s["rto_ms"]["aiokafka"]["p99"] == pytest.approx(2486.0)
    assert s["rto_ms"]["java"]["unrecovered"] == 1


def test_drain_without_node_down_anchors_commit_at_the_fault():
    trace = [
        fleet(1000, "drill_start", fault="drain"),
        fleet(2000, "fault", fault="drain", node="p3"),
        fleet(2050, "assignment_committed", epoch=9, detail="{}"),
        fleet(4000, "drill_end", fault="drain"),
        fleet(5000, "node_down", node="p3", epoch=10),  # after the window: ignored
    ]
    (f,) = measures.failover(trace, measures.fault_windows(trace))
    assert (f.detect_ms, f.commit_ms, f.failover_ms) == (None, 50.0, 50.0)


def test_fault_without_brackets_uses_run_bounds():
    trace = [ack(100, "a", "aiokafka", "1.0"), fleet(300, "fault", fault="kill", node="p1"),
             ack(1000, "a", "aiokafka", "1.1")]
    (w,) = measures.fault_windows(trace)
    assert (w.window_start_ns, w.window_end_ns) == (100 * MS, 1000 * MS)
    (r,) = measures.rto_per_client(trace, [w])
    assert r.rto_ms == 900 and r.recovered  # 100 -> 1000; the first ack after is the window end itself


def test_runs_are_separate():
    trace = [ev(0, "client", "ack", run_id="r2", client_id="a", family="java", topic="t", key="1.0", seq=0),
             *TRACE_A]
    s = summary.summarize_events(trace)
    assert s["run_ids"] == ["r1", "r2"]
    assert s["lost"] == 3  # r2's 1.0 is a different record from anything in r1
    assert len(s["faults"]) == 1


def test_no_faults_all_consumed_is_healthy():
    trace = [ack(1, "p", "java", "1.0"), consume(2, "c", "java", "1.0", "g")]
    s = summary.summarize_events(trace)
    assert s["rto_ms"] == {} and s["lost"] == 0 and s["duplicated"] == 0 and s["healthy"] is True


@pytest.mark.parametrize(("values", "p", "expected"), [
    ([10, 20, 30, 40], 0.5, 25.0),
    ([10, 20, 30, 40], 0.99, 39.7),  # position 2.97: 30 + 0.97 * 10
    ([40, 10, 30, 20], 0.0, 10.0),
    ([40, 10, 30, 20], 1.0, 40.0),
    ([5], 0.99, 5.0),
    ([], 0.5, None),
])
def test_percentile_linear(values, p, expected):
    got = measures.percentile(values, p)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_validate_trace(tmp_path):
    with TraceWriter(tmp_path, "ok", "r1") as w:
        w.client("ack", client_id="a", family="java", topic="t", key="1.0", seq=0, partition=1, offset=2)
        w.fleet("fault", fault="kill", node="p1")
    assert trace.validate_trace(tmp_path) == []
    line = json.loads((tmp_path / "ok.jsonl").read_text().splitlines()[0])
    bad = [dict(line, offset=2.0), dict(line, event="acked"), {k: v for k, v in line.items() if k != "group"},
           dict(line, family="rust")]
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(b) for b in bad) + "\nnot json\n")
    errors = trace.validate_trace(tmp_path)
    assert [e.split(":")[1] for e in errors] == ["1", "2", "3", "4", "5"]
    assert "'offset' must be a JSON integer" in errors[0] and "unknown client event" in errors[1]
    assert "missing ['group']" in errors[2] and "unknown client family" in errors[3] and "not JSON" in errors[4]


def test_summarize_reads_a_directory(tmp_path):
    by_file: dict[str, list] = {}
    for e in TRACE_A:
        by_file.setdefault(e["client_id"] or "fleet", []).append(e)
    for name, events in by_file.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    s = summary.summarize(tmp_path, fault="kill")
    assert s["trace_dir"] == str(tmp_path) and s["lost"] == 2 and s["rto_ms"]["aiokafka"]["max"] == 1150.0
    assert trace.validate_trace(tmp_path) == []


def test_max_gap_covers_the_whole_window():
    rows_a = {r.client_id: r.max_gap_ms for r in measures.rto_per_client(TRACE_A, measures.fault_windows(TRACE_A))}
    # ap: successes 500 1000 1900 2500 3000, nothing until the window end 9000 -> 6000
    # ac: last success 3400 -> 9000 = 5600 (the 600 -> 700 gap ends before the window start 1000)
    # cp: 1800 -> 7000 = 5200 beats 7000 -> 9000 = 2000; kp: 1500 -> 9000 = 7500
    assert rows_a == {"ap": 6000.0, "ac": 5600.0, "cp": 5200.0, "kp": 7500.0}
    rows_b = {(r.fault_idx, r.client_id): r for r in measures.rto_per_client(TRACE_B, measures.fault_windows(TRACE_B))}
    # x, window [1000, 5000]: the RTO gap is 1500 -> 2600 = 1100, but 2600 -> 4000 = 1400 is longer;
    # 4000 -> 6500 is cut at the window end (1000)
    assert (rows_b[(0, "x")].rto_ms, rows_b[(0, "x")].max_gap_ms) == (1100.0, 1400.0)
    # x, window [2000, 8000]: 4000 -> 6500 = 2500 (and 6500 -> 8000 = 1500)
    assert rows_b[(1, "x")].max_gap_ms == 2500.0
    s = summary.summarize_events(TRACE_A)
    assert s["max_gap_ms"]["aiokafka"] == {"p50": 5800.0, "p99": pytest.approx(5996.0), "max": 6000.0, "n": 2,
                                           "clients": 2}


def test_family_outcomes_attribute_lost_to_the_producer_and_duplicated_to_the_reader():
    from chaos.measures import FamilyOutcome, family_outcomes
    from tests.spark.traces import small_drill

    assert family_outcomes(small_drill().events) == [
        FamilyOutcome("aiokafka", 1, 700.0, 700.0, 700.0, lost=1, duplicated=0),  # p1 acked k3, nobody read it
        FamilyOutcome("java", 1, 700.0, 700.0, 700.0, lost=0, duplicated=1),  # c1 (group g1) read k5 twice
    ]
    clean = family_outcomes(small_drill(clean=True).events)
    assert [(r.family, r.lost, r.duplicated) for r in clean] == [("aiokafka", 0, 0), ("java", 0, 0)]


def test_longest_silence_covers_the_whole_run_not_only_the_fault_windows():
    """A stall after the heal (outside every fault window) is what this measure is for."""
    events = [
        fleet(1000, "drill_start", fault="partition"), fleet(2000, "fault", fault="partition", node="p2"),
        fleet(3000, "drill_end", fault="partition"),
        # ap: acks at 500, 1900, 2300, then silent until 14300 (12,000 ms after the drill's end)
        ack(500, "ap", "aiokafka", "1.0"), ack(1900, "ap", "aiokafka", "1.1"), ack(2300, "ap", "aiokafka", "1.2"),
        ack(14300, "ap", "aiokafka", "1.3"),
        # jp: 1000 -> 2600 is its longest (1,600 ms); the error is no success
        ack(1000, "jp", "java", "3.0"), error(1500, "jp", "java"), ack(2600, "jp", "java", "3.1"),
        ack(3000, "jp", "java", "3.2"),
        ack(900, "kp", "kafka-python", "5.0"),  # one success: no interval
    ]
    silences = {s.client_id: s.ms for s in measures.longest_silences(events)}
    assert silences == {"ap": 12_000.0, "jp": 1_600.0}
    out = summary.summarize_events(events)["longest_silence_ms"]
    assert out["aiokafka"]["max"] == 12_000.0 and out["aiokafka"]["longest"]["start_ns"] == 2300 * MS
    assert out["java"]["max"] == 1_600.0 and "kafka-python" not in out


def test_handback_gaps_are_the_longest_gaps_after_a_node_came_back_until_the_next_fault():
    """What the handback costs: from each node_back to the next fault (or the run's end)."""
    events = [
        fleet(1000, "drill_start", fault="kill"), fleet(2000, "fault", fault="kill", node="p2"),
        fleet(4000, "node_back", fault="kill", node="p2"), fleet(6000, "drill_end", fault="kill"),
        fleet(7000, "drill_start", fault="kill"), fleet(8000, "fault", fault="kill", node="p1"),
        fleet(9000, "node_back", fault="kill", node="p1"), fleet(12000, "drill_end", fault="kill"),
        # ac: the fault's gap (1900 -> 2500) is the RTO's; after p2 is back: 4400 -> 5500 (1,100 ms);
        # one across the next fault (7500 -> 8600) is that fault's RTO; after p1: 8600 -> 9100 (it ends after)
        *(consume(t, "ac", "aiokafka", f"1.{i}", "g") for i, t in
          enumerate((1900, 2500, 3000, 3500, 4100, 4400, 5500, 6000, 7000, 7500, 8600, 9100, 9300, 9400))),
        # jp: one that begins before p2 is back and ends after it counts (3800 -> 4300); one across
        # p1's fault that ends after p1 is back (4400 -> 9050) is that fault's; then 9500 -> 11000
        *(ack(t, "jp", "java", f"3.{i}") for i, t in enumerate((3000, 3800, 4300, 4400, 9050, 9500, 11000))),
    ]
    gaps = sorted((s.client_id, s.start_ns // MS, s.end_ns // MS) for s in measures.handback_gaps(events))
    assert gaps == [("ac", 4400, 5500), ("ac", 8600, 9100), ("jp", 3800, 4300), ("jp", 9500, 11000)]
    out = summary.summarize_events(events)["handback_gap_ms"]
    assert out["aiokafka"]["max"] == 1_100.0 and out["java"]["max"] == 1_500.0
