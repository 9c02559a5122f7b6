"""Hand-made traces whose answers are worked out by hand in the tests.

Times are written in milliseconds from an arbitrary origin ``T0_MS``; ``ns``
turns them into trace timestamps.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from chaos.trace import TraceWriter, make_event
from spark.schema import TRACE_SCHEMA

T0_MS = 1_700_000_000_000


def ns(ms: float) -> int:
    return int(round((T0_MS + ms) * 1_000_000))


class TraceBuilder:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def fleet(self, run_id: str, event: str, at_ms: float, **fields: Any) -> TraceBuilder:
        self.events.append(make_event("fleet", event, ts_ns=ns(at_ms), run_id=run_id, **fields))
        return self

    def client(self, run_id: str, event: str, at_ms: float, client_id: str, family: str, **fields: Any) -> TraceBuilder:
        self.events.append(
            make_event("client", event, ts_ns=ns(at_ms), run_id=run_id, client_id=client_id, family=family, **fields)
        )
        return self

    def producer(self, run_id: str, client_id: str, family: str, acks_ms: list[int], topic: str = "t") -> TraceBuilder:
        """A send 5 ms before every ack; key "<client>-<ms>", seq = ms."""
        for at in acks_ms:
            record = {"topic": topic, "key": f"{client_id}-{at}", "seq": at}
            self.client(run_id, "send", at - 5, client_id, family, **record)
            self.client(run_id, "ack", at, client_id, family, partition=0, offset=at, **record)
        return self

    def consumer(self, run_id: str, client_id: str, family: str, group: str, at_ms: list[int], topic: str = "t") -> TraceBuilder:
        for at in at_ms:
            self.client(run_id, "consume", at, client_id, family, topic=topic, key=f"x-{at}", seq=at, partition=0, offset=at, group=group)
        return self

    def frame(self, spark: SparkSession) -> DataFrame:
        return spark.createDataFrame(self.events, TRACE_SCHEMA)

    def write_jsonl(self, trace_dir: Path) -> Path:
        """Through the real writer: one file per process (client_id, or fleet-<run>)."""
        by_process: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for event in self.events:
            name = event["client_id"] if event["source"] == "client" else f"fleet-{event['run_id']}"
            by_process[(name, event["run_id"])].append(event)
        for (name, run_id), events in sorted(by_process.items()):
            with TraceWriter(trace_dir, name, run_id) as writer:
                for event in events:
                    fields = {k: v for k, v in event.items() if v is not None and k not in ("run_id", "source", "event")}
                    writer.emit(event["source"], event["event"], **fields)
        return trace_dir


def every(start: int, stop: int, step: int = 100, skip: tuple[int, ...] = ()) -> list[int]:
    """start, start+step, ... up to and including stop, without ``skip``."""
    return [t for t in range(start, stop + 1, step) if t not in skip]


def two_drills() -> TraceBuilder:
    """Run r1: a kill at 2000 (drill 1000-5000), a freeze at 7000 (drill 6000-9000).

    Success times (ms) per client:
      p1 aiokafka producer    1000..1900, 2600..6900, 7250..8950   (error at 2300)
      p2 confluent producer   1000..4900 without 2100 (stops before drill 2)
      p3 kafka-python prod.   1000..1800, 5100..8900
      c1 aiokafka consumer g1 1050..1950, 2350..6950, 7150..8950
      c2 java consumer g2     2500..6800, 7400..8900   (starts after the kill)
    Fleet: node_down 2150, commit 2180; node_down 5500 (between drills);
    commit 6200 (before the freeze); node_down 7400, commit 7500.
    """
    b = TraceBuilder()
    r = "r1"
    b.fleet(r, "drill_start", 990, fault="kill")
    b.fleet(r, "fault", 2000, fault="kill", node="p2")
    b.fleet(r, "node_down", 2150, node="p2", epoch=2)
    b.fleet(r, "assignment_committed", 2180, epoch=3, detail="{}")
    b.fleet(r, "node_back", 3500, node="p2")
    b.fleet(r, "drill_end", 5000, fault="kill")
    b.fleet(r, "node_down", 5500, node="p1", epoch=4)
    b.fleet(r, "drill_start", 6000, fault="freeze")
    b.fleet(r, "assignment_committed", 6200, epoch=5, detail="{}")
    b.fleet(r, "fault", 7000, fault="freeze", node="p1")
    b.fleet(r, "node_down", 7400, node="p1", epoch=6)
    b.fleet(r, "assignment_committed", 7500, epoch=7, detail="{}")
    b.fleet(r, "drill_end", 9000, fault="freeze")
    b.producer(r, "p1", "aiokafka", every(1000, 1900) + every(2600, 6900) + every(7250, 8950))
    b.client(r, "error", 2300, "p1", "aiokafka", topic="t", key="p1-2300", seq=2300, detail="timeout")
    b.producer(r, "p2", "confluent", every(1000, 4900, skip=(2100,)))
    b.producer(r, "p3", "kafka-python", every(1000, 1800) + every(5100, 8900))
    b.consumer(r, "c1", "aiokafka", "g1", every(1050, 1950) + every(2350, 6950) + every(7150, 8950))
    b.consumer(r, "c2", "java", "g2", every(2500, 6800) + every(7400, 8900))
    return b


def small_drill(clean: bool = False) -> TraceBuilder:
    """One kill drill (run d1, 900-5000, fault at 2000, node_down 2150, commit 2180).

    Producer p1 (aiokafka) acks key k<i>, seq i, at 1000..1900 and 2600..4900
    (i = 0, 1, ...). Consumer c1 (java, group g1) reads each 50 ms after its
    ack; unless ``clean``: never reads k3 (lost) and reads k5 twice (+10 ms).
    RTO of both: 700 ms. detect 150 ms, commit 30 ms.
    """
    b = TraceBuilder()
    r = "d1"
    b.fleet(r, "drill_start", 900, fault="kill")
    b.fleet(r, "fault", 2000, fault="kill", node="p2")
    b.fleet(r, "node_down", 2150, node="p2", epoch=2)
    b.fleet(r, "assignment_committed", 2180, epoch=3, detail="{}")
    b.fleet(r, "drill_end", 5000, fault="kill")
    for seq, at in enumerate(every(1000, 1900) + every(2600, 4900)):
        record = {"topic": "t", "key": f"k{seq}", "seq": seq}
        b.client(r, "send", at - 5, "p1", "aiokafka", **record)
        b.client(r, "ack", at, "p1", "aiokafka", partition=0, offset=seq, **record)
        delivery = {"partition": 0, "offset": seq, "group": "g1", **record}
        if clean or seq != 3:
            b.client(r, "consume", at + 50, "c1", "java", **delivery)
        if not clean and seq == 5:
            b.client(r, "consume", at + 60, "c1", "java", **delivery)
    return b
