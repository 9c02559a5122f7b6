"""Real Kafka clients, one uniform face: produce N records, consume them back.

Four families, each the real library: ``aiokafka`` (asyncio), ``confluent``
(confluent-kafka / librdkafka), ``kafka-python``, and ``java`` (Kafka's own
VerifiableProducer / VerifiableConsumer / admin tools run with ``java -cp``).

Record ``i`` of a batch with integer prefix ``P`` has key ``str(i)`` and value
``f"{P}.{i}"`` in every family (that is how the VerifiableProducer numbers its
records), so a test can compare what was produced with what was consumed
without caring which family wrote it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import tempfile
import time
from typing import Iterable

import attrs

from chaos.kafka_cluster import java_tool_cmd

FAMILIES = ("aiokafka", "confluent", "kafka-python", "java")


class ClientError(RuntimeError):
    """A client failed to produce or consume what it was asked to."""


@attrs.frozen
class Ack:
    key: str | None
    value: str
    partition: int
    offset: int


@attrs.frozen
class Consumed:
    key: str | None
    value: str
    partition: int
    offset: int


def values(prefix: int, n: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n)]


def _bootstrap(servers: str | Iterable[str]) -> str:
    return servers if isinstance(servers, str) else ",".join(servers)


# ------------------------------------------------------------------ produce
def produce(family: str, bootstrap: str | Iterable[str], topic: str, n: int, prefix: int,
            *, idempotent: bool = True, timeout: float = 60.0) -> list[Ack]:
    """Produce ``n`` records with acks=all (idempotent where the client can); return the acks."""
    bs = _bootstrap(bootstrap)
    fn = {"aiokafka": _produce_aiokafka, "confluent": _produce_confluent,
          "kafka-python": _produce_kafka_python, "java": _produce_java}[family]
    acks = fn(bs, topic, n, prefix, idempotent, timeout)
    if len(acks) != n:
        raise ClientError(f"{family}: {len(acks)} of {n} records acknowledged")
    return acks


def _produce_aiokafka(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float) -> list[Ack]:
    from aiokafka import AIOKafkaProducer

    async def run() -> list[Ack]:
        producer = AIOKafkaProducer(bootstrap_servers=bs, acks="all", enable_idempotence=idempotent,
                                    request_timeout_ms=int(timeout * 1000))
        await producer.start()
        try:
            futs = [await producer.send(topic, key=str(i).encode(), value=v.encode())
                    for i, v in enumerate(values(prefix, n))]
            metas = await asyncio.wait_for(asyncio.gather(*futs), timeout)
        finally:
            await producer.stop()
        return [Ack(str(i), v, m.partition, m.offset) for i, (v, m) in enumerate(zip(values(prefix, n), metas))]

    return asyncio.run(run())


def _produce_confluent(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float) -> list[Ack]:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bs, "acks": "all", "enable.idempotence": idempotent, "log_level": 2,
                         "message.timeout.ms": int(timeout * 1000)})
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


def _produce_kafka_python(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float) -> list[Ack]:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bs.split(","), acks="all", enable_idempotence=idempotent,
                             request_timeout_ms=int(timeout * 1000))
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


def _produce_java(bs: str, topic: str, n: int, prefix: int, idempotent: bool, timeout: float) -> list[Ack]:
    with tempfile.NamedTemporaryFile("w", suffix=".properties", delete=False) as cfg:
        cfg.write(f"enable.idempotence={'true' if idempotent else 'false'}\n")
        delivery_ms = int(timeout * 1000)
        cfg.write(f"delivery.timeout.ms={delivery_ms}\nlinger.ms=5\n")
        cfg.write(f"request.timeout.ms={min(30000, delivery_ms // 2)}\n")
        # The VerifiableProducer sets retries=0 unless told otherwise; idempotence needs retries.
        cfg.write("retries=2147483647\nmax.in.flight.requests.per.connection=5\n")
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableProducer", "--bootstrap-server", bs, "--topic", topic,
                        "--max-messages", str(n), "--acks", "-1", "--value-prefix", str(prefix),
                        "--repeating-keys", str(max(n, 1)), "--producer.config", cfg.name)
    events = run_json_tool(cmd, timeout + 30)
    acks = [Ack(e.get("key"), e["value"], e["partition"], e["offset"])
            for e in events if e.get("name") == "producer_send_success"]
    failed = [e for e in events if e.get("name") == "producer_send_error"]
    if failed:
        raise ClientError(f"java: {len(failed)} send errors, first: {failed[0]}")
    return acks


# ------------------------------------------------------------------ consume
def consume(family: str, bootstrap: str | Iterable[str], topic: str, group: str, n: int,
            *, timeout: float = 60.0) -> list[Consumed]:
    """Consume from the earliest offset in consumer group ``group`` until ``n`` records, committing."""
    bs = _bootstrap(bootstrap)
    fn = {"aiokafka": _consume_aiokafka, "confluent": _consume_confluent,
          "kafka-python": _consume_kafka_python, "java": _consume_java}[family]
    got = fn(bs, topic, group, n, timeout)
    if len(got) < n:
        raise ClientError(f"{family}: consumed {len(got)} of {n} records within {timeout}s")
    return got


def _consume_aiokafka(bs: str, topic: str, group: str, n: int, timeout: float) -> list[Consumed]:
    from aiokafka import AIOKafkaConsumer

    async def run() -> list[Consumed]:
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bs, group_id=group, auto_offset_reset="earliest",
                                    enable_auto_commit=False)
        await consumer.start()
        out: list[Consumed] = []
        deadline = time.monotonic() + timeout
        try:
            while len(out) < n and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    out.extend(Consumed(r.key.decode() if r.key else None, r.value.decode(), r.partition, r.offset)
                               for r in records)
                if batch:
                    await consumer.commit()
        finally:
            await consumer.stop()
        return out

    return asyncio.run(run())


def _consume_confluent(bs: str, topic: str, group: str, n: int, timeout: float,
                       isolation: str = "read_uncommitted", commit: bool = True) -> list[Consumed]:
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bs, "group.id": group, "auto.offset.reset": "earliest", "log_level": 2,
                         "enable.auto.commit": False, "isolation.level": isolation})
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


def _consume_kafka_python(bs: str, topic: str, group: str, n: int, timeout: float) -> list[Consumed]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bs.split(","), group_id=group,
                             auto_offset_reset="earliest", enable_auto_commit=False)
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


def _consume_java(bs: str, topic: str, group: str, n: int, timeout: float) -> list[Consumed]:
    cmd = java_tool_cmd("org.apache.kafka.tools.VerifiableConsumer", "--bootstrap-server", bs, "--topic", topic,
                        "--group-id", group, "--max-messages", str(n), "--verbose", "--reset-policy", "earliest")
    events = run_json_tool(cmd, timeout + 30)
    return [Consumed(e.get("key"), e["value"], e["partition"], e["offset"])
            for e in events if e.get("name") == "record_data"]


# -------------------------------------------------------------- java tools
def run_json_tool(cmd: list[str], timeout: float) -> list[dict]:
    """Run one of Kafka's verifiable tools; return its JSON-lines events."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise ClientError(f"{cmd[-1]}: timed out after {timeout}s") from exc
    events = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            events.append(json.loads(line))
    if proc.returncode != 0:
        raise ClientError(f"java tool exited {proc.returncode}: {proc.stderr[-2000:]}")
    return events


def kafka_tool(main_class: str, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one of Kafka's admin tools (``org.apache.kafka.tools.TopicCommand`` …); raise on failure."""
    proc = subprocess.run(java_tool_cmd(main_class, *args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise ClientError(f"{main_class} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc


def topics_describe(bootstrap: str | Iterable[str], topic: str | None = None) -> str:
    args = ["--bootstrap-server", _bootstrap(bootstrap), "--describe"]
    if topic:
        args += ["--topic", topic]
    return kafka_tool("org.apache.kafka.tools.TopicCommand", *args).stdout


def consumer_groups_describe(bootstrap: str | Iterable[str], group: str) -> str:
    return kafka_tool("org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server",
                      _bootstrap(bootstrap), "--describe", "--group", group).stdout


# ------------------------------------------------------------- transactions
def transactional_produce(family: str, bootstrap: str | Iterable[str], topic: str, n: int, prefix: int,
                          *, commit: bool = True, timeout: float = 60.0) -> None:
    """Produce ``n`` records in one transaction, then commit (or abort) it.

    For ``java`` the records come from partition 0 of ``topic + "-in"`` (which
    must hold at least ``n`` records), copied by Kafka's own
    TransactionalMessageCopier (consume-transform-produce with sendOffsetsToTransaction).
    """
    bs = _bootstrap(bootstrap)
    tid = f"tx-{family}-{topic}-{prefix}"
    if family == "aiokafka":
        from aiokafka import AIOKafkaProducer

        async def run() -> None:
            producer = AIOKafkaProducer(bootstrap_servers=bs, transactional_id=tid, enable_idempotence=True)
            await producer.start()
            try:
                await producer.begin_transaction()
                for i, v in enumerate(values(prefix, n)):
                    await producer.send(topic, key=str(i).encode(), value=v.encode())
                if commit:
                    await producer.commit_transaction()
                else:
                    await producer.abort_transaction()
            finally:
                await producer.stop()

        asyncio.run(asyncio.wait_for(run(), timeout))
    elif family == "confluent":
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": bs, "transactional.id": tid, "log_level": 2})
        producer.init_transactions(timeout)
        producer.begin_transaction()
        for i, v in enumerate(values(prefix, n)):
            producer.produce(topic, key=str(i).encode(), value=v.encode())
        if commit:
            producer.commit_transaction(timeout)
        else:
            producer.abort_transaction(timeout)
    elif family == "kafka-python":
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=bs.split(","), transactional_id=tid, enable_idempotence=True)
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
    elif family == "java":
        if not commit:
            raise ClientError("java: TransactionalMessageCopier only commits")
        cmd = java_tool_cmd("org.apache.kafka.tools.TransactionalMessageCopier", "--broker-list", bs,
                            "--input-topic", f"{topic}-in", "--input-partition", "0", "--output-topic", topic,
                            "--transactional-id", tid, "--consumer-group", f"{tid}-group",
                            "--max-messages", str(n), "--transaction-size", str(max(1, n // 2)))
        events = run_json_tool(cmd, timeout + 30)
        done = [e for e in events if e.get("remaining") == 0 or e.get("message") == "ShutdownComplete"]
        if not done and not any(e.get("transactionsCompleted", 0) for e in events):
            raise ClientError(f"java: copier did not finish: {events[-3:]}")
    else:
        raise ValueError(f"unknown family {family!r}")


def consume_committed(bootstrap: str | Iterable[str], topic: str, group: str, n: int,
                      timeout: float = 60.0) -> list[Consumed]:
    """Read with isolation.level=read_committed (confluent) until ``n`` records or ``timeout``."""
    return _consume_confluent(_bootstrap(bootstrap), topic, group, n, timeout, isolation="read_committed",
                              commit=False)
