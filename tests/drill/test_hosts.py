"""Emulated hosts (`kproxy fleet up --hosts netns`): each proxy node, the broker and the clients in
a network namespace of their own on one bridge; records flow from the clients' host through the
fleet; `fleet down` leaves no namespace, link or address behind.

Cost: a fleet of its own (one broker, two proxies: about 30-40 s to start on a 2-core machine)
and one short drill; skipped, with the reason, where namespaces cannot be made (no root)."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys

import pytest

from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
from chaos.testbed.hosts import SUBNET, unavailable_reason

pytestmark = [pytest.mark.drill, pytest.mark.slow]

PRODUCE_CONSUME = """
import sys
from chaos.clients.batch import produce, consume
acks = produce("confluent", sys.argv[1], "hosts", 40, 5)
got = consume("aiokafka", sys.argv[1], "hosts", "hosts-g", 40, timeout=60)
print(len(acks), len({c.value for c in got}))
"""


def _ip_json(*args: str) -> list[dict]:
    return json.loads(subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout or "[]")


def _left_behind(tag: str) -> list[str]:
    """Every namespace and link named for the fleet, and every address of the test range."""
    left = [f"netns {n['name']}" for n in _ip_json("netns", "list") if n["name"].startswith(tag)]
    left += [f"link {link['ifname']}" for link in _ip_json("link", "show") if link["ifname"].startswith(tag)]
    left += [f"address {a['local']} on {link['ifname']}" for link in _ip_json("addr", "show")
             for a in link.get("addr_info", [])
             if a.get("family") == "inet" and ipaddress.ip_address(a["local"]) in SUBNET]
    return left


def test_netns_fleet_carries_records_from_the_clients_host_and_leaves_nothing(tmp_path):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated hosts need network namespaces: {reason}")
    from click.testing import CliRunner

    from chaos.testbed.fleet import LocalFleet
    from cli.main import cli

    state = tmp_path / "fleet"
    up = CliRunner().invoke(cli, ["fleet", "up", "--hosts", "netns", "--brokers", "1", "--proxies", "2",
                                  "--state-dir", str(state), "--json"])
    fleet = LocalFleet.load(state) if (state / "fleet.json").exists() else None
    tag = fleet.hosts.tag if fleet is not None and fleet.hosts is not None else None
    try:
        assert up.exit_code == 0, up.output
        assert fleet is not None and fleet.hosts is not None and tag is not None
        assert json.loads(up.stdout)["bootstrap"] == ["198.18.0.11:9092", "198.18.0.12:9092"]
        assert fleet.kafka is not None and fleet.kafka.bootstrap == ["198.18.0.2:19092"]
        fleet.kafka.create_topic("hosts", partitions=2, replication=1)
        # From the clients' own host, through the fleet: 40 records acknowledged and read back.
        proc = subprocess.run([*fleet.client_exec, sys.executable, "-c", PRODUCE_CONSUME, fleet.bootstrap_servers],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.split() == ["40", "40"], proc.stdout + proc.stderr[-3000:]
        # A drill's workloads run on the clients' host too, and its final read finds every acked record.
        config = DrillConfig(fault="none", out_dir=tmp_path / "drill", clients=parse_clients("aiokafka"), rate=50,
                             seed=4100, partitions=2, replication=1)
        result = run_drill(config, Target.of_fleet(fleet))
        context = json.dumps({k: result.get(k) for k in ("errors", "records", "final_read", "lost")}, default=str)
        assert result["passed"] is True and result["lost"] == 0, context
        assert result["records"]["acked"] > 0 and result["final_read"]["via"] == "fleet", context
        manifest = json.loads((tmp_path / "drill" / result["run_id"] / "drill.json").read_text())
        assert manifest["bootstrap"] == ["198.18.0.11:9092", "198.18.0.12:9092"]
        assert manifest["client_exec"] == ["ip", "netns", "exec", f"{tag}-clients"]
    finally:
        down = CliRunner().invoke(cli, ["fleet", "down", "--state-dir", str(state)])
    assert down.exit_code == 0, down.output
    assert _left_behind(tag) == []


LISTEN_ONCE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000))
s.listen()
print("listening", flush=True)
c, _ = s.accept()
c.sendall(sys.argv[2].encode())
c.close()
"""
ASK = """
import socket, sys
with socket.create_connection((sys.argv[1], 7000), timeout=3) as s:
    print(s.recv(16).decode())
"""
TAKE = """
import sys
from proxy.addresses.config import parse_mover_config
from proxy.addresses.movers import build_mover
from proxy.addresses.plan import FloatingAddress
build_mover(parse_mover_config({"mover": "netns"})).take(FloatingAddress.parse(sys.argv[1], "p1"))
"""
# Release twice (the second finds it gone: done), then what the link holds, by netlink.
RELEASE_TWICE = """
import sys
from proxy.addresses.config import parse_mover_config
from proxy.addresses.movers import build_mover, read_link_addresses
from proxy.addresses.plan import FloatingAddress
mover = build_mover(parse_mover_config({"mover": "netns"}))
before = sorted(str(a.ip) + ("/secondary" if a.secondary else "") for a in read_link_addresses("eth0"))
for _ in range(2):
    mover.release(FloatingAddress.parse(sys.argv[1], "p1"))
print(" ".join(before), "|", " ".join(sorted(str(a.ip) for a in read_link_addresses("eth0"))))
"""


def _answer(net_prefix: tuple[str, ...], listen_on: str, name: str, ask: str, client: tuple[str, ...]) -> str:
    """Who answers ``ask``:7000 from the clients' host while ``name`` listens on ``listen_on``."""
    server = subprocess.Popen([*net_prefix, sys.executable, "-c", LISTEN_ONCE, listen_on, name],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        proc = subprocess.run([*client, sys.executable, "-c", ASK, ask], capture_output=True, text=True, timeout=20)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()
    finally:
        server.kill()
        server.wait(5)


def test_netns_mover_moves_a_dead_hosts_address_to_a_survivor(tmp_path):
    """p1's host goes dark (its link down); p2 takes 198.18.0.11, p1's floating address, with the netns mover (ip addr +
    raw gratuitous ARP); the clients' host, whose ARP cache still named p1, reaches p2 there at once."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated hosts need network namespaces: {reason}")
    from chaos.testbed.hosts import HostNet, plan_hosts, tag_for

    plan = plan_hosts(tag_for(tmp_path), ["p1", "p2"])
    net = HostNet(plan).create()
    try:
        p1, p2, clients = (plan.exec_prefix(n) for n in ("p1", "p2", "clients"))
        take = subprocess.run([*p1, sys.executable, "-c", TAKE, "198.18.0.11/24"], capture_output=True, text=True,
                              timeout=30)  # p1's floating address, on p1's host first
        assert take.returncode == 0, take.stderr[-2000:]
        assert _answer(p1, "198.18.0.11", "p1", "198.18.0.11", clients) == "p1"  # the clients' ARP cache: p1
        subprocess.run([*p1, "ip", "link", "set", "eth0", "down"], check=True)
        take = subprocess.run([*p2, sys.executable, "-c", TAKE, "198.18.0.11/24"], capture_output=True, text=True,
                              timeout=30)
        assert take.returncode == 0, take.stderr[-2000:]
        assert _answer(p2, "198.18.0.11", "p2", "198.18.0.11", clients) == "p2"
        gone = subprocess.run([*p2, sys.executable, "-c", RELEASE_TWICE, "198.18.0.11/24"], capture_output=True,
                              text=True, timeout=30)
        assert gone.returncode == 0, gone.stderr[-2000:]
        held_before, held_after = (part.split() for part in gone.stdout.strip().split("|"))
        assert "198.18.0.11/secondary" in held_before and "198.18.0.11" not in held_after, gone.stdout
        assert held_after and all(a in [h.split("/")[0] for h in held_before] for a in held_after), gone.stdout
    finally:
        left = net.remove()
    assert left == []


# In one host: the mover's netlink socket is opened once and kept; a link made again (a new index)
# and a socket that broke under it are both handled on the next request.
KEPT_SOCKET = """
import ipaddress, json, subprocess
from proxy.addresses.movers import _netlink, read_link_addresses, set_address
from proxy.addresses.plan import SetAddress

def make():
    subprocess.run(["ip", "link", "add", "kpx0", "type", "veth", "peer", "name", "kpx1"], check=True)
    subprocess.run(["ip", "link", "set", "kpx0", "up"], check=True)

def held():
    return sorted(str(a.ip) for a in read_link_addresses("kpx0"))

ip = ipaddress.IPv4Address("198.18.0.200")
out = {}
make()
set_address(SetAddress("kpx0", ip, 24, True))
kept = _netlink._ipr
out["first"] = held()
subprocess.run(["ip", "link", "del", "kpx0"], check=True)
make()
out["remade"] = held()
set_address(SetAddress("kpx0", ip, 24, True))
out["again"] = held()
out["same_socket"] = _netlink._ipr is kept
_netlink._ipr.close()  # broken under it: the next request opens a new one
set_address(SetAddress("kpx0", ip, 24, False))
out["deleted"] = held()
out["new_socket"] = _netlink._ipr is not None and _netlink._ipr is not kept
print(json.dumps(out))
"""


def test_netns_mover_keeps_one_netlink_socket_across_link_changes(tmp_path):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated hosts need network namespaces: {reason}")
    from chaos.testbed.hosts import HostNet, plan_hosts, tag_for

    plan = plan_hosts(tag_for(tmp_path), ["p1"])
    net = HostNet(plan).create()
    try:
        run = subprocess.run([*plan.exec_prefix("p1"), sys.executable, "-c", KEPT_SOCKET], capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        assert out == {"first": ["198.18.0.200"], "remade": [], "again": ["198.18.0.200"], "same_socket": True,
                       "deleted": [], "new_socket": True}, out
    finally:
        left = net.remove()
    assert left == []
