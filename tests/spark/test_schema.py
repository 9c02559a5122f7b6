"""The Spark schema comes from chaos.trace.FIELDS; the line checker agrees with the writer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.types import IntegerType, LongType, StringType

from chaos.trace import CLIENT_EVENTS, FIELD_NAMES, FIELDS, FLEET_EVENTS, make_event
from spark.schema import TRACE_SCHEMA, build_schema, check_json_line

pytestmark = pytest.mark.unit


def test_schema_is_built_from_the_trace_fields() -> None:
    assert tuple(TRACE_SCHEMA.fieldNames()) == FIELD_NAMES
    expected = {"long": LongType(), "int": IntegerType(), "string": StringType()}
    for field, (name, kind) in zip(TRACE_SCHEMA.fields, FIELDS):
        assert (field.name, field.dataType, field.nullable) == (name, expected[kind], True)
    # a field added to the writer shows up in the reader
    grown = build_schema((*FIELDS, ("rack", "string")))
    assert grown.fieldNames()[-1] == "rack" and grown.fields[-1].dataType == StringType()


longs = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ints = st.integers(min_value=-(2**31), max_value=2**31 - 1)
text = st.text(max_size=8)


@st.composite
def events(draw: st.DrawFn) -> dict[str, object]:
    source = draw(st.sampled_from(["client", "fleet"]))
    event = draw(st.sampled_from(sorted(CLIENT_EVENTS if source == "client" else FLEET_EVENTS)))
    fields = {}
    for name, kind in FIELDS:
        if name in ("ts_ns", "run_id", "source", "event"):
            continue
        strategy = {"long": longs, "int": ints, "string": text}[kind]
        value = draw(st.none() | strategy)
        if value is not None:
            fields[name] = value
    return make_event(source, event, ts_ns=draw(st.integers(0, 2**63 - 1)), run_id=draw(text), **fields)


@given(events())
def test_every_event_the_writer_makes_passes_the_line_check(event: dict[str, object]) -> None:
    assert check_json_line(json.dumps(event, separators=(",", ":"))) is None


@given(events(), st.sampled_from([name for name, kind in FIELDS if kind != "string"]))
def test_a_float_in_an_integer_field_is_caught(event: dict[str, object], name: str) -> None:
    event[name] = 1.0
    assert f"field {name!r} must be a JSON integer, got 1.0" == check_json_line(json.dumps(event))


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("", None),
        ("   ", None),
        ("[1]", "not a JSON object: list"),
        ('{"ts_ns":1,"run_id":"r","source":"fleet","event":"fault"} x', "invalid JSON"),
        ('{"ts_ns":NaN,"run_id":"r","source":"fleet","event":"fault"}', "invalid JSON"),
        ('{"ts_ns":true,"run_id":"r","source":"fleet","event":"fault"}', "field 'ts_ns' must be a JSON integer, got true"),
        ('{"ts_ns":1,"run_id":5,"source":"fleet","event":"fault"}', "field 'run_id' must be a string, got 5"),
        ('{"ts_ns":1,"run_id":"r","source":"client","event":"fault"}', "unknown client event 'fault'"),
        ('{"run_id":"r","source":"fleet","event":"fault"}', "field 'ts_ns' is missing or null"),
    ],
)
def test_line_check_reasons(line: str, reason: str | None) -> None:
    result = check_json_line(line)
    if reason == "invalid JSON":
        assert result is not None and result.startswith("invalid JSON: ")
    else:
        assert result == reason
