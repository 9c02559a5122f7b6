"""Every pysyncobj private access of ``RaftReplica`` against a real in-process SyncObj.

The accessors read name-mangled internals of pysyncobj ``PINNED_PYSYNCOBJ``;
the first test fails on any other version so that an upgrade forces a re-check
of all of them (run this file against the new version, then move the pin).
Hosts 127.0.0.41-47, free ports.
"""

from __future__ import annotations

import inspect
import re
import socket
import threading
from pathlib import Path

import pysyncobj
import pysyncobj.tcp_connection as tcp_connection
import pytest
from pysyncobj.version import VERSION

from membership.commands import Drain, SetBrokers
from membership.config import MemberConfig, MemberSpec
from membership.raft import BACKSTOP_SPREAD, MIN_WAIT_S, PINNED_PYSYNCOBJ, RaftReplica, bind_outgoing
from tests.integration.test_raft import free_port
from tests.integration.test_raft_inprocess import wait_until
from topology import Broker, ProxyNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


def test_pysyncobj_is_the_pinned_version():
    pinned = re.search(r"^pysyncobj==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None, "constraints.txt pins pysyncobj"
    assert VERSION == pinned.group(1) == PINNED_PYSYNCOBJ, (
        f"pysyncobj {VERSION} installed, {pinned.group(1)} pinned, accessors written for {PINNED_PYSYNCOBJ}: "
        "re-check every private access in membership/raft.py"
    )
    assert pysyncobj.SyncObj is not None


def election_wait(config: MemberConfig) -> float:
    """How long bare replicas (no Member hastening them) may take to elect a leader: pysyncobj's
    own timer, the backstop, draws 3-4.5 s, and a split vote costs another draw; three draws
    (the 10 s default failed once in CI with a wrong-password third member beside the pair)."""
    return 3 * config.raft_backstop_timeout * BACKSTOP_SPREAD


def _destroy(raft: RaftReplica) -> None:
    """destroy() is asynchronous: the tick thread closes the sockets. Wait for it, or a
    socket of a later test may get a file descriptor number it is about to close."""
    raft.destroy()
    wait_until("the tick thread ended", lambda: not raft.tick_thread_alive(), timeout=5)


def _configs(hosts: dict[str, str]) -> dict[str, MemberConfig]:
    specs = [MemberSpec(ProxyNode(p, h, 9092), h, free_port(h)) for p, h in hosts.items()]
    return {p: MemberConfig(node_id=p, members=specs, password="private-accessors") for p in hosts}


@pytest.fixture
def pair():
    """Two members of a two-member group, both running: one leads."""
    configs = _configs({"a": "127.0.0.44", "b": "127.0.0.45"})
    rafts = {p: RaftReplica(c) for p, c in configs.items()}
    try:
        for r in rafts.values():
            r.waitBinded()
        yield configs, rafts
    finally:
        for r in rafts.values():
            _destroy(r)


def test_role_leader_address_and_links_kept_open(pair):
    configs, rafts = pair
    wait_until("one leader", lambda: sorted(r.role() for r in rafts.values()) == ["follower", "leader"],
               timeout=election_wait(configs["a"]))
    leader = next(p for p, r in rafts.items() if r.role() == "leader")
    follower = next(p for p in rafts if p != leader)
    address = configs[leader].me.raft_address
    wait_until("the follower knows the leader", lambda: rafts[follower].leader_address() == address)
    assert rafts[leader].leader_address() == address
    follower_address = configs[follower].me.raft_address
    wait_until("both links up", lambda: rafts[leader].keep_links_open([follower_address]) == 1
               and rafts[follower].keep_links_open([address]) == 1)
    assert rafts[leader].keep_links_open(["127.0.0.1:1"]) == 0  # not a peer
    # The group keeps its leader and still commits.
    done = threading.Event()
    rafts[follower].submit(Drain("x"),
                           lambda _result, _err: done.set())
    assert done.wait(5)
    assert rafts[leader].role() == "leader"


def test_link_lost_reports_the_peer_address(pair):
    configs, rafts = pair
    lost: list[str] = []
    rafts["a"].on_link_lost(lost.append)
    wait_until("a is connected to b", lambda: rafts["a"].keep_links_open([configs["b"].me.raft_address]) == 1)
    _destroy(rafts["b"])
    wait_until("a saw the link to b drop", lambda: configs["b"].me.raft_address in lost)


def test_hasten_election_moves_the_deadline_earlier_only():
    """Three members; the leader goes away; hastening moves one follower's election deadline to
    now (a later one is ignored), and the two elect a leader. Which of them wins is not checked:
    a bare replica ticks only every autotick_period (0.25 s), so the other's own 0.3-0.6 s
    timeout (the backstop, 3-4.5 s) can come first on a very loaded machine (a Member hastens on its tick thread, and its
    wait ends at the new deadline)."""
    configs = _configs({"a": "127.0.0.41", "b": "127.0.0.42", "c": "127.0.0.43"})
    rafts = {p: RaftReplica(c) for p, c in configs.items()}
    try:
        for r in rafts.values():
            r.waitBinded()
        wait_until("one leader", lambda: sorted(r.role() for r in rafts.values()) == ["follower", "follower", "leader"],
                   timeout=election_wait(configs["a"]))
        leader = next(p for p, r in rafts.items() if r.role() == "leader")
        eager, other = sorted(p for p in rafts if p != leader)
        rafts[eager].hasten_election(1000.0)  # later than the current deadline: no effect
        remaining = rafts[eager].election_deadline_in()
        # pysyncobj's own timer is the backstop (membership.election): up to 1.5 times it.
        assert remaining is not None and remaining < 1.5 * configs[eager].raft_backstop_timeout + 0.1
        _destroy(rafts.pop(leader))
        natural = rafts[eager].election_deadline_in()
        rafts[eager].hasten_election(0.0)
        hastened = rafts[eager].election_deadline_in()
        # Due now (MIN_WAIT_S ahead, so that the tick thread's wait ends at it), unless the tick
        # thread already acted on it (then it stands for election or leads).
        assert (hastened is not None and hastened <= MIN_WAIT_S) or rafts[eager].role() != "follower", (natural, hastened)
        wait_until("a new leader", lambda: sorted(r.role() for r in rafts.values()) == ["follower", "leader"],
                   timeout=election_wait(configs["a"]))
        new_leader = next(p for p, r in rafts.items() if r.role() == "leader")
        follower = other if new_leader == eager else eager
        wait_until("the other follows it",
                   lambda: rafts[follower].leader_address() == configs[new_leader].me.raft_address, timeout=5)
    finally:
        for r in rafts.values():
            _destroy(r)


def test_subscribe_fd_runs_the_callback_on_readable():
    configs = _configs({"a": "127.0.0.46"})
    raft = RaftReplica(configs["a"])
    recv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        raft.waitBinded()
        recv.bind(("127.0.0.46", 0))
        recv.setblocking(False)
        got: list[bytes] = []

        def on_event(_fd: int, _event: int) -> None:
            try:
                got.append(recv.recv(64))
            except BlockingIOError:
                pass

        raft.subscribe_fd(recv.fileno(), on_event)
        send.sendto(b"ping", recv.getsockname())
        wait_until("the poller saw the datagram", lambda: got == [b"ping"], timeout=3)
    finally:
        _destroy(raft)
        recv.close()
        send.close()


def test_bind_outgoing_binds_pysyncobj_tcp_sockets(monkeypatch):
    assert "socket.socket(" in inspect.getsource(tcp_connection), "pysyncobj creates sockets through socket.socket"
    monkeypatch.setattr(tcp_connection, "socket", tcp_connection.socket)  # restored after the test
    bind_outgoing("127.0.0.47")
    s = tcp_connection.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        assert s.getsockname()[0] == "127.0.0.47"
    finally:
        s.close()
    u = tcp_connection.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        assert u.getsockname() == ("0.0.0.0", 0)  # only TCP is bound
    finally:
        u.close()


def test_a_peer_that_joins_late_is_caught_up_at_once_not_at_the_idle_period():
    # The leader's idle append_entries period is set to 30 s here: without catch_up_at_once a
    # member started after a commit would learn it only at the leader's next period (its link
    # coming up and its refusal of entries that do not follow its empty log each waited one).
    configs = _configs({"a": "127.0.0.46", "b": "127.0.0.47", "c": "127.0.0.48"})
    rafts = {p: RaftReplica(configs[p]) for p in ("a", "b")}
    late: RaftReplica | None = None
    try:
        for r in rafts.values():
            r.catch_up_at_once()
            r.waitBinded()
        wait_until("a leader of two", lambda: "leader" in {r.role() for r in rafts.values()},
                   timeout=election_wait(configs["a"]))
        for r in rafts.values():
            r.set_append_entries_period(30.0)
        done = threading.Event()
        rafts["a"].submit(SetBrokers((Broker(1, "kafka1", 9092),)), lambda _result, _err: done.set())
        assert done.wait(10), "a command committed by the two"
        leader = next(r for r in rafts.values() if r.role() == "leader")
        leader.set_append_entries_period(30.0)
        late = RaftReplica(configs["c"])
        late.catch_up_at_once()
        late.set_append_entries_period(30.0)
        late.waitBinded()
        # Within 2 s: its own election timer (3-4.5 s, a bare replica) must not fire first.
        wait_until("the late member has the committed state", lambda: late.state.broker_ids() == {1},
                   timeout=2)
    finally:
        for r in [*rafts.values(), *([late] if late is not None else [])]:
            _destroy(r)


def test_trace_links_reports_votes_and_a_link_made_again():
    configs = _configs({"a": "127.0.0.49", "b": "127.0.0.50"})
    seen: dict[str, list[tuple[str, str, dict]]] = {"a": [], "b": []}
    rafts: dict[str, RaftReplica] = {}
    try:
        for p, c in configs.items():
            rafts[p] = RaftReplica(c)
            rafts[p].trace_links(lambda peer, what, fields, p=p: seen[p].append((peer, what, fields)))
        for r in rafts.values():
            r.waitBinded()
        wait_until("one leader", lambda: sorted(r.role() for r in rafts.values()) == ["follower", "leader"],
                   timeout=election_wait(configs["a"]))
        leader = next(p for p, r in rafts.items() if r.role() == "leader")
        other = next(p for p in rafts if p != leader)
        term = rafts[leader].raftCurrentTerm
        # The winning round: the request went out over an open link, was read, answered, and the answer read.
        assert (configs[other].me.raft_address, "vote_request_out", {"term": term, "sent": True}) in seen[leader]
        assert (configs[leader].me.raft_address, "vote_request_in", {"term": term}) in seen[other]
        assert (configs[leader].me.raft_address, "vote_out", {"term": term, "sent": True}) in seen[other]
        assert (configs[other].me.raft_address, "vote_in", {"term": term}) in seen[leader]
        # b (the greater address) makes the link: dropped, it is connected again and both ends say so.
        a_address, b_address = configs["a"].me.raft_address, configs["b"].me.raft_address
        before = {p: len(s) for p, s in seen.items()}
        transport = getattr(rafts["b"], "_SyncObj__transport")
        conn = next(c for n, c in transport._connections.items() if n.address == a_address)
        conn.disconnect()  # from the test thread: pysyncobj's own connect follows on the tick thread
        wait_until("b connected to a again", lambda: (a_address, "up", {}) in seen["b"][before["b"]:], timeout=5)
        assert (a_address, "connecting", {}) in seen["b"][before["b"]:]
        wait_until("a took b's new link", lambda: (b_address, "up", {}) in seen["a"][before["a"]:], timeout=5)
        assert all(what != "connecting" for _peer, what, _f in seen["a"]), "a never connects: b's address is greater"
    finally:
        for r in rafts.values():
            _destroy(r)


def test_a_live_peers_link_stuck_in_backoff_is_reset_and_made_again(monkeypatch):
    """keep_links_open reads each live peer's socket (pysyncobj's private one) through
    stuck_backoff: a stuck link is aborted and connected anew; a healthy one is only marked read.
    (That stuck_backoff reads the kernel right: tests/integration/test_raft_stuck_link.py.)"""
    import membership.raft as raft_module

    configs = _configs({"a": "127.0.0.51", "b": "127.0.0.52"})
    seen: list[tuple[str, str, dict]] = []
    rafts: dict[str, RaftReplica] = {}
    try:
        for p, c in configs.items():
            rafts[p] = RaftReplica(c)
        rafts["b"].trace_links(lambda peer, what, fields: seen.append((peer, what, fields)))
        for r in rafts.values():
            r.waitBinded()
        a_address = configs["a"].me.raft_address
        wait_until("b connected to a", lambda: a_address in rafts["b"].connected_peers())
        stuck: set[int] = set()
        real = raft_module.stuck_backoff
        monkeypatch.setattr(raft_module, "stuck_backoff", lambda sock: 5 if sock.fileno() in stuck else real(sock))
        transport = getattr(rafts["b"], "_SyncObj__transport")
        conn = next(c for n, c in transport._connections.items() if n.address == a_address)
        stuck.add(conn._TcpConnection__socket.fileno())
        before = len(seen)
        assert rafts["b"].keep_links_open([a_address]) == 0  # reset, not marked read
        assert (a_address, "reset_stuck", {"backoff": 5}) in seen[before:]
        stuck.clear()
        wait_until("b connected to a again", lambda: (a_address, "up", {}) in seen[before:], timeout=5)
        wait_until("the new link is up", lambda: a_address in rafts["b"].connected_peers(), timeout=5)
        assert rafts["b"].keep_links_open([a_address]) == 1
        # a (the smaller address) never connects: its reset's RST makes b connect anew.
        b_address = configs["b"].me.raft_address
        a_transport = getattr(rafts["a"], "_SyncObj__transport")

        def incoming_socket():  # a's side of b's new connection, once a has taken it (its own loop)
            conns = [c for n, c in a_transport._connections.items() if n.address == b_address]
            return conns[0]._TcpConnection__socket if conns else None

        wait_until("a holds b's new connection", lambda: incoming_socket() is not None, timeout=5)
        stuck.add(incoming_socket().fileno())
        before = len(seen)
        assert rafts["a"].keep_links_open([b_address]) == 0
        stuck.clear()
        wait_until("b connected to a once more", lambda: (a_address, "up", {}) in seen[before:], timeout=5)
    finally:
        for r in rafts.values():
            _destroy(r)
