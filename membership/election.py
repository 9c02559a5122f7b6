"""When a follower starts a Raft election: on the leader's UDP beat, not on Raft's own timer.

pysyncobj's follower starts an election when no ``append_entries`` arrived for its election
timeout, so the leader must send one to every follower several times per timeout whether or not
the log changed: each is pickled, compressed, encrypted and answered, a wake-up on both ends
and most of an idle fleet's CPU (BENCHMARKS.md, "Idle cost: where the CPU goes"). The
heartbeat already proves at every beat (0.2 s) that each peer is alive, for one HMAC and no
answer. So the proof that the leader is alive is its beat (membership.liveness: each datagram
carries the sender's term and whether it leads it), and Raft's own timers become a slow
backstop (``MemberConfig.raft_backstop_timeout``, with idle append_entries every
``append_entries_period``). :class:`ElectionTimer` decides, from the beat:

* **hold**: a beat from the leader we know, claiming leadership of our term or a later one,
  pushes Raft's election deadline forward (:class:`HoldElection`): a leader whose beats arrive
  is alive even if an append_entries is late. With no leader known, a live peer's claim does the
  same (:func:`claimed_by_a_peer`): its append_entries are on their way. A deposed leader claims
  an older term, and a node that stepped down claims nothing: neither holds anyone's election off.
* **leader silent**: a leader that beats but whose claim is ``raft_min_timeout`` overdue (its
  next beat was due ``heartbeat_interval`` after the last), or no leader at all for as long (a
  lost election, a fresh fleet), starts an election (:class:`HastenElection`), followers in id
  order turned by the term, the last one at ``raft_max_timeout`` overdue: the first one's vote
  request reaches the others before their turn, and after a refused round another node asks first.
* **leader dead**: the heartbeat declared the leader down (its process died and its port
  refuses, or it fell silent for ``suspect_timeout``, or it stopped hearing us): an election at
  once, survivors in id order (turned by the term) ``HASTEN_SPACING_S`` apart.
* **no campaign without a majority** (the pre-vote of Raft's thesis, §9.6, on the beat): a
  follower that has not been in two-way contact with a majority (itself counted) within
  :func:`campaign_window` starts no election, neither by the rules above nor by Raft's backstop
  (:class:`DeferElection` on every tick). A host that hears nothing (a one-way cut) sees its
  leader fall silent like everyone else, and its vote requests still go out: each, at a higher
  term, deposed the healthy majority's leader (measured on emulated hosts: 0.5-2 s without a
  leader, then a degraded spell and fencing on the healthy nodes), and its inflated term deposed
  it again after the heal. The window is shorter than the silence that starts an election (the
  leader's beat ``raft_min_timeout`` overdue: at least that long since the cut host last heard
  anyone) and longer than a beat, so a healthy follower, hearing the others every beat, asks at
  once, or at the first beat to arrive after a late one. Back in contact, the silence counts
  anew, and a leader not live yet is given ``CONTACT_SETTLE_BEATS`` beats: the first peer heard
  after a heal is seldom the leader (a candidate 3 ms before the leader's beat arrived deposed
  it), and after a two-way cut the leader's first datagrams still say it does not hear us.

A leader whose datagrams carry no term (a node from before the leader's beat, in a rolling
upgrade) still sends append_entries at Raft's old rate, so only the last rule applies to it and
Raft's backstop does the rest; a leader of this version sends them at that rate too while any
peer is such a node (:func:`append_entries_period`), since that peer's election timer runs on them.

Pure: time and every input come from the caller (membership.control feeds it on each tick).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import attrs

from topology import ProxyId

# Survivors of a dead leader ask for votes this far apart, in id order turned by the term (ElectionTimer._order).
HASTEN_SPACING_S = 0.1
# A silent leader's followers ask at least this far apart (their window may be narrower).
MIN_SPACING_S = 0.02
# Back in contact after a spell without a majority, the "leader dead" rule waits this many beats:
# after a two-way cut the leader's first datagrams still say it does not hear us (until ours reach it).
CONTACT_SETTLE_BEATS = 2


@attrs.frozen(slots=True)
class HastenElection:
    """Start an election ``within_s`` from now unless Raft's own deadline is earlier."""

    within_s: float


@attrs.frozen(slots=True)
class HoldElection:
    """The leader just proved it is alive: let Raft's election deadline be no earlier than
    ``for_s`` from now (an election pysyncobj is about to start is left alone)."""

    for_s: float


@attrs.frozen(slots=True)
class DeferElection:
    """This node cannot win an election now (no majority in two-way contact): let Raft's
    election deadline be no earlier than ``for_s`` from now, even one already past."""

    for_s: float


@attrs.frozen(slots=True)
class LeaderBeat:
    """What the heartbeat says of the leader Raft names: ``beats``, its datagrams carry a term
    (it claims leadership in them); ``claimed_at``, when its latest datagram arrived if that
    one claimed leadership of our term or a later one (else None)."""

    beats: bool = False
    claimed_at: float | None = None


NO_BEAT = LeaderBeat()


@attrs.frozen(slots=True)
class LeaderClaim:
    """A peer's latest datagram said it is the Raft leader of ``term``; it arrived at ``at``."""

    term: int
    at: float


def leader_beat(beats: bool, claim: LeaderClaim | None, term: int) -> LeaderBeat:
    """The leader Raft names at our ``term``: it ``beats`` (its datagrams carry a term), and its
    latest ``claim``. A claim of an older term is a deposed leader's, which holds nothing off."""
    return LeaderBeat(beats, claim.at if claim is not None and claim.term >= term else None)


def claimed_by_a_peer(claims: Iterable[LeaderClaim | None], term: int) -> LeaderBeat:
    """Raft names no leader here, but live peers' beats claim leadership of ``term`` or a later
    one: the latest such claim, which holds this node's election off like its leader's beat
    would. A node back from a cut often has no leader yet (its Raft link to the new one is being
    made again, and an idle leader's append_entries come every 0.75 s); asking for votes then, it
    deposed the healthy leader at a higher term it could not win with its short log, over and over
    (1.3 s without a leader after a heal, on emulated hosts)."""
    times = [c.at for c in claims if c is not None and c.term >= term]
    return LeaderBeat(True, max(times)) if times else NO_BEAT


def campaign_window(beat_interval: float, overdue_s: float) -> float:
    """How recently a peer must have been heard, both ways, to count towards the majority a
    follower needs before it asks for votes: halfway between a beat and the silence that
    starts an election (module doc)."""
    return (beat_interval + overdue_s) / 2


def can_campaign(now: float, live: frozenset[ProxyId], heard_at: Mapping[ProxyId, float] | None,
                 members: Collection[ProxyId], self_id: ProxyId, window_s: float) -> bool:
    """This node and enough ``live`` peers heard within ``window_s`` to make a majority of
    ``members`` (``heard_at`` None: every live peer counts)."""
    need = len(members) // 2  # peers besides this node: 2 * (need + 1) > len(members)
    fresh = sum(1 for p in live if p != self_id and p in members
                and (heard_at is None or now - heard_at.get(p, float("-inf")) < window_s))
    return fresh >= need


def append_entries_period(idle_period: float, legacy_period: float, legacy_peers: Collection[ProxyId]) -> float:
    """The leader's append_entries period: ``idle_period``, but ``legacy_period`` while any
    peer's election timer still runs on append_entries (its datagrams carry no term)."""
    return legacy_period if legacy_peers else idle_period


class ElectionTimer:
    """One member's election decisions (see the module doc); :meth:`update` on every tick."""

    __slots__ = ("self_id", "overdue_s", "window_s", "beat_interval", "hold_s", "_key", "_since", "_fired",
                 "_held", "_deferred", "_contact_at", "next_due", "_ordered")

    def __init__(self, self_id: ProxyId, overdue_s: float, window_s: float, beat_interval: float,
                 hold_s: float, now: float) -> None:
        """``overdue_s``/``window_s``: the first follower asks that long after the leader's beat
        was due, the last ``window_s`` later; ``hold_s``: a beat holds Raft's election off that long."""
        self.self_id = self_id
        self.overdue_s = overdue_s
        self.window_s = window_s
        self.beat_interval = beat_interval
        self.hold_s = hold_s
        self._key: tuple[int, ProxyId | None] | None = None
        self._since = now  # when the term or the leader last changed
        self._fired: float | None = None  # the due time already acted on
        self._held: float | None = None  # the claim already acted on
        self._deferred = False  # the last update deferred (no majority in contact)
        self._contact_at = float("-inf")  # when a majority was in contact again after a deferral
        #: When :meth:`update` must run next for a silent leader (inf: nothing pending).
        self.next_due = float("inf")
        # (live, leader, term, _order(...)): the last order, kept while its inputs are the same.
        self._ordered: tuple[frozenset[ProxyId], ProxyId | None, int, list[ProxyId]] | None = None

    def started(self, now: float) -> None:
        self._since = now

    def update(self, now: float, live: frozenset[ProxyId], role: str, leader: ProxyId | None, term: int,
               beat: LeaderBeat = NO_BEAT,
               electable: bool = True) -> list[HastenElection | HoldElection | DeferElection]:
        """``electable``: this node is in two-way contact with a majority (:func:`can_campaign`)."""
        self.next_due = float("inf")
        if (term, leader) != self._key:
            if self._key is not None:  # the first view is the one at start: the silence counts from there
                self._since = now
            self._key = (term, leader)
        if role == "leader":
            return []
        if not electable:
            self._deferred = True
            return [DeferElection(self.hold_s)]
        if self._deferred:  # back in contact: the leader's silence counts from now (its beat may
            self._deferred = False  # arrive a few ms after the first peer's)
            self._since = self._contact_at = now
        if leader is not None and leader not in live:
            settled = self._contact_at + CONTACT_SETTLE_BEATS * self.beat_interval
            if now < settled:  # the leader's first datagrams may still say it does not hear us
                self.next_due = settled
                return []
            order = self._ordered_survivors(live, leader, term)
            return [HastenElection(order.index(self.self_id) * HASTEN_SPACING_S if self.self_id in order
                                   else len(order) * HASTEN_SPACING_S)]
        out: list[HastenElection | HoldElection | DeferElection] = []
        if beat.claimed_at is not None and beat.claimed_at != self._held:
            self._held = beat.claimed_at
            out.append(HoldElection(self.hold_s))
        if leader is None or beat.beats:
            due = self._silence_due(live, leader, beat, term)
            if now < due:
                self.next_due = due
            elif due != self._fired:
                self._fired = due
                out.append(HastenElection(0.0))
        return out

    def _silence_due(self, live: frozenset[ProxyId], leader: ProxyId | None, beat: LeaderBeat, term: int) -> float:
        """When this follower asks for votes if nothing is heard from a leader until then."""
        proof = self._since if beat.claimed_at is None else max(self._since, beat.claimed_at)
        order = self._ordered_survivors(live, leader, term)
        rank = order.index(self.self_id) if self.self_id in order else len(order)
        spacing = max(MIN_SPACING_S, min(HASTEN_SPACING_S, self.window_s / max(1, len(order) - 1)))
        return proof + self.beat_interval + self.overdue_s + rank * spacing

    def _ordered_survivors(self, live: frozenset[ProxyId], leader: ProxyId | None, term: int) -> list[ProxyId]:
        """:meth:`_order`, kept while ``live``, ``leader`` and ``term`` stay the same (asked on
        every tick; the caller only reads it)."""
        kept = self._ordered
        if kept is not None and kept[0] == live and kept[1] == leader and kept[2] == term:
            return kept[3]
        order = self._order(live, leader, term)
        self._ordered = (live, leader, term, order)
        return order

    @staticmethod
    def _order(live: frozenset[ProxyId], leader: ProxyId | None, term: int) -> list[ProxyId]:
        """Survivors in id order, turned by the term: random jitter smaller than a tick collided
        about one time in three (ticks run in lockstep), and every node at a term agrees on its
        order. Turned, because the first one may be refused round after round: a follower's log
        can be shorter than its peers' for a moment (pysyncobj drops a follower's entries after a
        late append_entries' prevLogIdx), and a voter with a longer log refuses it; each refusal
        moves both to the candidate's term and restarts both silences, so with one fixed order the
        same node would ask first every round (every ~0.55 s) until Raft's own 3-4.5 s timer broke
        the tie (a model of two survivors, tests/unit/test_leader_beat.py; seen once on emulated
        hosts with the turn: refused at term 2, the other asked first at term 3 and won). Turned
        by the term, the next round's first is another node."""
        order = sorted(live - {leader}) if leader is not None else sorted(live)
        if len(order) > 1:
            turn = term % len(order)
            order = order[turn:] + order[:turn]
        return order
