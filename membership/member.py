"""``Member``: one proxy node's membership — the interface the data path uses.

A thin shell: every decision is :class:`membership.control.MemberCore`'s; this
class owns the threads, the pysyncobj ``RaftReplica``, the heartbeat sockets,
and executes the core's actions.

Threads (all started by :meth:`Member.start`, all joined by :meth:`stop`):

* the **pysyncobj tick thread** runs Raft and, through a tick callback, the
  core's tick (heartbeat sockets sit in pysyncobj's poller). Nothing in it
  blocks; it wakes on socket events or when a timer is due (Raft's, the
  heartbeat's, a peer going stale), at the latest every ``autotick_period``. Command
  results come back on this thread too, so the core is single-threaded.
* the **member thread** owns the ``SyncObj`` (pysyncobj stops ticking when the
  thread that created it exits, so it must be ours, not the caller's) and
  calls subscribers, so a slow subscriber never delays Raft.

The data path reads :meth:`serving_map` (an attribute read, no lock) per
Metadata response and reacts to :meth:`subscribe` callbacks.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pysyncobj import FAIL_REASON

from membership import control
from membership.commands import (ADD, REJECTED, REMOVE, BeginAdd, BeginRemove, Command, Drain, FinishRemove,
                                  MemberChange, Result, Undrain)
from membership.config import MemberConfig, MemberSpec
from membership.control import MemberCore, RaftView
from membership.election import NO_BEAT, LeaderBeat, append_entries_period, claimed_by_a_peer, leader_beat
from membership.formats import SUPPORTED, FormatRange
from membership.heartbeat import Heartbeat
from membership.liveness import NOBODY
from membership.raft import RaftReplica
from membership.realtime import run_realtime
from membership.roster import ChangeRefused, check_add, check_remove, current_roster
from membership.serving import ServingMap
from membership.state import FleetState
from membership.status import MemberStatus, PeerStatus
from topology import Broker, BrokerId, ProxyId

log = logging.getLogger(__name__)

# After a peer's Raft link dropped, its heartbeat port is probed at once and again this long after
# (seconds): see Member._on_link_lost.
REPROBE_AFTER_S = (0.003, 0.010, 0.030)
# The dispatch thread waits for a new snapshot or stop(), both notify it: the timeout only bounds
# a wait that a lost notification would make endless (an idle node woke it every second).
DISPATCH_WAIT_S = 30.0

# Bounded history of membership events kept for status() and measurements.
EVENT_HISTORY = 200


class MembershipError(RuntimeError):
    """A membership operation was rejected by the state machine."""


class FormatRefused(RuntimeError):
    """This node cannot read the fleet's state format: it must not serve (the message says why)."""


Subscriber = Callable[[ServingMap], None]


class Member:
    def __init__(self, config: MemberConfig, formats: FormatRange = SUPPORTED) -> None:
        """``formats``: the state formats this node reads and writes (membership.formats)."""
        config.validate()
        self.config = config
        self.node_id: ProxyId = config.node_id
        # Event times (status, subscribers) are time.monotonic(): comparable
        # across processes on one Linux machine.
        self._clock = time.monotonic
        self._addr_to_id = {m.raft_address: m.id for m in config.members}
        self._raft_addresses = {m.id: m.raft_address for m in config.members}
        self._core = MemberCore(config, self._clock(), formats)
        self._raft: RaftReplica | None = None
        self._hb: Heartbeat | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._subscribers: list[Subscriber] = []
        self._wake = False  # a new snapshot or a new subscriber for the member thread
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENT_HISTORY)
        self._registered = False  # tick thread only
        # Peers whose Raft link dropped: when to probe their heartbeat port again (tick thread only).
        self._reprobes: dict[str, list[float]] = {}
        # The last RaftView and LeaderBeat handed to the core, reused while their fields are the same.
        self._raft_view = RaftView()
        self._beat_memo: tuple[bool, object, int, LeaderBeat] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Bind the Raft and heartbeat ports and start the threads. Raises on failure."""
        if self._thread is not None:
            raise RuntimeError("already started")
        peers = {m.id: m.heartbeat_address for m in self.config.peers}
        self._hb = Heartbeat(self.node_id, self.config.me.heartbeat_bind, peers, self.config.password or "",
                             self.config.heartbeat_interval, self.config.suspect_timeout, clock=self._clock,
                             origins={m.id: m.origin_ip for m in self.config.peers})
        try:
            self._hb.open()
        except OSError as exc:  # one line naming the listener and its address, not a traceback
            host, port = self.config.me.heartbeat_bind
            raise OSError(exc.errno, f"heartbeat listener (UDP) {host}:{port}: "
                                     f"{os.strerror(exc.errno or 0).lower()}") from None
        self._thread = threading.Thread(target=self._run, name=f"kproxy-member-{self.node_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop()
            raise TimeoutError(f"member {self.node_id} did not start within {timeout}s")
        if self._start_error is not None:
            err = self._start_error
            self._thread.join(timeout)
            self._hb.close()
            if str(err) == "BindError":  # pysyncobj's one word for any failed bind
                raise OSError(errno.EADDRINUSE, f"Raft listener (TCP) {self.config.me.raft_bind_address}: cannot bind "
                                                "(address already in use, or not an address of this host)") from None
            raise RuntimeError(f"member {self.node_id} failed to start: {err}") from err

    def stop(self, timeout: float = 5.0) -> None:
        """Stop Raft, close every socket, join the threads (bounded by ``timeout``)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("member thread of %s did not stop within %ss", self.node_id, timeout)

    def _run(self) -> None:
        # Before pysyncobj's threads start: they inherit it (membership.realtime).
        run_realtime(self.config.realtime_priority, "member")
        raft: RaftReplica | None = None
        try:
            raft = RaftReplica(self.config)
            raft.waitBinded()
        except Exception as exc:  # reported to start()
            self._start_error = exc
            if raft is not None:
                raft.destroy()
            self._started.set()
            return
        self._core.started(self._clock())
        self._raft = raft
        raft.on_link_lost(self._on_link_lost)
        raft.catch_up_at_once()
        raft.trace_links(self._on_link_event)
        raft.cap_poll_wait(self._seconds_to_next_timer)
        raft.addOnTickCallback(self._on_tick)
        self._started.set()
        try:
            self._dispatch_loop()
        finally:
            raft.removeOnTickCallback(self._on_tick)
            raft.destroy()
            deadline = self._clock() + 5.0
            while raft.tick_thread_alive() and self._clock() < deadline:
                self._stop.wait(0.01)  # stop is already set: this is a bounded poll
            if self._hb is not None:
                self._hb.close()

    def _dispatch_loop(self) -> None:
        """Give every subscriber each newer snapshot exactly once (bursts coalesce)."""
        delivered: dict[Subscriber, int] = {}
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._wake or self._stop.is_set(), timeout=DISPATCH_WAIT_S)
                self._wake = False
                subscribers = list(self._subscribers)
            delivered = {cb: v for cb, v in delivered.items() if cb in subscribers}
            snapshot = self._core.serving
            for callback in subscribers:
                if delivered.get(callback, -1) >= snapshot.version:
                    continue
                delivered[callback] = snapshot.version
                try:
                    callback(snapshot)
                except Exception:
                    log.exception("membership subscriber %r failed", callback)

    # ---- the data path's interface -----------------------------------------------------------

    def serving_map(self) -> ServingMap:
        """The whole immutable snapshot: owners, addresses, vacant nodes, stand-ins, version."""
        return self._core.serving

    effective = serving_map

    def effective_assignment(self) -> tuple[int, dict[BrokerId, ProxyId]]:
        """(committed epoch, broker_id -> proxy_id) the data path should advertise."""
        m = self._core.serving
        return m.epoch, m.owner_map()

    def advertised_addresses(self) -> dict[BrokerId, tuple[str, int]]:
        return self._core.serving.address_map()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(map)`` from the member thread after every change of
        the serving map (bursts may be coalesced: the callback always gets the
        latest map), and once right away. Returns an unsubscribe function."""
        with self._cond:
            self._subscribers.append(callback)
            self._wake = True
            self._cond.notify_all()

        def unsubscribe() -> None:
            with self._cond:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def set_brokers(self, brokers: Iterable[Broker]) -> None:
        """The upstream brokers the local data path sees. Used at once in the
        serving map; committed by the leader from its own data path's report
        (so nodes with different views never flip-flop the table). An empty
        list is ignored: Kafka never reports zero brokers, so it means the
        data path does not know."""
        self._core.set_brokers(brokers)

    def raft_peers_connected(self) -> set[str]:
        """Raft addresses of the peers this member holds a Raft connection to."""
        raft = self._raft
        return set() if raft is None else raft.connected_peers()

    def is_leader(self) -> bool:
        return self._core.view.role == "leader"

    def live(self) -> frozenset[str]:
        """The members this node itself hears now (what membership changes are checked against)."""
        return frozenset(self._core.live)

    def committed_state(self) -> FleetState:
        return self._core.state

    def drain(self, node_id: str, timeout: float | None = None) -> int:
        """Move every identity away from ``node_id``; returns the epoch at which
        that is committed. Raises MembershipError if rejected, TimeoutError."""
        state = self._core.state
        if state.change == MemberChange(REMOVE, node_id) and node_id in state.draining:
            return state.epoch  # being removed: drained by the removal (and perhaps cut off from Raft already)
        deadline = self._clock() + (self.config.commit_timeout if timeout is None else timeout)
        self._submit_and_wait(Drain(node_id), deadline)
        state = self._wait_state(lambda s: node_id in s.draining and s.is_valid(), deadline, f"drain {node_id}")
        return state.epoch

    def undrain(self, node_id: str, timeout: float | None = None) -> int:
        """Make ``node_id`` eligible again (it gets identities by the next rebalance)."""
        deadline = self._clock() + (self.config.commit_timeout if timeout is None else timeout)
        self._submit_and_wait(Undrain(node_id), deadline)
        state = self._wait_state(lambda s: node_id not in s.draining, deadline, f"undrain {node_id}")
        return state.epoch

    @property
    def refused(self) -> str | None:
        """Why this node cannot serve in this fleet (its state format), or None."""
        return self._core.refused

    def wait_joined(self, timeout: float) -> bool:
        """Wait until the committed state holds this node (True) or ``timeout`` passes (False:
        no quorum yet, for instance). Raises FormatRefused if the fleet's format is one this
        node cannot read."""
        with self._cond:
            self._cond.wait_for(lambda: self._core.refused is not None or self._core.joined(self._core.state)
                                or self._stop.is_set(), timeout=timeout)
        if self._core.refused is not None:
            raise FormatRefused(self._core.refused)
        return self._core.joined(self._core.state)

    # ---- live membership changes (membership/roster.py has the rules) ------------------------

    def roster(self) -> tuple[MemberSpec, ...]:
        """The fleet's members as committed (the configured ones before any change)."""
        return current_roster(self._core.state, self.config.members)

    def raft_members(self) -> frozenset[str]:
        """Raft addresses in this replica's Raft configuration (itself included)."""
        raft = self._raft
        if raft is None:
            return frozenset()
        for _ in range(10):  # the tick thread may change the set while we copy it
            try:
                return raft.raft_members()
            except RuntimeError:
                continue
        return raft.raft_members()

    def add_member(self, spec: MemberSpec, timeout: float | None = None) -> int:
        """Add ``spec`` to the fleet: commit the new roster, then the Raft change. The
        node's process may start once this returns; the change ends when it is marked
        up (it then gets identities by the planner's rebalance). Asking again for
        the change in flight resumes it. Raises ChangeRefused, MembershipError, TimeoutError."""
        deadline = self._clock() + (self.config.commit_timeout if timeout is None else timeout)
        state = self._core.state
        if not (state.change == MemberChange(ADD, spec.id) and spec in state.roster):
            check_add(state, self.roster(), self._core.live, spec)
            self._submit_current(lambda s: BeginAdd(spec.id, (*current_roster(s, self.config.members), spec),
                                                    s.epoch), deadline)
        self._change_raft(True, spec.raft_address, deadline)
        return self._core.state.epoch

    def remove_member(self, node_id: str, timeout: float | None = None) -> int:
        """Remove ``node_id``: it drains (planned moves), leaves Raft, leaves the state.
        Run on another member: a node cannot hear its own removal committed.
        Raises ChangeRefused, LookupError, MembershipError, TimeoutError."""
        if node_id == self.node_id:
            raise ChangeRefused(f"{node_id!r} cannot remove itself: ask another member")
        deadline = self._clock() + (self.config.commit_timeout if timeout is None else timeout)
        state = self._core.state
        spec = next((m for m in self.roster() if m.id == node_id), None)
        if state.change != MemberChange(REMOVE, node_id) or spec is None:
            check_remove(state, self.roster(), self._core.live, node_id)
            self._submit_current(lambda s: BeginRemove(node_id, current_roster(s, self.config.members), s.epoch),
                                 deadline)
            spec = next(m for m in self.roster() if m.id == node_id)
        self._wait_state(lambda s: s.is_valid() and node_id not in s.owner_map().values(), deadline,
                         f"drain {node_id} before its removal")
        self._change_raft(False, spec.raft_address, deadline)
        self._submit_and_wait(FinishRemove(node_id), deadline)
        return self._core.state.epoch

    def _submit_current(self, make: Callable[[FleetState], Command], deadline: float) -> Result:
        """Submit a command made from the freshest state; re-made when a concurrent commit made it stale."""
        while True:
            try:
                return self._submit_and_wait(make(self._core.state), deadline)
            except MembershipError as exc:
                if "stale epoch" not in str(exc) or self._clock() >= deadline:
                    raise
            if self._stop.wait(0.02):
                raise TimeoutError("member stopped")

    def _change_raft(self, add: bool, address: str, deadline: float) -> None:
        """Until ``address`` is in (add) or out of this replica's Raft configuration.
        pysyncobj denies a change while the previous one is uncommitted, or a removal
        of the leader itself (it hands over first, control.HandOver): retried."""
        raft = self._raft
        if raft is None:
            raise RuntimeError("not started")
        last: object = None
        while (address in self.raft_members()) != add:
            done = threading.Event()
            box: list[int] = []

            def callback(_result: Any, err: int, box: list[int] = box, done: threading.Event = done) -> None:
                box.append(err)
                done.set()

            raft.change_members(add, address, callback)
            if done.wait(max(0.0, deadline - self._clock())) and box[0] == FAIL_REASON.SUCCESS:
                # Committed; a follower appends the entry a moment later.
                self._wait_until(lambda: (address in self.raft_members()) == add, deadline)
                break
            last = box[0] if box else "no answer"
            if self._stop.wait(0.05) or self._clock() >= deadline:
                verb = "add" if add else "remove"
                raise TimeoutError(f"Raft did not {verb} {address} in time (last error {last})")

    def _wait_until(self, predicate: Callable[[], bool], deadline: float) -> None:
        while not predicate() and self._clock() < deadline:
            self._stop.wait(0.01)

    def status(self) -> MemberStatus:
        core = self._core
        now = self._clock()
        beats = self._hb.peer_status(now) if self._hb is not None else {}
        peers = tuple((p, PeerStatus.from_heartbeat(info, core.peer_changed_at.get(p))) for p, info in beats.items())
        return MemberStatus(node=self.node_id, view=core.view, state=core.state, serving=core.serving,
                            peers=peers, events=tuple(self._events), now=now, supported=core.formats)

    # ---- helpers for callers on other threads ------------------------------------------------

    def _submit_and_wait(self, command: Command, deadline: float) -> Result:
        raft = self._raft
        if raft is None:
            raise RuntimeError("not started")
        while True:
            done = threading.Event()
            box: list[Any] = []

            def callback(result: Any, err: int, box: list[Any] = box, done: threading.Event = done) -> None:
                box.append((result, err))
                done.set()

            raft.submit(command, callback)
            if not done.wait(max(0.0, deadline - self._clock())):
                raise TimeoutError(f"{command!r} not committed in time")
            result, err = box[0]
            if err == FAIL_REASON.SUCCESS:
                if result.outcome == REJECTED:
                    raise MembershipError(f"{command!r} rejected: {result.reason}")
                return result
            # Leader changed / missing / maybe applied: commands are idempotent, retry.
            if self._stop.wait(0.05) or self._clock() >= deadline:
                raise TimeoutError(f"{command!r} not committed in time (last error {err})")

    def _wait_state(self, predicate: Callable[[FleetState], bool], deadline: float, what: str) -> FleetState:
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate(self._core.state) or self._stop.is_set(),
                                     timeout=max(0.0, deadline - self._clock()))
        if not ok or not predicate(self._core.state):
            raise TimeoutError(f"{what}: not committed in time")
        return self._core.state

    # ---- the tick (pysyncobj thread) ---------------------------------------------------------

    def _on_tick(self) -> None:
        try:
            self._tick()
        except Exception:
            log.exception("membership tick failed")

    def _seconds_to_next_timer(self) -> float:
        """Until the next heartbeat is due or a live peer goes stale (tick thread)."""
        hb = self._hb
        if hb is None:
            return float("inf")
        now = self._clock()
        reprobe = min((times[0] for times in self._reprobes.values()), default=float("inf"))
        return min(hb.next_send, hb.next_expiry(now), self._core.election.next_due, reprobe) - now

    def _on_link_event(self, raft_address: str, what: str, fields: dict[str, Any]) -> None:
        """A Raft link or vote event (tick thread, RaftReplica.trace_links): a ``raft_link``
        membership event naming the peer."""
        self._events.append({"t": self._clock(), "ts_ns": time.time_ns(), "event": "raft_link",
                             "peer": self._addr_to_id.get(raft_address, raft_address), "link": what, **fields})

    def _on_link_lost(self, raft_address: str) -> None:
        """The Raft connection to a peer dropped (tick thread): probe its heartbeat
        port now, so a dead process is seen before the next beat; and again a few
        milliseconds later (REPROBE_AFTER_S): a dying process' kernel resets its
        Raft connections as it closes them, and a thread that runs at once (a
        real-time member, membership.realtime) may probe before its heartbeat
        socket is closed too, when nothing answers "port unreachable" yet."""
        self._on_link_event(raft_address, "down", {})
        peer, hb = self._addr_to_id.get(raft_address), self._hb
        if peer is not None and hb is not None and not self._stop.is_set():
            now = self._clock()
            hb.probe(peer, now)
            self._reprobes[peer] = [now + after for after in REPROBE_AFTER_S]

    def _probe_again(self, hb: Heartbeat, now: float) -> None:
        """The probes due of peers whose Raft link dropped (:meth:`_on_link_lost`)."""
        for peer in list(self._reprobes):
            times = self._reprobes[peer]
            while times and times[0] <= now:
                times.pop(0)
                hb.probe(peer, now)
            if not times:
                del self._reprobes[peer]

    def _tick(self) -> None:
        raft, hb = self._raft, self._hb
        if raft is None or hb is None:
            return
        if not self._registered:
            for fd, callback in hb.registrations():
                raft.subscribe_fd(fd, callback)
            self._registered = True
        now = self._clock()
        role, term = raft.role(), raft.raftCurrentTerm
        hb.term, hb.leader_term = term, (term if role == "leader" else None)
        if self._reprobes:
            self._probe_again(hb, now)
        hb.tick(now)  # reads what the peers sent first: every judgement below sees it
        leader = self.node_id if role == "leader" else self._addr_to_id.get(raft.leader_address())
        view, state = self._raft_view, raft.state
        if view.role != role or view.leader != leader or view.term != term or view.state is not state:
            view = self._raft_view = RaftView(role, leader, term, state)
        heard_all = hb.heard_all()
        live = hb.live(now)
        self._execute(raft, self._core.tick(now, live, heard_all, view, isolated=hb.isolated(now),
                                            leader_beat=self._leader_beat(hb, leader, term, live),
                                            hearing=hb.view.hearing(now), heard_at=hb.view.heard_at(),
                                            refused=hb.view.refused_peers() if self.config.floating_addresses else NOBODY))
        if role == "leader":
            raft.set_append_entries_period(append_entries_period(
                self.config.append_entries_period, self.config.legacy_append_entries_period, hb.legacy_peers()))

    def _leader_beat(self, hb: Heartbeat, leader: str | None, term: int, live: frozenset[str]) -> LeaderBeat:
        """What the heartbeat says of the leader Raft names, or with none named, of the live
        peers that claim leadership (membership.election)."""
        if leader == self.node_id:
            return NO_BEAT
        if leader is None:
            return claimed_by_a_peer((hb.leader_claim(p) for p in live if p != self.node_id), term)
        beats, claim = hb.speaks_leader_beat(leader), hb.leader_claim(leader)
        memo = self._beat_memo  # the claim is replaced, not changed, by each datagram: same object, same beat
        if memo is not None and memo[0] == beats and memo[1] is claim and memo[2] == term:
            return memo[3]
        beat = leader_beat(beats, claim, term)
        self._beat_memo = (beats, claim, term, beat)
        return beat

    def _execute(self, raft: RaftReplica, actions: list[control.Action]) -> None:
        for action in actions:
            if isinstance(action, control.Emit):
                # ``ts_ns`` is wall-clock (the drill traces' clock), ``t`` the member's monotonic clock.
                self._events.append(action.record(time.time_ns()))
            elif isinstance(action, control.KeepLinksOpen):
                raft.keep_links_open(self._raft_addresses[p] for p in action.peers)
            elif isinstance(action, control.HastenElection):
                raft.hasten_election(action.within_s)
            elif isinstance(action, control.HoldElection):
                raft.hold_election(action.for_s)
            elif isinstance(action, control.DeferElection):
                raft.defer_election(action.for_s)
            elif isinstance(action, control.SubmitJoin):
                raft.submit(action.command, self._join_callback(action.token))
            elif isinstance(action, control.SubmitPlan):
                raft.submit(action.command, self._plan_callback(raft, action))
            elif isinstance(action, control.Refuse):
                log.error("refusing to join the fleet: %s", action.reason)
                with self._cond:
                    self._cond.notify_all()
            elif isinstance(action, control.HandOver):
                raft.hand_over_leadership(lambda _result, _err: None)  # retried by the core until done
            elif isinstance(action, control.NewRoster):
                self._follow_roster(raft, action.members)
            elif isinstance(action, (control.NewState, control.Publish)):
                with self._cond:
                    self._wake = self._wake or isinstance(action, control.Publish)
                    self._cond.notify_all()

    def _follow_roster(self, raft: RaftReplica, peers: tuple[MemberSpec, ...]) -> None:
        """Beat to the committed members (tick thread); pysyncobj follows its own log."""
        members = (self.config.me, *peers)
        self._addr_to_id = {m.raft_address: m.id for m in members}
        self._raft_addresses = {m.id: m.raft_address for m in members}
        if self._hb is not None:
            added = self._hb.set_peers({m.id: m.heartbeat_address for m in peers}, raft.unsubscribe_fd)
            for fd, callback in added:
                raft.subscribe_fd(fd, callback)

    def _join_callback(self, token: int) -> Callable[[Any, int], None]:
        def done(_result: Any, err: int) -> None:
            self._core.join_done(token, err == FAIL_REASON.SUCCESS, self._clock())

        return done

    def _plan_callback(self, raft: RaftReplica, action: control.SubmitPlan) -> Callable[[Any, int], None]:
        def done(result: Any, err: int) -> None:
            ok = err == FAIL_REASON.SUCCESS and isinstance(result, Result)
            self._execute(raft, self._core.plan_done(action.token, action.command, result if ok else None, err,
                                                     self._clock()))

        return done
