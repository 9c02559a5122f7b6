"""A node's advertised host apart from its bind address, and nodes sharing one address (::1).

What clients and peers are told comes from ``nodes[].advertised_host`` (default ``host``);
what the node binds is ``host``. Each test writes the expected addresses by hand."""

from __future__ import annotations

from typing import Any

import pytest

from membership.serving import BOOTSTRAP, StandIn, addresses_for, stand_in_duties, standalone_map
from proxy.config import ConfigError, parse, proxy_node, proxy_nodes
from proxy.hosts import source_address
from proxy.member_link import member_config

pytestmark = pytest.mark.unit


def _raw(*nodes: dict[str, Any], base: int | None = 9100, fleet: bool = False) -> dict[str, Any]:
    raw: dict[str, Any] = {"upstream": {"bootstrap": ["127.0.0.1:19092"]}, "nodes": list(nodes)}
    if base is not None:
        raw["ports"] = {"base": base}
    if fleet:
        raw["fleet"] = {"password": "pw"}
    return raw


def test_advertised_host_is_what_the_node_table_carries_and_host_is_what_it_binds():
    config = parse(_raw({"id": "p1", "host": "0.0.0.0", "advertised_host": "proxy-1.example", "bootstrap_port": 9092}))
    assert config.node("p1").host == "0.0.0.0"
    assert config.node("p1").advertised == "proxy-1.example"
    node = proxy_node(config, "p1")
    assert (node.host, node.address_for(2)) == ("proxy-1.example", ("proxy-1.example", 9102))
    serving = standalone_map(node, [1, 2])
    assert serving.address_map() == {1: ("proxy-1.example", 9101), 2: ("proxy-1.example", 9102)}


def test_without_advertised_host_the_host_is_advertised_as_before():
    config = parse(_raw({"id": "p1", "host": "127.0.0.121", "bootstrap_port": 9092}))
    assert config.node("p1").advertised == "127.0.0.121"
    assert proxy_node(config, "p1").address_for(1) == ("127.0.0.121", 9101)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_host_needs_an_advertised_host(host):
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": host, "bootstrap_port": 9092}))
    assert err.value.field == "nodes[0].advertised_host"
    assert "required" in str(err.value)


def test_a_wildcard_cannot_be_advertised():
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": "127.0.0.121", "advertised_host": "0.0.0.0", "bootstrap_port": 9092}))
    assert err.value.field == "nodes[0].advertised_host"


def test_a_bad_advertised_ip_is_named():
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": "127.0.0.121", "advertised_host": "127.0.0.300", "bootstrap_port": 9092}))
    assert err.value.field == "nodes[0].advertised_host"


def test_nodes_on_one_ipv6_address_differ_by_port_base():
    config = parse(_raw(
        {"id": "p1", "host": "::1", "bootstrap_port": 25192, "port_base": 25200},
        {"id": "p2", "host": "::1", "bootstrap_port": 25193, "port_base": 25500},
        base=None))
    nodes = {n.id: n for n in proxy_nodes(config)}
    assert nodes["p1"].address_for(3) == ("::1", 25203)
    assert nodes["p2"].address_for(3) == ("::1", 25503)
    entries, error = addresses_for({1: "p1", 2: "p2"}, nodes.values(), [1, 2, 3])
    assert error is None
    assert dict(entries) == {1: ("::1", 25201), 2: ("::1", 25502)}


def test_nodes_on_one_address_with_overlapping_ports_are_refused():
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": "::1", "bootstrap_port": 25192, "port_base": 25200},
                   {"id": "p2", "host": "::1", "bootstrap_port": 25193, "port_base": 25300}, base=None))
    assert err.value.field == "nodes[1]" and "::1 port 25300" in str(err.value)


def test_a_shared_ports_base_on_one_address_is_refused():
    """Both nodes on 127.0.0.121 with the fleet's one base would bind the same broker ports."""
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": "127.0.0.121", "bootstrap_port": 9092},
                   {"id": "p2", "host": "127.0.0.121", "bootstrap_port": 9093}))
    assert "both use 127.0.0.121 port" in str(err.value)


def test_a_node_base_whose_window_leaves_the_port_range_is_refused():
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": "::1", "bootstrap_port": 25192, "port_base": 65400}, base=None))
    assert err.value.field == "nodes[0].port_base"


def test_without_any_port_base_the_ports_section_is_still_required():
    with pytest.raises(ConfigError) as err:
        parse(_raw({"id": "p1", "host": "::1", "bootstrap_port": 25192}, base=None))
    assert err.value.field == "ports"


def test_raft_peers_dial_the_advertised_host_and_the_member_binds_its_own():
    config = parse(_raw(
        {"id": "p1", "host": "0.0.0.0", "advertised_host": "127.0.0.122", "bootstrap_port": 9092, "raft_port": 9500},
        {"id": "p2", "host": "127.0.0.123", "bootstrap_port": 9092, "raft_port": 9500}, fleet=True))
    members = {m.id: m for m in member_config(config, "p1").members}
    assert members["p1"].raft_address == "127.0.0.122:9500"
    assert members["p1"].raft_bind_address == "0.0.0.0:9500"
    assert members["p1"].heartbeat_bind == ("0.0.0.0", 9500)
    assert members["p1"].origin_ip is None  # a wildcard bind: the kernel picks its datagrams' source
    assert (members["p2"].raft_bind_address, members["p2"].origin_ip) == ("127.0.0.123:9500", "127.0.0.123")


def test_raft_on_ipv6():
    config = parse(_raw({"id": "p1", "host": "::1", "bootstrap_port": 25192, "port_base": 25200, "raft_port": 25194},
                        {"id": "p2", "host": "::1", "bootstrap_port": 25195, "port_base": 25500, "raft_port": 25196},
                        base=None, fleet=True))
    members = {m.id: m for m in member_config(config, "p2").members}
    assert members["p2"].raft_address == "::1:25196"  # pysyncobj splits at the last colon
    assert members["p1"].origin_ip == "::1"


def test_a_stand_in_binds_the_vacant_nodes_advertised_address():
    """p1 binds every address and is reached at 127.0.0.122: p2 stands in on that, the address p1's clients kept."""
    config = parse(_raw(
        {"id": "p1", "host": "0.0.0.0", "advertised_host": "127.0.0.122", "bootstrap_port": 25120,
         "port_base": 25130, "raft_port": 25121},
        {"id": "p2", "host": "127.0.0.123", "bootstrap_port": 25120, "port_base": 25430, "raft_port": 25121},
        base=None, fleet=True))
    duties = stand_in_duties({1: "p2"}, proxy_nodes(config), {"p1"})
    assert duties == (StandIn("p2", "p1", BOOTSTRAP, "127.0.0.122", 25120),
                      StandIn("p2", "p1", 1, "127.0.0.122", 25131))


@pytest.mark.parametrize(("bind", "remote", "source"), [
    ("127.0.0.121", "127.0.0.1", ("127.0.0.121", 0)),   # one IP of the broker's family: leave from it
    ("127.0.0.121", "broker-1.example", ("127.0.0.121", 0)),
    ("0.0.0.0", "127.0.0.1", None),                     # a wildcard: the kernel picks
    ("::1", "127.0.0.1", None),                         # an IPv6 node in front of IPv4 brokers
    ("::1", "::1", ("::1", 0)),
    ("::1", "broker-1.example", None),
    ("proxy-1.example", "127.0.0.1", None),             # a name: not pinned
])
def test_the_upstream_source_address(bind, remote, source):
    assert source_address(bind, remote) == source


def test_a_wildcard_bound_peers_heartbeats_are_taken_from_any_source_and_a_bound_ones_only_from_its_ip():
    from membership.heartbeat import Heartbeat, encode, heartbeat_key

    hb = Heartbeat("p2", ("127.0.0.123", 9500), {"p1": ("127.0.0.122", 9500), "p3": ("127.0.0.124", 9500)}, "pw",
                   interval=0.25, suspect_timeout=1.0, clock=lambda: 0.0, origins={"p1": None, "p3": "127.0.0.124"})
    key = heartbeat_key("pw")
    hb.receive(encode(key, "p1", b"i" * 8, 1), "127.0.0.1", now=1.0)   # p1 binds 0.0.0.0: the kernel's source
    hb.receive(encode(key, "p3", b"i" * 8, 1), "127.0.0.1", now=1.0)   # p3 binds .124: not from elsewhere
    assert (hb.has_heard("p1"), hb.has_heard("p3"), hb.rejected) == (True, False, 1)
    hb.receive(encode(key, "p3", b"i" * 8, 2), "127.0.0.124", now=1.0)
    assert hb.has_heard("p3")


def test_nodes_on_different_hosts_may_bind_the_same_wildcard_or_private_address():
    """Containers on three hosts: each binds 0.0.0.0 (or the same bridge address) with the same ports."""
    config = parse(_raw(
        {"id": "p1", "host": "0.0.0.0", "advertised_host": "203.0.113.11", "bootstrap_port": 9092, "raft_port": 9500},
        {"id": "p2", "host": "0.0.0.0", "advertised_host": "203.0.113.12", "bootstrap_port": 9092, "raft_port": 9500},
        {"id": "p3", "host": "172.17.0.2", "advertised_host": "proxy-3.example", "bootstrap_port": 9092,
         "raft_port": 9500}, fleet=True))
    assert [n.address_for(1) for n in proxy_nodes(config)] == [
        ("203.0.113.11", 9101), ("203.0.113.12", 9101), ("proxy-3.example", 9101)]
