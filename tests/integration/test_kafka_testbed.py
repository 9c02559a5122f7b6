"""The test bed itself: every client family against the real 3-broker cluster."""

from __future__ import annotations

import pytest

from chaos.clients import batch as clients

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("family", clients.FAMILIES)
def test_family_produces_idempotently_and_consumes_back(kafka_cluster, topic_name, family):
    kafka_cluster.create_topic(topic_name, partitions=3, replication=3)
    acks = clients.produce(family, kafka_cluster.bootstrap, topic_name, 50, prefix=7)
    assert sorted(a.value for a in acks) == sorted(f"7.{i}" for i in range(50))
    assert all(a.offset >= 0 and 0 <= a.partition < 3 for a in acks)
    got = clients.consume(family, kafka_cluster.bootstrap, topic_name, f"g-{topic_name}", 50, timeout=60)
    assert sorted(c.value for c in got) == sorted(f"7.{i}" for i in range(50))
    assert {(c.partition, c.offset) for c in got} == {(a.partition, a.offset) for a in acks}


def test_topics_describe_shows_rf3_and_min_isr(kafka_cluster, topic_name):
    kafka_cluster.create_topic(topic_name, partitions=2, replication=3)
    out = clients.topics_describe(kafka_cluster.bootstrap, topic_name)
    assert f"Topic: {topic_name}" in out
    assert "ReplicationFactor: 3" in out
    assert "min.insync.replicas=2" in out
    assert out.count("Isr:") == 2


def test_brokers_carry_their_racks(kafka_cluster):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap_servers})
    md = admin.list_topics(timeout=10)
    assert sorted(md.brokers) == [1, 2, 3]
    desc = admin.describe_cluster(include_authorized_operations=False).result(timeout=10)
    assert sorted((n.id, n.rack) for n in desc.nodes) == [(1, "rack-1"), (2, "rack-2"), (3, "rack-3")]


@pytest.mark.slow
def test_clients_continue_with_one_broker_killed(kafka_cluster, topic_name):
    """Kafka's own failover (the baseline proxy failover is compared with)."""
    kafka_cluster.create_topic(topic_name, partitions=3, replication=3)
    for i, family in enumerate(clients.FAMILIES):
        clients.produce(family, kafka_cluster.bootstrap, topic_name, 20, prefix=i)
    victim = 2
    kafka_cluster.kill(victim)
    try:
        assert victim not in kafka_cluster.pids
        for i, family in enumerate(clients.FAMILIES):
            acks = clients.produce(family, kafka_cluster.bootstrap, topic_name, 20, prefix=10 + i, timeout=90)
            assert len(acks) == 20
        expected = sorted(f"{p}.{j}" for p in (0, 1, 2, 3, 10, 11, 12, 13) for j in range(20))
        for family in clients.FAMILIES:
            got = clients.consume(family, kafka_cluster.bootstrap, topic_name, f"g-{family}-{topic_name}",
                                  len(expected), timeout=90)
            assert sorted(c.value for c in got) == expected, family
    finally:
        kafka_cluster.restart(victim)
    assert victim in kafka_cluster.pids


def test_storage_format_accepts_a_cluster_id_starting_with_a_dash(tmp_path):
    """Cluster ids are url-safe base64 and may start with '-' (once read as an option)."""
    from chaos.testbed.kafka_cluster import KafkaCluster

    cluster = KafkaCluster(tmp_path, 1, base_port=38001)
    cluster.cluster_id = "-abcDEFghiJKLmnoPQRstu"
    spec = cluster.specs[0]
    cluster._format(spec, cluster._write_config(spec))
    meta = (tmp_path / "broker-1" / "data" / "meta.properties").read_text()
    assert "cluster.id=-abcDEFghiJKLmnoPQRstu" in meta
