"""``MemberCore``: one fleet member's decisions, sans-IO.

The core takes events and time and returns actions; it reads no clock, draws
no random number, starts no thread and touches no socket. ``Member``
(membership/member.py) feeds it from pysyncobj and the heartbeat sockets and
executes what it returns; ``membership.sim`` feeds it simulated time and a
simulated Raft. Inputs, on every tick: ``now``, the live set from heartbeats,
whether every peer has been heard once, and a :class:`RaftView` (role, leader,
term, committed state); besides, the local brokers (:meth:`set_brokers`) and
the results of the commands it asked to submit (:meth:`join_done`,
:meth:`plan_done`). Actions, in the order the shell must execute them:
:class:`KeepLinksOpen`, :class:`Emit`, :class:`HastenElection` / :class:`HoldElection` /
:class:`DeferElection`, :class:`SubmitJoin`, :class:`SubmitPlan`, :class:`NewRoster`, :class:`NewState`,
:class:`Publish`.

What it decides:

* **suspicion**: peer up/down events from the heartbeat view;
* **the no-quorum lease** (:class:`QuorumLease`): quorum means a majority of
  the configured members live *and* a leader we can hear;
* **elections**: the leader's UDP beat holds them off; a silent or dead leader
  starts one, followers in id order turned by the term (membership.election, :class:`ElectionTimer`);
* **Raft links kept open** every ``connection_timeout / 4``: those to live
  peers (see :class:`KeepLinksOpen`);
* **join gating**: propose our own ``Join`` (with the state formats this node
  reads) until the committed state holds it (never once the committed roster no
  longer lists us: a removed node); a committed state whose format this node
  cannot read makes it refuse to serve (:class:`Refuse`, once);
* **the roster**: the members are the committed ``state.roster`` once a live
  membership change was made (the configured ones before): the quorum count,
  the peers tracked and the nodes' addresses follow it (:class:`NewRoster`);
* **plan gating**: on the leader only, after warm-up, one command in flight
  with a deadline, re-planned at least every ``PLAN_INTERVAL_S``; when the
  planner has nothing to do, a state format upgrade every member supports
  (membership.formats.next_format);
* **the serving map**: rebuilt when its inputs change, published with a new
  ``version`` when what it serves changed.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import attrs

from membership.commands import APPLIED, REJECTED, REMOVE, Command, Join, MemberChange, Result, SetFormat
from membership.config import MemberConfig, MemberSpec
from membership.effective import QuorumLease, build_serving_map, committed_is_sane, committed_vacant
from membership.election import (NO_BEAT, DeferElection, ElectionTimer, HastenElection, HoldElection, LeaderBeat,
                                 campaign_window, can_campaign)
from membership.formats import SUPPORTED, FormatRange, next_format, refusal
from membership.planner import Planner
from membership.serving import ServingMap
from membership.state import FleetState
from topology import Broker, ProxyId

# The leader re-plans at least this often even when nothing changed (rebalance timers).
PLAN_INTERVAL_S = 0.1
# A leader being removed asks a follower to take over this often until one has.
HAND_OVER_RETRY_S = 0.2
# A failed Join is retried after this long (a successful one: at the next tick, if still needed).
JOIN_RETRY_S = 0.2
# After its own stall (a freeze, a long pause) a node neither starts an election nor plans for
# this many beats: the peers' datagrams queued while it was frozen say "we no longer hear you",
# true of the freeze and undone within milliseconds of its first beat, but acted on at once it
# deposed a healthy leader and, as the new one, marked a healthy node down (emulated hosts).
RELISTEN_BEATS = 2


@attrs.frozen(slots=True)
class RaftView:
    """What the local Raft replica says this tick."""

    role: str = "follower"  # "follower", "candidate" or "leader"
    leader: ProxyId | None = None
    term: int = 0
    state: FleetState = FleetState()


@attrs.frozen(slots=True)
class MemberView:
    """The member's own view, as ``status()`` reports it."""

    role: str = "follower"
    term: int = 0
    leader: ProxyId | None = None
    has_quorum: bool = False
    degraded: bool = False


# ---- actions ----------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class KeepLinksOpen:
    """Keep the Raft links to ``peers`` from being dropped as idle.

    pysyncobj checks a connection's timeout when it *sends*: a link that read
    nothing for connection_timeout (follower to follower, all the time in a
    stable cluster) is dropped by the first message sent on it, and that
    first message is a candidate's vote request when the leader dies.
    Measured: the vote was lost, both followers became candidates and the
    election took a second round (~0.5 s instead of ~0.1 s).

    ``peers`` are the live ones: each sent us an authenticated heartbeat
    within suspect_timeout (<= connection_timeout), so the link's idleness
    says nothing the heartbeat does not already know better. The shell marks
    those links as read just now; no message is sent (a no-op Raft message
    per link, encrypted at both ends, was a large share of an idle node's CPU)."""

    peers: frozenset[ProxyId]


@attrs.frozen(slots=True)
class SubmitJoin:
    """Propose ``command``; report its outcome with :meth:`MemberCore.join_done`."""

    token: int
    command: Join


@attrs.frozen(slots=True)
class SubmitPlan:
    """Propose the leader's ``command``; report with :meth:`MemberCore.plan_done`."""

    token: int
    command: Command


@attrs.frozen(slots=True)
class Emit:
    """A membership event for status() and measurements (the shell stamps wall-clock time)."""

    t: float
    event: str
    fields: tuple[tuple[str, Any], ...] = ()

    def record(self, ts_ns: int) -> dict[str, Any]:
        return {"t": self.t, "ts_ns": ts_ns, "event": self.event, **dict(self.fields)}


@attrs.frozen(slots=True)
class HandOver:
    """This leader is being removed and owns nothing: make a caught-up follower leader."""


@attrs.frozen(slots=True)
class NewRoster:
    """The committed members changed (a live membership change): beat to these peers."""

    members: tuple[MemberSpec, ...]


@attrs.frozen(slots=True)
class NewState:
    """The committed state changed (wake whoever waits on it)."""

    state: FleetState


@attrs.frozen(slots=True)
class Publish:
    """A new serving map: hand it to the subscribers."""

    map: ServingMap


@attrs.frozen(slots=True)
class Refuse:
    """This node cannot read the fleet's committed state format: it must not serve
    (the shell stops it; ``reason`` says which formats it supports)."""

    reason: str


Action = (KeepLinksOpen | HastenElection | HoldElection | DeferElection | SubmitJoin | SubmitPlan | HandOver | Emit
          | NewRoster | NewState | Publish | Refuse)


def _emit(now: float, event: str, **fields: Any) -> Emit:
    return Emit(now, event, tuple(fields.items()))


def majority_heard_at(heard_at: Mapping[ProxyId, float], members: Collection[ProxyId], self_id: ProxyId) -> float | None:
    """The last time this node and a majority of ``members`` had all been heard from: the
    arrival of the datagram that completed it (None if they never were). Once the majority is
    gone no leader can be elected until peers come back, so waiting for one is pointless; and
    a peer cut off from all the others fences itself once it has not heard them for
    ``suspect_timeout`` (membership.liveness ``isolated``), well inside the lease from then."""
    need = len(members) // 2  # peers besides this node: 2 * (need + 1) > len(members)
    if need == 0:
        return None
    times = sorted((t for p, t in heard_at.items() if p in members and p != self_id), reverse=True)
    return times[need - 1] if len(times) >= need else None


class MemberCore:
    def __init__(self, config: MemberConfig, now: float, formats: FormatRange = SUPPORTED) -> None:
        """``formats``: the state formats this node reads and writes (membership.formats)."""
        self.config = config
        self.node_id: ProxyId = config.node_id
        self._me = config.me.node
        self.formats = formats
        self.refused: str | None = None
        self._all_ids = frozenset(m.id for m in config.members)
        self._peer_ids = tuple(m.id for m in config.peers)
        self._configured = config.nodes()
        self.roster: tuple[MemberSpec, ...] = tuple(config.members)
        self.live: frozenset[ProxyId] = frozenset([self.node_id])
        self.isolated = False
        self.hearing: frozenset[ProxyId] = frozenset()
        self.refused_peers: frozenset[ProxyId] = frozenset()
        self._planner = Planner(config.rebalance_delay, broker_grace=config.broker_grace)
        self._tokens = itertools.count(1)
        self._started_at = now
        self._last_tick: float | None = None
        # After this node's own stall, until then: its view of the peers is the freeze's, not theirs.
        self._relisten_until = float("-inf")
        self._lease = QuorumLease(config.quorum_lease, now)
        self.election = ElectionTimer(self.node_id, config.raft_min_timeout,
                                      config.raft_max_timeout - config.raft_min_timeout,
                                      config.heartbeat_interval, config.raft_backstop_timeout, now)
        self._campaign_window = campaign_window(config.heartbeat_interval, config.raft_min_timeout)
        # Read by the shell (single attribute reads from any thread).
        self.view = MemberView()
        self.state = FleetState()
        self.serving = ServingMap()
        self.local_brokers: tuple[Broker, ...] | None = None
        self.peer_changed_at: dict[ProxyId, float] = {}
        self._peer_live: dict[ProxyId, bool] = {}
        self._was_leader = False
        self._inflight: int | None = None
        self._inflight_deadline = 0.0
        self._join_token: int | None = None
        self._next_join_at = 0.0
        self._next_keepalive = 0.0
        self._next_plan_at = 0.0
        self._next_hand_over = 0.0
        self._plan_key: tuple = ()
        self._map_key: tuple = ()
        self._sane_key: tuple = ()
        self._sane = False
        self._joined: tuple[FleetState, bool] | None = None  # joined(state), kept for that state object
        self._tracked: tuple[frozenset[ProxyId], tuple[ProxyId, ...]] | None = None  # _track_peers' last inputs
        # (state, members, next_format's answer): the leader asks on every plan, of the same state.
        self._format_target: tuple[FleetState, frozenset[ProxyId], int | None] | None = None
        # Stand-in duties follow the last view that was committed and not degraded.
        self._vacant: frozenset[ProxyId] = frozenset()

    def started(self, now: float) -> None:
        """The member's Raft is up at ``now``: warm-up and the lease count from here."""
        self._started_at = now
        self._lease = QuorumLease(self.config.quorum_lease, now)
        self.election.started(now)

    # ---- inputs besides the tick -------------------------------------------------------------

    def set_brokers(self, brokers: Iterable[Broker]) -> None:
        """The upstream brokers the local data path sees; empty means "does not know"."""
        reported = tuple(sorted(brokers, key=lambda b: b.id))
        if reported:
            self.local_brokers = reported

    def join_done(self, token: int, ok: bool, now: float) -> None:
        if self._join_token == token:
            self._next_join_at = now + (0.0 if ok else JOIN_RETRY_S)

    def plan_done(self, token: int, command: Command, result: Result | None, error: object, now: float) -> list[Action]:
        """``result`` is the state machine's answer, or None when not committed (``error`` says why)."""
        if self._inflight == token:
            self._inflight = None
            self._next_plan_at = 0.0
        name = type(command).__name__
        if result is None:
            return [_emit(now, "not_committed", command=name, error=error)]
        fields: dict[str, Any] = {"command": name, "epoch": result.epoch}
        nodes = getattr(command, "nodes", None)
        if nodes:
            fields["nodes"] = sorted(nodes)
        if result.outcome == APPLIED:
            return [_emit(now, "committed", **fields)]
        if result.outcome == REJECTED:
            return [_emit(now, "rejected", reason=result.reason, **fields)]
        return []

    # ---- the tick ----------------------------------------------------------------------------

    def tick(self, now: float, live: frozenset[ProxyId], heard_all: bool, raft: RaftView,
             isolated: bool = False, leader_beat: LeaderBeat = NO_BEAT,
             hearing: frozenset[ProxyId] | None = None,
             heard_at: Mapping[ProxyId, float] | None = None,
             refused: frozenset[ProxyId] = frozenset()) -> list[Action]:
        """``live``: this node and every peer that is live both ways (membership.liveness);
        ``heard_all``: every peer has been in two-way contact once since this process started;
        ``isolated``: this node hears no peer and they all fell silent at once (it is
        more likely the one cut off: its map then claims no peer's address); ``leader_beat``:
        what the heartbeat says of the leader Raft names (membership.election); ``hearing``: the
        peers this node hears, whether or not they hear it (default: ``live``); in degraded
        mode only the silent ones count as unreachable (membership.effective); ``heard_at``: when
        each peer was last heard (with no majority left, the quorum lease counts from the last
        time one was heard, :func:`majority_heard_at`); ``refused``: the peers whose host refused a
        heartbeat since they were last heard (membership.liveness ``refused_peers``), for the map."""
        out: list[Action] = []
        self.hearing = live if hearing is None else hearing
        self.refused_peers = refused
        if isolated != self.isolated:
            self.isolated = isolated
            out.append(_emit(now, "isolated" if isolated else "not_isolated"))
        if raft.state.roster and raft.state.roster != self.roster:
            self._adopt_roster(raft.state.roster, now, out)
        self.live = live
        if now >= self._next_keepalive:
            self._next_keepalive = now + self.config.connection_timeout / 4
            out.append(KeepLinksOpen(frozenset(live & self._all_ids) - {self.node_id}))
        self._track_peers(live, now, out)
        state, role, leader = raft.state, raft.role, raft.leader
        majority = 2 * len(live & self._all_ids) > len(self._all_ids)
        has_quorum = majority and leader is not None and leader in live
        sane_key = (state, live)
        if sane_key != self._sane_key:
            self._sane_key, self._sane = sane_key, committed_is_sane(state, live)
        # After a stall of this node (a freeze, a long pause) the peers' silence is its own deafness.
        stalled_for = 0.0 if self._last_tick is None else now - self._last_tick
        stalled = stalled_for > 2 * self.config.heartbeat_interval
        self._last_tick = now
        if stalled_for > self.config.suspect_timeout:
            # Only then did the peers stop hearing it (a busy machine's late tick is not a freeze).
            self._relisten_until = now + RELISTEN_BEATS * self.config.heartbeat_interval
        relistening = now < self._relisten_until
        lost_at = (None if majority or heard_at is None or stalled
                   else majority_heard_at(heard_at, self._all_ids, self.node_id))
        degraded = self._lease.update(now, has_quorum, self._sane, lost_at)
        if degraded != self.view.degraded:
            out.append(_emit(now, "degraded" if degraded else "quorum_back"))
        if role != self.view.role or leader != self.view.leader:
            out.append(_emit(now, "role", role=role, leader=leader, term=raft.term))
        view = self.view
        if (view.role, view.term, view.leader, view.has_quorum, view.degraded) != (role, raft.term, leader,
                                                                                     has_quorum, degraded):
            self.view = MemberView(role, raft.term, leader, has_quorum, degraded)

        # In two-way contact with a majority, each heard within the campaign window: needed to ask
        # for votes and, as leader, to propose. "Live" alone is not enough: a host whose receive path
        # was just cut still counts a peer live until suspect_timeout, and the peers' last datagrams
        # expire one by one: for a moment it saw exactly a majority and, as leader, proposed marking
        # the other one down (its followers appended it; the next leader committed it).
        in_contact = can_campaign(now, live, heard_at, self._all_ids, self.node_id, self._campaign_window)
        if not relistening:
            out.extend(self.election.update(now, live, role, leader, raft.term, leader_beat, in_contact))
        if self.refused is None:
            self._check_format(state, now, out)
        if self.refused is not None:  # never joins, plans or publishes again
            if state is not self.state:
                self.state = state
                out.append(NewState(state))
            return out
        self._maybe_join(state, now, out)
        if role == "leader":
            if not self._was_leader:
                self._planner.reset()
                self._was_leader = True
            # A leader out of contact with a majority proposes nothing: it cannot commit, and a
            # one-way cut leader's followers still take its entries, so its view of the others
            # (all down: it hears nobody) reached the log and the next leader committed it.
            if not relistening and in_contact:
                self._maybe_plan(state, live, heard_all, now, out)
            self._maybe_hand_over(state, now, out)
        elif self._was_leader:
            self._planner.reset()
            self._was_leader = False

        if state is not self.state:
            self.state = state
            out.append(NewState(state))
        self._update_map(state, live, degraded, now, out)
        return out

    def _maybe_hand_over(self, state: FleetState, now: float, out: list[Action]) -> None:
        """Raft cannot remove its own leader (pysyncobj denies it): a leader being
        removed hands over once its identities are gone, then a follower removes it."""
        if state.change != MemberChange(REMOVE, self.node_id) or now < self._next_hand_over:
            return
        if self.node_id in state.repaired().values():
            return
        self._next_hand_over = now + HAND_OVER_RETRY_S
        out.append(_emit(now, "hand_over"))
        out.append(HandOver())

    def _adopt_roster(self, roster: tuple[MemberSpec, ...], now: float, out: list[Action]) -> None:
        self.roster = roster
        self._all_ids = frozenset(m.id for m in roster)
        self._peer_ids = tuple(m.id for m in roster if m.id != self.node_id)
        self._configured = {m.id: m.node for m in roster}
        for gone in set(self._peer_live) - self._all_ids:
            self._peer_live.pop(gone, None)
            self.peer_changed_at.pop(gone, None)
        out.append(_emit(now, "roster", members=sorted(self._all_ids)))
        out.append(NewRoster(tuple(m for m in roster if m.id != self.node_id)))

    def _track_peers(self, live: frozenset[ProxyId], now: float, out: list[Action]) -> None:
        # The same live set (the heartbeat hands over the same object while it is unchanged) and
        # the same peers as last time: every _peer_live entry already says what the loop would.
        tracked = self._tracked
        if (tracked is not None and tracked[0] is live and tracked[1] is self._peer_ids
                and type(live) is frozenset):
            return
        self._tracked = (live, self._peer_ids)
        for p in self._peer_ids:
            is_live = p in live
            if self._peer_live.get(p) != is_live:
                if p in self._peer_live or is_live:
                    out.append(_emit(now, "peer_up" if is_live else "peer_down", node=p))
                self._peer_live[p] = is_live
                self.peer_changed_at[p] = now

    def joined(self, state: FleetState) -> bool:
        """The committed state holds this node's record and the formats it reads."""
        memo = self._joined
        if memo is not None and memo[0] is state:  # FleetState is immutable: asked on every tick
            return memo[1]
        joined = (any(n == self._me for n in state.members)
                  and state.format_map().get(self.node_id) == self.formats)
        self._joined = (state, joined)
        return joined

    def _check_format(self, state: FleetState, now: float, out: list[Action]) -> None:
        reason = refusal(self.node_id, state.format, self.formats)
        if reason is not None:
            self.refused = reason
            out.append(_emit(now, "format_refused", format=state.format, supported=str(self.formats)))
            out.append(Refuse(reason))

    def _maybe_join(self, state: FleetState, now: float, out: list[Action]) -> None:
        """Until the committed state holds this node's own record, propose
        Join (forwarded to the leader, queued while there is none); one
        attempt at a time, retried after a failure or after commit_timeout."""
        if now < self._next_join_at or self.joined(state):
            return
        if self.node_id not in self._all_ids:  # removed from the fleet: never come back by itself
            return
        self._next_join_at = now + self.config.commit_timeout
        self._join_token = next(self._tokens)
        out.append(SubmitJoin(self._join_token, Join(self._me, self.formats)))

    def _maybe_plan(
        self, state: FleetState, live: frozenset[ProxyId], heard_all: bool, now: float, out: list[Action]
    ) -> None:
        # Until every peer has been heard once (or suspect_timeout has passed)
        # our view is incomplete: never mark anyone down on it.
        if not heard_all and now - self._started_at < self.config.suspect_timeout:
            return
        if self._inflight is not None:
            if now < self._inflight_deadline:
                return
            self._inflight = None
        key = (state, live, self.local_brokers)
        if key == self._plan_key and now < self._next_plan_at:
            return
        self._plan_key, self._next_plan_at = key, now + PLAN_INTERVAL_S
        command = self._planner.next_command(state, live, now, self.local_brokers)
        if command is None:
            kept = self._format_target
            if kept is None or kept[0] is not state or kept[1] is not self._all_ids:
                target = next_format(state.format, state.format_map(), self._all_ids | state.member_ids())
                kept = self._format_target = (state, self._all_ids, target)
            command = None if kept[2] is None else SetFormat(kept[2], state.epoch)
        if command is None:
            return
        self._inflight, self._inflight_deadline = next(self._tokens), now + self.config.commit_timeout
        out.append(_emit(now, "propose", command=type(command).__name__, epoch=state.epoch))
        out.append(SubmitPlan(self._inflight, command))

    def _update_map(
        self, state: FleetState, live: frozenset[ProxyId], degraded: bool, now: float, out: list[Action]
    ) -> None:
        local = self.local_brokers or ()
        key = (state, live, degraded, local, self.isolated, self.hearing if degraded else None, self.refused_peers)
        if key == self._map_key:
            return
        self._map_key = key
        if not degraded and state.epoch > 0:
            self._vacant = committed_vacant(state)
        prev = self.serving
        new = build_serving_map(
            state,
            self_id=self.node_id,
            configured=self._configured,
            reachable=live,
            degraded=degraded,
            local_brokers=local,
            vacant=self._vacant,
            version=prev.version + 1,
            changed_at=now,
            isolated=self.isolated,
            hearing=self.hearing | {self.node_id},
            refused=self.refused_peers,
        )
        if new.same_table(prev):
            return
        self.serving = new
        out.append(_emit(now, "effective", epoch=new.epoch, version=new.version, degraded=new.degraded))
        out.append(Publish(new))
