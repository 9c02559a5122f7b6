"""A 3-node fleet in front of a SASL_SSL broker (SCRAM-SHA-512), TLS toward clients: every
client family through it, SASL passed through, broker addresses never leaked."""

from __future__ import annotations

import struct

import pytest

from chaos.clients import batch as clients

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
