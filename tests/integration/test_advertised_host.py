"""Real deployments (issue 15, item 4): a node reached at another address than it binds, and
a fleet on IPv6, each in front of the session's IPv4 brokers, with real clients end to end.

* ``wildcard``: p1 binds 0.0.0.0 and advertises ``localhost`` (a name; here it resolves to
  127.0.0.1, which reaches the wildcard listener), p2 binds and advertises 127.0.0.125. Raft
  and heartbeats run between the name and the address.
* ``ipv6``: p1 and p2 both on ::1, apart by their ports (``nodes[].port_base``); Raft,
  heartbeats and admin on ::1 too.

Ports stay below 20000: the session's Kafka cluster picks its own from 20000-39000."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from chaos.clients import batch as clients

pytestmark = [pytest.mark.integration]

# node -> (bind host, advertised host or None, bootstrap, admin, raft, port_base)
WILDCARD = {"p1": ("0.0.0.0", "localhost", 14420, 14421, 14422, 14430),
            "p2": ("127.0.0.125", None, 14720, 14721, 14722, 14730)}
IPV6 = {"p1": ("::1", None, 15020, 15021, 15022, 15030),
        "p2": ("::1", None, 15320, 15321, 15322, 15330)}


def _write_config(path: Path, upstream: list[str], nodes: dict[str, tuple[Any, ...]]) -> Path:
    import secrets

    entries = []
    for node_id, (host, advertised, bootstrap, admin, raft, base) in nodes.items():
        entry = {"id": node_id, "host": host, "bootstrap_port": bootstrap, "admin_port": admin, "raft_port": raft,
                 "port_base": base, "workers": 1}
        if advertised:
            entry["advertised_host"] = advertised
        entries.append(entry)
    path.write_text(tomli_w.dumps({
        "upstream": {"bootstrap": upstream, "refresh_interval_s": 5.0}, "nodes": entries,
        "admin": {"token_env": "KPROXY_ADMIN_TOKEN"}, "fleet": {"password_env": "KPROXY_RAFT_PASSWORD"}}))
    path.with_suffix(".env").write_text(f"KPROXY_ADMIN_TOKEN={secrets.token_urlsafe(16)}\n"
                                        f"KPROXY_RAFT_PASSWORD={secrets.token_urlsafe(16)}\n")
    return path


def _fleet(kafka_cluster, tmp_path: Path, nodes: dict[str, tuple[Any, ...]]):
    from chaos.testbed.proxies import NodeProcess
    from proxy.admin_client import ClusterAdmin

    cfg = _write_config(tmp_path / "fleet.toml", kafka_cluster.bootstrap, nodes)
    procs = [NodeProcess(cfg, node_id, advertised or host, admin, tmp_path / f"{node_id}.log")
             for node_id, (host, advertised, _, admin, _, _) in nodes.items()]
    for p in procs:
        p.start()
    for p in procs:
        p.bootstrap_port = nodes[p.node_id][2]
    try:
        for p in procs:
            p.wait_ready(90)
        fleet = ClusterAdmin(procs, kafka_cluster.bootstrap)
        fleet.wait_balanced(60)
        return fleet, procs
    except BaseException:
        for p in procs:
            p.stop()
        raise


@pytest.fixture
def wildcard_fleet(kafka_cluster, tmp_path):
    fleet, procs = _fleet(kafka_cluster, tmp_path, WILDCARD)
    yield fleet
    for p in procs:
        p.stop()


@pytest.fixture
def ipv6_fleet(kafka_cluster, tmp_path):
    fleet, procs = _fleet(kafka_cluster, tmp_path, IPV6)
    yield fleet
    for p in procs:
        p.stop()


def _expected_brokers(fleet, nodes: dict[str, tuple[Any, ...]]) -> list[tuple[int, str, int]]:
    """Each broker at its owner's advertised host and the owner's port_base + id (the table is the fleet's)."""
    assignment = fleet.status("p1").assignment
    assert len(assignment) == 3 and set(assignment.values()) == {"p1", "p2"}, assignment
    out = []
    for broker, owner in sorted(assignment.items()):
        host, advertised, _, _, _, base = nodes[owner]
        out.append((int(broker), advertised or host, base + int(broker)))
    return out


def _metadata_brokers(bootstrap: str) -> list[tuple[int, str, int]]:
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2}).list_topics(timeout=20)
    return sorted((b.id, b.host, b.port) for b in md.brokers.values())


def _round_trip(families: list[str], bootstrap: str, topic: str, kafka_cluster) -> None:
    clients.kafka_tool("org.apache.kafka.tools.TopicCommand", "--bootstrap-server", bootstrap, "--create",
                       "--topic", topic, "--partitions", "3", "--replication-factor", "3")
    for prefix, family in enumerate(families, 1):
        acks = clients.produce(family, bootstrap, topic, 30, prefix=prefix)
        assert sorted(a.value for a in acks) == sorted(clients.values(prefix, 30))
    want = sorted(v for prefix in range(1, len(families) + 1) for v in clients.values(prefix, 30))
    for family in families:
        got = clients.consume(family, bootstrap, topic, f"g-{family}-{topic}", len(want))
        assert sorted(c.value for c in got) == want, family
    direct = clients.consume("confluent", kafka_cluster.bootstrap, topic, f"direct-{topic}", len(want))
    assert sorted(c.value for c in direct) == want  # in Kafka indeed


def test_a_node_binding_every_address_advertises_its_name(wildcard_fleet, kafka_cluster, topic_name):
    bootstrap = "localhost:14420"
    expected = _expected_brokers(wildcard_fleet, WILDCARD)
    assert any(host == "localhost" for _, host, _ in expected)  # p1 owns some identity
    assert _metadata_brokers(bootstrap) == expected
    assert _metadata_brokers("127.0.0.125:14720") == expected  # every node tells the same table
    status = wildcard_fleet.status("p1")
    assert status.members["p1"].host == "localhost"  # the committed member record carries the name
    assert status.admin_endpoints == {"p1": "http://localhost:14421", "p2": "http://127.0.0.125:14721"}
    _round_trip(["aiokafka", "java"], bootstrap, topic_name, kafka_cluster)
    # Never the bind address, never a broker's own address.
    out = clients.topics_describe(bootstrap, topic_name)
    assert "0.0.0.0" not in out and not any(addr in out for addr in kafka_cluster.bootstrap)


def test_an_ipv6_fleet_in_front_of_ipv4_brokers(ipv6_fleet, kafka_cluster, topic_name):
    bootstrap = "[::1]:15020"
    expected = _expected_brokers(ipv6_fleet, IPV6)
    assert {host for _, host, _ in expected} == {"::1"}  # the host field is the bare address, no brackets
    assert _metadata_brokers(bootstrap) == expected
    assert _metadata_brokers("[::1]:15320") == expected
    status = ipv6_fleet.status("p2")
    assert status.has_quorum and status.leader is not None  # Raft between ::1 ports
    assert status.admin_endpoints == {"p1": "http://[::1]:15021", "p2": "http://[::1]:15321"}
    _round_trip(["aiokafka", "confluent", "java"], bootstrap, topic_name, kafka_cluster)


def test_an_ipv6_node_stands_in_for_a_stopped_peer(ipv6_fleet, kafka_cluster, topic_name):
    """p2 stops (SIGTERM: it drains first): p1 owns every identity and also listens on p2's
    bootstrap port, so a client bootstrapping on p2's address still gets in."""
    ipv6_fleet.nodes["p2"].stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = ipv6_fleet.status("p1")
        if set(status.assignment.values()) == {"p1"} and "[::1]:15320" in status.standing_in:
            break
        time.sleep(0.1)
    assert set(status.assignment.values()) == {"p1"} and "[::1]:15320" in status.standing_in, status
    assert _metadata_brokers("[::1]:15320") == [(b, "::1", 15030 + b) for b in (1, 2, 3)]
