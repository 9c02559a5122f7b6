"""KIP-368 through the fleet: the SASL_SSL broker asks for re-authentication every REAUTH_MS
(connections.max.reauth.ms); a long-lived librdkafka producer re-authenticates on its open
connections through the proxy (SaslHandshake/SaslAuthenticate pass through mid-connection) and
keeps producing without a new connection for it."""

from __future__ import annotations

import time

import pytest

from tests.conftest import REAUTH_MS

pytestmark = [pytest.mark.integration]

BOOTSTRAP = "127.0.0.61:9092,127.0.0.62:9092,127.0.0.63:9092"


def fleet_counter(fleet, name: str, labels: str) -> float:  # type: ignore[no-untyped-def]
    total = 0.0
    for node in fleet.nodes.values():
        for line in node.get("/metrics").text.splitlines():
            if line.startswith(name + "{") and all(part in line for part in labels.split(",") if part):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_reauthentication_passes_through(secure_fleet, secure_kafka, topic_name):
    from confluent_kafka import Producer

    secure_kafka.create_topic(topic_name, partitions=1, replication=1)
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "acks": "all", "enable.idempotence": True,
                         "log_level": 2, **secure_fleet.client.confluent()})
    errors: list[str] = []
    acked = 0

    def delivered(err, msg) -> None:  # type: ignore[no-untyped-def]
        nonlocal acked
        if err is not None:
            errors.append(str(err))
        else:
            acked += 1

    producer.produce(topic_name, b"first", on_delivery=delivered)
    assert producer.flush(30) == 0 and acked == 1  # connected and logged in
    auth_before = fleet_counter(secure_fleet, "kproxy_requests_total", 'api_key="36"')
    connections_before = fleet_counter(secure_fleet, "kproxy_connections_total", "")
    end = time.monotonic() + 2.5 * REAUTH_MS / 1000
    while time.monotonic() < end:
        producer.produce(topic_name, b"x", on_delivery=delivered)
        producer.poll(0.05)
    assert producer.flush(30) == 0 and not errors, errors[:3]
    auth_after = fleet_counter(secure_fleet, "kproxy_requests_total", 'api_key="36"')
    connections_after = fleet_counter(secure_fleet, "kproxy_connections_total", "")
    assert connections_before > 0
    assert auth_after - auth_before >= 2, "no re-authentication passed through the proxy"
    assert connections_after - connections_before <= 1, "the producer reconnected instead of re-authenticating"
