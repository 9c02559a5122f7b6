"""A generated trace with known ground truth, and the generator itself."""

from __future__ import annotations

import pytest
from pyspark.testing import assertDataFrameEqual

from spark import extract, synth, transform
from spark.synth import SynthSpec

SPEC = SynthSpec(
    seed=3,
    runs=2,
    drills=3,
    producers=3,
    groups=2,
    consumers_per_group=2,
    period_ms=20.0,
    lost=3,
    duplicated=4,
    unrecovered=2,
)


@pytest.mark.unit
def test_generator_plants_what_it_says() -> None:
    table, truth = synth.generate(SPEC)
    assert table.num_rows == truth.events
    # lost, duplicated and unrecovered are planted per run
    assert len(truth.lost) == SPEC.runs * 3 and len(truth.duplicated) == SPEC.runs * 4
    assert not {(r, t, k, s) for (r, t, _, k, s) in truth.duplicated} & truth.lost
    # every producer takes part in every fault; the truth's producer gaps are the planted ones
    producers = [r for r in truth.rto if r["role"] == "producer"]
    assert len(producers) == SPEC.runs * SPEC.drills * SPEC.producers
    for row in producers:
        last_ack, first_ack = truth.producer_gaps[(row["run_id"], row["fault_idx"], row["client_id"])]
        assert row["gap_start_ns"] == last_ack
        if row["recovered"]:
            assert row["gap_end_ns"] == first_ack
        else:
            assert first_ack > row["gap_end_ns"]  # the first ack after the gap is past drill_end
    assert sum(not r["recovered"] for r in producers) == SPEC.runs * 2
    again, _ = synth.generate(SPEC)
    assert again.equals(table)  # deterministic for a seed


@pytest.mark.unit
def test_spec_for_events_is_close_to_the_target() -> None:
    for target in (1_000_000, 10_000_000):
        approx = synth.spec_for_events(target).approx_events()
        assert 0.9 * target < approx < 1.1 * target


@pytest.mark.spark
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_jobs_recover_the_planted_truth(spark_session, tmp_path, fmt):  # type: ignore[no-untyped-def]
    truth = synth.write_trace(SPEC, tmp_path, fmt=fmt)
    trace = extract.read_trace(spark_session, tmp_path)
    try:
        events = trace.events
        assert trace.count == truth.events
        faults = transform.fault_windows(events)
        rto_cols = ["run_id", "fault_idx", "fault", "client_id", "family", "role", "gap_start_ns", "gap_end_ns", "rto_ms", "recovered"]
        expected_rto = spark_session.createDataFrame(
            [tuple(r[c] for c in rto_cols) for r in truth.rto],
            "run_id string, fault_idx int, fault string, client_id string, family string, role string, "
            "gap_start_ns long, gap_end_ns long, rto_ms double, recovered boolean",
        )
        assertDataFrameEqual(transform.rto_per_client(events, faults).select(*rto_cols), expected_rto)

        fo_cols = ["run_id", "fault_idx", "fault", "node", "fault_ts_ns", "node_down_ns", "committed_ns", "detect_ms", "commit_ms"]
        expected_fo = spark_session.createDataFrame(
            [tuple(r[c] for c in fo_cols) for r in truth.failover],
            "run_id string, fault_idx int, fault string, node string, fault_ts_ns long, node_down_ns long, "
            "committed_ns long, detect_ms double, commit_ms double",
        )
        assertDataFrameEqual(transform.failover(events, faults).select(*fo_cols), expected_fo)

        outcomes = transform.record_outcomes(events)
        lost = {tuple(r) for r in transform.lost(outcomes).collect()}
        assert lost == truth.lost
        dups = {tuple(r[:5]): r["times"] for r in transform.duplicated(outcomes).collect()}
        assert dups == truth.duplicated
    finally:
        trace.release()
