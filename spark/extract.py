"""Extract: a trace directory -> one validated events DataFrame.

A trace directory holds either JSON-lines files (``*.jsonl``, one per writing
process, as ``chaos.trace.TraceWriter`` writes them: at the top, or, for a
drill's ``--out`` directory, below it in ``<run_id>/trace/``, every run at once)
or Parquet files (``*.parquet`` anywhere below it, the native format; see
``convert_to_parquet``). Both are read with the schema from ``spark.schema``;
nothing is inferred.

JSON lines are read in FAILFAST mode: a value Spark cannot convert (a float in
an integer field, a string where a number belongs, a truncated line) fails the
read instead of turning into a silent null. Spark's error names the file but
not the line, so on failure the file is scanned in Python with the same rules
(``spark.schema.check_json_line``) and the error names ``file:line``.

Every event must also have ts_ns, run_id, source and event, and a source/event
pair that ``chaos.trace`` knows; the first event that does not is an error too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlparse

import attrs
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from chaos.trace import EVENTS_BY_SOURCE, FIELDS
from spark.schema import ARROW_TYPES, COLUMNS, REQUIRED, TRACE_SCHEMA, check_json_line

JSONL = "jsonl"
PARQUET = "parquet"
_FILE_COL = "_file"


class TraceFormatError(ValueError):
    """A trace that does not fit the schema: names the file and, if known, the line."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")


@attrs.frozen
class Trace:
    """The events of one trace directory, validated, plus where they came from."""

    events: DataFrame
    format: str
    root: str
    files: tuple[str, ...]
    count: int
    _persisted: DataFrame | None = None

    def release(self) -> None:
        """Drop the cached copy of a JSONL trace (Parquet traces are not cached)."""
        if self._persisted is not None:
            self._persisted.unpersist()


def find_trace_files(trace_dir: str | Path) -> tuple[str, tuple[Path, ...]]:
    """(format, files) of a trace directory; mixed or empty directories are errors."""
    root = Path(trace_dir)
    if not root.is_dir():
        raise TraceFormatError(root, None, "not a directory")
    jsonl = tuple(sorted(p for p in root.glob("*.jsonl") if p.is_file()))
    if not jsonl:  # a drill's --out directory: <run_id>/trace/*.jsonl for every run
        jsonl = tuple(sorted(p for p in root.rglob("*.jsonl") if p.is_file() and not _hidden(p, root)))
    parquet = tuple(sorted(p for p in root.rglob("*.parquet") if p.is_file() and not _hidden(p, root)))
    if jsonl and parquet:
        raise TraceFormatError(root, None, "holds both *.jsonl and *.parquet files: point at one format")
    if parquet:
        return PARQUET, parquet
    if jsonl:
        return JSONL, jsonl
    raise TraceFormatError(root, None, "no trace files (*.jsonl or *.parquet)")


def read_trace(spark: SparkSession, trace_dir: str | Path) -> Trace:
    """Read and validate a trace directory (JSON lines or Parquet)."""
    root = Path(trace_dir).resolve()
    fmt, files = find_trace_files(root)
    if fmt == JSONL:
        return _read_jsonl(spark, root, files)
    return _read_parquet(spark, root, files)


def convert_to_parquet(spark: SparkSession, trace_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> int:
    """Validate a trace (either format) and write it as Parquet; returns the event count."""
    trace = read_trace(spark, trace_dir)
    try:
        trace.events.write.mode("overwrite" if overwrite else "errorifexists").parquet(str(Path(out_dir).resolve()))
    finally:
        trace.release()
    return trace.count


# -- JSON lines ---------------------------------------------------------------


def _read_jsonl(spark: SparkSession, root: Path, files: tuple[Path, ...]) -> Trace:
    nested = any(path.parent != root for path in files)
    raw = (
        spark.read.schema(TRACE_SCHEMA)
        .option("mode", "FAILFAST")
        .option("pathGlobFilter", "*.jsonl")
        .option("recursiveFileLookup", "true" if nested else "false")
        .json(str(root))
        .select(*COLUMNS, F.col("_metadata.file_path").alias(_FILE_COL))
    )
    # Cached whole: the validation below then parses every field of every line
    # once (a pruned scan would skip fields it does not need), and the jobs do
    # not parse the text again.
    cached = raw.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        count, bad_file = _validate(spark, cached, files)
    except BaseException:
        cached.unpersist()
        raise
    if bad_file is not None:
        cached.unpersist()
        path = _local_path(bad_file)
        error = _first_bad_line([path, *files])
        raise error or TraceFormatError(path, None, "an event lacks ts_ns/run_id/source/event or has an unknown event")
    return Trace(cached.select(*COLUMNS), JSONL, str(root), tuple(map(str, files)), count, cached)


def _first_bad_line(paths: Iterable[Path]) -> TraceFormatError | None:
    """The first malformed line, looking at ``paths`` in order (each once)."""
    seen: set[Path] = set()
    for path in paths:
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        with open(path, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, start=1):
                reason = check_json_line(line)
                if reason is not None:
                    return TraceFormatError(path, number, reason)
    return None


# -- Parquet ------------------------------------------------------------------


def _read_parquet(spark: SparkSession, root: Path, files: tuple[Path, ...]) -> Trace:
    for path in files:
        _check_parquet_schema(path)
    df = (
        spark.read.schema(TRACE_SCHEMA)
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "*.parquet")
        .parquet(str(root))
    )
    count, bad_file = _validate(spark, df.select(*COLUMNS, F.col("_metadata.file_path").alias(_FILE_COL)), files)
    if bad_file is not None:
        path = _local_path(bad_file)
        raise TraceFormatError(path, None, f"row {_first_bad_row(path)}: an event lacks ts_ns/run_id/source/event or has an unknown event")
    return Trace(df.select(*COLUMNS), PARQUET, str(root), tuple(map(str, files)), count)


def _check_parquet_schema(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise TraceFormatError(path, None, f"not a readable Parquet file: {exc}") from exc
    for name, kind in FIELDS:
        index = schema.get_field_index(name)
        if index < 0:
            if name in REQUIRED:
                raise TraceFormatError(path, None, f"column {name!r} is missing")
            continue
        arrow_type = schema.field(index).type
        if pa.types.is_dictionary(arrow_type):
            arrow_type = arrow_type.value_type
        if str(arrow_type) not in ARROW_TYPES[kind]:
            raise TraceFormatError(path, None, f"column {name!r} has type {arrow_type}, expected {kind}")


def _first_bad_row(path: Path) -> int | None:
    """0-based index of the first row of a Parquet file that fails the checks."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=list(REQUIRED))
    for index, row in enumerate(table.to_pylist()):
        if _bad_row(row):
            return index
    return None


def _bad_row(row: dict[str, object]) -> bool:
    if any(row.get(name) is None for name in REQUIRED):
        return True
    return row["event"] not in EVENTS_BY_SOURCE.get(str(row["source"]), frozenset())


# -- shared -------------------------------------------------------------------


def bad_event(df: DataFrame) -> Column:
    """True for an event without ts_ns/run_id/source/event or with an unknown event."""
    known = F.lit(False)
    for source, events in sorted(EVENTS_BY_SOURCE.items()):
        known = known | ((F.col("source") == source) & F.col("event").isin(*sorted(events)))
    missing = F.col("ts_ns").isNull() | F.col("run_id").isNull()
    return missing | ~F.coalesce(known, F.lit(False))


def _validate(spark: SparkSession, df: DataFrame, files: tuple[Path, ...]) -> tuple[int, str | None]:
    """(event count, first file holding a bad event or None); FAILFAST errors -> file:line.

    One pass counts events and bad events; only when there are bad ones does a
    second pass look for the file (the per-row file name costs a column).
    """
    bad = bad_event(df)
    sc = spark.sparkContext
    level = sc.getConf().get("spark.log.level", "ERROR")
    # An expected FAILFAST failure would log a task stack trace per attempt;
    # the error raised below says everything, so keep the log quiet meanwhile.
    sc.setLogLevel("OFF")
    try:
        row = df.agg(F.count(F.lit(1)).alias("n"), F.count(F.when(bad, 1)).alias("bad")).first()
    except Exception as exc:  # py4j / pyspark errors carry the JVM message as text
        message = str(exc)
        if "MALFORMED_RECORD" not in message and "FAILED_READ_FILE" not in message:
            raise
        named = _file_in_message(message)
        error = _first_bad_line([*([named] if named else []), *files])
        if error is not None:
            raise error from None
        raise TraceFormatError(named or "trace", None, _cause_in_message(message)) from None
    finally:
        sc.setLogLevel(level)
    assert row is not None
    if row["n"] == 0:
        raise TraceFormatError(files[0].parent if files else "trace", None, "the trace has no events")
    if row["bad"] == 0:
        return int(row["n"]), None
    first = df.filter(bad).select(_FILE_COL).orderBy(_FILE_COL).first()
    return int(row["n"]), first[_FILE_COL] if first else None


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith((".", "_")) for part in path.relative_to(root).parts)


def _local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    return Path(unquote(parsed.path)) if parsed.scheme in ("file", "") else Path(uri)


_FILE_RE = re.compile(r"reading file (\S+?)\.?\s+SQLSTATE")
_CAUSE_RE = re.compile(r"\[(CANNOT_PARSE_JSON_FIELD|MALFORMED_RECORD_IN_PARSING)[^\]]*\]([^\n]*)")


def _file_in_message(message: str) -> Path | None:
    match = _FILE_RE.search(message)
    return _local_path(match.group(1)) if match else None


def _cause_in_message(message: str) -> str:
    causes = _CAUSE_RE.findall(message)
    if causes:
        return causes[-1][1].strip()
    return message.strip().splitlines()[0] if message.strip() else "malformed trace"
