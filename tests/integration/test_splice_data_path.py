"""Large Fetch response bodies are spliced (proxy.splice) and arrive intact:
an in-process proxy node (127.0.0.23, no tap, so it splices) in front of the
real session cluster, real clients (librdkafka, aiokafka, kafka-python) producing and
fetching a few MB of records in large batches through it."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid

import pytest
import uvloop

from proxy.config import parse
from proxy.datapath import DataPath

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.23"
RECORDS = 3000
VALUE_BYTES = 2048  # ~6 MB in all: fetch responses of several MB, far above splice_min_bytes


class NodeThread:
    """A DataPath on its own uvloop in a background thread (the clients block)."""

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        self.config = config
        self.loop = uvloop.new_event_loop()
        self.node: DataPath | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, name="proxy-node-23", daemon=True)

    def __enter__(self) -> DataPath:
        self.thread.start()

        async def start() -> DataPath:
            node = DataPath(self.config, "p1")
            await node.start(discovery_timeout=30)
            return node

        self.node = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        return self.node

    def __exit__(self, *exc: object) -> None:
        if self.node is not None:
            asyncio.run_coroutine_threadsafe(self.node.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def test_large_fetch_responses_are_spliced_and_byte_identical(kafka_cluster, topic_name, caplog):
    kafka_cluster.create_topic(topic_name, 2, 3)
    config = parse({"upstream": {"bootstrap": kafka_cluster.bootstrap}, "ports": {"base": 9100},
                    "nodes": [{"id": "p1", "host": HOST, "bootstrap_port": 9092}],
                    "logging": {"level": "WARNING"}})
    assert config.limits.splice_min_bytes > 0  # on by default
    bootstrap = f"{HOST}:9092"
    sent = {str(i).encode(): os.urandom(VALUE_BYTES) for i in range(RECORDS)}
    caplog.set_level(logging.WARNING, logger="kproxy")

    from confluent_kafka import Consumer, Producer

    with NodeThread(config) as node:
        producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                             "linger.ms": 100, "batch.size": 1 << 20, "compression.type": "none"})
        failures: list[str] = []
        for key, value in sent.items():
            while True:
                try:
                    producer.produce(topic_name, value, key,
                                     on_delivery=lambda err, msg: failures.append(str(err)) if err else None)
                    break
                except BufferError:
                    producer.poll(0.1)
        assert producer.flush(60) == 0 and not failures, failures
        producer = None  # its handle would keep dialling the node after the test
        produced_to_broker = node.metrics.bytes_to_broker
        spliced_before = node.metrics.spliced_bytes

        # librdkafka: large fetches (max.partition.fetch.bytes well above what a partition holds).
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"splice-{uuid.uuid4().hex[:8]}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False,
                             "fetch.max.bytes": 50 << 20, "max.partition.fetch.bytes": 16 << 20,
                             "fetch.wait.max.ms": 100})
        consumer.subscribe([topic_name])
        got: dict[bytes, bytes] = {}
        offsets: set[tuple[int, int]] = set()
        deadline = time.monotonic() + 90
        try:
            while len(offsets) < RECORDS and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is None:
                    continue
                assert msg.error() is None, msg.error()
                offsets.add((msg.partition(), msg.offset()))
                got[msg.key()] = msg.value()
        finally:
            consumer.close()
        spliced_librdkafka = node.metrics.spliced_bytes - spliced_before
        assert len(offsets) == RECORDS, f"read {len(offsets)} of {RECORDS} records"
        assert got == sent  # every record byte-identical

        # aiokafka, the same records again.
        async def aiokafka_read() -> dict[bytes, bytes]:
            from aiokafka import AIOKafkaConsumer

            c = AIOKafkaConsumer(topic_name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                 enable_auto_commit=False, group_id=None, fetch_max_bytes=50 << 20,
                                 max_partition_fetch_bytes=16 << 20, request_timeout_ms=30000)
            await c.start()
            out: dict[bytes, bytes] = {}
            n = 0
            try:
                end = time.monotonic() + 90
                while n < RECORDS and time.monotonic() < end:
                    batches = await c.getmany(timeout_ms=500)
                    for records in batches.values():
                        for r in records:
                            out[r.key] = r.value
                            n += 1
            finally:
                await c.stop()
            assert n == RECORDS, f"aiokafka read {n} of {RECORDS} records"
            return out

        spliced_before = node.metrics.spliced_bytes
        assert asyncio.run(aiokafka_read()) == sent
        spliced_aiokafka = node.metrics.spliced_bytes - spliced_before

        # kafka-python, once more.
        from kafka import KafkaConsumer

        spliced_before = node.metrics.spliced_bytes
        kp = KafkaConsumer(topic_name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                           enable_auto_commit=False, group_id=None, fetch_max_bytes=50 << 20,
                           max_partition_fetch_bytes=16 << 20, consumer_timeout_ms=1000)
        got_kp: dict[bytes, bytes] = {}
        n = 0
        deadline = time.monotonic() + 90
        try:
            while n < RECORDS and time.monotonic() < deadline:
                for r in kp:  # stops after consumer_timeout_ms without records
                    got_kp[r.key] = r.value
                    n += 1
        finally:
            kp.close()
        assert n == RECORDS, f"kafka-python read {n} of {RECORDS} records"
        assert got_kp == sent
        spliced_kafka_python = node.metrics.spliced_bytes - spliced_before
        text = node.metrics.render().decode()

    payload = RECORDS * VALUE_BYTES
    assert produced_to_broker > payload
    # Most of each read-back went around user space (the first read of each frame is copied).
    assert spliced_librdkafka > payload // 2, (spliced_librdkafka, payload)
    assert spliced_aiokafka > payload // 2, (spliced_aiokafka, payload)
    assert spliced_kafka_python > payload // 2, (spliced_kafka_python, payload)
    assert 'kproxy_spliced_bytes_total{node="p1"}' in text
    aborted = [r.getMessage() + " " + str(getattr(r, "reason", "")) for r in caplog.records
               if r.name.startswith("kproxy") and r.levelno >= logging.WARNING]
    assert not aborted, aborted
