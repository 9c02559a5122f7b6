"""The transforms on hand-made traces; every expected value worked out by hand.

See tests/spark/traces.py for the traces (times in ms from T0_MS).
"""

from __future__ import annotations

import pytest
from pyspark.testing import assertDataFrameEqual

from spark import transform
from tests.spark.traces import TraceBuilder, every, ns, two_drills

pytestmark = pytest.mark.spark

RTO_SCHEMA = (
    "run_id string, fault_idx int, fault string, node string, fault_ts_ns long, client_id string, "
    "family string, role string, gap_start_ns long, gap_end_ns long, rto_ms double, recovered boolean"
)
WINDOW_SCHEMA = "run_id string, fault_idx int, fault string, node string, fault_ts_ns long, window_start_ns long, window_end_ns long"


def rto_row(fault_idx, client, family, role, start_ms, end_ms, rto_ms, recovered):  # type: ignore[no-untyped-def]
    fault, node, at = [("kill", "p2", 2000), ("freeze", "p1", 7000)][fault_idx]
    return ("r1", fault_idx, fault, node, ns(at), client, family, role, ns(start_ms), ns(end_ms), rto_ms, recovered)


@pytest.fixture(scope="module")
def drills(spark_session):  # type: ignore[no-untyped-def]
    events = two_drills().frame(spark_session).cache()
    faults = transform.fault_windows(events).cache()
    yield events, faults
    events.unpersist()
    faults.unpersist()


def test_fault_windows_follow_the_drill_brackets(spark_session, drills):  # type: ignore[no-untyped-def]
    _, faults = drills
    expected = spark_session.createDataFrame(
        [
            ("r1", 0, "kill", "p2", ns(2000), ns(990), ns(5000)),
            ("r1", 1, "freeze", "p1", ns(7000), ns(6000), ns(9000)),
        ],
        WINDOW_SCHEMA,
    )
    assertDataFrameEqual(faults, expected)


def test_fault_windows_without_brackets_use_neighbouring_faults_and_run_ends(spark_session):  # type: ignore[no-untyped-def]
    b = TraceBuilder()
    b.producer("r9", "p", "java", [1000, 8000])  # run spans 995..8000
    b.fleet("r9", "fault", 2000, fault="kill", node="a")
    b.fleet("r9", "fault", 5000, fault="drain", node="b")
    expected = spark_session.createDataFrame(
        [
            ("r9", 0, "kill", "a", ns(2000), ns(995), ns(5000)),
            ("r9", 1, "drain", "b", ns(5000), ns(2000), ns(8000)),
        ],
        WINDOW_SCHEMA,
    )
    assertDataFrameEqual(transform.fault_windows(b.frame(spark_session)), expected)


def test_rto_per_client_two_drills(spark_session, drills):  # type: ignore[no-untyped-def]
    events, faults = drills
    expected = spark_session.createDataFrame(
        [
            # kill at 2000, drill 990-5000
            rto_row(0, "p1", "aiokafka", "producer", 1900, 2600, 700.0, True),  # the error at 2300 is no success
            rto_row(0, "p2", "confluent", "producer", 2000, 2200, 200.0, True),  # an ack at the fault instant is before it
            rto_row(0, "p3", "kafka-python", "producer", 1800, 5000, 3200.0, False),  # next ack 5100 > drill_end
            rto_row(0, "c1", "aiokafka", "consumer", 1950, 2350, 400.0, True),
            # c2 starts at 2500, after the kill: not part of it
            # freeze at 7000, drill 6000-9000; p2 stopped at 4900: not part of it
            rto_row(1, "p1", "aiokafka", "producer", 6900, 7250, 350.0, True),
            rto_row(1, "p3", "kafka-python", "producer", 7000, 7100, 100.0, True),
            rto_row(1, "c1", "aiokafka", "consumer", 6950, 7150, 200.0, True),
            rto_row(1, "c2", "java", "consumer", 6800, 7400, 600.0, True),
        ],
        RTO_SCHEMA,
    )
    assertDataFrameEqual(transform.rto_per_client(events, faults), expected)


def test_rto_gap_starts_at_first_event_without_earlier_success(spark_session):  # type: ignore[no-untyped-def]
    b = TraceBuilder()
    b.fleet("r2", "drill_start", 0, fault="kill")
    b.client("r2", "send", 500, "p", "java", topic="t", key="a", seq=1)  # first event, no success yet
    b.fleet("r2", "fault", 1000, fault="kill", node="n")
    b.client("r2", "ack", 1800, "p", "java", topic="t", key="a", seq=1)
    b.fleet("r2", "drill_end", 3000, fault="kill")
    events = b.frame(spark_session)
    actual = transform.rto_per_client(events, transform.fault_windows(events))
    expected = spark_session.createDataFrame(
        [("r2", 0, "kill", "n", ns(1000), "p", "java", "producer", ns(500), ns(1800), 1300.0, True)], RTO_SCHEMA
    )
    assertDataFrameEqual(actual, expected)


def test_rto_stats_exact_percentiles(spark_session, drills):  # type: ignore[no-untyped-def]
    events, faults = drills
    actual = transform.rto_stats(transform.rto_per_client(events, faults))
    # percentile = linear interpolation at q*(n-1): [400, 700] -> p50 550, p99 400 + 0.99*300 = 697
    #                                                [200, 350] -> p50 275, p99 200 + 0.99*150 = 348.5
    expected = spark_session.createDataFrame(
        [
            ("freeze", "aiokafka", 2, 275.0, 348.5, 350.0, 0),
            ("freeze", "java", 1, 600.0, 600.0, 600.0, 0),
            ("freeze", "kafka-python", 1, 100.0, 100.0, 100.0, 0),
            ("kill", "aiokafka", 2, 550.0, 697.0, 700.0, 0),
            ("kill", "confluent", 1, 200.0, 200.0, 200.0, 0),
            ("kill", "kafka-python", 1, 3200.0, 3200.0, 3200.0, 1),
        ],
        "fault string, family string, clients long, p50_ms double, p99_ms double, max_ms double, unrecovered long",
    )
    assertDataFrameEqual(actual, expected, checkRowOrder=True)


def test_failover_detect_and_commit(spark_session, drills):  # type: ignore[no-untyped-def]
    events, faults = drills
    actual = transform.failover(events, faults).select(
        "run_id", "fault_idx", "node_down_ns", "committed_ns", "detect_ms", "commit_ms", "failover_ms"
    )
    # kill 2000: node_down 2150 (150), commit 2180 (30), 180 in all.
    # freeze 7000: the commit at 6200 and the node_down at 5500 come before it;
    # node_down 7400 (400), commit 7500 (100), 500 in all.
    expected = spark_session.createDataFrame(
        [
            ("r1", 0, ns(2150), ns(2180), 150.0, 30.0, 180.0),
            ("r1", 1, ns(7400), ns(7500), 400.0, 100.0, 500.0),
        ],
        "run_id string, fault_idx int, node_down_ns long, committed_ns long, detect_ms double, commit_ms double, failover_ms double",
    )
    assertDataFrameEqual(actual, expected)


def test_failover_without_node_down_times_the_commit_from_the_fault(spark_session):  # type: ignore[no-untyped-def]
    b = TraceBuilder()
    b.fleet("r3", "drill_start", 0, fault="drain")
    b.fleet("r3", "fault", 100, fault="drain", node="n1")
    b.fleet("r3", "assignment_committed", 112.5, epoch=1)
    b.fleet("r3", "drill_end", 1000, fault="drain")
    b.fleet("r3", "drill_start", 2000, fault="kill")
    b.fleet("r3", "fault", 2100, fault="kill", node="n2")
    b.fleet("r3", "drill_end", 3000, fault="kill")
    b.fleet("r3", "node_down", 3100, node="n2")  # after the drill: not counted
    events = b.frame(spark_session)
    actual = transform.failover(events, transform.fault_windows(events)).select(
        "fault_idx", "fault", "detect_ms", "commit_ms", "failover_ms"
    )
    expected = spark_session.createDataFrame(
        [(0, "drain", None, 12.5, 12.5), (1, "kill", None, None, None)],
        "fault_idx int, fault string, detect_ms double, commit_ms double, failover_ms double",
    )
    assertDataFrameEqual(actual, expected)


def test_failover_stats(spark_session, drills):  # type: ignore[no-untyped-def]
    events, faults = drills
    actual = transform.failover_stats(transform.failover(events, faults))
    expected = spark_session.createDataFrame(
        [
            ("freeze", 1, 1, 1, 400.0, 400.0, 400.0, 100.0, 100.0, 100.0, 500.0, 500.0, 500.0),
            ("kill", 1, 1, 1, 150.0, 150.0, 150.0, 30.0, 30.0, 30.0, 180.0, 180.0, 180.0),
        ],
        "fault string, faults long, detected long, committed long, "
        "detect_p50_ms double, detect_p99_ms double, detect_max_ms double, "
        "commit_p50_ms double, commit_p99_ms double, commit_max_ms double, "
        "failover_p50_ms double, failover_p99_ms double, failover_max_ms double",
    )
    assertDataFrameEqual(actual, expected, checkRowOrder=True)


def records_trace() -> TraceBuilder:
    """Acks and deliveries for lost / duplicated / unacked-consumed."""
    b = TraceBuilder()

    def ack(run, topic, key, seq):  # type: ignore[no-untyped-def]
        b.client(run, "ack", seq, "p", "java", topic=topic, key=key, seq=seq)

    def read(run, topic, key, seq, group, client="c"):  # type: ignore[no-untyped-def]
        b.client(run, "consume", 100 + seq, client, "java", topic=topic, key=key, seq=seq, group=group)

    for key, seq in [("k1", 1), ("k2", 2), ("k3", 3), ("k4", 4), ("k5", 5), ("k2", 7)]:
        ack("r1", "t", key, seq)
    ack("r1", "u", "k1", 1)  # same key on another topic: a record of its own
    ack("r1", "u", "k9", 9)
    read("r1", "t", "k1", 1, "g1")
    read("r1", "t", "k2", 2, "g1")
    read("r1", "t", "k2", 2, "g1")  # g1 reads k2 twice: duplicated
    read("r1", "t", "k3", 3, "g1")
    read("r1", "t", "k2", 7, "g1")  # same key, other seq: not a duplicate of k2/2
    read("r1", "t", "k1", 1, "g2")  # k1 by g1 and g2 once each: fine
    for _ in range(3):
        read("r1", "t", "k3", 3, "g2")  # g2 reads k3 three times
    read("r1", "t", "k4", 4, "g2")  # only g2 reads k4: not lost
    read("r1", "t", "k6", 6, "g1")  # never acked
    read("r1", "u", "k9", 9, None, client="solo")  # a consumer without a group is its own group
    read("r1", "u", "k9", 9, None, client="solo")
    ack("r2", "t", "k5", 5)  # another run: does not make r1's k5 read
    read("r2", "t", "k5", 5, "g1")
    return b


@pytest.mark.parametrize("max_pivot", [transform.MAX_PIVOT_READERS, 0], ids=["one-pass", "two-pass"])
def test_lost_duplicated_and_unacked(spark_session, max_pivot):  # type: ignore[no-untyped-def]
    events = records_trace().frame(spark_session)
    assert transform.consumer_readers(events) == ["client:solo", "g1", "g2"]
    outcomes = transform.record_outcomes(events, max_pivot=max_pivot).cache()
    record = "run_id string, topic string, key string, seq long"
    assertDataFrameEqual(
        transform.lost(outcomes),
        spark_session.createDataFrame([("r1", "t", "k5", 5), ("r1", "u", "k1", 1)], record),
    )
    assertDataFrameEqual(
        transform.duplicated(outcomes),
        spark_session.createDataFrame(
            [("r1", "t", "g1", "k2", 2, 2), ("r1", "t", "g2", "k3", 3, 3), ("r1", "u", "client:solo", "k9", 9, 2)],
            "run_id string, topic string, group string, key string, seq long, times long",
        ),
    )
    assertDataFrameEqual(
        transform.unacked_consumed(outcomes), spark_session.createDataFrame([("r1", "t", "k6", 6)], record)
    )
    # record_problems keeps exactly those records, so the three views agree on it
    problems = transform.record_problems(outcomes)
    assertDataFrameEqual(transform.lost(problems), transform.lost(outcomes))
    assert problems.count() == 2 + 3 + 1
    outcomes.unpersist()


def test_timeline_buckets_with_fault_markers(spark_session):  # type: ignore[no-untyped-def]
    b = TraceBuilder()
    b.fleet("r1", "drill_start", 0, fault="kill")  # run r1 starts at 0
    for at in (10, 20, 150, 370):
        b.client("r1", "ack", at, "p", "java", topic="t", key=f"k{at}", seq=at)
    for at in (60, 160, 170):
        b.client("r1", "consume", at, "c", "java", topic="t", key=f"k{at}", seq=at, group="g")
    b.client("r1", "send", 250, "p", "java", topic="t", key="x", seq=0)  # not counted
    b.fleet("r1", "fault", 120, fault="kill", node="a")
    b.fleet("r1", "fault", 310, fault="partition", node="b")
    b.fleet("r1", "fault", 390, fault="freeze", node="c")
    b.fleet("r1", "drill_end", 450, fault="kill")  # last event: bucket 4
    b.client("r2", "ack", 10_000, "q", "java", topic="t", key="a", seq=1)  # run r2 starts at 10000
    b.client("r2", "ack", 10_250, "q", "java", topic="t", key="b", seq=2)
    events = b.frame(spark_session)
    runs = transform.runs(events)
    actual = transform.timeline(events, runs, transform.fault_windows(events, runs))
    expected = spark_session.createDataFrame(
        [
            ("r1", 0, 0, 2, 1, None),
            ("r1", 1, 100, 1, 2, "kill"),
            ("r1", 2, 200, 0, 0, None),
            ("r1", 3, 300, 1, 0, "freeze,partition"),
            ("r1", 4, 400, 0, 0, None),
            ("r2", 0, 0, 1, 0, None),
            ("r2", 1, 100, 0, 0, None),
            ("r2", 2, 200, 1, 0, None),
        ],
        "run_id string, bucket long, t_ms long, acks long, consumes long, faults string",
    )
    assertDataFrameEqual(actual, expected)


def test_runs_table(spark_session, drills):  # type: ignore[no-untyped-def]
    events, _ = drills
    # 990 (drill_start) .. 9000 (drill_end); 5 clients; 2 faults.
    # events: fleet 13; p1 sends+acks 2*(10+44+18)=144, its error 1; p2 2*39=78;
    # p3 2*(9+39)=96; c1 10+47+19=76; c2 44+16=60  -> 468
    assert every(2600, 6900) == list(range(2600, 6901, 100)) and len(every(2600, 6900)) == 44
    expected = spark_session.createDataFrame(
        [("r1", ns(990), ns(9000), 8010.0, 468, 5, 2)],
        "run_id string, start_ns long, end_ns long, duration_ms double, events long, clients long, faults long",
    )
    assertDataFrameEqual(transform.runs(events), expected)
