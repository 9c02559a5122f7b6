"""Every client family through one proxy node in front of the real 3-broker cluster."""

from __future__ import annotations

import re

import pytest

from chaos.clients import batch as clients

pytestmark = [pytest.mark.integration]


def _create_topic_through_proxy(bootstrap: str, name: str, partitions: int) -> None:
    clients.kafka_tool("org.apache.kafka.tools.TopicCommand", "--bootstrap-server", bootstrap, "--create",
                       "--topic", name, "--partitions", str(partitions), "--replication-factor", "3",
                       "--config", "min.insync.replicas=2")


@pytest.mark.parametrize("family", clients.FAMILIES)
def test_family_round_trip_through_proxy(proxy, kafka_cluster, topic_name, family):
    bs = proxy.bootstrap
    _create_topic_through_proxy(bs, topic_name, 3)
    acks = clients.produce(family, bs, topic_name, 60, prefix=5)
    assert sorted(a.value for a in acks) == sorted(f"5.{i}" for i in range(60))
    group = f"g-{topic_name}"
    got = clients.consume(family, bs, topic_name, group, 60)
    assert sorted(c.value for c in got) == sorted(f"5.{i}" for i in range(60))
    # The records really are in Kafka: read them again directly from the brokers.
    direct = clients.consume("confluent", kafka_cluster.bootstrap, topic_name, f"direct-{group}", 60)
    assert {(c.partition, c.offset) for c in direct} == {(a.partition, a.offset) for a in acks}
    # The group's committed offsets are visible to Kafka's own admin tool, through the proxy.
    out = clients.consumer_groups_describe(bs, group)
    lags = [line.split() for line in out.splitlines() if line.startswith(group)]
    assert len(lags) == 3, out
    assert sum(int(cols[3]) for cols in lags) == 60  # CURRENT-OFFSET column sums to what was consumed
    state = clients.kafka_tool("org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server",
                               bs, "--describe", "--group", group, "--state").stdout
    coordinator = re.search(r"127\.0\.0\.\d+:(\d+)", state)
    assert coordinator is not None, state
    assert coordinator.group(0).startswith("127.0.0.21:91"), state
    assert not any(addr in state for addr in kafka_cluster.bootstrap)


@pytest.mark.parametrize("family", ["aiokafka", "confluent", "kafka-python"])
def test_transactions_through_proxy(proxy, topic_name, family):
    bs = proxy.bootstrap
    _create_topic_through_proxy(bs, topic_name, 3)
    clients.transactional_produce(family, bs, topic_name, 10, prefix=1, commit=False)
    clients.transactional_produce(family, bs, topic_name, 10, prefix=2, commit=True)
    got = clients.consume_committed(bs, topic_name, f"g-{topic_name}", 10, timeout=30)
    assert sorted(c.value for c in got) == sorted(f"2.{i}" for i in range(10))


def test_java_transactional_copier_through_proxy(proxy, topic_name):
    bs = proxy.bootstrap
    _create_topic_through_proxy(bs, f"{topic_name}-in", 1)
    _create_topic_through_proxy(bs, topic_name, 3)
    clients.produce("java", bs, f"{topic_name}-in", 20, prefix=4)
    clients.transactional_produce("java", bs, topic_name, 20, prefix=4)
    got = clients.consume_committed(bs, topic_name, f"g-{topic_name}", 20, timeout=30)
    assert sorted(c.value for c in got) == sorted(f"4.{i}" for i in range(20))


def test_describe_cluster_and_topics_show_only_proxy_addresses(proxy, kafka_cluster, topic_name):
    bs = proxy.bootstrap
    _create_topic_through_proxy(bs, topic_name, 2)
    out = clients.topics_describe(bs, topic_name)
    assert "ReplicationFactor: 3" in out and out.count("Leader:") == 2
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bs, "log_level": 2})
    desc = admin.describe_cluster().result(timeout=20)
    assert sorted((n.id, n.host, n.port, n.rack) for n in desc.nodes) == [
        (1, "127.0.0.21", 9101, "rack-1"), (2, "127.0.0.21", 9102, "rack-2"), (3, "127.0.0.21", 9103, "rack-3")]
    md = admin.list_topics(timeout=20)
    assert sorted((b.id, b.host, b.port) for b in md.brokers.values()) == [
        (1, "127.0.0.21", 9101), (2, "127.0.0.21", 9102), (3, "127.0.0.21", 9103)]
    assert md.controller_id in (1, 2, 3)


def _api_versions(host: str, port: int) -> dict[int, tuple[int, int]]:
    import io
    import socket
    import struct

    from kio.schema.api_versions.v3.request import ApiVersionsRequest
    from kio.schema.api_versions.v3.response import ApiVersionsResponse
    from kio.schema.request_header.v2.header import RequestHeader
    from kio.schema.response_header.v0.header import ResponseHeader
    from kio.serial import entity_reader, entity_writer
    from kio.static.primitive import i16, i32

    buf = io.BytesIO()
    entity_writer(RequestHeader)(buf, RequestHeader(request_api_key=i16(18), request_api_version=i16(3),
                                                    correlation_id=i32(7), client_id="t"))
    entity_writer(ApiVersionsRequest)(buf, ApiVersionsRequest(client_software_name="kproxy-test",
                                                              client_software_version="1"))
    payload = buf.getvalue()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(struct.pack(">i", len(payload)) + payload)
        size = struct.unpack(">i", s.recv(4, socket.MSG_WAITALL))[0]
        data = s.recv(size, socket.MSG_WAITALL)
    header, used = entity_reader(ResponseHeader)(data, 0)
    assert header.correlation_id == 7
    body, _ = entity_reader(ApiVersionsResponse)(data, used)
    return {int(k.api_key): (int(k.min_version), int(k.max_version)) for k in body.api_keys}


def test_api_versions_are_clamped_to_what_the_proxy_rewrites(proxy, kafka_cluster):
    direct = _api_versions("127.0.0.1", kafka_cluster.specs[0].port)
    proxied = _api_versions("127.0.0.21", 9092)
    assert direct[1][1] >= 16  # the broker offers Fetch with KIP-951 node_endpoints ...
    assert proxied[1][1] == 15  # ... the proxy caps Fetch at v15 (cut-through, no addresses inside)
    from proxy.codec import known_versions

    for api_key, (lo, hi) in proxied.items():
        versions = known_versions(api_key)
        assert versions is not None and lo >= versions[0] and hi <= versions[-1], api_key
    assert set(proxied) <= set(direct)
