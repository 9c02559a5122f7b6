"""Long-running client workloads for drills: one OS process per (family, role).

Theory of operation
-------------------
A drill starts one process per client with ``python -m chaos.workloads ROLE``
and stops it with SIGTERM. Each process writes its trace events through
``chaos.trace.TraceWriter`` to ``<trace_dir>/<client_id>.jsonl``.

Records. Every producer has an integer ``prefix`` P, unique within a run, and
its record number ``seq`` counts 0, 1, 2, ...; the record value on the wire is
``f"{P}.{seq}"`` in every family (that is the VerifiableProducer's own format,
so the Java client needs no special case). In the trace, ``key`` is that
value string and ``seq`` is the number: (run_id, topic, key, seq) names one
record for producers and consumers alike, whatever family wrote or read it.
The wire key is ``str(seq % 1000)`` for the Python families (the Java tool's
``--repeating-keys 1000``), so records spread over every partition.

Producers send at a fixed ``--rate`` (records/s), idempotently with acks=all.
Events: ``send`` (handed to the client), ``ack`` (partition, offset), ``error``
(detail). On SIGTERM, or after ``--duration-s``, a producer stops sending,
flushes (waits for every outstanding acknowledgement, bounded by
``FLUSH_TIMEOUT_S``), closes its client and exits 0.

Consumers join a consumer group (``--group``), read from the earliest offset,
write one ``consume`` event per delivered record and then commit the batch's
offsets synchronously (at-least-once: deliver, then commit; a failed commit is
retried before the next poll, so a failover alone never redelivers). On
SIGTERM they finish the batch in hand, commit, close and exit 0.

Java. ``--family java`` runs Kafka's VerifiableProducer (``--throughput`` =
rate, ``--value-prefix`` = P) or VerifiableConsumer (``--verbose``) as a child
JVM; this process reads its JSON lines and translates them into trace events
(producer_send_success -> ack, producer_send_error -> error, record_data ->
consume, offsets_committed with success=false -> error). The tools print no
event per send, so Java producers have no ``send`` events. Timestamps: every
Java event is stamped with ``time.time_ns()`` when its line is read here (the
trace's one clock); the tool's own ``timestamp`` (ms, wall clock) is kept in
``detail`` as ``java_ts_ms=...``. SIGTERM is forwarded to the JVM, whose
shutdown hook flushes (producer) or commits (consumer) and prints the last
events; the JVM is SIGKILLed if it has not exited ``JVM_EXIT_TIMEOUT_S`` later.

Client settings (why): every family gets
  * acks=all, idempotence on (producers), linger 5 ms;
  * request timeout 10 s (``REQUEST_TIMEOUT_MS``): a silent peer (frozen or
    partitioned proxy) is noticed after at most this long (defaults are
    30-60 s); it stays above Kafka's own leader fail-over time (broker
    session timeout 6 s in ``chaos.kafka_cluster``) so a broker kill causes
    no spurious request timeouts;
  * reconnect backoff 50 ms -> max 1 s where the client has the knob
    (kafka-python's default max is 30 s, librdkafka's 10 s);
  * retry backoff 100 ms -> max 1 s;
  * metadata max age 10 s (default 5 min) so a client that missed a
    disconnect still learns a new address map soon;
  * consumer session timeout 30 s, heartbeat 3 s: a hung coordinator
    connection (10 s request timeout) is replaced before the session
    expires, so a proxy fault alone does not cause a rebalance (a rebalance
    would redeliver uncommitted records);
  * fetch max wait 200 ms (consumers notice gaps quickly).
See ``SETTINGS`` for the exact per-family options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos.trace import TraceWriter

FAMILIES = ("aiokafka", "confluent", "kafka-python", "java")
ROLES = ("producer", "consumer")

REQUEST_TIMEOUT_MS = 10_000
SESSION_TIMEOUT_MS = 30_000
HEARTBEAT_INTERVAL_MS = 3_000
METADATA_MAX_AGE_MS = 10_000
RECONNECT_BACKOFF_MS = 50
RECONNECT_BACKOFF_MAX_MS = 1_000
RETRY_BACKOFF_MS = 100
RETRY_BACKOFF_MAX_MS = 1_000
DELIVERY_TIMEOUT_MS = 120_000  # Java/kafka-python/librdkafka: give up on a record after this long
FETCH_MAX_WAIT_MS = 200
LINGER_MS = 5
KEY_SPREAD = 1000  # wire key = seq % KEY_SPREAD (Java: --repeating-keys)

FLUSH_TIMEOUT_S = 30.0  # producer: wait for outstanding acks on stop
COMMIT_RETRY_S = 10.0  # consumer: keep retrying a failed commit this long
POLL_TIMEOUT_S = 0.2  # consumer poll
TOPIC_WAIT_S = 60.0  # a consumer waits this long for its topic's metadata
JVM_EXIT_TIMEOUT_S = 30.0  # after SIGTERM to the JVM, SIGKILL it after this long
MAX_BEHIND_S = 0.5  # producer pacing: after a stall longer than this, do not burst to catch up
MAX_LIFETIME_S = 3600.0  # without --duration-s: stop anyway after this long (an orphan must end)

SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "aiokafka": {
        "producer": {
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": LINGER_MS,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,  # also the batch TTL while a partition has no leader
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
        },
        "consumer": {
            "auto_offset_reset": "earliest",
            "enable_auto_commit": False,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "session_timeout_ms": SESSION_TIMEOUT_MS,
            "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
            "fetch_max_wait_ms": FETCH_MAX_WAIT_MS,
        },
    },
    "confluent": {
        "producer": {
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": LINGER_MS,
            "request.timeout.ms": REQUEST_TIMEOUT_MS,
            "socket.timeout.ms": REQUEST_TIMEOUT_MS,
            "message.timeout.ms": DELIVERY_TIMEOUT_MS,
            "reconnect.backoff.ms": RECONNECT_BACKOFF_MS,
            "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
            "retry.backoff.ms": RETRY_BACKOFF_MS,
            "retry.backoff.max.ms": RETRY_BACKOFF_MAX_MS,
            "topic.metadata.refresh.interval.ms": METADATA_MAX_AGE_MS,
            "log_level": 3,
        },
        "consumer": {
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "socket.timeout.ms": REQUEST_TIMEOUT_MS,
            "session.timeout.ms": SESSION_TIMEOUT_MS,
            "heartbeat.interval.ms": HEARTBEAT_INTERVAL_MS,
            "reconnect.backoff.ms": RECONNECT_BACKOFF_MS,
            "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
            "retry.backoff.ms": RETRY_BACKOFF_MS,
            "retry.backoff.max.ms": RETRY_BACKOFF_MAX_MS,
            "topic.metadata.refresh.interval.ms": METADATA_MAX_AGE_MS,
            "fetch.wait.max.ms": FETCH_MAX_WAIT_MS,
            "log_level": 3,
        },
    },
    "kafka-python": {
        "producer": {
            "acks": "all",
            "enable_idempotence": True,
            "linger_ms": LINGER_MS,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "delivery_timeout_ms": DELIVERY_TIMEOUT_MS,
            "reconnect_backoff_ms": RECONNECT_BACKOFF_MS,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
        },
        "consumer": {
            "auto_offset_reset": "earliest",
            "enable_auto_commit": False,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "session_timeout_ms": SESSION_TIMEOUT_MS,
            "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
            "reconnect_backoff_ms": RECONNECT_BACKOFF_MS,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
            "retry_backoff_ms": RETRY_BACKOFF_MS,
            "metadata_max_age_ms": METADATA_MAX_AGE_MS,
            "fetch_max_wait_ms": FETCH_MAX_WAIT_MS,
        },
    },
    "java": {
        # --acks -1 and --throughput/--value-prefix/--repeating-keys on the command line.
        "producer": {
            "enable.idempotence": "true",
            "retries": "2147483647",  # the VerifiableProducer sets 0 otherwise; idempotence needs retries
            "max.in.flight.requests.per.connection": "5",
            "linger.ms": str(LINGER_MS),
            "request.timeout.ms": str(REQUEST_TIMEOUT_MS),
            "delivery.timeout.ms": str(DELIVERY_TIMEOUT_MS),  # >= linger.ms + request.timeout.ms
            "reconnect.backoff.ms": str(RECONNECT_BACKOFF_MS),
            "reconnect.backoff.max.ms": str(RECONNECT_BACKOFF_MAX_MS),
            "retry.backoff.ms": str(RETRY_BACKOFF_MS),
            "retry.backoff.max.ms": str(RETRY_BACKOFF_MAX_MS),
            "metadata.max.age.ms": str(METADATA_MAX_AGE_MS),
        },
        # --session-timeout, --reset-policy earliest, --group-id on the command line.
        "consumer": {
            "request.timeout.ms": str(REQUEST_TIMEOUT_MS),
            "heartbeat.interval.ms": str(HEARTBEAT_INTERVAL_MS),
            "reconnect.backoff.ms": str(RECONNECT_BACKOFF_MS),
            "reconnect.backoff.max.ms": str(RECONNECT_BACKOFF_MAX_MS),
            "retry.backoff.ms": str(RETRY_BACKOFF_MS),
            "retry.backoff.max.ms": str(RETRY_BACKOFF_MAX_MS),
            "metadata.max.age.ms": str(METADATA_MAX_AGE_MS),
            "fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
        },
    },
}

log = logging.getLogger("kproxy.workloads")


# ------------------------------------------------------------------ records
def record_value(prefix: int, seq: int) -> str:
    """The wire value (and trace key) of record ``seq`` of producer ``prefix``."""
    return f"{prefix}.{seq}"


def wire_key(seq: int) -> bytes:
    return str(seq % KEY_SPREAD).encode()


def parse_value(value: bytes | str | None) -> tuple[str, int] | None:
    """``b"7.42"`` -> ``("7.42", 42)`` (trace key, seq); None if it is not one of ours."""
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    prefix, dot, seq = text.partition(".")
    if not dot or not prefix.isdigit() or not seq.isdigit():
        return None
    return text, int(seq)


# ---------------------------------------------------------------- stopping
class Stop:
    """Set by SIGTERM/SIGINT or when ``duration_s`` has passed."""

    def __init__(self, duration_s: float | None) -> None:
        self.event = threading.Event()
        self.deadline = time.monotonic() + (MAX_LIFETIME_S if duration_s is None else duration_s)
        self.on_signal: list[Any] = []

    def install(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.event.set()
            for fn in self.on_signal:
                fn(signum)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def requested(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.event.set()
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (bounded by the duration); True if stop was requested."""
        timeout_s = min(timeout_s, max(0.0, self.deadline - time.monotonic()))
        self.event.wait(max(0.0, timeout_s))
        return self.requested()


class Pacer:
    """Fixed-rate schedule: the instant of send ``i`` is ``t0 + i / rate``."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.interval_s = 1.0 / rate
        self.next_t = time.monotonic()

    def delay_s(self) -> float:
        now = time.monotonic()
        if now - self.next_t > MAX_BEHIND_S:  # after a stall: resume the pace, no burst
            self.next_t = now
        return max(0.0, self.next_t - now)

    def advance(self) -> None:
        self.next_t += self.interval_s


# --------------------------------------------------------------- producers
class ProducerTrace:
    """Trace events of one producer, plus counts for its exit line."""

    def __init__(self, writer: TraceWriter, client_id: str, family: str, topic: str, prefix: int) -> None:
        self.w = writer
        self.common = {"client_id": client_id, "family": family, "topic": topic}
        self.prefix = prefix
        self.sent = self.acked = self.errors = 0
        self._lock = threading.Lock()

    def send(self, seq: int) -> None:
        self.sent += 1
        self.w.client("send", key=record_value(self.prefix, seq), seq=seq, **self.common)

    def ack(self, seq: int, partition: int, offset: int, detail: str | None = None) -> None:
        with self._lock:
            self.acked += 1
        self.w.client("ack", key=record_value(self.prefix, seq), seq=seq, partition=partition, offset=offset,
                      detail=detail, **self.common)

    def error(self, detail: str, seq: int | None = None) -> None:
        with self._lock:
            self.errors += 1
        key = None if seq is None else record_value(self.prefix, seq)
        self.w.client("error", key=key, seq=seq, detail=detail[:500], **self.common)

    def outstanding(self) -> int:
        with self._lock:
            return self.sent - self.acked - self.errors

    def counts(self) -> dict[str, int]:
        return {"sent": self.sent, "acked": self.acked, "errors": self.errors}


def _produce_aiokafka(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> None:
    import asyncio

    from aiokafka import AIOKafkaProducer

    async def run() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=a.bootstrap, client_id=a.client_id,
                                    **SETTINGS["aiokafka"]["producer"])
        await producer.start()
        pacer = Pacer(a.rate)
        pending: set[asyncio.Future[Any]] = set()

        def done(seq: int, fut: asyncio.Future[Any]) -> None:
            pending.discard(fut)
            if fut.cancelled():
                t.error("cancelled", seq)
            elif fut.exception() is not None:
                t.error(f"{type(fut.exception()).__name__}: {fut.exception()}", seq)
            else:
                md = fut.result()
                t.ack(seq, md.partition, md.offset)

        try:
            seq = 0
            while not stop.requested():
                delay = pacer.delay_s()
                if delay > 0:
                    await asyncio.sleep(delay)  # pacing; SIGTERM is seen at the next send slot
                    continue
                t.send(seq)
                try:
                    fut = await producer.send(a.topic, key=wire_key(seq), value=record_value(a.prefix, seq).encode())
                except Exception as exc:  # no metadata within request_timeout_ms, buffer full, ...
                    t.error(f"{type(exc).__name__}: {exc}", seq)
                else:
                    pending.add(fut)
                    fut.add_done_callback(lambda f, s=seq: done(s, f))
                seq += 1
                pacer.advance()
            if pending:
                await asyncio.wait(set(pending), timeout=FLUSH_TIMEOUT_S)
        finally:
            await asyncio.wait_for(producer.stop(), FLUSH_TIMEOUT_S)

    asyncio.run(run())


def _produce_confluent(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> None:
    from confluent_kafka import Producer

    def on_error(err: Any) -> None:
        t.error(f"client: {err}")

    producer = Producer({"bootstrap.servers": a.bootstrap, "client.id": a.client_id, "error_cb": on_error,
                         **SETTINGS["confluent"]["producer"], **_rdkafka_debug()})
    pacer = Pacer(a.rate)

    def on_delivery(seq: int, err: Any, msg: Any) -> None:
        if err is not None:
            t.error(str(err), seq)
        else:
            t.ack(seq, msg.partition(), msg.offset())

    seq = 0
    while not stop.requested():
        delay = pacer.delay_s()
        if delay > 0:
            producer.poll(delay)  # serve delivery callbacks while pacing
            continue
        t.send(seq)
        try:
            producer.produce(a.topic, key=wire_key(seq), value=record_value(a.prefix, seq).encode(),
                             on_delivery=lambda err, msg, s=seq: on_delivery(s, err, msg))
        except BufferError as exc:
            t.error(f"BufferError: {exc}", seq)
        seq += 1
        pacer.advance()
        producer.poll(0)
    remaining = producer.flush(FLUSH_TIMEOUT_S)
    if remaining:
        log.warning("%s: %d records still undelivered after %.0f s", a.client_id, remaining, FLUSH_TIMEOUT_S)


def _produce_kafka_python(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=a.bootstrap.split(","), client_id=a.client_id,
                             **SETTINGS["kafka-python"]["producer"])
    pacer = Pacer(a.rate)
    try:
        seq = 0
        while not stop.requested():
            delay = pacer.delay_s()
            if delay > 0:
                stop.wait(delay)
                continue
            t.send(seq)
            try:
                fut = producer.send(a.topic, key=wire_key(seq), value=record_value(a.prefix, seq).encode())
            except Exception as exc:
                t.error(f"{type(exc).__name__}: {exc}", seq)
            else:
                # Callbacks run on the client's I/O thread; the TraceWriter is thread-safe.
                fut.add_callback(lambda md, s=seq: t.ack(s, md.partition, md.offset))
                fut.add_errback(lambda exc, s=seq: t.error(f"{type(exc).__name__}: {exc}", s))
            seq += 1
            pacer.advance()
        producer.flush(FLUSH_TIMEOUT_S)
    finally:
        producer.close(timeout=FLUSH_TIMEOUT_S)


# --------------------------------------------------------------- consumers
class ConsumerTrace:
    def __init__(self, writer: TraceWriter, client_id: str, family: str, topic: str, group: str) -> None:
        self.w = writer
        self.common = {"client_id": client_id, "family": family, "topic": topic, "group": group}
        self.consumed = self.errors = self.foreign = 0

    def consume(self, value: bytes | str | None, partition: int, offset: int, detail: str | None = None) -> None:
        parsed = parse_value(value)
        if parsed is None:
            self.foreign += 1
            self.error(f"foreign record at {partition}:{offset}: {value!r:.80}")
            return
        key, seq = parsed
        self.consumed += 1
        self.w.client("consume", key=key, seq=seq, partition=partition, offset=offset, detail=detail, **self.common)

    def error(self, detail: str) -> None:
        self.errors += 1
        self.w.client("error", detail=detail[:500], **self.common)

    def counts(self) -> dict[str, int]:
        return {"consumed": self.consumed, "errors": self.errors, "foreign": self.foreign}


class CommitRetry:
    """What to do after a failed commit: retry after a backoff, bounded by ``COMMIT_RETRY_S``,
    or give up at once when only a poll can cure the error. A commit refused because the
    group is rebalancing (or this member's generation is gone) never succeeds before the
    consumer polls again, which is what rejoins the group; retrying it in a loop kept
    kafka-python out of its group for the whole 10 s of retries, again and again. Given up,
    the commit is just not made: the next one covers those offsets too (commits are
    cumulative). Only if the rejoin hands a partition to another member are its records
    since the last commit read again, which the drill counts as duplicated, as it would
    after any failed commit."""

    __slots__ = ("t", "rebalancing", "deadline", "backoff_s", "attempts")

    def __init__(self, t: ConsumerTrace, rebalancing: Callable[[BaseException], bool]) -> None:
        self.t = t
        self.rebalancing = rebalancing
        self.deadline = time.monotonic() + COMMIT_RETRY_S
        self.backoff_s = RETRY_BACKOFF_MS / 1000
        self.attempts = 0

    def failed(self, exc: BaseException) -> float | None:
        """Record the failure; return the seconds to wait before the next attempt, or None."""
        self.t.error(f"commit failed: {type(exc).__name__}: {exc}")
        self.attempts += 1
        if self.rebalancing(exc) or self.attempts >= 1000 or time.monotonic() + self.backoff_s > self.deadline:
            return None
        delay, self.backoff_s = self.backoff_s, min(self.backoff_s * 2, RETRY_BACKOFF_MAX_MS / 1000)
        return delay


def _commit_with_retry(commit: Callable[[], Any], t: ConsumerTrace,
                       rebalancing: Callable[[BaseException], bool]) -> None:
    """Call ``commit()`` until it succeeds or :class:`CommitRetry` gives up."""
    retry = CommitRetry(t, rebalancing)
    while True:
        try:
            commit()
            return
        except Exception as exc:
            delay = retry.failed(exc)
            if delay is None:
                return
            time.sleep(delay)  # retry backoff (a rate, not a condition)


def _is_instance(*types: type[BaseException]) -> Callable[[BaseException], bool]:
    return lambda exc: isinstance(exc, types)


def _consume_aiokafka(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> None:
    import asyncio

    from aiokafka import AIOKafkaConsumer
    from aiokafka import errors

    rebalancing = _is_instance(errors.CommitFailedError, errors.RebalanceInProgressError,
                               errors.IllegalGenerationError, errors.UnknownMemberIdError)

    async def run() -> None:
        consumer = AIOKafkaConsumer(a.topic, bootstrap_servers=a.bootstrap, group_id=a.group, client_id=a.client_id,
                                    **SETTINGS["aiokafka"]["consumer"])
        await consumer.start()
        try:
            while not stop.requested():
                batch = await consumer.getmany(timeout_ms=int(POLL_TIMEOUT_S * 1000))
                if not batch:
                    continue
                offsets = {}
                for tp, records in batch.items():
                    for r in records:
                        t.consume(r.value, r.partition, r.offset)
                    offsets[tp] = records[-1].offset + 1
                retry = CommitRetry(t, rebalancing)
                while True:
                    try:
                        await consumer.commit(offsets)
                        break
                    except Exception as exc:
                        delay = retry.failed(exc)
                        if delay is None:
                            break
                        await asyncio.sleep(delay)
        finally:
            await stop_aiokafka(consumer)

    asyncio.run(run())


async def stop_aiokafka(client: Any) -> None:
    """``await client.stop()`` within FLUSH_TIMEOUT_S. aiokafka 0.14's Fetcher.close() cancels its
    pending fetch tasks and awaits them without suppressing their CancelledError: a fetch in its
    retry backoff at stop (its broker connection had just closed) made stop() raise although the
    consumer is stopped. That is logged; our own task being cancelled still propagates."""
    import asyncio

    try:
        await asyncio.wait_for(client.stop(), FLUSH_TIMEOUT_S)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("aiokafka stop() raised CancelledError from inside; stopped anyway")


def _rdkafka_debug() -> dict[str, Any]:
    """librdkafka's own debug contexts (e.g. ``broker,fetch``) from KPROXY_RDKAFKA_DEBUG, for a diagnosis."""
    contexts = os.environ.get("KPROXY_RDKAFKA_DEBUG", "")
    return {"debug": contexts, "log_level": 7} if contexts else {}


def confluent_rebalancing(exc: BaseException) -> bool:
    """A librdkafka commit error that only a poll cures (see :class:`CommitRetry`)."""
    from confluent_kafka import KafkaError, KafkaException

    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(err, KafkaError) and err.code() in (
        KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID)


def _consume_confluent(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> None:
    from confluent_kafka import Consumer, TopicPartition

    def on_error(err: Any) -> None:
        t.error(f"client: {err}")

    consumer = Consumer({"bootstrap.servers": a.bootstrap, "group.id": a.group, "client.id": a.client_id,
                         "error_cb": on_error, **SETTINGS["confluent"]["consumer"], **_rdkafka_debug()})
    consumer.subscribe([a.topic])
    try:
        while not stop.requested():
            # consume(n, timeout) waits for n messages or the whole timeout: records would
            # reach the application in ~200 ms lumps. poll() returns at the first one;
            # what is already queued behind it comes with consume(timeout=0).
            first = consumer.poll(POLL_TIMEOUT_S)
            if first is None:
                continue
            msgs = [first, *consumer.consume(num_messages=499, timeout=0)]
            offsets: dict[int, int] = {}
            for m in msgs:
                if m.error() is not None:
                    t.error(f"consume: {m.error()}")
                    continue
                t.consume(m.value(), m.partition(), m.offset())
                offsets[m.partition()] = m.offset() + 1
            if offsets:
                tps = [TopicPartition(a.topic, p, o) for p, o in offsets.items()]
                _commit_with_retry(lambda: consumer.commit(offsets=tps, asynchronous=False), t,
                                   confluent_rebalancing)
    finally:
        consumer.close()


def _consume_kafka_python(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> None:
    from kafka import KafkaConsumer
    from kafka import errors
    from kafka.structs import OffsetAndMetadata

    rebalancing = _is_instance(errors.CommitFailedError, errors.RebalanceInProgressError,
                               errors.IllegalGenerationError, errors.UnknownMemberIdError)

    consumer = KafkaConsumer(bootstrap_servers=a.bootstrap.split(","), group_id=a.group,
                             client_id=a.client_id, **SETTINGS["kafka-python"]["consumer"])
    try:
        # Subscribe once the topic's partitions are known. kafka-python (3.0) that joins
        # its group while its metadata lacks a just-created topic gets no partitions
        # ("No partition metadata for topic") and was seen never to rebalance after.
        deadline = time.monotonic() + TOPIC_WAIT_S
        while not consumer.partitions_for_topic(a.topic) and not stop.requested():
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {a.topic} has no partitions after {TOPIC_WAIT_S:.0f} s")
            time.sleep(0.1)
        consumer.subscribe([a.topic])
        while not stop.requested():
            batch = consumer.poll(timeout_ms=int(POLL_TIMEOUT_S * 1000))
            offsets = {}
            for tp, records in batch.items():
                for r in records:
                    t.consume(r.value, r.partition, r.offset)
                offsets[tp] = OffsetAndMetadata(records[-1].offset + 1, "", -1)
            if offsets:
                _commit_with_retry(lambda: consumer.commit(offsets), t, rebalancing)
    finally:
        consumer.close()


# -------------------------------------------------------------------- java
def _java_props(settings: dict[str, Any]) -> Path:
    fd, name = tempfile.mkstemp(prefix="kproxy-workload-", suffix=".properties")
    with os.fdopen(fd, "w") as fh:
        fh.write("".join(f"{k}={v}\n" for k, v in settings.items()))
    return Path(name)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send ``sig`` to this process when its parent dies (no orphans)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def watch_parent(stop: Stop, period_s: float = 1.0) -> threading.Thread:
    """Stop (cleanly, as on SIGTERM) when the parent process dies: no orphan keeps producing.

    Not PR_SET_PDEATHSIG: it fires when the parent *thread* exits, and trio spawns processes
    from worker threads that end while the child lives on.
    """
    parent = os.getppid()

    def run() -> None:
        while not stop.wait(period_s):  # bounded by the stop deadline
            if os.getppid() != parent:
                log.warning("parent %d is gone: stopping", parent)
                stop.event.set()
                for fn in stop.on_signal:
                    fn(signal.SIGTERM)

    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread


def _run_java(cmd: list[str], stop: Stop, on_event: Any) -> int:
    """Run a verifiable tool; feed each JSON line to ``on_event``; forward SIGTERM; return its exit code."""
    # The JVM is spawned by this process's main thread, which lives as long as the process: here
    # PR_SET_PDEATHSIG is right, and SIGKILLs the JVM if this wrapper dies without forwarding.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1,
                            preexec_fn=lambda: die_with_parent(signal.SIGKILL))
    stop.on_signal.append(lambda signum: _signal(proc, signal.SIGTERM))

    def watchdog() -> None:
        # Stop after --duration-s, and SIGKILL a JVM that ignores SIGTERM.
        while proc.poll() is None and not stop.wait(0.5):
            pass
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
        try:
            proc.wait(JVM_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("JVM %d did not exit %.0f s after SIGTERM: SIGKILL", proc.pid, JVM_EXIT_TIMEOUT_S)
            _signal(proc, signal.SIGKILL)

    dog = threading.Thread(target=watchdog, name="jvm-watchdog", daemon=True)
    dog.start()
    assert proc.stdout is not None
    for line in proc.stdout:  # ends at EOF, when the JVM exits
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        on_event(event)
    rc = proc.wait()
    stop.event.set()
    dog.join(JVM_EXIT_TIMEOUT_S + 5)
    return rc


def _signal(proc: subprocess.Popen[str], sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _java_detail(event: dict[str, Any]) -> str | None:
    ts = event.get("timestamp")
    return None if ts is None else f"java_ts_ms={ts}"


def _produce_java(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> int:
    from chaos.kafka_cluster import java_tool_cmd

    props = _java_props(SETTINGS["java"]["producer"])
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableProducer", "--bootstrap-server", a.bootstrap,
                        "--topic", a.topic, "--max-messages", "-1", "--throughput", str(int(round(a.rate))),
                        "--acks", "-1", "--value-prefix", str(a.prefix), "--repeating-keys", str(KEY_SPREAD),
                        "--command-config", str(props))

    def on_event(e: dict[str, Any]) -> None:
        name = e.get("name")
        parsed = parse_value(e.get("value"))
        if name == "producer_send_success" and parsed is not None:
            t.ack(parsed[1], int(e["partition"]), int(e["offset"]), detail=_java_detail(e))
        elif name == "producer_send_error":
            t.error(f"{e.get('exception')}: {e.get('message')}", None if parsed is None else parsed[1])

    try:
        return _run_java(cmd, stop, on_event)
    finally:
        props.unlink(missing_ok=True)


def _consume_java(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> int:
    from chaos.kafka_cluster import java_tool_cmd

    props = _java_props(SETTINGS["java"]["consumer"])
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableConsumer", "--bootstrap-server", a.bootstrap,
                        "--topic", a.topic, "--group-id", a.group, "--max-messages", "-1", "--verbose",
                        "--reset-policy", "earliest", "--session-timeout", str(SESSION_TIMEOUT_MS),
                        "--command-config", str(props))

    def on_event(e: dict[str, Any]) -> None:
        name = e.get("name")
        if name == "record_data":
            t.consume(e.get("value"), int(e["partition"]), int(e["offset"]), detail=_java_detail(e))
        elif name == "offsets_committed" and not e.get("success", True):
            t.error(f"commit failed: {e.get('error')}")

    try:
        return _run_java(cmd, stop, on_event)
    finally:
        props.unlink(missing_ok=True)


# --------------------------------------------------------------------- main
PRODUCERS = {"aiokafka": _produce_aiokafka, "confluent": _produce_confluent,
             "kafka-python": _produce_kafka_python, "java": _produce_java}
CONSUMERS = {"aiokafka": _consume_aiokafka, "confluent": _consume_confluent,
             "kafka-python": _consume_kafka_python, "java": _consume_java}


def command(role: str, family: str, *, bootstrap: str, topic: str, trace_dir: str | os.PathLike[str],
            client_id: str, run_id: str, rate: float | None = None, prefix: int | None = None,
            group: str | None = None, duration_s: float | None = None, python: str | None = None) -> list[str]:
    """The command line that starts one workload process (what the drill runs)."""
    cmd = [python or sys.executable, "-m", "chaos.workloads", role, "--family", family, "--bootstrap", bootstrap,
           "--topic", topic, "--trace-dir", str(trace_dir), "--client-id", client_id, "--run-id", run_id]
    if role == "producer":
        if rate is None or prefix is None:
            raise ValueError("a producer needs rate and prefix")
        cmd += ["--rate", str(rate), "--prefix", str(prefix)]
    elif role == "consumer":
        if group is None:
            raise ValueError("a consumer needs a group")
        cmd += ["--group", group]
    else:
        raise ValueError(f"unknown role {role!r}")
    if duration_s is not None:
        cmd += ["--duration-s", str(duration_s)]
    return cmd


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos.workloads", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    for role in ROLES:
        s = sub.add_parser(role)
        s.add_argument("--family", choices=FAMILIES, required=True)
        s.add_argument("--bootstrap", required=True, help="comma-separated host:port list")
        s.add_argument("--topic", required=True)
        s.add_argument("--trace-dir", required=True)
        s.add_argument("--client-id", required=True)
        s.add_argument("--run-id", required=True)
        s.add_argument("--duration-s", type=float, default=None, help="stop after this long (default: SIGTERM)")
        if role == "producer":
            s.add_argument("--rate", type=float, default=100.0, help="records per second")
            s.add_argument("--prefix", type=int, required=True, help="integer producer number, unique in the run")
        else:
            s.add_argument("--group", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in filter(None, os.environ.get("KPROXY_WORKLOAD_DEBUG", "").split(",")):
        logging.getLogger(name.strip()).setLevel(logging.DEBUG)  # e.g. kafka.coordinator, for a diagnosis
    if a.role == "producer" and a.rate <= 0:
        print("--rate must be positive", file=sys.stderr)
        return 2
    stop = Stop(a.duration_s)
    stop.install()
    watch_parent(stop)
    writer = TraceWriter(a.trace_dir, a.client_id, a.run_id)
    trace: ProducerTrace | ConsumerTrace
    if a.role == "producer":
        trace = ProducerTrace(writer, a.client_id, a.family, a.topic, a.prefix)
        fn = PRODUCERS[a.family]
    else:
        trace = ConsumerTrace(writer, a.client_id, a.family, a.topic, a.group)
        fn = CONSUMERS[a.family]
    rc = 0
    try:
        result = fn(a, trace, stop)  # type: ignore[arg-type]
        if isinstance(result, int) and result not in (0, 143):  # 143: JVM ended by SIGTERM
            rc = 1
    except Exception as exc:
        log.exception("%s %s failed", a.family, a.role)
        trace.error(f"workload failed: {type(exc).__name__}: {exc}")
        rc = 1
    finally:
        writer.close()
    print(json.dumps({"client_id": a.client_id, "family": a.family, "role": a.role, "rc": rc, **trace.counts()}),
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
