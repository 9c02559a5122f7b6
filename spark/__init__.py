"""kproxy spark: failover traces in, RTO / loss / duplicate figures out.

Theory of operation
-------------------
A drill leaves a *trace*: a directory of JSON-lines files, one per process,
written by ``chaos.trace.TraceWriter`` (``*.jsonl``), or the same events as
Parquet (``*.parquet``, the native format; ``spark.convert`` writes it). One
schema rules both: ``spark.schema.TRACE_SCHEMA`` is built from
``chaos.trace.FIELDS``, so the writer and the readers cannot drift.

The report is extract -> transform -> load:

``extract`` (spark/extract.py)
    Reads the directory with the schema, JSON in FAILFAST mode, and validates
    every event. Anything malformed is a ``TraceFormatError`` naming the file
    and line (row for Parquet): never a silent null.
``transform`` (spark/transform.py)
    Pure DataFrame -> DataFrame functions, one per measure of DESIGN §7: fault
    windows, RTO per client per fault and its exact percentiles, detection and
    commit times, lost / duplicated records, the 100 ms throughput timeline.
    Built-in Spark SQL only, so executors need none of this code.
``load`` (spark/load.py, plots.py, report_text.py)
    Collects the small results and writes report.json, summary.txt, CSV
    tables and PNG plots. Computes nothing the transforms do not.

``spark.jobs`` wires them (``run_report``; ``spark-submit spark/jobs.py``),
``cli/report_cmd.py`` is the ``kproxy report`` face, the notebook in
``spark/notebooks`` replays a trace interactively with the same functions.
``spark.synth`` builds synthetic traces with planted gaps, losses and
duplicates plus their truth (tests, benchmark); ``spark.bench`` times the job;
``spark.standalone`` starts a throwaway standalone cluster on 127.0.0.1.

``spark.session`` holds the Spark settings for a 2-core machine: local[2], UI
off, few shuffle partitions, Arrow, everything bound to 127.0.0.1.
"""
