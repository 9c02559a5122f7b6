"""The drill trace: one schema, written by chaos/ and read by spark/.

A trace is a directory of JSON-lines files (``*.jsonl``), one file per writing
process, one JSON object per event. Every event carries every field below;
fields that do not apply are ``null``. Timestamps are nanoseconds since the Unix
epoch from ``time.time_ns()``: one clock for every process on the machine.

``spark/schema.py`` builds the Spark ``StructType`` from ``FIELDS`` so the
writer and the readers cannot drift apart.

Client events (``source == "client"``):
  send     a record handed to the client (key, seq)
  ack      the broker acknowledged it (partition, offset)
  error    the client reported an error (detail)
  consume  a consumer delivered a record (key, seq, partition, offset, group)

Fleet events (``source == "fleet"``):
  fault                 the harness injected a fault (fault, node)
  node_down             the fleet detected a node as down (node, epoch)
  assignment_committed  an assignment was committed (epoch, detail = JSON map)
  node_back             a node is serving again (node)
  drill_start / drill_end   bracket one repetition (fault)

Verifier events (``source == "verifier"``), written by the final read after the drills
(``chaos.drills.verify``), not by a workload client:
  read      one record found in the topic's log (topic, partition, offset, key, seq)
  read_end  the final read of ``topic`` reached the end of every partition (detail = JSON:
            the end offsets per partition and the path read, ``fleet`` or ``brokers``)
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import IO, Any

from chaos.clients import FAMILIES

# (name, type) with type one of: "string", "long", "int". Order is the column
# order of the Spark schema.
FIELDS: tuple[tuple[str, str], ...] = (
    ("ts_ns", "long"),
    ("run_id", "string"),
    ("source", "string"),
    ("event", "string"),
    ("client_id", "string"),
    ("family", "string"),
    ("topic", "string"),
    ("partition", "int"),
    ("offset", "long"),
    ("key", "string"),
    ("seq", "long"),
    ("group", "string"),
    ("fault", "string"),
    ("node", "string"),
    ("epoch", "long"),
    ("detail", "string"),
)
FIELD_NAMES = tuple(name for name, _ in FIELDS)

CLIENT_EVENTS = frozenset({"send", "ack", "error", "consume"})
FLEET_EVENTS = frozenset(
    {"fault", "node_down", "assignment_committed", "node_back", "drill_start", "drill_end"}
)
VERIFIER_EVENTS = frozenset({"read", "read_end"})
EVENTS_BY_SOURCE: dict[str, frozenset[str]] = {
    "client": CLIENT_EVENTS, "fleet": FLEET_EVENTS, "verifier": VERIFIER_EVENTS}
CLIENT_FAMILIES = frozenset(FAMILIES)


# Fields without which an event means nothing.
REQUIRED: tuple[str, ...] = ("ts_ns", "run_id", "source", "event")
INT_RANGE: dict[str, tuple[int, int]] = {"long": (-(2**63), 2**63 - 1), "int": (-(2**31), 2**31 - 1)}


class TraceError(ValueError):
    """An event that does not fit the schema."""


def check_event(obj: Any, *, complete: bool = True) -> str | None:
    """Why a decoded JSON value is not a valid trace event, or None if it is.

    ``complete=True`` is the writer's contract (``chaos.measures``): exactly the
    schema's fields, and a client event names its client and a known family.
    ``complete=False`` is the readers' (``spark.schema``): an absent field reads
    as null, as Spark's JSON reader has it.
    """
    if not isinstance(obj, dict):
        return f"not a JSON object: {type(obj).__name__}"
    if complete and set(obj) != set(FIELD_NAMES):
        missing, extra = sorted(set(FIELD_NAMES) - set(obj)), sorted(set(obj) - set(FIELD_NAMES))
        return f"fields differ from the schema (missing {missing}, unknown {extra})"
    for name, kind in FIELDS:
        value = obj.get(name)
        if value is None:
            if name in REQUIRED:
                return f"field {name!r} is missing or null"
            continue
        if kind in INT_RANGE:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"field {name!r} must be a JSON integer, got {json.dumps(value)}"
            low, high = INT_RANGE[kind]
            if not low <= value <= high:
                return f"field {name!r} out of range for {kind}: {value}"
        elif not isinstance(value, str):
            return f"field {name!r} must be a string, got {json.dumps(value)}"
    source, event = obj["source"], obj["event"]
    if source not in EVENTS_BY_SOURCE:
        return f"unknown source {source!r}"
    if event not in EVENTS_BY_SOURCE[source]:
        return f"unknown {source} event {event!r}"
    if source == "client":
        if complete and obj["client_id"] is None:
            return "client event without client_id"
        if complete and obj["family"] not in CLIENT_FAMILIES:
            return f"unknown client family {obj['family']!r}"
    elif source == "verifier" and complete and obj["topic"] is None:
        return "verifier event without topic"
    return None


def make_event(source: str, event: str, *, ts_ns: int | None = None, run_id: str, **fields: Any) -> dict[str, Any]:
    """Build one event dict with every schema field present, validated."""
    if source not in EVENTS_BY_SOURCE:
        raise TraceError(f"unknown source {source!r}")
    if event not in EVENTS_BY_SOURCE[source]:
        raise TraceError(f"unknown {source} event {event!r}")
    unknown = set(fields) - set(FIELD_NAMES)
    if unknown:
        raise TraceError(f"unknown trace fields {sorted(unknown)}")
    record: dict[str, Any] = {name: None for name in FIELD_NAMES}
    record.update(fields)
    record["ts_ns"] = time.time_ns() if ts_ns is None else int(ts_ns)
    record["run_id"] = run_id
    record["source"] = source
    record["event"] = event
    for name, kind in FIELDS:
        value = record[name]
        if value is None:
            continue
        if kind in ("long", "int") and (isinstance(value, bool) or not isinstance(value, int)):
            raise TraceError(f"field {name!r} must be an integer, got {value!r}")
        if kind == "string" and not isinstance(value, str):
            raise TraceError(f"field {name!r} must be a string, got {value!r}")
    return record


class TraceWriter:
    """Appends events to ``<trace_dir>/<name>.jsonl``; thread-safe, line-buffered.

    Integers are written as JSON integers (never floats), so Spark's FAILFAST
    reader keeps them.
    """

    def __init__(self, trace_dir: str | os.PathLike[str], name: str, run_id: str) -> None:
        self.run_id = run_id
        self.path = Path(trace_dir) / f"{name}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh: IO[str] = open(self.path, "a", buffering=1, encoding="utf-8")

    def emit(self, source: str, event: str, **fields: Any) -> dict[str, Any]:
        record = make_event(source, event, run_id=self.run_id, **fields)
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._fh.write(line + "\n")
        return record

    def client(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.emit("client", event, **fields)

    def fleet(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.emit("fleet", event, **fields)

    def verifier(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.emit("verifier", event, **fields)

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ reading
def trace_files(trace_dir: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(trace_dir).glob("*.jsonl"))


def iter_events(trace_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    for path in trace_files(trace_dir):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    yield json.loads(line)


def load_events(trace_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return list(iter_events(trace_dir))


def validate_trace(trace_dir: str | os.PathLike[str], max_errors: int = 20) -> list[str]:
    """Every schema violation as ``file:line: reason`` (at most ``max_errors``); [] when valid."""
    errors: list[str] = []
    files = trace_files(trace_dir)
    if not files:
        return [f"{trace_dir}: no *.jsonl files"]
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    reason = check_event(json.loads(line))
                except ValueError as exc:
                    reason = f"not JSON: {exc}"
                if reason is not None:
                    errors.append(f"{path}:{number}: {reason}")
                    if len(errors) >= max_errors:
                        return errors
    return errors
