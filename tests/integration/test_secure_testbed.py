"""The secured test bed (``KafkaCluster(security=SASL_SSL)``): every client family and every
SASL mechanism reach the broker directly with the settings chaos.testbed.security gives."""

from __future__ import annotations

import pytest

from chaos.clients import batch as clients

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("family", clients.FAMILIES)
def test_family_reaches_a_sasl_ssl_broker_with_scram_sha_512(secure_kafka, topic_name, family):
    sec = secure_kafka.client_security
    secure_kafka.create_topic(topic_name, partitions=2, replication=1)
    acks = clients.produce(family, secure_kafka.bootstrap, topic_name, 20, prefix=3, security=sec)
    assert sorted(a.value for a in acks) == sorted(clients.values(3, 20))
    got = clients.consume(family, secure_kafka.bootstrap, topic_name, f"g-{topic_name}", 20, timeout=60,
                          security=sec)
    assert sorted(c.value for c in got) == sorted(clients.values(3, 20))


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "OAUTHBEARER"])
def test_every_mechanism_logs_in(secure_kafka, topic_name, mechanism):
    sec = secure_kafka.client_security.with_mechanism(mechanism)
    acks = clients.produce("confluent", secure_kafka.bootstrap, topic_name, 5, prefix=1, security=sec)
    assert len(acks) == 5


def test_a_wrong_password_is_refused(secure_kafka, topic_name):
    import attrs

    sec = attrs.evolve(secure_kafka.client_security, password="not-the-password")
    with pytest.raises(clients.ClientError):  # librdkafka retries the login until the record times out
        clients.produce("confluent", secure_kafka.bootstrap, topic_name, 1, prefix=1, security=sec, timeout=10)
