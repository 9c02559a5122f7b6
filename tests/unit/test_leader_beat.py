"""The leader's UDP beat as the proof it is alive: the datagram's term and leader flag, the
heartbeat's per-peer version and claims, the election timer (membership.election) and the one
accessor of pysyncobj's election deadline. No sockets: a hand-driven clock and the fake wire of
test_liveness."""

from __future__ import annotations

import inspect

import pytest
from pysyncobj import SyncObj

from membership import raft
from membership.election import (CONTACT_SETTLE_BEATS, HASTEN_SPACING_S, DeferElection, ElectionTimer,
                                 HastenElection, HoldElection, LeaderBeat, LeaderClaim, append_entries_period,
                                 campaign_window, can_campaign, claimed_by_a_peer, leader_beat)
from membership.liveness import Beat, decode, encode
from tests.unit.test_liveness import INC, INTERVAL, KEY, Fleet

pytestmark = pytest.mark.unit

OVERDUE, WINDOW, BEAT, HOLD = 0.3, 0.3, 0.25, 3.0
LIVE = frozenset("abc")


# ---- the datagram ---------------------------------------------------------------------------------


def test_a_datagram_carries_the_senders_term_and_whether_it_leads_it():
    data = encode(KEY, "a", INC, 5, True, term=7, leader=True)
    assert data.startswith(b"KPH3")
    assert decode(KEY, data) == Beat("a", INC, 5, True, 7, True)
    assert decode(KEY, encode(KEY, "a", INC, 6, False, term=7)) == Beat("a", INC, 6, False, 7, False)
    assert decode(KEY, encode(KEY, "a", INC, 6, True)) == Beat("a", INC, 6, True, None, False)  # KPH2


def test_the_leader_flag_and_the_term_are_under_the_mac():
    data = bytearray(encode(KEY, "a", INC, 5, True, term=7, leader=False))
    flags = 4 + 8 + 8  # magic, incarnation, seq
    for offset, bit in ((flags, 0x02), (flags + 8, 0x01)):  # the leader flag; the term's last byte
        forged = bytearray(data)
        forged[offset] ^= bit
        assert decode(KEY, bytes(forged)) is None


# ---- the heartbeat: versions per peer and leader claims ---------------------------------------------


def test_the_leaders_beat_claims_its_term_and_stops_claiming_when_it_steps_down():
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    fleet.hb["a"].term = fleet.hb["a"].leader_term = 4
    fleet.step()  # sent at once, not at the next beat: the followers' timers run on it
    claim = fleet.hb["b"].leader_claim("a")
    assert claim is not None and claim.term == 4 and fleet.now - claim.at <= 0.01
    assert fleet.hb["c"].leader_claim("a") == claim
    assert fleet.hb["b"].speaks_leader_beat("a") and fleet.hb["b"].leader_claim("c") is None
    fleet.run_until(lambda: fleet.hb["b"].leader_claim("a").at > claim.at, 2 * INTERVAL)  # every beat
    fleet.hb["a"].leader_term = None
    fleet.step()
    assert fleet.hb["b"].leader_claim("a") is None and fleet.hb["c"].leader_claim("a") is None


def test_a_peer_that_sends_no_term_is_answered_in_kind_and_counted_as_legacy():
    fleet = Fleet()
    fleet.run_until(fleet.all_live, 1.0)
    a = fleet.hb["a"]
    a.receive(encode(KEY, "c", b"\x09" * 8, 1, True), "198.18.0.13", fleet.now)  # c restarted as a KPH2 node
    assert a.legacy_peers() == {"c"} and not a.speaks_leader_beat("c")
    fleet.wire.queue.clear()
    a._next_send = 0.0  # due now
    a.tick(fleet.now)
    sent = {to: data for to, _ip, data in fleet.wire.queue}
    assert sent["c"].startswith(b"KPH2") and sent["b"].startswith(b"KPH3")
    a.receive(encode(KEY, "c", b"\x09" * 8, 2, True, term=1), "198.18.0.13", fleet.now)  # upgraded
    assert a.legacy_peers() == set() and a.speaks_leader_beat("c")


def test_the_leader_sends_append_entries_at_the_old_rate_while_a_legacy_peer_is_there():
    assert append_entries_period(0.75, 0.0857, frozenset()) == 0.75
    assert append_entries_period(0.75, 0.0857, frozenset({"c"})) == 0.0857


# ---- the election timer -----------------------------------------------------------------------------


def timer(node: str, now: float = 0.0) -> ElectionTimer:
    return ElectionTimer(node, OVERDUE, WINDOW, BEAT, HOLD, now)


def hastens(actions) -> list[HastenElection]:
    return [a for a in actions if isinstance(a, HastenElection)]


def test_a_deposed_leaders_claim_holds_nothing_off():
    assert leader_beat(True, LeaderClaim(5, 1.0), 5) == LeaderBeat(True, 1.0)
    assert leader_beat(True, LeaderClaim(6, 1.0), 5) == LeaderBeat(True, 1.0)  # its append_entries are late
    assert leader_beat(True, LeaderClaim(4, 1.0), 5) == LeaderBeat(True, None)  # deposed
    assert leader_beat(False, None, 5) == LeaderBeat(False, None)


def test_each_new_claim_holds_raft_s_election_off_once():
    t = timer("b")
    assert t.update(0.1, LIVE, "follower", "a", 3, LeaderBeat(True, 0.1)) == [HoldElection(HOLD)]
    assert t.update(0.2, LIVE, "follower", "a", 3, LeaderBeat(True, 0.1)) == []  # the same beat
    assert t.update(0.35, LIVE, "follower", "a", 3, LeaderBeat(True, 0.35)) == [HoldElection(HOLD)]
    assert t.update(0.4, LIVE, "follower", "a", 3, LeaderBeat(True, None)) == []  # deposed / not claiming


def test_a_silent_leader_is_replaced_when_its_beat_is_overdue_followers_in_id_order():
    b, c = timer("b"), timer("c")
    claimed = LeaderBeat(True, 1.0)
    due_b = 1.0 + BEAT + OVERDUE
    due_c = due_b + min(HASTEN_SPACING_S, WINDOW)  # two followers: the window's end or the spacing
    for t in (b, c):
        t.update(1.0, LIVE, "follower", "a", 4, claimed)
    assert b.next_due == pytest.approx(due_b) and c.next_due == pytest.approx(due_c)
    assert hastens(b.update(due_b - 0.01, LIVE, "follower", "a", 4, claimed)) == []
    assert hastens(b.update(due_b, LIVE, "follower", "a", 4, claimed)) == [HastenElection(0.0)]
    assert hastens(b.update(due_b + 0.01, LIVE, "follower", "a", 4, claimed)) == []  # once per silence
    assert hastens(c.update(due_b, LIVE, "follower", "a", 4, claimed)) == []
    assert hastens(c.update(due_c, LIVE, "follower", "a", 4, claimed)) == [HastenElection(0.0)]
    # A beat in time moves the deadline: no election.
    fresh = timer("b")
    for now in (1.0, 1.25, 1.5, 1.75, 2.0):
        assert hastens(fresh.update(now, LIVE, "follower", "a", 4, LeaderBeat(True, now))) == []
        assert fresh.next_due == pytest.approx(now + BEAT + OVERDUE)


def test_a_dead_leader_is_replaced_at_once_whatever_its_beat_said():
    b, c = timer("b"), timer("c")
    survivors = frozenset("bc")
    assert b.update(1.0, survivors, "follower", "a", 4, LeaderBeat(True, 0.99)) == [HastenElection(0.0)]
    assert c.update(1.0, survivors, "follower", "a", 4, LeaderBeat(True, 0.99)) == [HastenElection(HASTEN_SPACING_S)]


def test_no_leader_means_an_election_after_the_same_silence_and_again_after_a_lost_one():
    t = timer("b", now=0.0)
    rank_b = HASTEN_SPACING_S  # second of a, b, c at term 3 (the window would allow 0.15 apart)
    assert hastens(t.update(0.6, LIVE, "candidate", None, 3)) == []
    assert t.update(BEAT + OVERDUE + rank_b, LIVE, "follower", None, 3) == [HastenElection(0.0)]
    assert hastens(t.update(0.7, LIVE, "candidate", None, 4)) == []  # its election: the term moved
    # At term 4 the order is turned by one (b, c, a): b asks first after a lost round.
    assert t.next_due == pytest.approx(0.7 + BEAT + OVERDUE)
    assert hastens(t.update(0.7 + BEAT + OVERDUE, LIVE, "candidate", None, 4)) == [
        HastenElection(0.0)]  # that one was lost


def test_a_leader_whose_datagrams_carry_no_term_is_left_to_raft_unless_it_dies():
    t = timer("b")
    for now in (1.0, 3.0, 10.0):  # an old node's append_entries hold its followers' elections off
        assert t.update(now, LIVE, "follower", "a", 4, LeaderBeat(False, None)) == []
        assert t.next_due == float("inf")
    assert t.update(10.1, frozenset("bc"), "follower", "a", 4, LeaderBeat(False, None)) == [HastenElection(0.0)]


def test_without_a_majority_a_follower_defers_every_election_then_asks_at_the_first_tick_with_one():
    """A host that hears nothing (one-way cut) sees its leader fall silent and then dead like
    everyone else: its vote requests, which still go out, would depose the healthy majority's
    leader. It keeps Raft's own timer off too; once a majority is back the overdue rule acts."""
    t = timer("b")
    claimed = LeaderBeat(True, 1.0)
    due = 1.0 + BEAT + OVERDUE
    assert t.update(due + 0.05, LIVE, "follower", "a", 4, claimed, electable=False) == [DeferElection(HOLD)]
    assert t.update(5.0, frozenset("b"), "follower", "a", 4, claimed, electable=False) == [DeferElection(HOLD)]
    assert t.update(5.0, frozenset("b"), "candidate", None, 5, electable=False) == [DeferElection(HOLD)]
    assert t.next_due == float("inf")
    back = timer("b")  # back in contact: the silence counts anew, the leader's beat is due soon
    back.update(due + 0.05, LIVE, "follower", "a", 4, claimed, electable=False)
    assert hastens(back.update(due + 0.1, LIVE, "follower", "a", 4, claimed)) == []
    assert back.next_due == pytest.approx(due + 0.1 + BEAT + OVERDUE)
    assert hastens(back.update(due + 0.11, LIVE, "follower", "a", 4, LeaderBeat(True, due + 0.11))) == []
    assert hastens(back.update(back.next_due, LIVE, "follower", "a", 4, LeaderBeat(True, due + 0.11))) == [
        HastenElection(0.0)]  # and a leader silent for as long again is replaced
    # After a two-way cut the leader's first datagrams say it does not hear us yet: not dead.
    healed = timer("b")
    healed.update(5.0, frozenset("b"), "follower", "a", 4, claimed, electable=False)
    assert healed.update(5.1, frozenset("bc"), "follower", "a", 4, claimed) == []
    assert healed.next_due == pytest.approx(5.1 + CONTACT_SETTLE_BEATS * BEAT)
    assert hastens(healed.update(5.1 + CONTACT_SETTLE_BEATS * BEAT, frozenset("bc"), "follower", "a", 4,
                                 claimed)) == [HastenElection(0.0)]  # still not live: it is gone


def test_with_no_leader_named_a_live_peers_claim_holds_the_election_off():
    """Back from a cut, Raft names no leader until the new one's append_entries arrive; the new
    leader's beat, claiming our term or a later one, holds the election off meanwhile."""
    assert claimed_by_a_peer([None, LeaderClaim(7, 2.0), LeaderClaim(8, 2.1)], 7) == LeaderBeat(True, 2.1)
    assert claimed_by_a_peer([LeaderClaim(6, 2.0)], 7) == LeaderBeat(False, None)  # a deposed leader's
    assert claimed_by_a_peer([], 7) == LeaderBeat(False, None)
    t = timer("b", now=0.0)
    for now in (0.2, 0.4, 0.6, 0.8, 1.0):  # a claim every beat: never silent long enough
        actions = t.update(now, LIVE, "follower", None, 7, claimed_by_a_peer([LeaderClaim(7, now)], 7))
        assert hastens(actions) == [] and HoldElection(HOLD) in actions
    due = 1.0 + BEAT + OVERDUE + HASTEN_SPACING_S  # b is second of a, b, c
    assert hastens(t.update(due, LIVE, "follower", None, 7, claimed_by_a_peer([LeaderClaim(7, 1.0)], 7))) == [
        HastenElection(0.0)]  # the claims stopped: an election after the same silence as for a named leader


def test_a_majority_to_campaign_counts_live_peers_heard_within_the_window():
    window = campaign_window(0.2, 0.3)
    assert 0.2 < window < 0.3  # longer than a beat, shorter than the silence that starts an election
    members = frozenset("abc")
    # b's leader a froze: c still beats every 0.2 s.
    assert can_campaign(10.0, frozenset("bc"), {"a": 9.4, "c": 9.85}, members, "b", window)
    # b's receive path is cut: a and c were last heard when the cut began, >= 0.3 s before its
    # election was due; their datagrams said they heard it (still "live" for suspect_timeout).
    assert not can_campaign(10.0, frozenset("abc"), {"a": 9.6, "c": 9.7}, members, "b", window)
    assert not can_campaign(10.0, frozenset("b"), {"a": 9.6, "c": 9.7}, members, "b", window)
    # heard, but saying it does not hear b (not live): not counted.
    assert not can_campaign(10.0, frozenset("b"), {"a": 9.95, "c": 9.95}, members, "b", window)
    assert can_campaign(10.0, frozenset("bc"), None, members, "b", window)  # no arrival times: live counts
    five = frozenset("abcde")
    assert not can_campaign(10.0, frozenset("bc"), {"c": 9.9}, five, "b", window)
    assert can_campaign(10.0, frozenset("bcd"), {"c": 9.9, "d": 9.9}, five, "b", window)
    assert can_campaign(10.0, frozenset("a"), {}, frozenset("a"), "a", window)  # a fleet of one


def test_the_leader_itself_never_hastens_or_holds():
    t = timer("a")
    assert t.update(5.0, frozenset("a"), "leader", "a", 3, LeaderBeat(True, 0.0)) == []
    assert t.next_due == float("inf")


# ---- pysyncobj's election deadline: one accessor ------------------------------------------------------


def test_pysyncobj_still_keeps_the_election_deadline_where_the_accessor_looks():
    """Fails when pysyncobj renames ``__raftElectionDeadline`` (read by its tick, set by its
    append_entries and votes): membership.raft.election_deadline must follow."""
    source = inspect.getsource(SyncObj)
    assert raft.ELECTION_DEADLINE == "_SyncObj__raftElectionDeadline"
    assert "self.__raftElectionDeadline = monotonicTime() + self.__generateRaftTimeout()" in source
    assert "if self.__raftElectionDeadline < monotonicTime() and self.__connectedToAnyone():" in source


class FakeReplica:
    """Just what hold_election and hasten_election use of a replica."""

    def __init__(self, deadline_in: float) -> None:
        setattr(self, raft.ELECTION_DEADLINE, raft.raft_clock() + deadline_in)

    def left(self) -> float:
        return raft.election_deadline(self) - raft.raft_clock()


def test_hold_only_moves_a_future_deadline_later_and_hasten_only_earlier():
    r = FakeReplica(0.5)
    raft.RaftReplica.hold_election(r, 3.0)
    assert 2.9 < r.left() <= 3.0
    raft.RaftReplica.hold_election(r, 1.0)  # earlier: ignored
    assert r.left() > 2.8
    raft.RaftReplica.hasten_election(r, 0.0)  # never in the past: the tick thread's wait ends at it
    assert 0.0 < r.left() <= raft.MIN_WAIT_S
    transfer = FakeReplica(-1.0)  # past: a leadership transfer's TimeoutNow, pysyncobj acts on it next
    raft.RaftReplica.hold_election(transfer, 3.0)
    assert transfer.left() < 0


def test_defer_moves_even_a_past_deadline_later_and_never_earlier():
    r = FakeReplica(-0.5)  # past: pysyncobj would start an election at its next tick
    raft.RaftReplica.defer_election(r, 1.0)
    assert 0.9 < r.left() <= 1.0
    raft.RaftReplica.defer_election(r, 0.2)  # earlier: ignored
    assert r.left() > 0.8


def _elect(survivors: dict[str, int], dead_leader: str, term: int, until: float = 5.0) -> tuple[str | None, float]:
    """Two or more survivors of a dead leader, driven by their ElectionTimers alone (Raft's backstop
    never fires within ``until``), ``survivors`` naming each one's last log index. Raft's rules for a
    vote request: a voter at a lower term moves to the request's term; it grants its vote if it has
    not voted in that term and the candidate's log is at least as long as its own. Returns the
    leader and when, or (None, until)."""
    timers = {n: timer(n, 0.0) for n in survivors}
    terms = dict.fromkeys(survivors, term)
    roles = dict.fromkeys(survivors, "follower")
    leaders: dict[str, str | None] = dict.fromkeys(survivors, dead_leader)
    voted: dict[str, int] = {}
    live = frozenset(survivors)
    now = 0.0
    while now < until:
        for n in sorted(survivors):
            actions = timers[n].update(now, live, roles[n], leaders[n], terms[n])
            if not any(isinstance(a, HastenElection) and a.within_s <= 0.01 for a in actions):
                continue  # asks now (within a step) or not at all this step
            terms[n] += 1
            roles[n], leaders[n], voted[n] = "candidate", None, terms[n]
            votes = 1
            for v in survivors:
                if v == n:
                    continue
                if terms[v] < terms[n]:
                    terms[v], roles[v], leaders[v] = terms[n], "follower", None
                if terms[v] == terms[n] and voted.get(v) != terms[n] and survivors[n] >= survivors[v]:
                    voted[v] = terms[n]
                    votes += 1
            if 2 * votes > len(survivors) + 1:  # the dead leader is still a member
                return n, now
        now = round(now + 0.01, 2)
    return None, until


def test_survivors_whose_first_in_order_has_the_shorter_log_still_elect_within_two_rounds():
    """After a leader dies, survivors ask in an order; if the first one's log is behind (a follower's
    log can shrink for a moment: pysyncobj drops the entries after a late append_entries' prevLogIdx),
    the other refuses it. The order moves on with the term, so the refusing one asks next instead of
    the same first one asking again every round until Raft's own timer (3-4.5 s) breaks the tie."""
    for term in range(3, 9):
        winner, at = _elect({"b": 40, "c": 41}, "a", term)
        assert winner == "c" and at < 2 * (BEAT + OVERDUE + HASTEN_SPACING_S) + 0.2, (term, winner, at)
        winner, at = _elect({"b": 41, "c": 41}, "a", term)  # equal logs: the first asker wins at once
        assert winner is not None and at < 0.2, (term, winner, at)
