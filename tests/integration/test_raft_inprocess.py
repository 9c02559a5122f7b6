"""Member's Python interface, three members in this process on 127.0.0.21-23."""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from membership.config import MemberConfig, MemberSpec
from membership.heartbeat import Heartbeat
from membership.member import Member, MembershipError
from tests.integration.test_raft import free_port
from tests.waiting import wait_until
from topology import Broker, ProxyNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HOSTS = {"a": "127.0.0.21", "b": "127.0.0.22", "c": "127.0.0.23"}
BROKERS = [Broker(i, f"kafka{i}", 9092) for i in (1, 2, 3, 4)]





@pytest.fixture
def members():
    specs = [MemberSpec(ProxyNode(p, h, 9092), h, free_port(h)) for p, h in HOSTS.items()]
    out = {}
    for p in HOSTS:
        cfg = MemberConfig(node_id=p, members=specs, password="in-process-secret", rebalance_delay=0.3)
        out[p] = Member(cfg)
    try:
        for m in out.values():
            m.start()
        yield out
    finally:
        for m in out.values():
            m.stop()


def settled(members: dict[str, Member]) -> bool:
    effs = [m.effective_assignment() for m in members.values()]
    leaders = [m for m in members.values() if m.is_leader()]
    owners = effs[0][1]
    loads = sorted(list(owners.values()).count(p) for p in HOSTS)
    return (
        len(leaders) == 1
        and all(e == effs[0] for e in effs)
        and set(owners) == {1, 2, 3, 4}
        and loads == [1, 1, 2]
        and members["a"].committed_state().owner_map() == owners
    )


def test_interface(members):
    seen: list = []
    got = threading.Event()

    def on_change(snapshot):
        seen.append(snapshot)
        got.set()

    unsubscribe = members["a"].subscribe(on_change)
    assert got.wait(5), "subscribe calls back once at once"
    for m in members.values():
        m.set_brokers(BROKERS)
    wait_until("a settled, balanced table everywhere", lambda: settled(members), timeout=15)
    epoch, owners = members["a"].effective_assignment()
    assert epoch == members["a"].committed_state().epoch
    wait_until("the subscriber saw the settled table", lambda: seen[-1].owner_map() == owners)
    versions = [s.version for s in seen]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    # Addresses follow the owners: default port scheme bootstrap + 1 + broker id.
    addrs = members["a"].advertised_addresses()
    for b, p in owners.items():
        assert addrs[b] == (HOSTS[p], 9092 + 1 + b)

    st = members["b"].status().to_json()
    for key in ("node", "role", "term", "leader", "has_quorum", "epoch", "assignment", "peers", "members",
                "draining", "degraded", "effective"):
        assert key in st
    assert st["node"] == "b" and st["has_quorum"] and st["peers"]["a"]["live"]

    # drain from any member returns once the move is committed
    target = "c"
    epoch = members["a"].drain(target)
    state = members["a"].committed_state()
    assert state.epoch >= epoch and target in state.draining
    assert target not in state.owner_map().values()
    wait_until("every member moved off the drained node",
               lambda: all(target not in m.effective_assignment()[1].values() for m in members.values()))
    with pytest.raises(MembershipError):
        members["b"].drain("nobody")
    members["b"].undrain(target)
    wait_until("rebalanced after undrain", lambda: settled(members), timeout=10)
    unsubscribe()

    # A new upstream broker reported by every data path: committed and assigned.
    for m in members.values():
        m.set_brokers([*BROKERS, Broker(5, "kafka5", 9092)])
    wait_until("broker 5 committed and owned",
               lambda: all(5 in m.effective_assignment()[1] for m in members.values())
               and 5 in members["a"].committed_state().owner_map())


def test_stop_joins_threads_and_closes_sockets():
    host = "127.0.0.24"
    port = free_port(host)
    spec = MemberSpec(ProxyNode("solo", host, 9092), host, port)
    before = {t.ident for t in threading.enumerate()}
    m = Member(MemberConfig(node_id="solo", members=[spec], password="x"))
    m.start()
    m.set_brokers(BROKERS)
    wait_until("a single member leads itself and owns everything",
               lambda: m.is_leader() and set(m.effective_assignment()[1].values()) == {"solo"}
               and len(m.effective_assignment()[1]) == 4)
    m.stop()
    wait_until("threads gone", lambda: {t.ident for t in threading.enumerate()} <= before, timeout=5)
    # Raft (TCP) and heartbeat (UDP) ports are free again.
    tcp = socket.socket()
    tcp.bind((host, port))
    tcp.close()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, port))
    udp.close()


def test_start_fails_cleanly_when_the_raft_port_is_taken():
    host = "127.0.0.27"
    port = free_port(host)
    squatter = socket.socket()
    squatter.bind((host, port))
    squatter.listen(1)
    try:
        before = {t.ident for t in threading.enumerate()}
        m = Member(MemberConfig(node_id="x", members=[MemberSpec(ProxyNode("x", host, 9092), host, port)],
                                     password="pw"))
        with pytest.raises(OSError) as info:  # one line naming the listener and its address
            m.start()
        assert info.value.errno == errno.EADDRINUSE
        assert f"Raft listener (TCP) {host}:{port}" in str(info.value)
        wait_until("no thread left behind", lambda: {t.ident for t in threading.enumerate()} <= before, timeout=5)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((host, port))  # the heartbeat socket was closed
        udp.close()
    finally:
        squatter.close()


def test_heartbeat_sees_a_closed_port_at_once_and_silence_after_the_timeout():
    """The detector's two paths with real sockets: refusal (process death) and silence (freeze)."""
    ha, hb_host = "127.0.0.25", "127.0.0.26"
    pa, pb = free_port(ha), free_port(hb_host)
    a = Heartbeat("a", (ha, pa), {"b": (hb_host, pb)}, "pw", interval=0.05, suspect_timeout=0.5)
    b = Heartbeat("b", (hb_host, pb), {"a": (ha, pa)}, "pw", interval=0.05, suspect_timeout=0.5)
    a.open()
    b.open()
    try:
        def pump() -> None:
            now = time.monotonic()
            a.tick(now)
            b.tick(now)
            a.collect(time.monotonic())
            b.collect(time.monotonic())
            a.on_peer_event("b")

        wait_until("a hears b", lambda: (pump(), a.is_live("b", time.monotonic()))[1], timeout=3)
        b.close()  # b's process "dies": its port refuses
        t0 = time.monotonic()
        wait_until("a sees b refuse", lambda: (pump(), not a.is_live("b", time.monotonic()))[1], timeout=3)
        refused_s = time.monotonic() - t0
        assert refused_s < 0.3, refused_s  # far below the 0.5 s silence timeout
        # A stranger with the wrong password is not a peer.
        c = Heartbeat("b", (hb_host, pb), {"a": (ha, pa)}, "wrong", interval=0.05, suspect_timeout=0.5)
        c.open()
        try:
            for _ in range(5):
                c.tick(time.monotonic() + _)
            wait_until("a rejects the forged beats", lambda: (a.collect(time.monotonic()), a.rejected >= 1)[1], timeout=3)
            assert not a.is_live("b", time.monotonic())
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_probe_sees_a_closed_port_before_the_next_beat():
    """Heartbeat.probe: a refusal is recorded at once, whatever the beat interval."""
    ha, hb_host = "127.0.0.27", "127.0.0.28"
    pa, pb = free_port(ha), free_port(hb_host)
    a = Heartbeat("a", (ha, pa), {"b": (hb_host, pb)}, "pw", interval=10.0, suspect_timeout=30.0)
    b = Heartbeat("b", (hb_host, pb), {"a": (ha, pa)}, "pw", interval=10.0, suspect_timeout=30.0)
    a.open()
    b.open()
    try:
        def pump() -> None:  # one beat each, then the off-beat answers of two-way liveness
            now = time.monotonic()
            a.tick(now)
            b.tick(now)
            a.collect(time.monotonic())
            b.collect(time.monotonic())

        wait_until("a hears b", lambda: (pump(), a.is_live("b", time.monotonic()))[1], timeout=3)
        assert a.next_expiry(time.monotonic()) > time.monotonic() + 29  # b's last datagram + suspect_timeout
        b.close()
        a.probe("b", time.monotonic())
        wait_until("a sees b refuse", lambda: (a.on_peer_event("b"), not a.is_live("b", time.monotonic()))[1],
                   timeout=1)
        assert a.next_expiry(time.monotonic()) == float("inf")  # no live peer left to go stale
    finally:
        a.close()
        b.close()


_MEMBER_PROCESS = """
import json, sys, time
from membership.config import MemberConfig
from membership.member import Member
Member(MemberConfig.from_dict(json.loads(sys.argv[1]))).start()
print("started", flush=True)
time.sleep(60)
"""


def test_a_killed_member_is_seen_before_the_next_beat():
    """SIGKILL: its Raft connections reset, the survivors probe its heartbeat port and
    see it refuse within milliseconds, not at the next beat (every 2 s here) nor after
    the silence timeout (6 s). Elections wait for a beat that is overdue, so they are slower too."""
    hosts = {"a": "127.0.0.21", "b": "127.0.0.22", "c": "127.0.0.23"}
    specs = [MemberSpec(ProxyNode(p, h, 9092), h, free_port(h)) for p, h in hosts.items()]
    configs = {p: MemberConfig(node_id=p, members=specs, password="in-process-secret", heartbeat_interval=2.0,
                               suspect_timeout=6.0, raft_min_timeout=2.0, raft_max_timeout=2.5, quorum_lease=5.0,
                               connection_timeout=2.5) for p in hosts}
    members = {p: Member(configs[p]) for p in ("a", "b")}
    child = subprocess.Popen([sys.executable, "-c", _MEMBER_PROCESS, json.dumps(configs["c"].to_dict())],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "started"
        for m in members.values():
            m.start()
        c_raft = specs[2].raft_address

        def sees_c(node: str) -> bool:
            m = members[node]
            return ("c", True) in {(p, s.live) for p, s in m.status().peers} and c_raft in m.raft_peers_connected()

        wait_until("a and b hear c and hold a Raft link to it", lambda: sees_c("a") and sees_c("b"), timeout=15)
        child.kill()
        t0 = time.monotonic()
        wait_until("a and b see c gone", lambda: not sees_c("a") and not sees_c("b"), timeout=3)
        assert time.monotonic() - t0 < 0.3
    finally:
        child.kill()
        child.wait(10)
        for m in members.values():
            m.stop()
