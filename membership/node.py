"""``FleetMember``: one proxy node's membership — the interface the data path uses.

Threads (all started by :meth:`FleetMember.start`, all joined by :meth:`stop`):

* the **pysyncobj tick thread** runs Raft and, through a tick callback, all of
  our own work: heartbeats (their sockets sit in pysyncobj's poller), the
  liveness view, the quorum lease, the leader's planner, and the effective
  table. Nothing in it blocks; it wakes on socket events or every
  ``autotick_period``.
* the **member thread** owns the ``SyncObj`` (pysyncobj stops ticking when the
  thread that created it exits, so it must be ours, not the caller's) and
  calls subscribers, so a slow subscriber never delays Raft.

The data path reads :meth:`effective_assignment` (an attribute read, no lock)
per Metadata response and reacts to :meth:`subscribe` callbacks.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pysyncobj import FAIL_REASON
from pysyncobj.monotonic import monotonic as raft_clock
from pysyncobj.poller import POLL_EVENT_TYPE

from membership.commands import APPLIED, REJECTED, Command, Drain, Join, Result, Undrain
from membership.config import MemberConfig
from membership.effective import EffectiveAssignment, QuorumLease, build_effective, committed_is_sane
from membership.heartbeat import Heartbeat
from membership.planner import Planner
from membership.raft import FleetRaft
from membership.state import FleetState
from topology import Broker, BrokerId, ProxyId

log = logging.getLogger(__name__)

# The leader re-plans at least this often even when nothing changed (rebalance timers).
PLAN_INTERVAL_S = 0.1
# Bounded history of membership events kept for status() and measurements.
EVENT_HISTORY = 200
_ROLES = {0: "follower", 1: "candidate", 2: "leader"}


class MembershipError(RuntimeError):
    """A membership operation was rejected by the state machine."""


Subscriber = Callable[[EffectiveAssignment], None]


class FleetMember:
    def __init__(self, config: MemberConfig) -> None:
        config.validate()
        self.config = config
        self.node_id: ProxyId = config.node_id
        # Event times (status, subscribers) are time.monotonic(): comparable
        # across processes on one Linux machine.
        self._clock = time.monotonic
        self._addr_to_id = {m.raft_address: m.id for m in config.members}
        self._all_ids = frozenset(m.id for m in config.members)
        self._planner = Planner(config.rebalance_delay)
        self._raft: FleetRaft | None = None
        self._hb: Heartbeat | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._subscribers: list[Subscriber] = []
        self._wake = False  # a new snapshot or a new subscriber for the member thread
        # Written by the tick thread, read anywhere (single attribute reads).
        self._effective = EffectiveAssignment(epoch=0, owners=())
        self._state = FleetState()
        self._view: dict[str, Any] = {
            "role": "follower", "term": 0, "leader": None, "has_quorum": False, "degraded": False,
        }
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENT_HISTORY)
        self._local_brokers: tuple[Broker, ...] | None = None
        # Tick-thread-only bookkeeping.
        self._registered = False
        self._started_at = 0.0
        self._lease: QuorumLease | None = None
        self._was_leader = False
        self._inflight: object | None = None
        self._inflight_deadline = 0.0
        self._join_token: object | None = None
        self._next_join_at = 0.0
        self._next_keepalive = 0.0
        self._next_plan_at = 0.0
        self._plan_key: tuple = ()
        self._eff_key: tuple = ()
        self._sane_key: tuple = ()
        self._sane = False
        self._peer_live: dict[ProxyId, bool] = {}
        self._peer_changed_at: dict[ProxyId, float] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> None:
        """Bind the Raft and heartbeat ports and start the threads. Raises on failure."""
        if self._thread is not None:
            raise RuntimeError("already started")
        peers = {m.id: m.heartbeat_address for m in self.config.peers}
        self._hb = Heartbeat(
            self.node_id,
            self.config.me.heartbeat_address,
            peers,
            self.config.password or "",
            self.config.heartbeat_interval,
            self.config.suspect_timeout,
            clock=self._clock,
        )
        self._hb.open()
        self._thread = threading.Thread(target=self._run, name=f"kproxy-member-{self.node_id}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop()
            raise TimeoutError(f"member {self.node_id} did not start within {timeout}s")
        if self._start_error is not None:
            err = self._start_error
            self._thread.join(timeout)
            self._hb.close()
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
        raft: FleetRaft | None = None
        try:
            raft = FleetRaft(self.config)
            raft.waitBinded()
        except Exception as exc:  # reported to start()
            self._start_error = exc
            if raft is not None:
                raft.destroy()
            self._started.set()
            return
        now = self._clock()
        self._started_at = now
        self._lease = QuorumLease(self.config.quorum_lease, now)
        self._raft = raft
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
                self._cond.wait_for(lambda: self._wake or self._stop.is_set(), timeout=1.0)
                self._wake = False
                subscribers = list(self._subscribers)
            delivered = {cb: v for cb, v in delivered.items() if cb in subscribers}
            snapshot = self._effective
            for callback in subscribers:
                if delivered.get(callback, -1) >= snapshot.version:
                    continue
                delivered[callback] = snapshot.version
                try:
                    callback(snapshot)
                except Exception:
                    log.exception("membership subscriber %r failed", callback)

    # ---- the data path's interface -----------------------------------------------------------

    def effective_assignment(self) -> tuple[int, dict[BrokerId, ProxyId]]:
        """(committed epoch, broker_id -> proxy_id) the data path should advertise."""
        eff = self._effective
        return eff.epoch, eff.owner_map()

    def effective(self) -> EffectiveAssignment:
        """The whole immutable snapshot: owners, addresses, degraded flag, version."""
        return self._effective

    def advertised_addresses(self) -> dict[BrokerId, tuple[str, int]]:
        return self._effective.address_map()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(snapshot)`` from the member thread after every change
        of the effective table (bursts may be coalesced: the callback always
        gets the latest snapshot), and once right away. Returns an unsubscribe
        function."""
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
        effective table; committed by the leader from its own data path's
        report (so nodes with different views never flip-flop the table). An
        empty list is ignored: Kafka never reports zero brokers, so it means
        the data path does not know."""
        reported = tuple(sorted(brokers, key=lambda b: b.id))
        if reported:
            self._local_brokers = reported

    def is_leader(self) -> bool:
        return self._view["role"] == "leader"

    def committed_state(self) -> FleetState:
        return self._state

    def drain(self, node_id: str, timeout: float | None = None) -> int:
        """Move every identity away from ``node_id``; returns the epoch at which
        that is committed. Raises MembershipError if rejected, TimeoutError."""
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

    def status(self) -> dict[str, Any]:
        state = self._state
        eff = self._effective
        view = dict(self._view)
        now = self._clock()
        peers = self._hb.peer_status(now) if self._hb is not None else {}
        for p, info in peers.items():
            info["changed_at"] = self._peer_changed_at.get(p)
        return {
            "node": self.node_id,
            "role": view["role"],
            "term": view["term"],
            "leader": view["leader"],
            "has_quorum": view["has_quorum"],
            "degraded": view["degraded"],
            "epoch": state.epoch,
            "assignment": {str(b): p for b, p in state.owners},
            "effective": {
                "epoch": eff.epoch,
                "version": eff.version,
                "degraded": eff.degraded,
                "changed_at": eff.changed_at,
                "owners": {str(b): p for b, p in eff.owners},
                "addresses": {str(b): f"{h}:{port}" for b, (h, port) in eff.addresses},
                "error": eff.error,
            },
            "peers": peers,
            "members": {
                n.id: {
                    "host": n.host,
                    "bootstrap_port": n.bootstrap_port,
                    "rack": n.rack,
                    "up": n.id in state.up,
                    "draining": n.id in state.draining,
                }
                for n in state.members
            },
            "draining": sorted(state.draining),
            "brokers": [b.id for b in state.brokers],
            "events": list(self._events),
            "now": now,
        }

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
            remaining = deadline - self._clock()
            if not done.wait(max(0.0, remaining)):
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
            ok = self._cond.wait_for(
                lambda: predicate(self._state) or self._stop.is_set(), timeout=max(0.0, deadline - self._clock())
            )
        if not ok or not predicate(self._state):
            raise TimeoutError(f"{what}: not committed in time")
        return self._state

    def _event(self, now: float, event: str, **fields: Any) -> None:
        # ``ts_ns`` is wall-clock (the drill traces' clock), ``t`` the member's monotonic clock.
        self._events.append({"t": now, "ts_ns": time.time_ns(), "event": event, **fields})

    # ---- the tick (pysyncobj thread) ---------------------------------------------------------

    def _on_tick(self) -> None:
        try:
            self._tick()
        except Exception:
            log.exception("membership tick failed")

    def _tick(self) -> None:
        raft = self._raft
        hb = self._hb
        if raft is None or hb is None or self._lease is None:
            return
        if not self._registered:
            for fd, callback in hb.registrations():
                raft._poller.subscribe(fd, callback, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)
            self._registered = True
        now = self._clock()
        hb.tick(now)
        self._keep_raft_links_alive(raft, now)
        live = hb.live(now)
        self._track_peers(live, now)

        state = raft.state
        leader_node = raft._getLeader()
        leader = self._addr_to_id.get(getattr(leader_node, "address", None)) if leader_node else None
        role = _ROLES.get(getattr(raft, "_SyncObj__raftState", None), "follower")
        if raft._isLeader():
            role, leader = "leader", self.node_id
        majority = 2 * len(live & self._all_ids) > len(self._all_ids)
        has_quorum = majority and leader is not None and leader in live
        sane_key = (state, live)
        if sane_key != self._sane_key:
            self._sane_key, self._sane = sane_key, committed_is_sane(state, live)
        degraded = self._lease.update(now, has_quorum, self._sane)
        if degraded != self._view["degraded"]:
            self._event(now, "degraded" if degraded else "quorum_back")
        if role != self._view["role"] or leader != self._view["leader"]:
            self._event(now, "role", role=role, leader=leader, term=raft.raftCurrentTerm)
        self._view = {
            "role": role, "term": raft.raftCurrentTerm, "leader": leader,
            "has_quorum": has_quorum, "degraded": degraded,
        }

        if role != "leader" and leader is not None and leader not in live:
            self._hasten_election(raft, live, leader)

        self._maybe_join(raft, state, now)
        if role == "leader":
            if not self._was_leader:
                self._planner.reset()
                self._was_leader = True
            self._maybe_plan(raft, state, live, now)
        elif self._was_leader:
            self._planner.reset()
            self._was_leader = False

        if state is not self._state:
            with self._cond:
                self._state = state
                self._cond.notify_all()
        self._update_effective(state, live, degraded, now)

    def _keep_raft_links_alive(self, raft: FleetRaft, now: float) -> None:
        """Send a no-op message on every Raft link every connection_timeout / 4.

        pysyncobj checks a connection's timeout when it *sends*: a link that
        carried nothing for connection_timeout (follower to follower, all the
        time in a stable cluster) is dropped by the first message sent on it,
        and that first message is a candidate's vote request when the leader
        dies. Measured: the vote was lost, both followers became candidates and
        the election took a second round (~0.5 s instead of ~0.1 s). Unknown
        message types are ignored by the receiver."""
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + self.config.connection_timeout / 4
        transport = getattr(raft, "_SyncObj__transport", None)
        if transport is None:
            return
        for node in raft.otherNodes:
            transport.send(node, {"type": "kproxy_keepalive"})

    def _hasten_election(self, raft: FleetRaft, live: frozenset[ProxyId], leader: ProxyId) -> None:
        """Our heartbeat saw the leader die (its port refuses, ~0.1 s): start the
        election now instead of waiting out the election timeout since the
        leader's last append_entries.

        Survivors go in id order, ``2 * autotick_period`` apart: the first one's
        vote request reaches the others before their own turn, so they vote for
        it instead of splitting the vote (random jitter smaller than a tick
        collided about one time in three: ticks run in lockstep). If the first
        is refused (a shorter log), the next one asks at a higher term. Only
        ever makes the deadline earlier; runs on the tick thread that owns it.
        pysyncobj 0.3.17 has no API for this."""
        attr = "_SyncObj__raftElectionDeadline"
        current = getattr(raft, attr, None)
        if current is None:
            return
        order = sorted(live - {leader})
        rank = order.index(self.node_id) if self.node_id in order else len(order)
        # pysyncobj's clock is CLOCK_MONOTONIC_RAW, not time.monotonic().
        soon = raft_clock() + rank * 2 * self.config.autotick_period
        if soon < current:
            setattr(raft, attr, soon)

    def _track_peers(self, live: frozenset[ProxyId], now: float) -> None:
        for m in self.config.peers:
            is_live = m.id in live
            if self._peer_live.get(m.id) != is_live:
                if m.id in self._peer_live or is_live:
                    self._event(now, "peer_up" if is_live else "peer_down", node=m.id)
                self._peer_live[m.id] = is_live
                self._peer_changed_at[m.id] = now

    def _maybe_join(self, raft: FleetRaft, state: FleetState, now: float) -> None:
        """Until the committed state holds this node's own record, propose
        Join (forwarded to the leader, queued while there is none); one
        attempt at a time, retried after a failure or after commit_timeout."""
        me = self.config.me.node
        if now < self._next_join_at or any(n == me for n in state.members):
            return
        self._next_join_at = now + self.config.commit_timeout
        token = object()
        self._join_token = token

        def done(_result: Any, err: int) -> None:
            if self._join_token is token:
                self._next_join_at = self._clock() + (0.0 if err == FAIL_REASON.SUCCESS else 0.2)

        raft.submit(Join(me), done)

    def _maybe_plan(self, raft: FleetRaft, state: FleetState, live: frozenset[ProxyId], now: float) -> None:
        hb = self._hb
        # Until every peer has been heard once (or suspect_timeout has passed)
        # our view is incomplete: never mark anyone down on it.
        warm = now - self._started_at >= self.config.suspect_timeout or (
            hb is not None and all(hb.has_heard(p) for p in hb.peers)
        )
        if not warm:
            return
        if self._inflight is not None:
            if now < self._inflight_deadline:
                return
            self._inflight = None
        key = (state, live, self._local_brokers)
        if key == self._plan_key and now < self._next_plan_at:
            return
        self._plan_key, self._next_plan_at = key, now + PLAN_INTERVAL_S
        command = self._planner.next_command(state, live, now, self._local_brokers)
        if command is None:
            return
        token = object()
        self._inflight, self._inflight_deadline = token, now + self.config.commit_timeout
        self._event(now, "propose", command=type(command).__name__, epoch=state.epoch)
        raft.submit(command, functools.partial(self._on_result, token, command))

    def _on_result(self, token: object, command: Command, result: Any, err: int) -> None:
        now = self._clock()
        if self._inflight is token:
            self._inflight = None
            self._next_plan_at = 0.0
        if err == FAIL_REASON.SUCCESS and isinstance(result, Result):
            fields: dict[str, Any] = {"command": type(command).__name__, "epoch": result.epoch}
            nodes = getattr(command, "nodes", None)
            if nodes:
                fields["nodes"] = sorted(nodes)
            if result.outcome == APPLIED:
                self._event(now, "committed", **fields)
            elif result.outcome == REJECTED:
                self._event(now, "rejected", reason=result.reason, **fields)
        else:
            self._event(now, "not_committed", command=type(command).__name__, error=err)

    def _update_effective(self, state: FleetState, live: frozenset[ProxyId], degraded: bool, now: float) -> None:
        local = self._local_brokers or ()
        key = (state, live, degraded, local)
        if key == self._eff_key:
            return
        self._eff_key = key
        prev = self._effective
        eff = build_effective(
            state,
            self_id=self.node_id,
            configured=self.config.nodes(),
            reachable=live,
            degraded=degraded,
            local_brokers=local,
            version=prev.version + 1,
            changed_at=now,
        )
        if eff.same_table(prev):
            return
        self._effective = eff
        self._event(now, "effective", epoch=eff.epoch, version=eff.version, degraded=eff.degraded)
        with self._cond:
            self._wake = True
            self._cond.notify_all()
