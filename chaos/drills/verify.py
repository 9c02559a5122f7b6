"""The final read: after the drills, read every partition of a drill topic from its start to its
end and put what the log holds into the trace, so that ``lost`` compares the producers'
acknowledgements with the log itself, not with what some consumer group happened to see
(``chaos.measures``, "records").

Theory of operation
-------------------
One confluent-kafka consumer without a group (``assign``, no commits) reads every partition
from the low to the high watermark taken when the read starts. The producers have stopped and
flushed by then, so every acknowledged record (acks=all) is below the high watermark. The read
goes through the fleet first, as the clients did; when that fails (the fleet is down or cut
off) and the brokers are known, it reads them directly. The records are kept in memory and
written to the trace (``verifier.jsonl``: one ``read`` per record, then one ``read_end``) only
once a read is complete, so a failed attempt leaves nothing behind and a second one cannot
double the records.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from chaos.clients.paced import parse_value
from chaos.testbed.security import ClientSecurity, client_settings
from chaos.trace import TraceWriter

VIA_FLEET = "fleet"
VIA_BROKERS = "brokers"
METADATA_TIMEOUT_S = 10.0
POLL_TIMEOUT_S = 0.5
BATCH = 500


class VerifyError(RuntimeError):
    """The final read could not read the topic to its end (message says why, per path tried)."""


@attrs.frozen
class LogRecord:
    """One record of the log: where it is and, when it is one of ours, its trace key and seq."""

    partition: int
    offset: int
    key: str | None
    seq: int | None


@attrs.frozen
class FinalRead:
    topic: str
    via: str  # VIA_FLEET or VIA_BROKERS
    start_offsets: dict[int, int]  # per partition: the low watermark (0 unless retention cut the log)
    end_offsets: dict[int, int]  # per partition: the high watermark when the read started
    records: tuple[LogRecord, ...]
    foreign: int  # records whose value is not ours (not "P.seq")

    def summary(self) -> dict[str, Any]:
        return {"topic": self.topic, "via": self.via, "records": len(self.records), "foreign": self.foreign,
                "end_offsets": {str(p): o for p, o in sorted(self.end_offsets.items())}}


class ReadProgress:
    """Which partitions still have records below their end offset (pure: fed by the read loop)."""

    def __init__(self, start_offsets: dict[int, int], end_offsets: dict[int, int]) -> None:
        self.end_offsets = dict(end_offsets)
        self.position = {p: start_offsets.get(p, 0) for p in end_offsets}

    def wanted(self, partition: int, offset: int) -> bool:
        """A record at ``offset`` belongs to the read (below the end taken at the start)."""
        return offset < self.end_offsets.get(partition, 0)

    def advance(self, partition: int, next_offset: int) -> None:
        """The consumer is at ``next_offset`` of ``partition`` (after a record, or at its end)."""
        if partition in self.position:
            self.position[partition] = max(self.position[partition], next_offset)

    def remaining(self) -> dict[int, int]:
        """Per unfinished partition: how many offsets are left."""
        return {p: self.end_offsets[p] - pos for p, pos in sorted(self.position.items()) if pos < self.end_offsets[p]}

    def done(self) -> bool:
        return not self.remaining()


def read_topic(bootstrap: list[str], topic: str, timeout_s: float, *, via: str = VIA_FLEET,
               security: ClientSecurity | None = None, clock: Callable[[], float] = time.monotonic) -> FinalRead:
    """Read every partition of ``topic`` from its start to its end (raise ``VerifyError`` if the
    end is not reached within ``timeout_s``); ``security``: TLS/SASL settings, none for plaintext."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

    deadline = clock() + timeout_s
    consumer = Consumer({"bootstrap.servers": ",".join(bootstrap), "group.id": f"kproxy-final-read-{uuid.uuid4()}",
                         "enable.auto.commit": False, "enable.partition.eof": True, "log_level": 2,
                         "isolation.level": "read_uncommitted", "auto.offset.reset": "earliest",
                         **client_settings(security, "confluent")})
    try:
        try:
            metadata = consumer.list_topics(topic, timeout=min(METADATA_TIMEOUT_S, timeout_s))
            described = metadata.topics.get(topic)
            if described is None or described.error is not None or not described.partitions:
                raise VerifyError(f"{via}: topic {topic} not found ({described.error if described else 'absent'})")
            starts, ends = {}, {}
            for p in sorted(described.partitions):
                starts[p], ends[p] = consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=max(0.1, min(METADATA_TIMEOUT_S, deadline - clock())))
        except KafkaException as exc:
            raise VerifyError(f"{via}: {exc}") from exc
        progress = ReadProgress(starts, ends)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        records: list[LogRecord] = []
        foreign = 0
        while not progress.done():
            if clock() > deadline:
                raise VerifyError(f"{via}: not at the end of {topic} after {timeout_s:.0f} s; "
                                  f"offsets left per partition: {progress.remaining()}")
            for msg in consumer.consume(num_messages=BATCH, timeout=POLL_TIMEOUT_S):
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        progress.advance(msg.partition(), msg.offset())
                        continue
                    if err.fatal() or not err.retriable():
                        raise VerifyError(f"{via}: {err}")
                    continue
                if not progress.wanted(msg.partition(), msg.offset()):
                    continue
                progress.advance(msg.partition(), msg.offset() + 1)
                parsed = parse_value(msg.value())
                foreign += parsed is None
                records.append(LogRecord(msg.partition(), msg.offset(), *(parsed or (None, None))))
        return FinalRead(topic, via, starts, ends, tuple(records), foreign)
    finally:
        consumer.close()


def read_final(topic: str, fleet_bootstrap: list[str] | None, broker_bootstrap: list[str] | None,
               timeout_s: float, *, fleet_security: ClientSecurity | None = None,
               broker_security: ClientSecurity | None = None,
               read: Callable[..., FinalRead] = read_topic) -> FinalRead:
    """The final read through the fleet, else directly from the brokers (each path with its
    own TLS/SASL settings); ``VerifyError`` naming every path tried when none reads the topic
    to its end."""
    paths = [(VIA_FLEET, fleet_bootstrap, fleet_security), (VIA_BROKERS, broker_bootstrap, broker_security)]
    failures = []
    for via, bootstrap, security in paths:
        if not bootstrap:
            continue
        try:
            return read(bootstrap, topic, timeout_s, via=via, security=security)
        except VerifyError as exc:
            failures.append(str(exc))
    raise VerifyError("final read failed: " + ("; ".join(failures) or "no bootstrap to read from"))


def write_final_read(writer: TraceWriter, final: FinalRead) -> None:
    """The read's records, then its ``read_end`` (which makes the topic verified)."""
    for r in final.records:
        writer.verifier("read", topic=final.topic, partition=r.partition, offset=r.offset, key=r.key, seq=r.seq)
    detail = {"via": final.via, "start_offsets": {str(p): o for p, o in sorted(final.start_offsets.items())},
              "end_offsets": {str(p): o for p, o in sorted(final.end_offsets.items())}, "foreign": final.foreign}
    writer.verifier("read_end", topic=final.topic, detail=json.dumps(detail, sort_keys=True))
