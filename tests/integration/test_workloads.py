"""Workloads and the drill harness against real Kafka (the session cluster), no proxy.

* two families (kafka-python and the Java verifiable tools) started by hand:
  SIGTERM makes producers flush and exit 0, and every acknowledged record
  reaches both consumer groups;
* a broker-kill drill (Kafka's own fail-over) with the other two families
  through ``chaos.drills.drill``: zero lost, zero duplicated, every client recovered,
  the trace valid. It runs last: the restarted broker is still catching up
  when it ends.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos import trace
from chaos.drills import summary
from chaos.drills.drill import DrillConfig, Target, run_drill
from chaos.drills.load import TraceTail
from chaos.clients.workload import command

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RTO_BOUND_MS = 30_000  # generous: Kafka fences a dead broker after 6 s (broker.session.timeout.ms)


def _wait(condition, timeout_s: float, what: str, period_s: float = 0.2, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / period_s) + 2):
        if condition():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(period_s)
    assert condition(), f"timed out after {timeout_s} s waiting for {what}\n{detail()}"


def _stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"workload {proc.args[3:6]} ignored SIGTERM for {timeout_s} s")


def test_java_and_kafka_python_workloads_flush_on_sigterm(kafka_cluster, topic_name, tmp_path):
    kafka_cluster.create_topic(topic_name, 3, 3)
    trace_dir, logs = tmp_path / "trace", tmp_path / "logs"
    logs.mkdir()
    bs = kafka_cluster.bootstrap_servers
    specs = {
        "kp-producer": command("producer", "kafka-python", bootstrap=bs, topic=topic_name, trace_dir=trace_dir,
                               client_id="kp-producer", run_id="r1", rate=40, prefix=1, python=sys.executable),
        "java-producer": command("producer", "java", bootstrap=bs, topic=topic_name, trace_dir=trace_dir,
                                 client_id="java-producer", run_id="r1", rate=40, prefix=2, python=sys.executable),
        "java-consumer": command("consumer", "java", bootstrap=bs, topic=topic_name, trace_dir=trace_dir,
                                 client_id="java-consumer", run_id="r1", group=f"{topic_name}-j",
                                 python=sys.executable),
        "kp-consumer": command("consumer", "kafka-python", bootstrap=bs, topic=topic_name, trace_dir=trace_dir,
                               client_id="kp-consumer", run_id="r1", group=f"{topic_name}-k", python=sys.executable),
    }
    procs: dict[str, subprocess.Popen] = {}
    outs: dict[str, Path] = {}
    tail = TraceTail(trace_dir)
    try:
        for cid, cmd in specs.items():
            outs[cid] = logs / f"{cid}.log"
            with open(outs[cid], "wb") as out:
                procs[cid] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def enough() -> bool:
            tail.poll()
            return all(tail.ok_count.get(c, 0) >= 40 for c in specs)

        def progress() -> str:
            logs_ = "\n".join(f"--- {cid} (exit {procs[cid].poll()})\n{outs[cid].read_text(errors='replace')[-1500:]}"
                              for cid in specs)
            return f"successes {dict(tail.ok_count)} errors {dict(tail.errors)}\n{logs_}"

        _wait(enough, 120, "40 successes from every client", detail=progress)
        for cid in ("kp-producer", "java-producer"):
            assert _stop(procs[cid]) == 0, outs[cid].read_text()[-3000:]
        groups = [f"{topic_name}-j", f"{topic_name}-k"]

        def drained() -> bool:
            tail.poll()
            return not any(tail.unread(groups).values())

        _wait(drained, 60, "both groups to read every acked record",
              detail=lambda: f"unread {tail.unread(groups)}")
        for cid in ("java-consumer", "kp-consumer"):
            assert _stop(procs[cid]) == 0, outs[cid].read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)

    assert trace.validate_trace(trace_dir) == []
    s = summary.summarize(trace_dir)
    assert s["lost"] == 0 and s["duplicated"] == 0 and s["unacked_consumed"] == 0
    assert s["missed_by_group"] == {f"{topic_name}-j": 0, f"{topic_name}-k": 0}
    events = trace.load_events(trace_dir)
    for cid in specs:  # the exit line's counts agree with the trace
        exit_line = json.loads([ln for ln in outs[cid].read_text().splitlines() if ln.startswith("{")][-1])
        mine = [e for e in events if e["client_id"] == cid]
        kind = "ack" if "producer" in cid else "consume"
        assert exit_line["rc"] == 0
        assert exit_line["acked" if kind == "ack" else "consumed"] == sum(e["event"] == kind for e in mine) > 0
    java_acks = [e for e in events if e["client_id"] == "java-producer" and e["event"] == "ack"]
    assert all(e["detail"].startswith("java_ts_ms=") and e["key"] == f"2.{e['seq']}" for e in java_acks)
    # Records spread over the partitions and each producer numbers its records 0, 1, 2, ... without gaps.
    assert {e["partition"] for e in events if e["event"] == "ack"} == {0, 1, 2}
    for prefix in ("1", "2"):
        seqs = sorted(e["seq"] for e in events if e["event"] == "ack" and e["key"].startswith(prefix + "."))
        assert seqs == list(range(len(seqs)))


def test_broker_kill_drill_loses_and_duplicates_nothing(kafka_cluster, tmp_path):
    config = DrillConfig(fault="broker-kill", out_dir=tmp_path, repeat=1,
                         clients=(("aiokafka", "consumer"), ("aiokafka", "producer"),
                                  ("confluent", "consumer"), ("confluent", "producer")),
                         rate=50, seed=11)
    result = run_drill(config, Target.of_kafka(kafka_cluster))
    context = json.dumps({k: result.get(k) for k in ("errors", "steps", "clients", "records", "lost_keys",
                                                     "duplicated_keys", "trace_dir")}, indent=1)
    assert result["skipped"] is False
    assert result["errors"] == [], context
    assert result["trace_errors"] == [], context
    assert result["records"]["acked"] > 0, context
    assert result["lost"] == 0, context
    assert result["duplicated"] == 0, context
    assert result["recovered"] is True, context
    assert set(result["rto_ms"]) == {"aiokafka", "confluent"}, context
    for family, s in result["rto_ms"].items():
        assert s["clients"] == 2 and s["unrecovered"] == 0, context
        assert 0 < s["max"] < RTO_BOUND_MS, context
        assert s["max"] <= result["max_gap_ms"][family]["max"] < RTO_BOUND_MS, context
    assert result["workload_exits"] == {c: 0 for c in ("aiokafka-consumer", "aiokafka-producer",
                                                       "confluent-consumer", "confluent-producer")}
    assert result["missed_by_group"] and not any(result["missed_by_group"].values()), context
    (fault,) = result["faults"]
    assert fault["fault"] == "broker-kill" and fault["node"].startswith("broker-")
    events = trace.load_events(result["trace_dir"])
    fleet = [e["event"] for e in events if e["source"] == "fleet"]
    assert fleet == ["drill_start", "fault", "node_back", "drill_end"]
    # The load straddles the fault: each producer had records acked before the broker died and
    # after (the drill's length follows the recovery, so no count is fixed here: a broker back
    # in 0.2 s left 138 acked records in one CI run, under a bound of 200 that assumed seconds).
    (step,) = result["steps"]
    for producer in ("aiokafka-producer", "confluent-producer"):
        acks = [e["ts_ns"] for e in events if e.get("client_id") == producer and e["event"] == "ack"]
        assert acks and min(acks) < step["fault_ts_ns"] < max(acks), (producer, context)
    assert result["passed"] is True
    assert json.loads((Path(result["out_dir"]) / "summary.json").read_text())["lost"] == 0
    # The cluster is whole again for the rest of the session.
    kafka_cluster.wait_ready(60)
