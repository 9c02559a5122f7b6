"""Failover under TLS+SASL: the owner of the broker's identity is SIGKILLed, then drained, while
an idempotent producer runs through the TLS fleet in front of the SASL_SSL broker; every
acknowledged record is read back exactly once, and the clients logged in again on the new node."""

from __future__ import annotations

import threading
import time

import pytest

from chaos.clients.settings import SETTINGS

pytestmark = [pytest.mark.integration, pytest.mark.drill]

BOOTSTRAP = "127.0.0.61:9092,127.0.0.62:9092,127.0.0.63:9092"
RATE = 200  # records/s
RUN_S = 6.0


class PacedProducer(threading.Thread):
    """confluent-kafka, idempotent, acks=all, the drills' settings; acked values in ``acked``."""

    def __init__(self, fleet, topic: str) -> None:  # type: ignore[no-untyped-def]
        super().__init__(daemon=True)
        from confluent_kafka import Producer

        self.topic = topic
        self.acked: list[str] = []
        self.errors: list[str] = []
        self.ack_times: list[float] = []
        self.producer = Producer({**SETTINGS["confluent"]["producer"], "bootstrap.servers": BOOTSTRAP,
                                  **fleet.client.confluent()})

    def _delivered(self, err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is not None:
            self.errors.append(str(err))
        else:
            self.acked.append(msg.value().decode())
            self.ack_times.append(time.monotonic())

    def run(self) -> None:
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < RUN_S:
            self.producer.produce(self.topic, key=str(i % 100).encode(), value=str(i).encode(),
                                  on_delivery=self._delivered)
            self.producer.poll(0)
            i += 1
            time.sleep(max(0.0, start + i / RATE - time.monotonic()))
        self.sent = i
        self.remaining = self.producer.flush(60)

    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.ack_times, self.ack_times[1:])), default=0.0)


def read_all(fleet, topic: str, expected: int) -> list[str]:  # type: ignore[no-untyped-def]
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"verify-{topic}", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False, "log_level": 2, **fleet.client.confluent()})
    consumer.subscribe([topic])
    out: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while len(out) < expected and time.monotonic() < deadline:
            out.extend(m.value().decode() for m in consumer.consume(500, timeout=0.5) if m.error() is None)
        # a little longer: a duplicate would come after the expected count
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            out.extend(m.value().decode() for m in consumer.consume(500, timeout=0.2) if m.error() is None)
    finally:
        consumer.close()
    return out


def run_fault(fleet, secure_kafka, topic: str, fault) -> PacedProducer:  # type: ignore[no-untyped-def]
    secure_kafka.create_topic(topic, partitions=2, replication=1)
    producer = PacedProducer(fleet, topic)
    producer.start()
    time.sleep(RUN_S / 3)
    fault()
    producer.join(RUN_S + 90)
    assert not producer.is_alive()
    assert producer.remaining == 0 and not producer.errors, producer.errors[:3]
    assert len(producer.acked) == producer.sent
    got = read_all(fleet, topic, len(producer.acked))
    assert sorted(got, key=int) == sorted(producer.acked, key=int), "lost or duplicated records"
    return producer


def test_sigkill_of_the_identity_owner(secure_fleet, secure_kafka, topic_name):
    owner = secure_fleet.fleet_view().assignment["1"]
    before = secure_fleet.fleet_view().epoch
    producer = run_fault(secure_fleet, secure_kafka, topic_name, lambda: secure_fleet.signal_node(owner, "KILL"))
    view = secure_fleet.wait_healthy(30, allow_dead=True)
    assert view.assignment["1"] != owner and view.epoch > before
    assert producer.longest_gap_s() < 5.0  # the clients logged in again on the new owner at once
    secure_fleet.restart_node(owner)
    secure_fleet.wait_healthy(60)


def test_drain_of_the_identity_owner(secure_fleet, secure_kafka, topic_name):
    owner = secure_fleet.fleet_view().assignment["1"]
    try:
        run_fault(secure_fleet, secure_kafka, topic_name, lambda: secure_fleet.drain(owner))
        assert secure_fleet.fleet_view().assignment["1"] != owner
    finally:
        secure_fleet.undrain(owner)
        secure_fleet.wait_healthy(60)
