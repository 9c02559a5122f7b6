"""A 3-node fleet in front of a SASL_SSL broker (SCRAM-SHA-512), TLS toward clients: every
client family through it, SASL passed through, broker addresses never leaked."""

from __future__ import annotations

import struct

import pytest

from chaos.clients import batch as clients
from chaos.clients import java_client

pytestmark = [pytest.mark.integration]

BOOTSTRAP = "127.0.0.61:9092,127.0.0.62:9092,127.0.0.63:9092"


@pytest.mark.parametrize("family", clients.FAMILIES)
def test_family_through_a_tls_fleet_to_sasl_ssl(secure_fleet, secure_kafka, topic_name, family):
    secure_kafka.create_topic(topic_name, partitions=2, replication=1)
    acks = clients.produce(family, BOOTSTRAP, topic_name, 30, prefix=5, security=secure_fleet.client)
    assert sorted(a.value for a in acks) == sorted(clients.values(5, 30))
    got = clients.consume(family, BOOTSTRAP, topic_name, f"g-{topic_name}", 30, timeout=60,
                          security=secure_fleet.client)
    assert sorted(c.value for c in got) == sorted(clients.values(5, 30))


def test_a_transaction_through_the_fleet(secure_fleet, secure_kafka, topic_name):
    secure_kafka.create_topic(topic_name, partitions=1, replication=1)
    for family in ("confluent", "kafka-python"):
        clients.transactional_produce(family, BOOTSTRAP, topic_name, 10, prefix=len(family),
                                      security=secure_fleet.client)
    got = clients.consume_committed(BOOTSTRAP, topic_name, f"g-{topic_name}", 20, security=secure_fleet.client)
    assert sorted(c.value for c in got) == sorted(clients.values(9, 10) + clients.values(12, 10))


def test_a_java_transaction_through_the_fleet(secure_fleet, secure_kafka, topic_name):
    """Kafka's own ProducerPerformance as a transactional producer (SASL_SSL through the fleet),
    several transactions committed; a read_committed consumer reads every record once."""
    secure_kafka.create_topic(topic_name, partitions=2, replication=1)
    n = 3000
    report = java_client.perf_transactions(BOOTSTRAP, topic_name, f"tx-java-{topic_name}", n, transaction_ms=100,
                                           timeout=90, security=secure_fleet.client)
    assert f"{n} records sent" in report, report[-500:]
    got = clients.consume_committed(BOOTSTRAP, topic_name, f"g-{topic_name}", n, timeout=60,
                                    security=secure_fleet.client)
    assert sorted(int(c.value) for c in got) == list(range(n))


def test_java_tools_create_and_describe_a_topic_through_the_fleet(secure_fleet, topic_name, tmp_path):
    props = secure_fleet.client.java_properties(tmp_path / "client.properties")
    clients.kafka_tool("org.apache.kafka.tools.TopicCommand", "--bootstrap-server", BOOTSTRAP, "--create",
                       "--topic", topic_name, "--partitions", "2", "--replication-factor", "1",
                       "--command-config", str(props))
    out = clients.kafka_tool("org.apache.kafka.tools.TopicCommand", "--bootstrap-server", BOOTSTRAP, "--describe",
                             "--topic", topic_name, "--command-config", str(props)).stdout
    assert f"Topic: {topic_name}" in out and out.count("Leader: 1") == 2


def test_no_broker_address_reaches_a_tls_client(secure_fleet, secure_kafka, topic_name):
    """The tap copies what each node writes to its clients before encryption."""
    clients.produce("aiokafka", BOOTSTRAP, topic_name, 5, prefix=1, security=secure_fleet.client)
    blobs = [p.read_bytes() for p in sorted(secure_fleet.tap_dir.iterdir())]
    assert len(blobs) >= 3, "the tap saw too few connections"
    data = b"\n".join(blobs)
    spec = secure_kafka.specs[0]
    assert data.count(spec.host.encode() + struct.pack(">i", spec.port)) == 0, "a broker address leaked"
    assert any(data.count(f"127.0.0.{ip}".encode() + struct.pack(">i", 9101)) for ip in (61, 62, 63))
