"""Shared fixtures: one real 3-broker Kafka cluster per test session."""

from __future__ import annotations

import os
import uuid

import pytest

from hypothesis import HealthCheck, settings

# Hypothesis: a fast derandomized profile for CI, a thorough one for long runs
# (HYPOTHESIS_PROFILE=thorough).
settings.register_profile("ci", max_examples=100, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=5000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory):
    """A real 3-broker KRaft cluster (Apache Kafka jars from Maven Central), shared by the session."""
    from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port

    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka"), 3, base_port=free_base_port(3, seed=os.getpid()))
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def topic_name(request) -> str:
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="session")
def tap_dir(tmp_path_factory):
    """Every byte the session proxy sends to clients lands here (leak check)."""
    return tmp_path_factory.mktemp("tap")


@pytest.fixture(scope="session")
def proxy(kafka_cluster, tmp_path_factory, tap_dir):
    """One proxy node (no fleet) on 127.0.0.21 in front of the session cluster."""
    from chaos.testbed.proxies import NodeProcess, fleet_config

    d = tmp_path_factory.mktemp("proxy")
    cfg = fleet_config(d / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=21, fleet=False,
                       tap_dir=str(tap_dir))
    node = NodeProcess(cfg, "p1", "127.0.0.21", 9400, d / "p1.log").start()
    try:
        node.wait_ready(60)
        node.bootstrap = "127.0.0.21:9092"  # type: ignore[attr-defined]
        yield node
    finally:
        node.stop()


# connections.max.reauth.ms of the secured broker (KIP-368): clients that can re-authenticate do,
# through the proxy, every few seconds; the others are closed by the broker and reconnect.
REAUTH_MS = 5000


@pytest.fixture(scope="session")
def secure_kafka(tmp_path_factory):
    """A second, small cluster: one KRaft broker whose listener is SASL_SSL (a CA of its own;
    PLAIN, SCRAM-SHA-256/512 and OAUTHBEARER; re-authentication every REAUTH_MS), for the TLS
    and SASL tests. One broker keeps the
    cost at one JVM (~15 s to start); topics there have replication factor 1."""
    from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port
    from chaos.testbed.security import Protocol

    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-sasl-ssl"), 1, security=Protocol.SASL_SSL,
                           base_port=free_base_port(1, seed=os.getpid() + 1), reauth_ms=REAUTH_MS)
    os.environ.update(cluster.security.proxy_env())  # proxy node processes inherit the upstream password
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def secure_fleet(secure_kafka, tmp_path_factory):
    """Three proxy nodes (127.0.0.61-63, a fleet) in front of ``secure_kafka``: TLS toward
    clients with a certificate from the test bed's CA, TLS and SASL (SCRAM-SHA-512) upstream,
    clients' SASL passed through. ``secure_fleet.client`` is what a client needs."""
    from chaos.testbed.fleet import LocalFleet

    sec = secure_kafka.security
    tap = tmp_path_factory.mktemp("tap-secure")
    fleet = LocalFleet.up(tmp_path_factory.mktemp("fleet-secure"), proxies=3, kafka_bootstrap=secure_kafka.bootstrap,
                          first_ip=61, timeout=90, testbed=sec, extra_config={"debug": {"tap_dir": str(tap)}})
    fleet.client = fleet.client_security  # type: ignore[attr-defined]
    fleet.tap_dir = tap  # type: ignore[attr-defined]
    try:
        yield fleet
    finally:
        fleet.down()
