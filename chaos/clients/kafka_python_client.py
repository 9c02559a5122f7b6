"""The kafka-python family: a batch produce/consume, a transaction, and the paced workload loops."""

from __future__ import annotations

import argparse
import time

from chaos.clients.batch import Ack, Consumed, values
from chaos.clients.paced import ConsumerTrace, Pacer, ProducerTrace, Stop, commit_with_retry, is_instance, record_value, wire_key
from chaos.testbed.security import ClientSecurity, client_settings
from chaos.clients.settings import FLUSH_TIMEOUT_S, POLL_TIMEOUT_S, RETRY_BACKOFF_MS, SETTINGS, TOPIC_WAIT_S


# ------------------------------------------------------------------ batch
def produce(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float,
            security: ClientSecurity | None = None) -> list[Ack]:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bs.split(","), acks="all", enable_idempotence=idempotent,
                             request_timeout_ms=int(timeout * 1000), **client_settings(security, "kafka-python"))
    try:
        futs = [(i, v, producer.send(topic, key=str(i).encode(), value=v.encode()))
                for i, v in enumerate(values(prefix, n))]
        producer.flush(timeout)
        out = []
        for i, v, f in futs:
            m = f.get(timeout=timeout)
            out.append(Ack(str(i), v, m.partition, m.offset))
        return out
    finally:
        producer.close(timeout=10)


def consume(bs: str, topic: str, group: str, n: int, timeout: float,
            security: ClientSecurity | None = None) -> list[Consumed]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bs.split(","), group_id=group,
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             **client_settings(security, "kafka-python"))
    out: list[Consumed] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            batch = consumer.poll(timeout_ms=500)
            for records in batch.values():
                out.extend(Consumed(r.key.decode() if r.key else None, r.value.decode(), r.partition, r.offset)
                           for r in records)
            if batch:
                consumer.commit()
    finally:
        consumer.close()
    return out


def transactional_produce(bs: str, topic: str, tid: str, n: int, prefix: int, commit: bool, timeout: float,
                          security: ClientSecurity | None = None) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bs.split(","), transactional_id=tid, enable_idempotence=True,
                             **client_settings(security, "kafka-python"))
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i, v in enumerate(values(prefix, n)):
            producer.send(topic, key=str(i).encode(), value=v.encode())
        if commit:
            producer.commit_transaction()
        else:
            producer.abort_transaction()
    finally:
        producer.close(timeout=10)


# ------------------------------------------------------------------ paced
def produce_paced(a: argparse.Namespace, t: ProducerTrace, stop: Stop) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=a.bootstrap.split(","), client_id=a.client_id,
                             **SETTINGS["kafka-python"]["producer"], **client_settings(a.security, "kafka-python"))
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


def consume_paced(a: argparse.Namespace, t: ConsumerTrace, stop: Stop) -> None:
    from kafka import KafkaConsumer
    from kafka import errors
    from kafka.structs import OffsetAndMetadata

    rebalancing = is_instance(errors.CommitFailedError, errors.RebalanceInProgressError,
                               errors.IllegalGenerationError, errors.UnknownMemberIdError)

    consumer = KafkaConsumer(bootstrap_servers=a.bootstrap.split(","), group_id=a.group,
                             client_id=a.client_id, **SETTINGS["kafka-python"]["consumer"],
                             **client_settings(a.security, "kafka-python"))
    try:
        # Subscribe once the topic's partitions are known. kafka-python (3.0) that joins
        # its group while its metadata lacks a just-created topic gets no partitions
        # ("No partition metadata for topic") and was seen never to rebalance after.
        # The lookup blocks on a metadata request and raises what fails it (a connection reset by
        # a fault): retried like poll's retriable errors, within the same deadline.
        deadline = time.monotonic() + TOPIC_WAIT_S
        while not stop.requested():
            try:
                if consumer.partitions_for_topic(a.topic):
                    break
            except errors.KafkaError as exc:
                if not exc.retriable:
                    raise
                t.error(f"partitions_for_topic: {type(exc).__name__}: {exc}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {a.topic} has no partitions after {TOPIC_WAIT_S:.0f} s")
            time.sleep(0.1)
        consumer.subscribe([a.topic])
        while not stop.requested():
            try:
                batch = consumer.poll(timeout_ms=int(POLL_TIMEOUT_S * 1000))
            except errors.KafkaError as exc:
                # kafka-python 3 can raise a retriable error out of poll() (seen: "socket
                # disconnected" from its coordinator lookup while a broker was killed); an
                # application polls again, so does the workload. Likewise UnknownBrokerIdError,
                # which kafka-python does not mark retriable: its fetcher built a fetch for a
                # broker that the metadata it had just read no longer lists (seen in a CI run's
                # broker-kill drill, 3.0.12: the killed broker); the next poll fetches from the
                # partition's new leader.
                if not exc.retriable and not isinstance(exc, errors.UnknownBrokerIdError):
                    raise
                t.error(f"poll: {type(exc).__name__}: {exc}")
                time.sleep(RETRY_BACKOFF_MS / 1000)  # retry backoff (a rate, not a condition)
                continue
            offsets = {}
            for tp, records in batch.items():
                for r in records:
                    t.consume(r.value, r.partition, r.offset)
                offsets[tp] = OffsetAndMetadata(records[-1].offset + 1, "", -1)
            if offsets:
                commit_with_retry(lambda: consumer.commit(offsets), t, rebalancing)
    finally:
        consumer.close()
