"""The trace schema on the Spark side, built from ``chaos.trace.FIELDS``.

``TRACE_SCHEMA`` is derived, never written by hand: add a field to
``chaos/trace.py`` and the readers here follow. The same module holds the
strict, pure-Python check of one JSON line that the extractor uses to name the
file and line of a malformed event (Spark's FAILFAST reader fails the job but
does not say which line).
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.sql.types import DataType, IntegerType, LongType, StringType, StructField, StructType

from chaos.trace import FIELD_NAMES, FIELDS, REQUIRED
from chaos.trace import check_event as _check_event

SPARK_TYPES: dict[str, DataType] = {
    "long": LongType(),
    "int": IntegerType(),
    "string": StringType(),
}

# Arrow/Parquet physical types accepted for each trace type.
ARROW_TYPES: dict[str, frozenset[str]] = {
    "long": frozenset({"int64"}),
    "int": frozenset({"int32"}),
    "string": frozenset({"string", "large_string"}),
}

__all__ = ["ARROW_TYPES", "COLUMNS", "REQUIRED", "SPARK_TYPES", "TRACE_SCHEMA", "build_schema", "check_event",
           "check_json_line"]


def build_schema(fields: tuple[tuple[str, str], ...] = FIELDS) -> StructType:
    """A nullable Spark column per trace field, in the writer's order."""
    return StructType([StructField(name, SPARK_TYPES[kind], nullable=True) for name, kind in fields])


TRACE_SCHEMA: StructType = build_schema()
COLUMNS: tuple[str, ...] = FIELD_NAMES


def check_event(obj: Any) -> str | None:
    """Why a decoded JSON value is not a valid trace event, or None if it is
    (the schema's own check; absent fields read as null, as in Spark)."""
    return _check_event(obj, complete=False)


def check_json_line(line: str) -> str | None:
    """Why one line of a ``.jsonl`` trace is malformed, or None if it is fine.

    Blank lines are fine (Spark's JSON reader skips them too). Stricter than
    Spark where Spark coerces silently (a number where a string belongs,
    trailing bytes after the object, NaN).
    """
    if not line.strip():
        return None
    try:
        obj = json.loads(line, parse_constant=_reject_constant)
    except ValueError as exc:
        return f"invalid JSON: {exc}"
    return check_event(obj)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
