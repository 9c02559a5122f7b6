"""The leader's UDP beat holds Raft elections off (membership.election), on real sockets and
members in this process (127.0.0.151-159): an idle leader's append_entries can stop altogether
without an election, a leader whose beat stops is replaced, and a beat's datagrams are read in
one wake-up of the tick thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from membership.config import MemberConfig, MemberSpec
from membership.heartbeat import GATHER_S, Heartbeat
from membership.member import Member
from membership.raft import RaftReplica
from tests.integration.test_raft import free_port
from tests.waiting import wait_until
from topology import Broker, ProxyNode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BROKERS = [Broker(i, f"kafka{i}", 9092) for i in (1, 2, 3)]
INTERVAL = 0.25


def grid_clock() -> Callable[[], float]:
    """time.monotonic() shifted so that it reads a multiple of INTERVAL now: a tick right away
    is a tick at a grid point."""
    offset = time.monotonic() % INTERVAL
    return lambda: time.monotonic() - offset


def test_the_peers_beats_of_a_grid_point_are_read_in_the_senders_tick():
    ips = {"a": "127.0.0.151", "b": "127.0.0.152", "c": "127.0.0.153"}
    ports = {p: free_port(ip) for p, ip in ips.items()}
    clock = grid_clock()
    hbs = {me: Heartbeat(me, (ip, ports[me]), {p: (ips[p], ports[p]) for p in ips if p != me}, "pw", INTERVAL,
                         4 * INTERVAL, clock=clock) for me, ip in ips.items()}
    for hb in hbs.values():
        hb.open()
    try:
        for hb in hbs.values():  # everyone hears everyone once (a's gather waits only for peers it hears)
            hb.tick(clock())
        for hb in hbs.values():
            hb.on_readable()
        a = hbs["a"]
        assert a.view.hearing(clock()) == {"b", "c"}
        before = {p: a._arrived.get(p) for p in ("b", "c")}
        # At the next grid point a beats first; b and c beat 2 ms later from another thread.
        late = [threading.Timer(0.002, lambda p=p: hbs[p].tick(clock())) for p in ("b", "c")]
        wait_until("the next grid point", lambda: clock() >= a.next_send, timeout=1, interval=0.001)
        for t in late:
            t.start()
        started = clock()
        a.tick(clock())
        took = clock() - started
        for t in late:
            t.join()
        assert all(a._arrived.get(p) != before[p] for p in ("b", "c")), "read in a's own tick"
        assert took < GATHER_S + 0.02
        # A silent peer costs at most GATHER_S after the grid point, once.
        wait_until("the next grid point", lambda: clock() >= a.next_send, timeout=1, interval=0.001)
        started = clock()
        a.tick(clock())
        assert clock() - started < GATHER_S + 0.02
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
