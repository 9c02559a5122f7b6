"""The emulated hosts' plan and shell (chaos.testbed.hosts) without root: names, addresses, the
``ip`` commands, the refusal of addresses not on links the launcher made, and what ``create``
does when the range is taken or a step fails (a fake ``ip``)."""

from __future__ import annotations

import json
import subprocess

import pytest

from chaos.testbed.hosts import HostNet, HostPlan, HostsError, plan_hosts, tag_for

pytestmark = pytest.mark.unit


def test_plan_gives_each_host_a_namespace_a_veth_and_an_address_of_the_test_range():
    plan = plan_hosts("kpabcde", ["p1", "p2", "p3"])
    assert plan.bridge == "kpabcde-br" and plan.bridge_address == "198.18.0.1"
    assert [(h.name, h.namespace, h.address) for h in plan.hosts] == [
        ("kafka", "kpabcde-kafka", "198.18.0.2"), ("clients", "kpabcde-clients", "198.18.0.3"),
        ("p1", "kpabcde-p1", "198.18.0.111"), ("p2", "kpabcde-p2", "198.18.0.112"),
        ("p3", "kpabcde-p3", "198.18.0.113")]
    # Each node advertises a floating address of its own, apart from its host's.
    assert [h.floating for h in plan.hosts] == [None, None, "198.18.0.11", "198.18.0.12", "198.18.0.13"]
    assert plan.exec_prefix("p2") == ("ip", "netns", "exec", "kpabcde-p2")
    assert HostPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_tag_is_short_stable_and_per_state_dir(tmp_path):
    a, b = tag_for(tmp_path / "a"), tag_for(tmp_path / "b")
    assert a == tag_for(tmp_path / "a") and a != b
    assert len(a) == 7 and a.startswith("kp")


def test_plan_refuses_names_too_long_for_a_link_and_no_nodes():
    with pytest.raises(HostsError, match="longer than 15"):
        plan_hosts("kpabcde", ["a-very-long-node"])
    with pytest.raises(HostsError, match="no proxy nodes"):
        plan_hosts("kpabcde", [])


def test_only_addresses_on_the_plans_links_are_accepted():
    plan = plan_hosts("kpabcde", ["p1"])
    assert plan.require_owned("198.18.0.11:9092") == "198.18.0.11:9092"
    assert plan.require_owned("198.18.0.2") == "198.18.0.2"
    assert plan.require_owned("198.18.0.111") == "198.18.0.111"  # p1's host's own
    for outside in ("198.18.0.12:9092", "127.0.0.1:19092", "198.18.1.11:9092", "10.0.0.1"):
        with pytest.raises(HostsError, match="not an address on a link the launcher created"):
            plan.require_owned(outside)


def test_setup_brings_up_lo_and_addresses_each_namespace_teardown_deletes_every_link():
    plan = plan_hosts("kpabcde", ["p1"])
    setup = [" ".join(c) for c in plan.setup_commands()]
    assert setup[:3] == ["ip link add kpabcde-br type bridge", "ip addr add 198.18.0.1/24 dev kpabcde-br",
                         "ip link set kpabcde-br up"]
    assert "ip -n kpabcde-p1 link set lo up" in setup
    assert "ip link add kpabcde-p1 type veth peer name eth0 netns kpabcde-p1" in setup
    assert "ip -n kpabcde-p1 addr add 198.18.0.111/24 dev eth0" in setup
    # A node binds its floating address before it holds it (the address moves later).
    assert ("ip netns exec kpabcde-p1 sysctl -qw net.ipv4.ip_nonlocal_bind=1 net.ipv4.conf.all.arp_announce=2"
            in setup)
    assert "ip netns exec kpabcde-kafka sysctl -qw net.ipv4.ip_nonlocal_bind=1" not in setup
    assert "ip link set kpabcde-p1 master kpabcde-br" in setup
    teardown = [" ".join(c) for c in plan.teardown_commands()]
    assert teardown == ["ip link delete kpabcde-kafka", "ip link delete kpabcde-clients", "ip link delete kpabcde-p1",
                        "ip netns delete kpabcde-kafka", "ip netns delete kpabcde-clients",
                        "ip netns delete kpabcde-p1", "ip link delete kpabcde-br"]


class FakeIp:
    """``ip`` over an in-memory set of namespaces, links and addresses; ``fail_on`` makes one
    command fail."""

    def __init__(self, addresses: dict[str, list[str]] | None = None, fail_on: str | None = None) -> None:
        self.namespaces: set[str] = set()
        self.addresses = addresses or {"lo": ["127.0.0.1"]}
        self.fail_on = fail_on
        self.commands: list[str] = []

    def __call__(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        line = " ".join(cmd)
        self.commands.append(line)
        if line == "ip -j addr show":
            out = [{"ifname": n, "addr_info": [{"family": "inet", "local": a} for a in addrs]}
                   for n, addrs in self.addresses.items()]
            return subprocess.CompletedProcess(cmd, 0, json.dumps(out), "")
        if line == "ip -j link show":
            return subprocess.CompletedProcess(cmd, 0, json.dumps([{"ifname": n} for n in self.addresses]), "")
        if line == "ip -j netns list":
            return subprocess.CompletedProcess(cmd, 0, json.dumps([{"name": n} for n in self.namespaces]), "")
        if self.fail_on and self.fail_on in line:
            return subprocess.CompletedProcess(cmd, 2, "", "RTNETLINK answers: Operation not permitted")
        match cmd[1:]:
            case ["netns", "add", name]:
                self.namespaces.add(name)
            case ["netns", "delete", name]:
                self.namespaces.discard(name)
            case ["link", "add", name, *_]:
                self.addresses[name] = []
            case ["addr", "add", cidr, "dev", name]:
                self.addresses[name].append(cidr.split("/")[0])
            case ["link", "delete", name]:
                self.addresses.pop(name, None)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_create_refuses_when_an_address_of_the_range_is_already_on_a_link():
    ip = FakeIp({"lo": ["127.0.0.1"], "br-other": ["198.18.0.1"]})
    with pytest.raises(HostsError, match=r"already in use \(br-other 198.18.0.1\)"):
        HostNet(plan_hosts("kpabcde", ["p1"]), run=ip).create()
    assert not any(" add " in c for c in ip.commands)  # nothing made


def test_create_rolls_back_everything_when_a_step_fails():
    ip = FakeIp(fail_on="addr add 198.18.0.111/24")
    net = HostNet(plan_hosts("kpabcde", ["p1"]), run=ip, sleep=lambda s: None)
    with pytest.raises(HostsError, match="Operation not permitted"):
        net.create()
    assert ip.namespaces == set() and set(ip.addresses) == {"lo"}
    assert net.leftovers() == []


def test_create_then_remove_leaves_nothing():
    ip = FakeIp()
    net = HostNet(plan_hosts("kpabcde", ["p1", "p2"]), run=ip, sleep=lambda s: None).create()
    assert ip.namespaces == {"kpabcde-kafka", "kpabcde-clients", "kpabcde-p1", "kpabcde-p2"}
    assert ip.addresses["kpabcde-br"] == ["198.18.0.1"]
    assert net.remove() == []
    assert ip.namespaces == set() and set(ip.addresses) == {"lo"}


def test_fleet_refuses_an_outside_kafka_on_emulated_hosts(tmp_path):
    from chaos.testbed.fleet import LocalFleet

    with pytest.raises(HostsError, match="refusing 127.0.0.1:19092"):
        LocalFleet.up(tmp_path / "fleet", kafka_bootstrap="127.0.0.1:19092", proxies=1, hosts="netns")
