"""What an idle node no longer recomputes on every wake-up (issue 12 item 3): the heartbeat's MAC
from precomputed keyed hashes, one encoded datagram per kind and beat instead of one per peer, and
the views kept between calls (membership.liveness, membership.control, membership.election,
membership.member). Each memo must give exactly what the plain computation gives: checked against
that computation, and for each input that must invalidate it."""

from __future__ import annotations

import hmac
import random
import struct

import pytest

import membership.heartbeat as heartbeat_module
from membership.config import MemberConfig
from membership.control import MemberCore, RaftView
from membership.election import ElectionTimer, LeaderBeat
from membership.heartbeat import Heartbeat
from membership.liveness import (HEARS_YOU, LEADER, MAC_BYTES, MAGIC, MAGIC_V1, MAGIC_V2, MAX_DATAGRAM, Beat,
                                 Liveness, _mac, decode, encode, heartbeat_key)
from membership.member import Member
from membership.state import FleetState
from tests.unit.test_liveness import INC, KEY, SUSPECT
from tests.unit.test_member_core import SPECS, joined

pytestmark = pytest.mark.unit


# ---- the MAC and the codec -----------------------------------------------------------------------


@pytest.mark.parametrize("key_len", [0, 1, 32, 63, 64, 65, 200])
def test_the_mac_is_hmac_sha256_for_any_key(key_len):
    rng = random.Random(key_len)
    key = bytes(rng.randrange(256) for _ in range(key_len))
    for size in (0, 1, 21, 47, 64, 65, 300):
        body = bytes(rng.randrange(256) for _ in range(size))
        assert _mac(key, body) == hmac.digest(key, body, "sha256")[:MAC_BYTES]
    assert _mac(KEY, b"x") != _mac(heartbeat_key("other"), b"x")


def _reference_decode(key: bytes, data: bytes) -> Beat | None:
    """The codec before this change (hmac.digest, startswith, struct.unpack on slices)."""
    if len(data) > MAX_DATAGRAM or len(data) < 21 + MAC_BYTES:
        return None
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.digest(key, body, "sha256")[:MAC_BYTES]):
        return None
    incarnation = body[4:12]
    term, flags = None, 0
    if body.startswith(MAGIC):
        if len(body) < 30:
            return None
        seq, flags, term, n = struct.unpack("!QBQB", body[12:30])
        head, hears_you = 30, bool(flags & HEARS_YOU)
    elif body.startswith(MAGIC_V2):
        if len(body) < 22:
            return None
        seq, flags, n = struct.unpack("!QBB", body[12:22])
        head, hears_you, flags = 22, bool(flags & HEARS_YOU), 0
    elif body.startswith(MAGIC_V1):
        seq, n = struct.unpack("!QB", body[12:21])
        head, hears_you = 21, None
    else:
        return None
    if len(body) != head + n:
        return None
    try:
        return Beat(body[head:].decode(), incarnation, seq, hears_you, term, bool(flags & LEADER))
    except UnicodeDecodeError:
        return None


def test_decode_reads_every_datagram_as_before_even_broken_ones_under_a_valid_mac():
    rng = random.Random(7)
    datagrams = [encode(KEY, "node-1", INC, 5, None), encode(KEY, "b", INC, 2**64 - 1, True),
                 encode(KEY, "b", INC, 9, False, term=3, leader=True), encode(KEY, "é", INC, 1, True, term=0)]
    seen_beats = seen_none = 0
    for _ in range(3000):
        body = bytearray(rng.choice(datagrams)[:-MAC_BYTES])
        for _ in range(rng.randrange(3)):  # flip bytes (the magic, flags, lengths, the id), cut or grow
            what = rng.randrange(3)
            if what == 0 and body:
                body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
            elif what == 1 and body:
                del body[rng.randrange(len(body)):]
            else:
                body += bytes([rng.randrange(256)])
        if rng.random() < 0.2:
            body[:4] = rng.choice([MAGIC, MAGIC_V1, MAGIC_V2])
        data = bytes(body) + hmac.digest(KEY, bytes(body), "sha256")[:MAC_BYTES]  # authentic
        got = decode(KEY, data)
        assert got == _reference_decode(KEY, data), data
        assert decode(heartbeat_key("other"), data) is None
        seen_beats += got is not None
        seen_none += got is None
    assert seen_beats > 300 and seen_none > 300  # both paths were exercised


# ---- the pure view: memos against the plain computation ------------------------------------------


def _plain_hearing(view: Liveness, now: float) -> frozenset[str]:
    return frozenset(p for p in view.peers if view.hears(p, now))


def test_the_kept_views_are_always_what_the_plain_computation_gives():
    rng = random.Random(12)
    peers = ["b", "c", "d", "e"]
    view = Liveness("a", peers, SUSPECT)
    seq = {p: 0 for p in peers}
    now = 0.0
    hits = 0
    for step in range(4000):
        now += rng.choice([0.0, 0.001, 0.01, 0.05, 0.1, SUSPECT / 2, SUSPECT])
        if rng.random() < 0.03:
            now -= rng.choice([0.01, 0.2])  # a caller's older ``now``
        what = rng.random()
        if what < 0.5:
            p = rng.choice(peers)
            seq[p] += rng.choice([1, 1, 1, 0])  # now and then a duplicate (no news)
            view.heard(Beat(p, INC, seq[p], rng.choice([True, True, True, False, None])), now)
        elif what < 0.55:
            view.refused(rng.choice(peers), now)
        elif what < 0.57:
            view.set_peers(rng.sample(peers, rng.randrange(1, len(peers) + 1)))
        for _ in range(rng.randrange(1, 4)):  # asked several times, now and then a little later
            t = now + rng.choice([0.0, 0.0, 0.002, SUSPECT / 4])
            before = view._hearing_memo
            hearing = view.hearing(t)
            assert hearing == _plain_hearing(view, t), (step, t)
            hits += before is not None and before[2] is hearing
            live = view.live(t)
            assert live == frozenset(["a", *(p for p in _plain_hearing(view, t) if view._hears_us.get(p) is not False)])
            judged = view._judged_at
            due = [view._heard[p] + SUSPECT for p in view.peers if view.hears(p, judged)]
            assert view.next_expiry(t) == min(due, default=float("inf"))
            assert view.contact_with_all() == all(view.has_contact(p) for p in view.peers)
    assert hits > 1000  # the memo was used, not just recomputed


def test_hearing_is_kept_until_the_earliest_arrival_in_it_goes_stale():
    view = Liveness("a", ["b", "c"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 1.0)
    view.heard(Beat("c", INC, 1, True), 1.1)
    both = view.hearing(1.2)
    assert both == {"b", "c"} and view.hearing(1.0 + SUSPECT) is both  # b is still heard at its expiry
    assert view.hearing(1.0 + SUSPECT + 0.001) == {"c"}  # ... not after it
    assert view.hearing(1.2) == {"b", "c"}  # an older ``now`` is judged again, not served the later set
    view.refused("c", 1.25)
    assert view.hearing(1.25) == {"b"}


def test_hearing_is_kept_across_a_heard_peers_new_datagram_but_not_one_accounted_earlier():
    view = Liveness("a", ["b", "c"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 1.0)
    view.heard(Beat("c", INC, 1, True), 1.0)
    both = view.hearing(1.1)
    view.heard(Beat("b", INC, 2, True), 1.2)
    assert view.hearing(1.2) is both  # b was heard and still is: nothing to recompute
    assert view.hearing(1.0 + SUSPECT + 0.01) == {"b"}  # c's expiry passes all the same
    view.heard(Beat("c", INC, 2, True), 1.5)
    assert view.hearing(1.5) == {"b", "c"}  # c heard again: back in the set
    view.heard(Beat("b", INC, 3, True), 1.5 - SUSPECT)  # a caller's older time: b's arrival moves back
    assert view.hearing(1.55) == {"c"}


def test_a_recomputed_view_equal_to_the_kept_one_is_the_same_object():
    view = Liveness("a", ["b", "c"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 1.0)
    view.heard(Beat("c", INC, 1, True), 1.0)
    hearing, live = view.hearing(1.1), view.live(1.1)
    view.heard(Beat("b", INC, 2, True), 1.2)  # news, but the same peers heard, and hearing us
    assert view.hearing(1.2) is hearing and view.live(1.2) is live
    view.heard(Beat("c", INC, 2, False), 1.3)  # c no longer hears us: live changes, hearing does not
    assert view.hearing(1.3) is hearing
    assert view.live(1.3) == {"a", "b"}
    view.heard(Beat("c", INC, 3, True), 1.4)
    assert view.live(1.4) == {"a", "b", "c"}


def test_next_expiry_follows_each_new_datagram_at_the_same_judgement():
    view = Liveness("a", ["b"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 1.0)
    view.live(1.1)
    assert view.next_expiry(1.1) == pytest.approx(1.0 + SUSPECT)
    view.heard(Beat("b", INC, 2, True), 1.15)  # judged at 1.1 still, but b arrived again
    assert view.next_expiry(1.16) == pytest.approx(1.15 + SUSPECT)
    view.refused("b", 1.17)
    assert view.next_expiry(1.17) == float("inf")


def test_contact_with_all_needs_every_peer_and_follows_the_peers():
    view = Liveness("a", ["b", "c"], SUSPECT)
    view.heard(Beat("b", INC, 1, True), 1.0)
    assert not view.contact_with_all()
    view.heard(Beat("c", INC, 1, False), 1.0)
    assert not view.contact_with_all()  # c does not hear us: no contact yet
    view.heard(Beat("c", INC, 2, True), 1.1)
    assert view.contact_with_all()
    view.set_peers(["b", "c", "d"])
    assert not view.contact_with_all()


# ---- the heartbeat: one encoding per kind of datagram and beat -----------------------------------


class Capture:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        return len(data)

    def recv(self, _n: int) -> bytes:
        raise BlockingIOError


def _heartbeat() -> tuple[Heartbeat, dict[str, Capture]]:
    peers = {p: (f"198.18.0.{20 + i}", 9000) for i, p in enumerate("bcdef")}
    hb = Heartbeat("a", ("198.18.0.10", 9000), peers, "pw", 0.1, SUSPECT, clock=lambda: 0.0)
    caps = {p: Capture() for p in peers}
    hb._send = dict(caps)
    return hb, caps


def test_each_peer_gets_its_own_flag_and_version_though_datagrams_are_encoded_once_per_kind(monkeypatch):
    hb, caps = _heartbeat()
    key = heartbeat_key("pw")
    hb.receive(encode(key, "b", INC, 1, True, term=1), "198.18.0.20", 1.0)       # KPH3, heard
    hb.receive(encode(key, "d", INC, 1, True, term=1), "198.18.0.22", 1.0)       # KPH3, heard
    hb.receive(encode(key, "e", INC, 1, True), "198.18.0.23", 1.0)               # KPH2, heard
    hb.receive(encode(key, "f", INC, 1, None), "198.18.0.24", 0.0)               # KPH1, stale by 1.05
    # c: never heard
    calls = []
    real = heartbeat_module.encode
    monkeypatch.setattr(heartbeat_module, "encode", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    hb.term, hb.leader_term = 4, None
    hb.tick(1.05)
    got = {p: decode(key, c.sent[-1]) for p, c in caps.items()}
    assert {p: (b.hears_you, b.term, b.leader) for p, b in got.items()} == {
        "b": (True, 4, False), "c": (False, 4, False), "d": (True, 4, False), "e": (True, None, False),
        "f": (None, None, False)}
    assert len({b.seq for b in got.values()}) == 1
    assert caps["b"].sent[-1] == caps["d"].sent[-1]  # the same kind: the same bytes, encoded once
    assert len(calls) == 4  # KPH3 heard, KPH3 not heard, KPH2, KPH1
    # The next beat is encoded anew: a new sequence number, the leader's term and flag.
    calls.clear()
    hb.leader_term = 5
    hb.tick(1.06)  # sent at once: we became the leader
    again = {p: decode(key, c.sent[-1]) for p, c in caps.items()}
    assert {b.seq for b in again.values()} == {got["b"].seq + 1}
    assert (again["b"].term, again["b"].leader, again["c"].term, again["c"].leader) == (5, True, 5, True)
    assert again["e"].term is None and again["f"].hears_you is None
    assert len(calls) == 4
    # A peer heard again: its flag changes at once, the others' datagrams stay alike.
    hb.receive(encode(key, "c", INC, 1, True, term=5), "198.18.0.21", 1.07)
    hb.tick(1.07)
    third = {p: decode(key, c.sent[-1]) for p, c in caps.items()}
    assert third["c"].hears_you is True and caps["c"].sent[-1] == caps["b"].sent[-1]


def test_a_probe_is_the_beat_of_its_own_sequence_number():
    hb, caps = _heartbeat()
    hb.term = 2
    hb.tick(1.0)
    hb.probe("c", 1.01)
    first, probe = decode(heartbeat_key("pw"), caps["c"].sent[0]), decode(heartbeat_key("pw"), caps["c"].sent[1])
    assert probe.seq == first.seq + 1 and probe.term == 2


# ---- the member and its core ----------------------------------------------------------------------


def _config(node: str = "a") -> MemberConfig:
    return MemberConfig(node_id=node, members=SPECS, password="pw")


def test_the_leader_beat_handed_to_the_core_follows_the_claim_and_the_term():
    member = Member(_config("b"))
    hb, _caps = _heartbeat()
    key = heartbeat_key("pw")
    hb.receive(encode(key, "c", INC, 1, True, term=4, leader=True), "198.18.0.21", 1.0)
    first = member._leader_beat(hb, "c", 4, frozenset("bc"))
    assert first == LeaderBeat(True, 1.0)
    assert member._leader_beat(hb, "c", 4, frozenset("bc")) is first  # nothing new: the same object
    hb.receive(encode(key, "c", INC, 2, True, term=4, leader=True), "198.18.0.21", 1.2)
    assert member._leader_beat(hb, "c", 4, frozenset("bc")) == LeaderBeat(True, 1.2)  # a new claim
    assert member._leader_beat(hb, "c", 5, frozenset("bc")) == LeaderBeat(True, None)  # the same claim, deposed
    assert member._leader_beat(hb, "d", 5, frozenset("bc")) == LeaderBeat(False, None)  # another leader


def test_joined_follows_the_committed_state():
    core = MemberCore(_config(), now=0.0)
    empty, full = FleetState(), joined()
    assert not core.joined(empty)
    assert core.joined(full)
    assert core.joined(full)
    assert not core.joined(empty)


def test_peer_events_follow_the_live_set_whether_or_not_it_is_the_same_object():
    core = MemberCore(_config(), now=0.0)
    view = RaftView(state=joined())
    live = frozenset("abc")

    def events(actions):
        return [(a.event, dict(a.fields)["node"]) for a in actions if getattr(a, "event", "").startswith("peer_")]

    assert events(core.tick(0.1, live, True, view)) == [("peer_up", "b"), ("peer_up", "c")]
    assert events(core.tick(0.2, live, True, view)) == []  # the same object: nothing to track
    assert events(core.tick(0.3, frozenset("ab"), True, view)) == [("peer_down", "c")]
    assert events(core.tick(0.4, live, True, view)) == [("peer_up", "c")]  # the first object again
    assert core.peer_changed_at["c"] == 0.4


def test_the_member_view_is_replaced_only_when_it_changes():
    core = MemberCore(_config(), now=0.0)
    view = RaftView("follower", "b", 2, joined())
    core.tick(0.1, frozenset("abc"), True, view)
    kept = core.view
    core.tick(0.2, frozenset("abc"), True, view)
    assert core.view is kept
    core.tick(0.3, frozenset("abc"), True, RaftView("follower", "b", 3, joined()))
    assert core.view.term == 3 and core.view.leader == "b" and core.view.has_quorum


def test_the_election_order_follows_the_live_set_the_leader_and_the_term():
    t = ElectionTimer("c", 0.3, 0.3, 0.25, 3.0, 0.0)
    t.update(1.0, frozenset("abc"), "follower", "a", 4, LeaderBeat(True, 1.0))
    second = t.next_due  # c after b (an even term: the order is not turned)
    t.update(1.0, frozenset("ac"), "follower", "a", 4, LeaderBeat(True, 1.0))
    assert t.next_due < second  # b gone: c asks first
    t.update(1.0, frozenset("abc"), "follower", "a", 4, LeaderBeat(True, 1.0))
    assert t.next_due == second
    t.update(1.0, frozenset("abc"), "follower", "b", 6, LeaderBeat(True, 1.0))  # b leads: a, then c
    assert t.next_due == second
    t.update(1.0, frozenset("abc"), "follower", "b", 7, LeaderBeat(True, 1.0))  # an odd term: c, then a
    assert t.next_due < second
    t.update(1.0, frozenset("abc"), "follower", None, 6, LeaderBeat(True, 1.0))  # no leader: a, b, then c
    assert t.next_due > second


class FakeRaft:
    """What Member._tick reads of its replica, set by hand."""

    def __init__(self) -> None:
        self.raftCurrentTerm = 1
        self.state = FleetState()
        self.leader = "127.0.0.12:7000"  # b

    def role(self) -> str:
        return "follower"

    def leader_address(self) -> str | None:
        return self.leader

    def keep_links_open(self, peers) -> None:
        list(peers)

    def hold_election(self, _for_s: float) -> None:
        pass

    def hasten_election(self, _within_s: float) -> None:
        pass

    def defer_election(self, _for_s: float) -> None:
        pass

    def submit(self, _command, _callback) -> None:
        pass


def test_the_member_hands_the_core_each_change_of_raft_s_view():
    now = [1.0]
    member = Member(_config("a"))
    member._clock = lambda: now[0]
    peers = {m.id: m.heartbeat_address for m in member.config.peers}
    hb = Heartbeat("a", member.config.me.heartbeat_bind, peers, "pw", 0.2, 0.6, clock=member._clock)
    hb._send = {p: Capture() for p in peers}
    raft = FakeRaft()
    member._hb, member._raft, member._registered = hb, raft, True
    member._tick()
    assert member._core.view.leader == "b" and member._core.state == FleetState()
    now[0] = 1.1
    raft.state = joined()  # a new committed state, all else the same
    member._tick()
    assert member._core.state is raft.state
    now[0] = 1.2
    raft.raftCurrentTerm = 2
    member._tick()
    assert member._core.view.term == 2
    now[0] = 1.3
    raft.leader = None
    member._tick()
    assert member._core.view.leader is None


def test_the_leader_asks_for_the_format_of_each_new_state_and_members():
    from membership.commands import MarkUp, SetFormat
    from membership.control import SubmitPlan
    from tests.unit.test_formats import BOTH, core, fleet

    leader = core("a", BOTH)
    partial = fleet(BOTH, BOTH)  # c (configured) has not joined: no upgrade yet
    partial, _ = partial.apply(MarkUp({"a", "b"}, partial.epoch, {}))

    def upgrade(now, state, live):
        plans = [a for a in leader.tick(now, frozenset(live), True, RaftView("leader", "a", 1, state))
                 if isinstance(a, SubmitPlan)]
        for plan in plans:
            leader.plan_done(plan.token, plan.command, None, "dropped", now)
        return [p.command for p in plans if isinstance(p.command, SetFormat)]

    assert upgrade(2.0, partial, "ab") == []
    everyone = fleet(BOTH, BOTH, BOTH)
    for _ in range(3):  # the planner's own commands first (mark up, assign), then the format
        plans = [a for a in leader.tick(2.25, frozenset("abc"), True, RaftView("leader", "a", 1, everyone))
                 if isinstance(a, SubmitPlan)]
        assert plans
        if isinstance(plans[0].command, SetFormat):
            break
        everyone, _ = everyone.apply(plans[0].command)
        leader.plan_done(plans[0].token, plans[0].command, None, "dropped", 2.25)
    assert plans[0].command == SetFormat(2, everyone.epoch)
    # The same state object, but the members it must be asked of changed (c left the roster):
    leader = core("a", BOTH)
    assert upgrade(3.0, partial, "ab") == []
    leader._all_ids = frozenset("ab")  # what adopting a roster of a and b does (_adopt_roster)
    assert upgrade(3.5, partial, "ab") == [SetFormat(2, partial.epoch)]


def test_a_peer_whose_raft_link_dropped_is_probed_at_once_and_again_a_few_milliseconds_later():
    """A real-time member may probe a killed peer before its dying process' heartbeat socket is
    closed (nothing answers "port unreachable" yet): it probes again REPROBE_AFTER_S later, and
    its tick thread wakes for those probes."""
    from membership.member import REPROBE_AFTER_S

    member = Member(_config("a"))
    hb, caps = _heartbeat()
    member._hb = hb
    now = [100.0]
    member._clock = lambda: now[0]  # type: ignore[method-assign]
    hb._next_send = now[0] + 0.2  # the next beat; no peer heard, none goes stale
    member._core.election.next_due = float("inf")
    assert member._seconds_to_next_timer() == pytest.approx(0.2)
    member._on_link_lost(member._raft_addresses["c"])
    assert len(caps["c"].sent) == 1 and not caps["b"].sent  # at once, that peer only
    assert member._seconds_to_next_timer() == pytest.approx(REPROBE_AFTER_S[0])  # the tick thread wakes for it
    member._probe_again(hb, 100.0 + REPROBE_AFTER_S[0] / 2)
    assert len(caps["c"].sent) == 1  # none due yet
    member._probe_again(hb, 100.0 + REPROBE_AFTER_S[1])
    assert len(caps["c"].sent) == 3  # the first two due
    member._probe_again(hb, 100.0 + REPROBE_AFTER_S[-1] + 1.0)
    assert len(caps["c"].sent) == 1 + len(REPROBE_AFTER_S)
    assert not member._reprobes  # done: no more wake-ups for it
