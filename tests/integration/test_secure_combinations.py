"""Any combination of client side and upstream side: TLS -> plaintext (a TLS node in front of the
plaintext session cluster) and plaintext -> TLS (a plaintext node in front of the SASL_SSL broker;
TLS -> TLS is test_secure_fleet's). Also every SASL mechanism through the TLS fleet."""

from __future__ import annotations

import pytest

from chaos.clients import batch as clients
from chaos.testbed.security import ClientSecurity, Protocol

pytestmark = [pytest.mark.integration]


def _node(tmp_path, upstream: list[str], ip: int, security: dict):  # type: ignore[no-untyped-def]
    from chaos.testbed.proxies import NodeProcess, fleet_config

    cfg = fleet_config(tmp_path / "node.toml", upstream, 1, first_ip=ip, fleet=False, extra={"security": security})
    node = NodeProcess(cfg, "p1", f"127.0.0.{ip}", 9400, tmp_path / "p1.log").start()
    try:
        node.wait_ready(60)
    except BaseException:
        node.stop()
        raise
    return node


def test_tls_clients_to_plaintext_brokers(kafka_cluster, secure_kafka, tmp_path, topic_name):
    bed = secure_kafka.security  # its CA and proxy certificate serve here too
    node = _node(tmp_path, kafka_cluster.bootstrap, 65, {"listeners": {"cert": str(bed.proxy.cert),
                                                                       "key": str(bed.proxy.key)}})
    try:
        client = ClientSecurity(Protocol.SSL, ca=bed.ca)
        acks = clients.produce("aiokafka", "127.0.0.65:9092", topic_name, 10, prefix=6, security=client)
        got = clients.consume("confluent", "127.0.0.65:9092", topic_name, f"g-{topic_name}", 10, security=client)
        assert sorted(c.value for c in got) == sorted(a.value for a in acks) == sorted(clients.values(6, 10))
    finally:
        node.stop()


def test_plaintext_clients_to_sasl_ssl_brokers(secure_kafka, tmp_path, topic_name):
    section = secure_kafka.security.proxy_config(listeners=False)
    node = _node(tmp_path, secure_kafka.bootstrap, 66, section)
    try:
        client = ClientSecurity(Protocol.SASL_PLAINTEXT, password=secure_kafka.security.password)
        acks = clients.produce("kafka-python", "127.0.0.66:9092", topic_name, 10, prefix=7, security=client)
        assert sorted(a.value for a in acks) == sorted(clients.values(7, 10))
    finally:
        node.stop()


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "OAUTHBEARER"])
def test_every_mechanism_through_the_tls_fleet(secure_fleet, topic_name, mechanism):
    client = secure_fleet.client.with_mechanism(mechanism)
    acks = clients.produce("confluent", "127.0.0.61:9092,127.0.0.62:9092", topic_name, 5, prefix=1, security=client)
    assert len(acks) == 5
