"""The drill's record of how the fleet reacts to a fault.

``ReactionWatcher`` polls the Raft leader's ``/status`` (``fleet.status(node)``)
every ``poll_period_s`` (50 ms) while a drill runs and writes ``node_down``
(the replicated state stopped counting a node as up; node, epoch) and
``assignment_committed`` (the committed table changed; epoch, detail = the
table as JSON). Timestamps: when the fleet itself acted, taken from the polled
node's own event log, so that the failover breaks down on one clock into
fault → detected → committed → clients back: ``node_down`` at the node's
``peer_down`` of the victim (its failure detector; the ``committed`` MarkDown
when the log holds no detection), ``assignment_committed`` at the command
committed at the table's epoch. An event's time is its wall-clock ``ts_ns``, or
its CLOCK_MONOTONIC ``t`` (one clock for the machine) mapped to wall time when
the node's clock checks out; otherwise the poll time (one period plus one
status request late at most).
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import trio

from chaos.drills.fault_names import FaultFailed
from chaos.trace import TraceWriter
from proxy.status import FleetView, NodeStatus


POLL_PERIOD_S = 0.05
VIEW_TIMEOUT_S = 2.0


async def in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float,
                    limiter: trio.CapacityLimiter | None = None) -> Any:
    """Run a blocking call in a worker thread; raise ``trio.TooSlowError`` after ``timeout_s``."""
    with trio.fail_after(timeout_s):
        return await trio.to_thread.run_sync(lambda: fn(*args), abandon_on_cancel=True, limiter=limiter)


@attrs.frozen
class Observation:
    """One look at the fleet, as ``ReactionWatcher.observe`` diffs it.

    ``epoch``/``assignment``: the Raft-committed table (a node's data path applies it a
    moment later, so its advertised epoch may lag); ``up``: whether the *fleet* counts each
    node as up (the replicated state's verdict; from a fleet view without it, whether the
    node answers). ``events``/``clock``: the polled node's own event log and the
    (monotonic, wall) instant the answer arrived, set only when the node's clock was checked
    against our request; ``sent_wall_ns``: when the request went out.
    """

    epoch: int | None
    assignment: dict[str, str] | None
    up: dict[str, bool]
    events: tuple[dict[str, Any], ...] = ()
    clock: tuple[float, int] | None = None
    sent_wall_ns: int | None = None

    @classmethod
    def of_status(cls, status: NodeStatus, **timing: Any) -> Observation:
        committed = status.committed_assignment if status.committed_assignment is not None else status.assignment
        epoch = status.committed_epoch if status.committed_epoch is not None else status.epoch
        return cls(epoch=epoch, assignment=dict(committed), up={m: r.up for m, r in status.members.items()},
                   **timing)

    @classmethod
    def of_view(cls, view: FleetView) -> Observation:
        return cls(epoch=view.epoch, assignment=dict(view.assignment),
                   up={n.id: n.up if n.up is not None else n.alive for n in view.nodes})


class ReactionWatcher:
    """Polls the fleet every ``period_s``; writes node_down / assignment_committed; answers waits.

    One request per poll: ``fleet.status(node)`` of the Raft leader (the node the last answer
    named), or of the next node that answers; a node that did not answer within
    ``STATUS_TIMEOUT_S`` is skipped for ``SKIP_S``, so a frozen or partitioned node does not slow
    the polls down. From the answer: ``node_down`` when the replicated state stops counting a
    member as up (``node_up``), ``assignment_committed`` when the committed table changes.
    Fleets whose status has no ``members`` fall back to ``fleet.fleet_view()`` (``alive``).
    """

    STATUS_TIMEOUT_S = 0.5
    SKIP_S = 1.0

    def __init__(self, fleet: Any, trace: TraceWriter, *, period_s: float = POLL_PERIOD_S,
                 max_duration_s: float = 3600.0) -> None:
        self.fleet = fleet
        self.trace = trace
        self.period_s = period_s
        self.max_polls = max(1, math.ceil(max_duration_s / period_s))
        self.node_ids = [str(n) for n in getattr(fleet, "node_ids", [])]
        self.up: dict[str, bool] = {}  # the fleet counts it as up (see ``node_up``)
        self.assignment: dict[str, Any] | None = None
        self.epoch: int | None = None
        self.down_at: dict[str, list[int]] = {}
        self.commits_ns: list[int] = []
        self.polls = self.failures = 0
        self._hint: str | None = None
        self._skip_until: dict[str, float] = {}
        self._use_view = False
        self._last_sent_ns = 0
        self._limiter = trio.CapacityLimiter(4)
        self._changed = trio.Event()

    async def view(self) -> Observation | None:
        if self._use_view or not self.node_ids:
            try:
                view = await in_thread(self.fleet.fleet_view, timeout_s=VIEW_TIMEOUT_S, limiter=self._limiter)
                return Observation.of_view(view)
            except Exception:
                self.failures += 1
                return None
        order = ([self._hint] if self._hint in self.node_ids else []) + [n for n in self.node_ids if n != self._hint]
        for node in order:
            if self._skip_until.get(node, 0.0) > time.monotonic():
                continue
            send_mono, send_wall_ns = time.monotonic(), time.time_ns()
            try:
                status = await in_thread(self.status, node, timeout_s=self.STATUS_TIMEOUT_S + 0.2,
                                         limiter=self._limiter)
            except Exception:
                self.failures += 1
                self._skip_until[node] = time.monotonic() + self.SKIP_S
                continue
            if not status.members:
                self._use_view = True  # not a fleet member's status: use the fleet view
                return await self.view()
            recv_mono, recv_wall_ns = time.monotonic(), time.time_ns()
            leader = status.leader
            self._hint = leader if leader is not None and leader in self.node_ids else node
            # The node stamps its events with time.monotonic() (CLOCK_MONOTONIC, one clock for the
            # machine). Trust the mapping only if its "now" falls inside our request.
            now = status.now
            if now is not None and send_mono - 0.005 <= now <= recv_mono + 0.005:
                return Observation.of_status(status, events=status.events, clock=(recv_mono, recv_wall_ns),
                                             sent_wall_ns=send_wall_ns)
            return Observation.of_status(status, sent_wall_ns=send_wall_ns)
        self._skip_until.clear()  # nobody answered: try everyone again next time
        return None

    def status(self, node: str) -> NodeStatus:
        """``GET /status`` of one node (blocking).

        Fast path: one plain ``http.client`` request on a fresh connection to the node's admin
        URL when the fleet exposes it (``fleet.nodes[id].admin_url``, as ``LocalFleet`` does):
        ~5 ms here, where ``fleet.status()`` (a new httpx client per call) costs 100-700 ms of
        CPU on a busy 2-core machine and would both blur the timings and load the system under
        test. Otherwise ``fleet.status(node)``.
        """
        url = None
        nodes = getattr(self.fleet, "nodes", None)
        if isinstance(nodes, dict) and node in nodes:
            url = getattr(nodes[node], "admin_url", None)
        if not isinstance(url, str):
            return self.fleet.status(node)
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=self.STATUS_TIMEOUT_S)
        try:
            conn.request("GET", parts.path.rstrip("/") + "/status", headers={"Connection": "close"})
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise FaultFailed(f"{node}: GET /status answered {response.status}")
        return NodeStatus.from_json(json.loads(body))

    async def is_alive(self, node: str) -> bool:
        """Whether ``node`` answers its admin endpoint now."""
        try:
            await in_thread(self.status, node, timeout_s=1.5, limiter=self._limiter)
            return True
        except Exception:
            return False

    async def wait_alive(self, node: str, alive: bool, timeout_s: float) -> bool:
        """Wait until ``node`` answers (``alive``) or stops answering (not ``alive``)."""
        with trio.move_on_after(timeout_s):
            for _ in range(int(timeout_s / 0.1) + 2):
                if await self.is_alive(node) == alive:
                    return True
                await trio.sleep(0.1)
        return False

    @staticmethod
    def _event_wall_ns(view: Observation, e: dict[str, Any]) -> int | None:
        """An event's wall-clock time: its own ``ts_ns``, else ``t`` mapped through a checked clock."""
        ts = e.get("ts_ns")
        if isinstance(ts, int) and not isinstance(ts, bool):
            return ts
        t = e.get("t")
        if view.clock is None or not isinstance(t, (int, float)):
            return None
        recv_mono, recv_wall_ns = view.clock
        return recv_wall_ns - int((recv_mono - t) * 1e9)

    def _fleet_time(self, view: Observation, match: Callable[[dict[str, Any]], bool], now_ns: int,
                    not_before_ns: int) -> tuple[int, dict[str, Any] | None]:
        """When the fleet itself made the change: the latest matching event of the polled node,
        in wall time, if it lies between ``not_before_ns`` and now; else the poll time."""
        for e in reversed(view.events):
            if match(e):
                wall_ns = self._event_wall_ns(view, e)
                if wall_ns is not None and not_before_ns <= wall_ns <= now_ns:
                    return wall_ns, e
                break
        return now_ns, None

    def _detected_at(self, view: Observation, node: str, now_ns: int) -> int | None:
        """When the polled node's failure detector last saw ``node`` go (its latest ``peer_down``
        of it, unless a ``peer_up`` came later), after this watcher's previous ``node_down`` of it."""
        previous = self.down_at.get(node, [])
        ts, e = self._fleet_time(view, lambda e: e.get("event") in ("peer_down", "peer_up") and e.get("node") == node,
                                 now_ns, previous[-1] + 1 if previous else 0)
        return ts if e is not None and e.get("event") == "peer_down" else None

    def observe(self, view: Observation, *, baseline: bool = False) -> None:
        """Diff one view against the last one and write the events (pure apart from the trace).

        Timestamps: the fleet's own event time when the polled node recorded the change
        (``committed`` MarkDown naming the node; the ``committed`` event at the table's epoch, or
        the latest ``committed`` Reassign), else the poll time.
        """
        now = time.time_ns()
        not_before = self._last_sent_ns
        epoch = view.epoch
        for nid, up in view.up.items():
            if not baseline and self.up.get(nid) and not up:
                ts, e = self._fleet_time(view, lambda e, n=nid: e.get("event") == "committed" and e.get(
                    "command") == "MarkDown" and n in (e.get("nodes") or []), now, not_before)
                down_epoch = e["epoch"] if e is not None and isinstance(e.get("epoch"), int) else epoch
                detected = self._detected_at(view, nid, now)
                ts = detected if detected is not None and detected <= ts else ts
                self.trace.fleet("node_down", node=nid, epoch=down_epoch, ts_ns=ts)
                self.down_at.setdefault(nid, []).append(ts)
            self.up[nid] = up
        assignment = view.assignment
        if assignment is not None:
            if not baseline and self.assignment is not None and assignment != self.assignment:
                # The command that produced this table: committed at the view's epoch (any command:
                # a MarkDown or Drain may repair the table itself), else the latest Reassign.
                ts, e = self._fleet_time(view, lambda e: e.get("event") == "committed" and (
                    e.get("epoch") == epoch if epoch is not None else e.get("command") == "Reassign"),
                    now, not_before)
                if e is None and epoch is not None:
                    ts, e = self._fleet_time(view, lambda e: e.get("event") == "committed" and e.get(
                        "command") == "Reassign", now, not_before)
                commit_epoch = e["epoch"] if e is not None and isinstance(e.get("epoch"), int) else epoch
                self.trace.fleet("assignment_committed", epoch=commit_epoch, ts_ns=ts,
                                 detail=json.dumps(assignment, sort_keys=True))
                self.commits_ns.append(ts)
            self.assignment = assignment
        self.epoch = epoch if epoch is not None else self.epoch
        self._last_sent_ns = view.sent_wall_ns if view.sent_wall_ns is not None else now
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Take a baseline, report started, then poll until cancelled (bounded in count)."""
        view = None
        for _ in range(max(1, int(10 / self.period_s))):
            view = await self.view()
            if view is not None:
                break
            await trio.sleep(self.period_s)
        if view is None:
            raise FaultFailed("the fleet did not answer for 10 s")
        self.observe(view, baseline=True)
        task_status.started()
        for _ in range(self.max_polls):
            await trio.sleep(self.period_s)
            view = await self.view()
            self.polls += 1
            if view is not None:
                self.observe(view)

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``condition()`` holds after some poll, at most ``timeout_s``."""
        with trio.move_on_after(timeout_s):
            for _ in range(self.max_polls):
                if condition():
                    return True
                await self._changed.wait()
        return condition()

    def down_since(self, node: str, since_ns: int) -> bool:
        return any(t >= since_ns for t in self.down_at.get(node, []))

    def committed_since(self, since_ns: int) -> bool:
        return any(t >= since_ns for t in self.commits_ns)
