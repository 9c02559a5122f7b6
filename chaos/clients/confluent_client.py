"""The confluent-kafka family (librdkafka): a batch produce/consume, a transaction, and the
paced workload loops."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from chaos.clients.batch import Ack, ClientError, Consumed, values
from chaos.clients.paced import ConsumerTrace, Pacer, ProducerTrace, Stop, commit_with_retry, record_value, wire_key
from chaos.testbed.security import ClientSecurity, client_settings
from chaos.clients.settings import FLUSH_TIMEOUT_S, POLL_TIMEOUT_S, SETTINGS

log = logging.getLogger("kproxy.workloads")


# ------------------------------------------------------------------ batch
def produce(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float,
            security: ClientSecurity | None = None) -> list[Ack]:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bs, "acks": "all", "enable.idempotence": idempotent, "log_level": 2,
                         "message.timeout.ms": int(timeout * 1000), **client_settings(security, "confluent")})
    acks: list[Ack] = []
    errors: list[str] = []

    def on_delivery(err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is not None:
            errors.append(str(err))
        else:
            acks.append(Ack(msg.key().decode(), msg.value().decode(), msg.partition(), msg.offset()))

    for i, v in enumerate(values(prefix, n)):
        producer.produce(topic, key=str(i).encode(), value=v.encode(), on_delivery=on_delivery)
        producer.poll(0)
    remaining = producer.flush(timeout)
    if errors or remaining:
        raise ClientError(f"confluent: {len(errors)} errors ({errors[:3]}), {remaining} undelivered")
    return acks


def consume(bs: str, topic: str, group: str, n: int, timeout: float,
            isolation: str = "read_uncommitted", commit: bool = True,
            security: ClientSecurity | None = None) -> list[Consumed]:
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bs, "group.id": group, "auto.offset.reset": "earliest", "log_level": 2,
                         "enable.auto.commit": False, "isolation.level": isolation,
                         **client_settings(security, "confluent")})
    consumer.subscribe([topic])
    out: list[Consumed] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            msgs = consumer.consume(num_messages=500, timeout=0.5)
            good = [m for m in msgs if m.error() is None]
            out.extend(Consumed(m.key().decode() if m.key() else None, m.value().decode(), m.partition(),
                                m.offset()) for m in good)
            if good and commit:
                consumer.commit(asynchronous=False)
    finally:
        consumer.close()
    return out


def transactional_produce(bs: str, topic: str, tid: str, n: int, prefix: int, commit: bool, timeout: float,
                          security: ClientSecurity | None = None) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bs, "transactional.id": tid, "log_level": 2,
                         **client_settings(security, "confluent")})
    producer.init_transactions(timeout)
    producer.begin_transaction()
    for i, v in enumerate(values(prefix, n)):
        producer.produce(topic, key=str(i).encode(), value=v.encode())
    if commit:
        producer.commit_transaction(timeout)
    else:
        producer.abort_transaction(timeout)


# ------------------------------------------------------------------ paced
def produce_paced(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> None:
    from confluent_kafka import Producer

    def on_error(err: Any) -> None:
        t.error(f"client: {err}")

    producer = Producer({"bootstrap.servers": a.bootstrap, "client.id": a.client_id, "error_cb": on_error,
                         **SETTINGS["confluent"]["producer"], **client_settings(a.security, "confluent"),
                         **rdkafka_debug()})
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


def rdkafka_debug() -> dict[str, Any]:
    """librdkafka's own debug contexts (e.g. ``broker,fetch``) from KPROXY_RDKAFKA_DEBUG, for a diagnosis."""
    contexts = os.environ.get("KPROXY_RDKAFKA_DEBUG", "")
    return {"debug": contexts, "log_level": 7} if contexts else {}


def confluent_rebalancing(exc: BaseException) -> bool:
    """A librdkafka commit error that only a poll cures (see :class:`CommitRetry`)."""
    from confluent_kafka import KafkaError, KafkaException

    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return isinstance(err, KafkaError) and err.code() in (
        KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID)


def consume_paced(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> None:
    from confluent_kafka import Consumer, TopicPartition

    def on_error(err: Any) -> None:
        t.error(f"client: {err}")

    consumer = Consumer({"bootstrap.servers": a.bootstrap, "group.id": a.group, "client.id": a.client_id,
                         "error_cb": on_error, **SETTINGS["confluent"]["consumer"],
                         **client_settings(a.security, "confluent"), **rdkafka_debug()})
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
                commit_with_retry(lambda: consumer.commit(offsets=tps, asynchronous=False), t,
                                   confluent_rebalancing)
    finally:
        consumer.close()
