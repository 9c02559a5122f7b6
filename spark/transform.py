"""Transform: DataFrame -> DataFrame, one function per measure of DESIGN §7.

Every function takes the events DataFrame (schema ``spark.schema.TRACE_SCHEMA``)
or the output of another function here, and returns a DataFrame; none collects
to the driver or touches a file. Only built-in Spark SQL expressions are used
(no Python UDFs), so the jobs run unchanged on a cluster whose executors have
no copy of this code.

The measures (fault window, RTO, detect/commit, lost, duplicated) are
defined once, with every parameter, in ``chaos.measures``; the constants used
here come from there, and ``tests/spark/test_measures_agree.py`` checks this
implementation against the pure-Python one on the same traces. Only here:

throughput timeline
    acks and consumes per 100 ms bucket counted from the run's first event,
    every bucket present (zeros included), with the faults injected in it.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from chaos.measures import (ACK, BOUNDARY_RANK, CLIENT, COMMITTED, CONSUME, FAULT, FINAL_READ, FLEET, NO_GROUP_READER,
                            NODE_DOWN, NS_PER_MS, PERCENTILES, RECORD_KEY, SUCCESS_EVENTS, UNKNOWN, VERIFIED_END,
                            VERIFIED_READ, VERIFIER, percentile_label)
from chaos.measures import FAULT_KEY as _FAULT_KEY

BUCKET_MS = 100


def _ms(ns: Column) -> Column:
    return ns.cast("double") / F.lit(float(NS_PER_MS))


def _is_client() -> Column:
    return F.col("source") == CLIENT


def _is_fleet() -> Column:
    return F.col("source") == FLEET


# -- runs and faults ------------------------------------------------------------


def runs(events: DataFrame) -> DataFrame:
    """One row per run: run_id, start_ns, end_ns, duration_ms, events, clients, faults."""
    return (
        events.groupBy("run_id")
        .agg(
            F.min("ts_ns").alias("start_ns"),
            F.max("ts_ns").alias("end_ns"),
            F.count(F.lit(1)).alias("events"),
            F.count_distinct(F.when(_is_client(), F.col("client_id"))).alias("clients"),
            F.sum(F.when(_is_fleet() & (F.col("event") == FAULT), 1).otherwise(0)).cast("long").alias("faults"),
        )
        .withColumn("duration_ms", _ms(F.col("end_ns") - F.col("start_ns")))
        .select("run_id", "start_ns", "end_ns", "duration_ms", "events", "clients", "faults")
    )


def fault_windows(events: DataFrame, run_table: DataFrame | None = None) -> DataFrame:
    """One row per fault: run_id, fault_idx (0-based, time order), fault, node,
    fault_ts_ns, window_start_ns, window_end_ns."""
    run_table = runs(events) if run_table is None else run_table
    rank = F.create_map(*[x for name, r in BOUNDARY_RANK.items() for x in (F.lit(name), F.lit(r))])
    order = Window.partitionBy("run_id").orderBy("ts_ns", "rank", "fault", "node")
    boundaries = (
        events.filter(_is_fleet() & F.col("event").isin(*BOUNDARY_RANK))
        .select("run_id", "ts_ns", "event", "fault", "node", rank[F.col("event")].alias("rank"))
        .withColumn("prev_ns", F.lag("ts_ns").over(order))
        .withColumn("next_ns", F.lead("ts_ns").over(order))
    )
    faults = boundaries.filter(F.col("event") == FAULT).withColumn(
        "fault_idx",
        (F.row_number().over(Window.partitionBy("run_id").orderBy("ts_ns", "fault", "node")) - 1).cast("int"),
    )
    bounds = F.broadcast(run_table.select("run_id", "start_ns", "end_ns"))
    return faults.join(bounds, "run_id").select(
        "run_id",
        "fault_idx",
        F.coalesce(F.col("fault"), F.lit(UNKNOWN)).alias("fault"),
        "node",
        F.col("ts_ns").alias("fault_ts_ns"),
        F.coalesce("prev_ns", "start_ns").alias("window_start_ns"),
        F.coalesce("next_ns", "end_ns").alias("window_end_ns"),
    )


# -- RTO ----------------------------------------------------------------------------


def fault_segments(faults: DataFrame) -> DataFrame:
    """Per run, the time ranges between faults: run_id, seg, lo_ns, hi_ns.

    Segment ``i`` holds the instants in (lo_ns, hi_ns]: segment 0 ends at the
    first fault, segment i at fault i, the last one (i = number of faults) has
    no end. An event at or before fault i is in a segment <= i.
    """
    order = Window.partitionBy("run_id").orderBy("fault_idx")
    inner = faults.select(
        "run_id",
        F.col("fault_idx").alias("seg"),
        F.lag("fault_ts_ns").over(order).alias("lo_ns"),
        F.col("fault_ts_ns").alias("hi_ns"),
    )
    last = faults.groupBy("run_id").agg(
        F.count(F.lit(1)).cast("int").alias("seg"),
        F.max("fault_ts_ns").alias("lo_ns"),
        F.lit(None).cast("long").alias("hi_ns"),
    )
    return inner.unionByName(last)


def rto_per_client(events: DataFrame, faults: DataFrame) -> DataFrame:
    """One row per (fault, participating client), see the module docstring.

    Columns: run_id, fault_idx, fault, node, fault_ts_ns, client_id, family,
    role, gap_start_ns, gap_end_ns, rto_ms, recovered.

    Cost: one pass over the client events, grouped by (run, client, segment)
    where a segment is the time between two consecutive faults of the run
    (a broadcast range join); the rest works on that small table.
    """
    segs = F.broadcast(fault_segments(faults).withColumnRenamed("run_id", "seg_run_id"))
    ok = F.col("event").isin(*SUCCESS_EVENTS)
    in_segment = (
        (F.col("run_id") == F.col("seg_run_id"))
        & (F.col("lo_ns").isNull() | (F.col("ts_ns") > F.col("lo_ns")))
        & (F.col("hi_ns").isNull() | (F.col("ts_ns") <= F.col("hi_ns")))
    )
    segments = (
        events.filter(_is_client() & F.col("client_id").isNotNull())
        .select("run_id", "client_id", "ts_ns", "event", "family")
        .join(segs, in_segment)
        .groupBy("run_id", "client_id", "seg")
        .agg(
            F.min("ts_ns").alias("first_ns"),
            F.max("ts_ns").alias("last_ns"),
            F.min(F.when(ok, F.col("ts_ns"))).alias("first_ok_ns"),
            F.max(F.when(ok, F.col("ts_ns"))).alias("last_ok_ns"),
            F.min("family").alias("family"),
            F.bool_or(F.col("event") == CONSUME).alias("consumer"),
        )
    )
    before = F.col("seg") <= F.col("fault_idx")  # ts <= this fault's instant
    per_client = (
        segments.join(F.broadcast(faults.select(*_FAULT_KEY)), "run_id")
        .groupBy(*_FAULT_KEY, "client_id")
        .agg(
            F.min("first_ns").alias("client_first_ns"),
            F.max("last_ns").alias("client_last_ns"),
            F.max(F.when(before, F.col("last_ok_ns"))).alias("last_ok_before_ns"),
            F.min(F.when(~before, F.col("first_ok_ns"))).alias("first_ok_after_ns"),
            F.min("family").alias("family"),
            F.bool_or("consumer").alias("consumer"),
        )
        .filter((F.col("client_first_ns") <= F.col("fault_ts_ns")) & (F.col("client_last_ns") >= F.col("window_start_ns")))
    )
    recovered = F.coalesce(F.col("first_ok_after_ns") <= F.col("window_end_ns"), F.lit(False))
    return (
        per_client.withColumn("recovered", recovered)
        .withColumn("gap_start_ns", F.coalesce("last_ok_before_ns", "client_first_ns"))
        .withColumn("gap_end_ns", F.when(F.col("recovered"), F.col("first_ok_after_ns")).otherwise(F.col("window_end_ns")))
        .select(
            "run_id",
            "fault_idx",
            "fault",
            "node",
            "fault_ts_ns",
            "client_id",
            F.coalesce("family", F.lit(UNKNOWN)).alias("family"),
            F.when(F.col("consumer"), F.lit("consumer")).otherwise(F.lit("producer")).alias("role"),
            "gap_start_ns",
            "gap_end_ns",
            _ms(F.col("gap_end_ns") - F.col("gap_start_ns")).alias("rto_ms"),
            "recovered",
        )
    )


def _stats(value: str, prefix: str = "") -> list[Column]:
    col = F.col(value)
    return [
        *(F.percentile(col, p).alias(f"{prefix}{percentile_label(p)}_ms") for p in PERCENTILES),
        F.max(col).alias(f"{prefix}max_ms"),
    ]


def run_summary(run_table: DataFrame, faults: DataFrame, rto: DataFrame, lost_records: DataFrame,
                duplicated_records: DataFrame) -> DataFrame:
    """One row per run (a drill's ``--out`` holds several): the columns of ``runs`` plus
    fault_types (comma-separated), rto_p50_ms/rto_p99_ms/rto_max_ms over its clients and faults,
    lost and duplicated (record counts, as in the report's totals)."""
    types = faults.groupBy("run_id").agg(F.concat_ws(",", F.array_sort(F.collect_set("fault"))).alias("fault_types"))
    rto_run = rto.groupBy("run_id").agg(*_stats("rto_ms", "rto_"))
    lost_run = lost_records.groupBy("run_id").agg(F.count(F.lit(1)).alias("lost"))
    dup_run = duplicated_records.groupBy("run_id").agg(F.count(F.lit(1)).alias("duplicated"))
    joined = (run_table.join(types, "run_id", "left").join(rto_run, "run_id", "left")
              .join(lost_run, "run_id", "left").join(dup_run, "run_id", "left"))
    return joined.select(
        *run_table.columns, F.coalesce("fault_types", F.lit("")).alias("fault_types"),
        *(c for c in rto_run.columns if c != "run_id"),
        F.coalesce("lost", F.lit(0)).alias("lost"), F.coalesce("duplicated", F.lit(0)).alias("duplicated"),
    ).orderBy("run_id")


def rto_stats(rto: DataFrame) -> DataFrame:
    """Exact p50/p99/max of rto_ms per (fault, family), over clients and repeats.

    Columns: fault, family, clients, p50_ms, p99_ms, max_ms, unrecovered.
    """
    return (
        rto.groupBy("fault", "family")
        .agg(
            F.count(F.lit(1)).alias("clients"),
            *_stats("rto_ms"),
            F.sum(F.when(F.col("recovered"), 0).otherwise(1)).cast("long").alias("unrecovered"),
        )
        .orderBy("fault", "family")
    )


# -- detection and commit ----------------------------------------------------------


def failover(events: DataFrame, faults: DataFrame) -> DataFrame:
    """One row per fault: the fault columns plus node_down_ns, committed_ns,
    detect_ms, commit_ms, failover_ms (nulls where the event never came)."""
    marks = events.filter(_is_fleet() & F.col("event").isin(NODE_DOWN, COMMITTED)).select(
        "run_id", "event", "ts_ns"
    )
    in_window = (F.col("ts_ns") >= F.col("anchor_ns")) & (F.col("ts_ns") <= F.col("window_end_ns"))
    downs = marks.filter(F.col("event") == NODE_DOWN)
    commits = marks.filter(F.col("event") == COMMITTED)
    detected = (
        faults.select(*_FAULT_KEY)
        .withColumn("anchor_ns", F.col("fault_ts_ns"))
        .join(F.broadcast(downs), "run_id", "left")
        .groupBy(*_FAULT_KEY)
        .agg(F.min(F.when(in_window, F.col("ts_ns"))).alias("node_down_ns"))
    )
    # The first commit after the *fault*, even one before node_down: a planned move
    # (drain, rolling restart) publishes the new map before the node goes down.
    committed = (
        detected.withColumn("anchor_ns", F.col("fault_ts_ns"))
        .join(F.broadcast(commits), "run_id", "left")
        .groupBy(*_FAULT_KEY, "node_down_ns")
        .agg(F.min(F.when(in_window, F.col("ts_ns"))).alias("committed_ns"))
        .withColumn("anchor_ns", F.coalesce("node_down_ns", "fault_ts_ns"))
    )
    return committed.select(
        *_FAULT_KEY,
        "node_down_ns",
        "committed_ns",
        _ms(F.col("node_down_ns") - F.col("fault_ts_ns")).alias("detect_ms"),
        F.when(F.col("committed_ns").isNotNull(),  # greatest() would turn a missing commit into 0
               F.greatest(_ms(F.col("committed_ns") - F.col("anchor_ns")), F.lit(0.0))).alias("commit_ms"),
        _ms(F.col("committed_ns") - F.col("fault_ts_ns")).alias("failover_ms"),
    )


def with_clients_back(failover_table: DataFrame, rto: DataFrame) -> DataFrame:
    """The last phase of the breakdown (fault -> detected -> committed -> clients back): adds
    clients_back_ns (the latest first success after the fault among the fault's recovered
    clients) and back_ms (from the commit, else node_down, else the fault, to clients_back_ns;
    0 when the clients were back first, null when none recovered). See chaos.measures.Failover."""
    back = (rto.filter(F.col("recovered")).groupBy("run_id", "fault_idx")
            .agg(F.max("gap_end_ns").alias("clients_back_ns")))
    anchor = F.coalesce("committed_ns", "node_down_ns", "fault_ts_ns")
    return failover_table.join(back, ["run_id", "fault_idx"], "left").withColumn(
        "back_ms", F.when(F.col("clients_back_ns").isNotNull(),
                          F.greatest(_ms(F.col("clients_back_ns") - anchor), F.lit(0.0))))


def failover_stats(failover_table: DataFrame) -> DataFrame:
    """Per fault type: faults, and p50/p99/max of detect_ms, commit_ms,
    failover_ms (over the faults where they exist: ``detected``, ``committed``)."""
    return (
        failover_table.groupBy("fault")
        .agg(
            F.count(F.lit(1)).alias("faults"),
            F.count("detect_ms").alias("detected"),
            F.count("committed_ns").alias("committed"),
            *_stats("detect_ms", "detect_"),
            *_stats("commit_ms", "commit_"),
            *_stats("failover_ms", "failover_"),
        )
        .orderBy("fault")
    )


# -- records: lost and duplicated ----------------------------------------------------

# Readers (consumer groups) counted in one pass as separate columns; above this
# many, the two-pass plan is used (the same result, more shuffle work).
MAX_PIVOT_READERS = 64
_READS_TYPE = "array<struct<group:string,times:bigint>>"


def _reader() -> Column:
    """Who read a record: the consume event's group, or the client itself when it has none; the
    final read for the verifier's reads; null for an ack."""
    group = F.coalesce(F.col("group"), F.concat(F.lit(NO_GROUP_READER), F.coalesce(F.col("client_id"), F.lit("?"))))
    return F.when(_is_client() & (F.col("event") == CONSUME), group).when(_is_final_read(), F.lit(FINAL_READ))


def _is_final_read() -> Column:
    return (F.col("source") == VERIFIER) & (F.col("event") == VERIFIED_READ)


def _record_events(events: DataFrame) -> DataFrame:
    """Acks, consumes and the final read's records: RECORD_KEY, reader (null for an ack)."""
    return events.filter(
        ((_is_client() & F.col("event").isin(*SUCCESS_EVENTS)) | _is_final_read())
        & (F.col("key").isNotNull() | F.col("seq").isNotNull())
    ).select(*RECORD_KEY, _reader().alias("reader"))


def consumer_readers(events: DataFrame) -> list[str]:
    """The distinct readers of the trace, the final read included (runs a small query)."""
    readers = _record_events(events).filter(F.col("reader").isNotNull()).select(F.col("reader").alias("r"))
    rows = readers.distinct().collect()
    return sorted(row["r"] for row in rows)


def verified_topics(events: DataFrame) -> DataFrame:
    """The (run_id, topic) pairs the final read read to the end: run_id, topic, verified (true)."""
    return (events.filter((F.col("source") == VERIFIER) & (F.col("event") == VERIFIED_END))
            .select("run_id", "topic").distinct().withColumn("verified", F.lit(True)))


def record_outcomes(
    events: DataFrame, readers: list[str] | None = None, *, max_pivot: int = MAX_PIVOT_READERS
) -> DataFrame:
    """One row per record: run_id, topic, key, seq, acked, consumes, final_reads, verified,
    dup_readers, reads.

    ``consumes`` counts the reads of consumer groups, ``final_reads`` those of the final read;
    ``verified`` says the record's topic was read to the end by the final read. ``reads`` lists
    (group, times) for every reader of the trace (times may be 0; the final read is the reader
    ``FINAL_READ``); ``dup_readers`` is how many readers read the record more than once.
    ``readers`` (the distinct readers, from ``consumer_readers``) is computed when not given.
    With at most ``max_pivot`` readers this is one shuffle of acks and reads with numeric
    aggregates only.
    """
    readers = sorted(consumer_readers(events) if readers is None else readers)
    records = _record_events(events)
    if len(readers) > max_pivot:
        grouped = _record_outcomes_two_pass(records)
    else:
        grouped = _record_outcomes_pivot(records, readers)
    return (grouped.join(F.broadcast(verified_topics(events)), ["run_id", "topic"], "left")
            .select(*RECORD_KEY, "acked", "consumes", "final_reads",
                    F.coalesce(F.col("verified"), F.lit(False)).alias("verified"), "dup_readers", "reads"))


def _record_outcomes_pivot(records: DataFrame, readers: list[str]) -> DataFrame:
    """``record_outcomes`` before the join with the verified topics, one column per reader."""
    counts = [F.count(F.when(F.col("reader") == r, 1)).alias(f"_r{i}") for i, r in enumerate(readers)]
    read = F.col("reader").isNotNull()
    grouped = records.groupBy(*RECORD_KEY).agg(
        F.bool_or(~read).alias("acked"),
        F.count(F.when(read & (F.col("reader") != FINAL_READ), 1)).alias("consumes"),
        F.count(F.when(F.col("reader") == FINAL_READ, 1)).alias("final_reads"),
        *counts,
    )
    if readers:
        dup_readers = sum((F.col(f"_r{i}") > 1).cast("long") for i in range(len(readers)))
        reads = F.array(*[F.struct(F.lit(r).alias("group"), F.col(f"_r{i}").alias("times")) for i, r in enumerate(readers)])
    else:
        dup_readers, reads = F.lit(0).cast("long"), F.array().cast(_READS_TYPE)
    return grouped.select(*RECORD_KEY, "acked", "consumes", "final_reads", dup_readers.alias("dup_readers"),
                          reads.alias("reads"))


def _record_outcomes_two_pass(records: DataFrame) -> DataFrame:
    """``record_outcomes`` for many readers: count per (record, reader), then per record.

    Repartitioning by the record first lets both aggregations share one shuffle.
    """
    per_reader = records.repartition(*RECORD_KEY).groupBy(*RECORD_KEY, "reader").agg(F.count(F.lit(1)).alias("n"))
    read = F.col("reader").isNotNull()
    final = F.col("reader") == FINAL_READ
    return per_reader.groupBy(*RECORD_KEY).agg(
        F.bool_or(~read).alias("acked"),
        F.coalesce(F.sum(F.when(read & ~final, F.col("n"))), F.lit(0)).alias("consumes"),
        F.coalesce(F.sum(F.when(final, F.col("n"))), F.lit(0)).alias("final_reads"),
        F.count(F.when(read & (F.col("n") > 1), 1)).alias("dup_readers"),
        F.collect_list(F.when(read, F.struct(F.col("reader").alias("group"), F.col("n").alias("times")))).alias("reads"),
    )


def _is_lost() -> Column:
    """Acked and not read: by the final read where the topic was read to the end, else by any group."""
    not_read = F.when(F.col("verified"), F.col("final_reads") == 0).otherwise(F.col("consumes") == 0)
    return F.col("acked") & not_read


def _is_duplicated() -> Column:
    return F.col("dup_readers") > 0


def _is_unacked_consumed() -> Column:
    return ~F.col("acked") & (F.col("consumes") > 0)


def record_problems(outcomes: DataFrame) -> DataFrame:
    """The records that are lost, duplicated or consumed without an ack
    (usually a handful: worth caching before lost/duplicated/unacked_consumed)."""
    return outcomes.filter(_is_lost() | _is_duplicated() | _is_unacked_consumed())


def lost(outcomes: DataFrame) -> DataFrame:
    """Acked records not read (see ``_is_lost``): run_id, topic, key, seq."""
    return outcomes.filter(_is_lost()).select(*RECORD_KEY)


def duplicated(outcomes: DataFrame) -> DataFrame:
    """Records one reader (a group or the final read) read more than once: run_id, topic, group, key,
    seq, times."""
    return (
        outcomes.filter(_is_duplicated())
        .select(*RECORD_KEY, F.explode("reads").alias("read"))
        .filter(F.col("read.times") > 1)
        .select("run_id", "topic", F.col("read.group").alias("group"), "key", "seq", F.col("read.times").alias("times"))
    )


def unacked_consumed(outcomes: DataFrame) -> DataFrame:
    """Records consumed although no ack was seen: run_id, topic, key, seq."""
    return outcomes.filter(_is_unacked_consumed()).select(*RECORD_KEY)


# -- throughput timeline ------------------------------------------------------------


def timeline(
    events: DataFrame, run_table: DataFrame, faults: DataFrame, bucket_ms: int = BUCKET_MS
) -> DataFrame:
    """Per run and bucket: run_id, bucket, t_ms, acks, consumes, faults.

    Buckets are ``bucket_ms`` wide from the run's first event; every bucket up
    to the run's last event is present. ``faults`` names the faults injected
    in the bucket (comma-separated, null when none).
    """
    width = F.lit(bucket_ms * NS_PER_MS)
    starts = F.broadcast(run_table.select("run_id", "start_ns"))
    bucket = ((F.col("ts_ns") - F.col("start_ns")) / width).cast("long")
    counts = (
        events.filter(_is_client() & F.col("event").isin(*SUCCESS_EVENTS))
        .join(starts, "run_id")
        .groupBy("run_id", bucket.alias("bucket"))
        .agg(
            F.sum(F.when(F.col("event") == ACK, 1).otherwise(0)).cast("long").alias("acks"),
            F.sum(F.when(F.col("event") == CONSUME, 1).otherwise(0)).cast("long").alias("consumes"),
        )
    )
    grid = run_table.select(
        "run_id",
        F.explode(F.sequence(F.lit(0).cast("long"), ((F.col("end_ns") - F.col("start_ns")) / width).cast("long"))).alias(
            "bucket"
        ),
    )
    marks = (
        faults.join(starts, "run_id")
        .withColumn("bucket", ((F.col("fault_ts_ns") - F.col("start_ns")) / width).cast("long"))
        .groupBy("run_id", "bucket")
        .agg(F.concat_ws(",", F.array_sort(F.collect_list("fault"))).alias("faults"))
    )
    return (
        grid.join(counts, ["run_id", "bucket"], "left")
        .join(marks, ["run_id", "bucket"], "left")
        .select(
            "run_id",
            "bucket",
            (F.col("bucket") * F.lit(bucket_ms)).alias("t_ms"),
            F.coalesce("acks", F.lit(0).cast("long")).alias("acks"),
            F.coalesce("consumes", F.lit(0).cast("long")).alias("consumes"),
            "faults",
        )
    )
