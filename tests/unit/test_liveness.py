"""Two-way liveness (membership.liveness) and the heartbeat that carries it, without sockets:
three ``Heartbeat`` objects exchange datagrams through a fake network on a simulated clock, so a
one-way cut (a host that hears nothing but still sends), a slow peer and a rolling upgrade from
``KPH1`` senders can be played exactly."""

from __future__ import annotations

import pytest

from membership.heartbeat import Heartbeat
from membership.liveness import MAX_DATAGRAM, Beat, Liveness, decode, encode, heartbeat_key

pytestmark = pytest.mark.unit

KEY = heartbeat_key("pw")
INC = b"\x01" * 8
INTERVAL, SUSPECT = 0.1, 0.4
IPS = {"a": "198.18.0.11", "b": "198.18.0.12", "c": "198.18.0.13"}


# ---- the codec ---------------------------------------------------------------------------------


def test_a_datagram_says_whether_its_sender_hears_the_receiver():
    assert decode(KEY, encode(KEY, "a", INC, 7, True)) == Beat("a", INC, 7, True)
    assert decode(KEY, encode(KEY, "a", INC, 8, False)) == Beat("a", INC, 8, False)


def test_a_kph1_datagram_is_read_and_says_nothing_about_hearing():
    data = encode(KEY, "a", INC, 9, None)
    assert data.startswith(b"KPH1")
    assert decode(KEY, data) == Beat("a", INC, 9, None)


@pytest.mark.parametrize("mangle", [
    lambda d: d[:-1] + bytes([d[-1] ^ 1]),       # MAC
    lambda d: d[:20] + bytes([d[20] ^ 1]) + d[21:],  # the flag byte under the MAC
    lambda d: d[:10],                               # truncated
    lambda d: b"KPH9" + d[4:],                      # unknown magic
    lambda d: d + b"\0" * MAX_DATAGRAM,             # oversized
])
def test_a_forged_or_broken_datagram_is_rejected(mangle):
    assert decode(KEY, mangle(encode(KEY, "a", INC, 1, True))) is None
    assert decode(heartbeat_key("other"), encode(KEY, "a", INC, 1, True)) is None


# ---- the pure view -------------------------------------------------------------------------------


def test_a_peer_that_does_not_hear_us_is_not_live_though_we_hear_it():
    view = Liveness("a", ["b"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 0.0)
    assert view.is_live("b", 0.1)
    view.heard(Beat("b", INC, 2, False), 0.2)
    assert view.hears("b", 0.2) and not view.is_live("b", 0.2)
    assert view.live(0.2) == {"a"}
    view.heard(Beat("b", INC, 3, True), 0.3)
    assert view.is_live("b", 0.3)


def test_contact_needs_a_datagram_that_hears_us():
    view = Liveness("a", ["b"], SUSPECT)
    view.heard(Beat("b", INC, 1, False), 0.0)
    assert not view.has_contact("b")
    view.heard(Beat("b", INC, 2, True), 0.1)
    assert view.has_contact("b")


def test_a_reordered_datagram_is_no_news_and_a_new_incarnation_is():
    view = Liveness("a", ["b"], SUSPECT)
    assert view.heard(Beat("b", INC, 5, True), 0.0)
    assert not view.heard(Beat("b", INC, 4, False), 0.1)  # older: its "not hearing" is stale
    assert view.is_live("b", 0.1)
    assert view.heard(Beat("b", b"\x02" * 8, 1, True), 0.2)  # restarted process


def test_silence_and_refusal_still_end_liveness():
    view = Liveness("a", ["b"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 0.0)
    assert view.next_expiry(0.0) == pytest.approx(SUSPECT)
    assert not view.is_live("b", SUSPECT + 0.01)
    view.heard(Beat("b", INC, 2, True), 1.0)
    view.refused("b", 1.05)
    assert not view.is_live("b", 1.06)


def test_refused_peers_are_those_heard_once_and_refused_since():
    view = Liveness("a", ["b", "c", "d"], SUSPECT)
    assert view.refused_peers() == frozenset()
    view.refused("d", 0.1)                                # never heard (not started yet): not counted
    view.heard(Beat("b", INC, 1, True), 0.2)
    view.heard(Beat("c", INC, 1, True), 0.2)
    assert view.refused_peers() == frozenset()
    view.refused("b", 0.3)                                # b's process is gone
    first = view.refused_peers()
    assert first == {"b"} and view.refused_peers() is first  # kept while nothing changes
    view.heard(Beat("c", INC, 2, True), 0.4)              # another peer's beat changes nothing
    assert view.refused_peers() is first
    view.heard(Beat("b", b"\x02" * 8, 1, True), 5.0)      # b restarted: heard again
    assert view.refused_peers() == frozenset()
    view.refused("c", 5.1)
    view.set_peers(["b", "d"])                            # c left the fleet
    assert view.refused_peers() == frozenset()


def test_an_expiry_passing_after_the_last_judgement_stays_a_timer_until_judged():
    # The member judges the peers (live) and a few ms later asks when to wake next; a peer
    # whose expiry fell between the two must still wake it (at once), not the next beat.
    view = Liveness("a", ["b", "c"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 0.0)
    view.heard(Beat("c", INC, 1, True), 0.2)
    assert view.live(SUSPECT - 0.001) == {"a", "b", "c"}
    assert view.next_expiry(SUSPECT + 0.005) == pytest.approx(SUSPECT)  # past: judge again now
    assert view.live(SUSPECT + 0.005) == {"a", "c"}
    assert view.next_expiry(SUSPECT + 0.006) == pytest.approx(0.2 + SUSPECT)  # b is judged: c's turn
    view.heard(Beat("b", INC, 2, True), SUSPECT + 0.1)  # b back: its expiry is a timer again
    assert view.next_expiry(SUSPECT + 0.1) == pytest.approx(0.2 + SUSPECT)
    assert view.live(0.2 + SUSPECT + 0.01) == {"a", "b"}
    assert view.next_expiry(0.2 + SUSPECT + 0.01) == pytest.approx(2 * SUSPECT + 0.1)


# ---- three heartbeats on a fake network -----------------------------------------------------------


class Wire:
    """Datagrams in flight; ``deaf`` hosts drop everything they receive (nft on the host)."""

    def __init__(self) -> None:
        self.queue: list[tuple[str, str, bytes]] = []  # (to, from ip, data)
        self.deaf: set[str] = set()


class FakeSocket:
    def __init__(self, wire: Wire, src: str, dst: str) -> None:
        self.wire, self.src, self.dst = wire, src, dst

    def send(self, data: bytes) -> int:
        if self.dst not in self.wire.deaf:
            self.wire.queue.append((self.dst, IPS[self.src], data))
        return len(data)

    def recv(self, _n: int) -> bytes:
        raise BlockingIOError


class Fleet:
    def __init__(self, *, v1: frozenset[str] = frozenset()) -> None:
        self.wire = Wire()
        self.now = 0.0
        self.hb: dict[str, Heartbeat] = {}
        self.v1 = v1  # nodes that send KPH1 (before two-way liveness)
        for me in IPS:
            peers = {p: (ip, 9000) for p, ip in IPS.items() if p != me}
            hb = Heartbeat(me, (IPS[me], 9000), peers, "pw", INTERVAL, SUSPECT, clock=lambda: self.now)
            hb._send = {p: FakeSocket(self.wire, me, p) for p in peers}
            self.hb[me] = hb
        self.stalled: dict[str, float] = {}  # node -> until when its thread does not run

    def running(self, node: str) -> bool:
        return self.stalled.get(node, -1.0) <= self.now

    def step(self, dt: float = 0.01) -> None:
        self.now += dt
        for node, hb in self.hb.items():
            if not self.running(node):
                continue
            if node in self.v1:
                if self.now >= hb._next_send:
                    hb._next_send = self.now + INTERVAL
                    hb._seq += 1
                    for s in hb._send.values():
                        s.send(encode(KEY, node, hb._incarnation, hb._seq, None))
            else:
                hb.tick(self.now)
        pending, self.wire.queue = self.wire.queue, []
        for to, ip, data in pending:
            if self.running(to):
                self.hb[to].receive(data, ip, self.now)
            else:
                self.wire.queue.append((to, ip, data))  # waits in the socket buffer

    def run_until(self, predicate, limit_s: float) -> float:
        start = self.now
        while not predicate():
            assert self.now - start < limit_s, f"not within {limit_s} s"
            self.step()
        return self.now - start

    def all_live(self) -> bool:
        return all(hb.live(self.now) == set(IPS) for hb in self.hb.values())


def test_everyone_is_live_within_a_beat_or_two_of_starting():
    fleet = Fleet()
    assert fleet.run_until(fleet.all_live, 3 * INTERVAL) <= 2 * INTERVAL
    assert all(hb.has_heard(p) for hb in fleet.hb.values() for p in hb.peers)


def test_a_host_that_hears_nothing_is_declared_down_by_every_peer():
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    fleet.wire.deaf.add("c")
    took = fleet.run_until(lambda: "c" not in fleet.hb["a"].live(fleet.now) | fleet.hb["b"].live(fleet.now),
                           3 * SUSPECT)
    # c stops hearing a and b SUSPECT after their last beat, and says so at once.
    assert took <= SUSPECT + INTERVAL + 0.03
    assert fleet.hb["a"].live(fleet.now) == {"a", "b"}
    assert fleet.hb["b"].live(fleet.now) == {"a", "b"}
    assert fleet.hb["c"].live(fleet.now) == {"c"}
    for _ in range(100):  # and stays down while the cut lasts, though c keeps sending
        fleet.step()
        assert "c" not in fleet.hb["a"].live(fleet.now)
    fleet.wire.deaf.clear()
    assert fleet.run_until(fleet.all_live, 1.0) <= 2 * INTERVAL


def test_a_peer_slower_than_a_beat_but_not_the_timeout_is_no_false_positive():
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    for stall in (0.25, SUSPECT * 0.7):  # c's thread does not run (a GC pause, a busy CPU)
        fleet.stalled["c"] = fleet.now + stall
        for _ in range(int((stall + 2 * INTERVAL) / 0.01)):
            fleet.step()
            assert fleet.hb["a"].live(fleet.now) == set(IPS)
            assert fleet.hb["b"].live(fleet.now) == set(IPS)


def test_a_frozen_peer_is_down_after_the_timeout_as_before():
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    fleet.stalled["c"] = fleet.now + 10
    took = fleet.run_until(lambda: "c" not in fleet.hb["a"].live(fleet.now), 2 * SUSPECT)
    assert SUSPECT - INTERVAL <= took <= SUSPECT + 0.02


def test_kph1_peers_are_answered_in_kind_and_count_as_hearing():
    fleet = Fleet(v1=frozenset({"c"}))
    fleet.run_until(lambda: "c" in fleet.hb["a"].live(fleet.now) and "c" in fleet.hb["b"].live(fleet.now), 1.0)
    fleet.wire.queue.clear()
    fleet.now += INTERVAL
    fleet.hb["a"].tick(fleet.now)
    sent = {to: data for to, _ip, data in fleet.wire.queue}
    assert sent["c"].startswith(b"KPH1") and sent["b"].startswith(b"KPH3")


# ---- isolation: the deaf host must not claim its peers' addresses -------------------------------


def test_a_host_that_hears_nothing_knows_it_is_the_one_cut_off():
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    fleet.wire.deaf.add("c")
    fleet.run_until(lambda: not fleet.hb["c"].live(fleet.now) - {"c"}, 3 * SUSPECT)
    assert fleet.hb["c"].isolated(fleet.now)
    assert not fleet.hb["a"].isolated(fleet.now) and not fleet.hb["b"].isolated(fleet.now)
    fleet.wire.deaf.clear()
    fleet.run_until(fleet.all_live, 1.0)
    assert not fleet.hb["c"].isolated(fleet.now)


def test_peers_failing_one_after_another_leave_the_last_one_not_isolated():
    """freeze-two: the last node standing must still take over (it serves alone on its lease)."""
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    fleet.stalled["a"] = fleet.now + 100
    fleet.run_until(lambda: "a" not in fleet.hb["c"].live(fleet.now), 2 * SUSPECT)
    fleet.stalled["b"] = fleet.now + 100
    fleet.run_until(lambda: fleet.hb["c"].live(fleet.now) == {"c"}, 2 * SUSPECT)
    for _ in range(50):
        fleet.step()
        assert not fleet.hb["c"].isolated(fleet.now)


def test_peers_frozen_together_look_like_isolation_but_a_refusal_does_not():
    view = Liveness("c", ["a", "b"], SUSPECT)
    view.heard(Beat("a", INC, 1, True), 1.00)
    view.heard(Beat("b", INC, 1, True), 1.05)
    assert not view.isolated(1.2, 2 * INTERVAL)          # still hears them
    assert view.isolated(1.5, 2 * INTERVAL)              # both silent, last heard 50 ms apart
    view.refused("b", 1.6)                               # b's host answered: our receive path works
    assert not view.isolated(1.7, 2 * INTERVAL)
    assert not Liveness("c", ["a"], SUSPECT).isolated(5.0, 2 * INTERVAL)  # one peer: cannot tell


def test_an_isolated_node_in_degraded_mode_lists_no_peer_as_unreachable():
    from membership.effective import build_serving_map
    from membership.state import FleetState
    from topology import ProxyNode

    nodes = {p: ProxyNode(p, ip, 9092) for p, ip in IPS.items()}
    common = dict(self_id="c", configured=nodes, reachable={"c"}, degraded=True)
    assert build_serving_map(FleetState(), **common).unreachable == {"a", "b"}
    deaf = build_serving_map(FleetState(), **common, isolated=True)
    assert deaf.isolated and deaf.unreachable == frozenset()
