"""Extract: JSONL (FAILFAST, errors name file and line) and Parquet, and the converter."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.testing import assertDataFrameEqual

from spark import extract, synth
from spark.extract import TraceFormatError
from tests.spark.traces import small_drill

pytestmark = pytest.mark.spark


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def replace_line(path: Path, number: int, text: str) -> None:
    content = lines(path)
    content[number - 1] = text
    path.write_text("\n".join(content) + "\n", encoding="utf-8")


@pytest.fixture
def jsonl_trace(tmp_path: Path) -> Path:
    return small_drill().write_jsonl(tmp_path / "trace")


def test_jsonl_written_by_trace_writer_reads_back_exactly(spark_session, jsonl_trace):  # type: ignore[no-untyped-def]
    builder = small_drill()
    trace = extract.read_trace(spark_session, jsonl_trace)
    try:
        # 5 fleet events, 34 records: send + ack each, 34 - 1 (k3) + 1 (k5 again) consumes
        assert trace.count == 5 + 2 * 34 + 34
        assert trace.format == "jsonl"
        assert sorted(Path(f).name for f in trace.files) == ["c1.jsonl", "fleet-d1.jsonl", "p1.jsonl"]
        assertDataFrameEqual(trace.events, builder.frame(spark_session))
    finally:
        trace.release()


def test_converter_round_trip_to_parquet(spark_session, jsonl_trace, tmp_path):  # type: ignore[no-untyped-def]
    out = tmp_path / "parquet"
    assert extract.convert_to_parquet(spark_session, jsonl_trace, out) == 107
    trace = extract.read_trace(spark_session, out)
    assert trace.format == "parquet"
    assertDataFrameEqual(trace.events, small_drill().frame(spark_session))
    with pytest.raises(Exception, match="already exists"):
        extract.convert_to_parquet(spark_session, jsonl_trace, out)


def test_parquet_from_pyarrow_generator(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    spec = synth.SynthSpec(drills=1, producers=1, consumers_per_group=1, lost=0, duplicated=0, unrecovered=0)
    table, truth = synth.generate(spec)
    synth.write_parquet(table, tmp_path)
    trace = extract.read_trace(spark_session, tmp_path)
    assert trace.count == table.num_rows == truth.events


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"ts_ns":1.5,"run_id":"d1","source":"fleet","event":"fault"}', "'ts_ns' must be a JSON integer, got 1.5"),
        ('{"ts_ns":"12","run_id":"d1","source":"fleet","event":"fault"}', "'ts_ns' must be a JSON integer"),
        ('{"ts_ns":1700000000000000000,"run_id":"d1","source":"fl', "invalid JSON"),
        ('{"ts_ns":17,"run_id":"d1","source":"fleet","event":"fault","partition":4000000000}', "out of range for int"),
        # a float in a column no job reads is still caught (the whole line is parsed)
        ('{"ts_ns":17,"run_id":"d1","source":"fleet","event":"fault","epoch":2.0}', "'epoch' must be a JSON integer"),
    ],
)
def test_malformed_jsonl_names_file_and_line(spark_session, jsonl_trace, line, reason):  # type: ignore[no-untyped-def]
    path = jsonl_trace / "p1.jsonl"
    replace_line(path, 7, line)
    with pytest.raises(TraceFormatError) as info:
        extract.read_trace(spark_session, jsonl_trace)
    assert info.value.path == str(path)
    assert info.value.line == 7
    assert str(info.value).startswith(f"{path}:7: ")
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"run_id": None}, "'run_id' is missing or null"),
        ({"event": "explode"}, "unknown fleet event 'explode'"),
        ({"source": "proxy"}, "unknown source 'proxy'"),
    ],
)
def test_events_without_meaning_name_file_and_line(spark_session, jsonl_trace, change, reason):  # type: ignore[no-untyped-def]
    path = jsonl_trace / "fleet-d1.jsonl"
    event = json.loads(lines(path)[2])
    event.update(change)
    replace_line(path, 3, json.dumps(event))
    with pytest.raises(TraceFormatError) as info:
        extract.read_trace(spark_session, jsonl_trace)
    assert (info.value.path, info.value.line) == (str(path), 3)
    assert reason in info.value.reason


def test_bad_parquet_column_type_names_the_file(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    table = pa.table({"ts_ns": pa.array([1.0]), "run_id": ["r"], "source": ["fleet"], "event": ["fault"]})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(TraceFormatError, match=r"bad\.parquet: column 'ts_ns' has type double, expected long"):
        extract.read_trace(spark_session, tmp_path)


def test_parquet_event_without_run_id_names_file_and_row(spark_session, tmp_path):  # type: ignore[no-untyped-def]
    table = pa.table(
        {
            "ts_ns": pa.array([1, 2, 3], pa.int64()),
            "run_id": ["r", "r", None],
            "source": ["fleet"] * 3,
            "event": ["drill_start", "fault", "drill_end"],
        }
    )
    pq.write_table(table, tmp_path / "fleet.parquet")
    with pytest.raises(TraceFormatError, match=r"fleet\.parquet: row 2: an event lacks"):
        extract.read_trace(spark_session, tmp_path)


def test_directory_errors(spark_session, tmp_path, jsonl_trace):  # type: ignore[no-untyped-def]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceFormatError, match="no trace files"):
        extract.read_trace(spark_session, empty)
    (empty / "a.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="the trace has no events"):
        extract.read_trace(spark_session, empty)
    mixed = jsonl_trace
    pq.write_table(pa.table({"ts_ns": pa.array([1], pa.int64())}), mixed / "x.parquet")
    with pytest.raises(TraceFormatError, match="both"):
        extract.read_trace(spark_session, mixed)
