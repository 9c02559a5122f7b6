"""The leader's UDP beat holds Raft elections off (membership.election), on real sockets and
members in this process (127.0.0.151-159): an idle leader's append_entries can stop altogether
without an election, a leader whose beat stops is replaced, and a beat is read at the reader's
next tick, dated when it arrived."""

from __future__ import annotations

import time

import pytest

from membership.config import MemberConfig, MemberSpec
from membership.heartbeat import Heartbeat
from membership.member import Member
from membership.raft import RaftReplica
from tests.integration.test_raft import free_port
from tests.waiting import wait_until
from topology import Broker, ProxyNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BROKERS = [Broker(i, f"kafka{i}", 9092) for i in (1, 2, 3)]
INTERVAL = 0.25


def test_a_peers_beat_is_read_at_the_readers_next_tick_and_dated_when_it_arrived():
    """The receiving socket is not polled (registrations: the sending sockets only), so a beat
    never wakes the tick thread; the reader's next tick reads it, and accounts it at the time
    the kernel received it, not when it was read: liveness expires suspect_timeout after the
    arrival, as when each arrival woke the thread."""
    ips = {"a": "127.0.0.151", "b": "127.0.0.152"}
    ports = {p: free_port(ip) for p, ip in ips.items()}
    hbs = {me: Heartbeat(me, (ip, ports[me]), {p: (ips[p], ports[p]) for p in ips if p != me}, "pw", INTERVAL,
                         4 * INTERVAL) for me, ip in ips.items()}
    for hb in hbs.values():
        hb.open()
    try:
        a, b = hbs["a"], hbs["b"]
        assert [fd for fd, _ in a.registrations()] == [a._send["b"].fileno()]
        sent = time.monotonic()
        b.tick(sent)
        read_at = sent + 0.15
        wait_until("150 ms after b's beat", lambda: time.monotonic() >= read_at, timeout=2, interval=0.005)
        a.tick(time.monotonic())
        heard = a.view.heard_at().get("b")
        assert heard is not None, "a's tick read b's beat"
        assert abs(heard - sent) < 0.05, f"dated {heard - sent:.3f} s after it was sent (read {read_at - sent:.2f} s after)"
        assert a.next_expiry(time.monotonic()) == pytest.approx(heard + 4 * INTERVAL)
    finally:
        for hb in hbs.values():
            hb.close()


@pytest.fixture
def trio():
    hosts = {"a": "127.0.0.154", "b": "127.0.0.155", "c": "127.0.0.156"}
    specs = [MemberSpec(ProxyNode(p, h, 9092), h, free_port(h)) for p, h in hosts.items()]
    members = {p: Member(MemberConfig(node_id=p, members=specs, password="leader-beat-secret")) for p in hosts}
    try:
        for m in members.values():
            m.start()
            m.set_brokers(BROKERS)
        yield members
    finally:
        for m in members.values():
            m.stop()


def balanced(members: dict[str, Member]) -> bool:
    """Every member serves the same committed table, one broker per node: nothing left to plan."""
    tables = [m.serving_map().owner_map() for m in members.values()]
    return all(t == tables[0] for t in tables) and sorted(tables[0].values()) == sorted(members)


def leader_of(members: dict[str, Member]) -> str | None:
    leaders = {m.status().view.leader for m in members.values()}
    return next(iter(leaders)) if len(leaders) == 1 else None


def test_the_beat_alone_keeps_the_leader_and_its_silence_replaces_it(trio):
    wait_until("one leader everyone follows and a balanced table",
               lambda: leader_of(trio) is not None and balanced(trio), timeout=15)
    old = leader_of(trio)
    term = trio[old].status().view.term
    raft: RaftReplica = trio[old]._raft
    # No more append_entries from the leader: the followers' pysyncobj timer (3-4.5 s) would
    # elect. (Nor answers then: the leader would step down after leader_fallback_timeout.)
    raft.set_append_entries_period = lambda _s: RaftReplica.set_append_entries_period(raft, 1000.0)
    raft._syncobj_conf.leaderFallbackTimeout = 1000.0
    backstop = 1.5 * trio[old].config.raft_backstop_timeout
    deadline = time.monotonic() + backstop + 1.5
    while time.monotonic() < deadline:
        assert leader_of(trio) == old and {m.status().view.term for m in trio.values()} == {term}
        time.sleep(0.1)  # sampling a state that must not change for the whole window
    # Now its beat stops too (its heartbeat sends nothing): the followers elect another leader
    # when the beat is overdue or, at the latest, when they declare it dead.
    silenced = time.monotonic()
    trio[old]._hb._send_to = lambda *_a: None
    survivors = {p: m for p, m in trio.items() if p != old}
    wait_until("the survivors elect one of them", lambda: leader_of(survivors) in survivors, timeout=5)
    took = time.monotonic() - silenced
    print(f"\nleader {old} silenced: {leader_of(survivors)} leads after {1000 * took:.0f} ms")
    assert took < trio[old].config.suspect_timeout + 1.0
