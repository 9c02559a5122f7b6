"""A node of W data-path worker processes (``workers`` > 1): the supervisor process.

Theory of operation
-------------------
One broker identity has one advertised address, so all of its traffic goes
through one node; to use every core of its host, the node runs W worker
processes (:mod:`proxy.worker`) that each bind every listener of the node
(bootstrap, one per identity, the stand-ins) with SO_REUSEPORT: the kernel
spreads new connections over them. This process, the supervisor, holds no
client connection. It owns the Raft member (membership.member.Member), its
heartbeat and the admin endpoint, so a busy data path cannot starve them.

* Each committed :class:`membership.serving.ServingMap` is pushed to every
  worker; the node reports a map (``/status`` epoch and assignment) only once
  every ready worker acknowledged it (:class:`proxy.worker_pool.AckBook`).
  Drains, identity moves and stand-ins follow from the map in each worker.
* Brokers any worker discovers are merged here and given to the member.
* ``/status`` and ``/metrics`` ask every worker and add up (connections,
  counters); ``/status`` lists each worker (pid, connections, epoch).
* A worker that exits is restarted after a bounded backoff
  (:class:`proxy.worker_pool.RestartPolicy`), logged; the other workers and
  the node's identities are untouched (no Raft change).
* The workers die with this process (PR_SET_PDEATHSIG, EOF on their
  socketpair) and share its process group, so a drill's SIGKILL or SIGSTOP of
  the group reaches every process of the node (chaos.testbed.proxies); the
  admin ``kill`` action signals the group too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs

from membership.realtime import run_realtime
from membership.serving import ServingMap
from proxy import logs
from proxy.admin import AdminServer, membership_actions
from proxy.config import Config, ConfigError, http_url
from proxy.datapath import DataPathStatus
from proxy.hosts import join_host_port
from proxy.metrics import render_families, worker_restarts_family
from proxy.status import NodeStatus, WorkerRow, node_status
from proxy.upstream import UpstreamBroker
from proxy.worker_pool import AckBook, RestartPolicy, RetiredCounters, merge_datapath_status
from proxy.worker_wire import (
    ASK_DRAIN_ALL,
    ASK_METRICS,
    ASK_STATUS,
    Answer,
    Applied,
    ApplyMap,
    Ask,
    BrokersChanged,
    Channel,
    LearnBrokers,
    Ready,
    Reload,
    Stop,
    WorkerReport,
    WorkerSetup,
    encode,
)

log = logging.getLogger("kproxy.supervisor")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}
KILL_DELAY_S = 0.1  # POST /kill: the answer goes out first
START_TIMEOUT_S = 120.0  # every worker discovers the brokers and binds (discovery alone may take 60 s)
ASK_TIMEOUT_S = 2.0  # a worker that does not answer (stopped, busy) is reported without its figures
STOP_TIMEOUT_S = 5.0


@attrs.define
class WorkerHandle:
    index: int
    proc: subprocess.Popen[bytes]
    channel: Channel
    ready: bool = False
    asks: dict[int, asyncio.Future[Any]] = attrs.field(factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    """The node's supervisor process (see the module doc). ``await serve()``."""

    def __init__(self, config: Config, node_id: str) -> None:
        self.config = config
        self.node_id = node_id
        self.local = config.node(node_id)
        self.count = self.local.workers
        self.fleet = config.fleet is not None
        self.book = AckBook()
        self.policy = RestartPolicy()
        self.retired = RetiredCounters()
        self.handles: dict[int, WorkerHandle] = {}
        self.brokers: dict[int, UpstreamBroker] = {}  # the node's: what any ready worker knows
        self._worker_brokers: dict[int, tuple[UpstreamBroker, ...]] = {}
        self.member: Any = None  # membership.member.Member with [fleet]
        self.admin: AdminServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = False
        self._stopping = False
        self._stopped = asyncio.Event()
        self.refused: Exception | None = None  # membership.member.FormatRefused
        self._ask_ids = itertools.count()

    # ------------------------------------------------------------- workers
    def _spawn(self, index: int) -> None:
        """Start worker ``index`` (on the loop thread: the workers' death signal is tied to it)."""
        if self._stopping:
            return
        mine, theirs = socket.socketpair()
        # Small and sent before the worker reads: fits the socket buffer, so this does not block.
        mine.sendall(encode(WorkerSetup(self.config, self.node_id, index, self.book.latest)))
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        mine.setblocking(False)
        # The callbacks run only once the loop reads the socket, after ``handle`` is bound.
        channel = Channel(lambda m: self._on_message(handle, m), lambda: self._exited(handle))
        handle = WorkerHandle(index, proc, channel)
        self.handles[index] = handle
        self.policy.started(index, time.monotonic())
        assert self.loop is not None
        self.loop.create_task(self.loop.create_unix_connection(lambda: handle.channel, sock=mine))
        log.info("worker started", extra={"worker": index, "pid": proc.pid})

    def _on_message(self, handle: WorkerHandle, message: object) -> None:
        if isinstance(message, Applied):
            self.book.acked(handle.index, message.version)
        elif isinstance(message, Answer):
            future = handle.asks.pop(message.id, None)
            if future is not None and not future.done():
                future.set_result(message.value)
        elif isinstance(message, BrokersChanged):
            self._learn(handle.index, message.brokers)
        elif isinstance(message, Ready):
            handle.ready = True
            self.book.ready(handle.index, message.version)
            self._learn(handle.index, message.brokers)
            if handle.index in self.book.behind():
                assert self.book.latest is not None
                handle.channel.send(ApplyMap(self.book.latest))
            log.info("worker ready", extra={"worker": handle.index, "pid": handle.pid, "version": message.version})
        else:
            log.error("unexpected message from a worker", extra={"worker": handle.index,
                                                                  "message": repr(message)[:200]})

    def _exited(self, handle: WorkerHandle) -> None:
        """The worker's end of the socketpair closed: it exited (or is about to)."""
        handle.ready = False
        self.book.left(handle.index)
        self.retired.exited(handle.index)
        for future in handle.asks.values():
            if not future.done():
                future.set_result(None)
        handle.asks.clear()
        if self.handles.get(handle.index) is handle:
            del self.handles[handle.index]
        assert self.loop is not None
        self.loop.run_in_executor(None, self._reap, handle)
        if self._stopping:
            return
        delay = self.policy.exited(handle.index, time.monotonic())
        log.warning("worker exited: restarting it", extra={"worker": handle.index, "pid": handle.pid,
                                                           "in_s": delay})
        self.loop.call_later(delay, self._spawn, handle.index)

    @staticmethod
    def _reap(handle: WorkerHandle) -> None:
        try:
            code = handle.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its socket closed but it lingers: finish it
            handle.proc.kill()
            code = handle.proc.wait()
        log.info("worker reaped", extra={"worker": handle.index, "pid": handle.pid, "exit_code": code})

    def _learn(self, worker: int, brokers: tuple[UpstreamBroker, ...]) -> None:
        """Worker ``worker`` knows exactly ``brokers`` now. The node knows what any of its workers
        knows: the other workers hear of a new broker (so each binds its listener soon), the member
        of every change (a broker is forgotten once every worker forgot it, proxy.broker_roster)."""
        self._worker_brokers[worker] = tuple(brokers)
        known: dict[int, UpstreamBroker] = {}
        for index in sorted(self._worker_brokers):
            known.update((b.node_id, b) for b in self._worker_brokers[index])
        new = [b for b in known.values() if self.brokers.get(b.node_id) != b]
        if known == self.brokers:
            return
        self.brokers = known
        for handle in self.handles.values():
            if handle.ready and new:
                handle.channel.send(LearnBrokers(tuple(new)))
        if self.member is not None:
            from proxy.member_link import report_brokers

            report_brokers(self.member, sorted(self.brokers.values()))

    def _push(self, serving: ServingMap) -> None:  # event loop
        if not self.book.pushed(serving):
            return  # an older snapshot overtaken by a newer one
        for handle in self.handles.values():
            if handle.ready:
                handle.channel.send(ApplyMap(serving))

    async def ask_all(self, what: str) -> dict[int, Any]:
        """Ask every ready worker; the answers by worker index (None: no answer in time)."""
        loop = asyncio.get_running_loop()
        futures = {}
        for handle in list(self.handles.values()):
            if handle.ready:
                ask = Ask(next(self._ask_ids), what)
                futures[handle.index] = handle.asks[ask.id] = loop.create_future()
                handle.channel.send(ask)
        if futures:
            await asyncio.wait(futures.values(), timeout=ASK_TIMEOUT_S)
        return {i: f.result() if f.done() else None for i, f in futures.items()}

    # ---------------------------------------------------------- admin views
    def _call(self, coro_fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    async def node_status(self) -> NodeStatus:
        # Taken before asking: every worker's answer then shows this map or a newer one.
        applied = self.book.applied() or ServingMap()
        reports: dict[int, WorkerReport | None] = await self.ask_all(ASK_STATUS)
        answered = [r for r in reports.values() if isinstance(r, WorkerReport)]
        datapath = (merge_datapath_status([r.status for r in answered]) if answered
                    else DataPathStatus(self.node_id, join_host_port(self.local.advertised, self.local.bootstrap_port),
                                        (), (), (), 0, False, ()))
        if self.fleet:
            serving = applied
        else:
            serving = answered[0].serving if answered else ServingMap()
        rows = []
        for i in range(self.count):
            handle = self.handles.get(i)
            report = reports.get(i)
            rows.append(WorkerRow(
                index=i, pid=handle.pid if handle else None, ready=bool(handle and handle.ready),
                restarts=self.policy.restarts.get(i, 0),
                connections=report.status.connections if isinstance(report, WorkerReport) else None,
                epoch=report.serving.epoch if isinstance(report, WorkerReport) else None,
                version=report.serving.version if isinstance(report, WorkerReport) else None))
        return node_status(datapath, serving, self.member.status() if self.member is not None else None,
                           pid=os.getpid(), ready=self._all_ready(), workers=tuple(rows),
                           admin_endpoints={n.id: http_url(n.advertised, n.admin_port) for n in self.config.nodes
                                            if n.admin_port is not None})

    def _all_ready(self) -> bool:
        return self.ready and len(self.handles) == self.count and all(h.ready for h in self.handles.values())

    async def metrics(self) -> bytes:
        answers = {i: a for i, a in (await self.ask_all(ASK_METRICS)).items() if a is not None}
        for i, families in answers.items():
            self.retired.seen(i, families)
        families = self.retired.totals(answers.values())
        families.append(worker_restarts_family(self.node_id, self.policy.restarts))
        return render_families(families)

    def _ready(self) -> bool:
        """Serving: every worker up, and a listener for every known broker in each."""
        if not self._all_ready():
            return False
        return not self._call(self.node_status).unbound

    # -------------------------------------------------------- admin actions
    def _kill(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("signal", "KILL")).upper()
        if name not in SIGNALS:
            raise ValueError(f"signal must be one of {sorted(SIGNALS)}")
        assert self.loop is not None
        # A moment later, so that this answer reaches the caller before the node dies or stops.
        self.loop.call_soon_threadsafe(self.loop.call_later, KILL_DELAY_S, self.signal_node, SIGNALS[name])
        return {"node": self.node_id, "signal": name, "in_s": KILL_DELAY_S}

    def signal_node(self, sig: int) -> None:
        """KILL and STOP hit every process of the node; TERM the supervisor (it drains, then stops the workers)."""
        if sig == signal.SIGTERM:
            os.kill(os.getpid(), sig)
        elif os.getpgrp() == os.getpid():  # the node's own process group (the launchers start it so)
            os.killpg(os.getpid(), sig)
        else:  # sharing the group of whoever started it: only our own processes
            for handle in list(self.handles.values()):
                os.kill(handle.pid, sig)
            os.kill(os.getpid(), sig)

    def _refuse_while_joining(self) -> None:
        if self.fleet and self.member is None:  # the admin endpoint is up before Raft
            raise TimeoutError(f"node {self.node_id} is starting: not in the fleet yet, ask again")

    def _drain(self, body: dict[str, Any]) -> dict[str, Any]:
        target = str(body.get("node", self.node_id))
        self._refuse_while_joining()
        if self.member is None:
            if target != self.node_id:
                raise LookupError(f"node {target!r} is not this node and there is no fleet to forward to")
            answers = self._call(lambda: self.ask_all(ASK_DRAIN_ALL))
            return {"node": target, "connections_drained": sum(a or 0 for a in answers.values())}
        if target not in {n.id for n in self.config.nodes}:
            raise LookupError(f"no node {target!r} in the fleet")
        return {"node": target, "epoch": self.member.drain(target)}  # the workers drain on seeing the map

    def reload(self, trigger: str) -> dict[str, Any]:
        """SIGHUP or POST /reload (on the loop): every worker reads its certificates again and
        gets the reloadable fields of the file (proxy.reload), as do workers started later. A
        file that does not load leaves the running config as it is (ConfigError out)."""
        from proxy.runtime import log_reload, read_reload

        try:
            plan = read_reload(self.config)
        except ConfigError as exc:
            log.error("config not reloaded: the running config stays", extra={"trigger": trigger,
                                                                             "reason": str(exc)})
            self._send_all(Reload(None))
            raise
        self.config = plan.config
        logs.set_level(plan.config.log_level)
        if self.admin is not None:
            self.admin.token = plan.config.admin_token
        workers = self._send_all(Reload(plan.config))
        log_reload(plan, trigger, workers=workers)
        return {"node": self.node_id, **plan.to_json(), "workers": workers}

    def _send_all(self, message: object) -> int:
        """To every ready worker; how many (a worker starting now gets ``self.config`` anyway)."""
        ready = [h for h in self.handles.values() if h.ready]
        for handle in ready:
            handle.channel.send(message)
        return len(ready)

    def _on_sighup(self) -> None:
        try:
            self.reload("SIGHUP")
        except ConfigError:
            pass  # logged; the node runs on

    def _undrain(self, body: dict[str, Any]) -> dict[str, Any]:
        target = str(body.get("node", self.node_id))
        self._refuse_while_joining()
        if self.member is None:
            raise LookupError("no fleet: nothing to undrain")
        if target not in {n.id for n in self.config.nodes}:
            raise LookupError(f"no node {target!r} in the fleet")
        return {"node": target, "epoch": self.member.undrain(target)}

    # -------------------------------------------------------------- running
    async def serve(self) -> None:
        """The admin endpoint and the Raft port check first, then the workers (the data listeners),
        then the fleet: the order and its reasons are proxy.runtime's."""
        self.loop = asyncio.get_running_loop()
        if self.config.fleet is not None:  # this loop pushes each map to the workers (which it starts: spawns)
            run_realtime(self.config.fleet.member_priority, "supervisor", spawns=True)
        if self.local.admin_port is not None:
            self.admin = AdminServer(
                self.local.host, self.local.admin_port, token=self.config.admin_token,
                status=lambda: self._call(self.node_status).to_json(), metrics=lambda: self._call(self.metrics),
                ready=self._ready, actions={"kill": self._kill, "drain": self._drain, "undrain": self._undrain,
                                            "reload": lambda _body: self._call(self._reload_async),
                                            **membership_actions(lambda: self.member)})
            self.admin.start()
        try:
            await self._start_serving()
        except BaseException:
            self._stopping = True
            for handle in list(self.handles.values()):
                handle.proc.kill()
            if self.admin is not None:
                self.admin.stop()
            raise
        self.ready = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopped.set)
        self.loop.add_signal_handler(signal.SIGHUP, self._on_sighup)  # certificates and config (proxy.reload)
        log.info("node ready", extra={"node": self.node_id, "workers": self.count,
                                      "pids": sorted(h.pid for h in self.handles.values()),
                                      "admin": self.admin.address if self.admin else None})
        try:
            await self._stopped.wait()
        finally:
            await self.shutdown()
        if self.refused is not None:
            raise self.refused

    async def _start_serving(self) -> None:
        if self.fleet:
            from proxy.member_link import check_raft_ports

            check_raft_ports(self.config, self.node_id)
        for i in range(self.count):
            self._spawn(i)
        await self._wait(lambda: len(self.handles) == self.count and all(h.ready for h in self.handles.values()),
                         START_TIMEOUT_S, "every worker ready")
        if self.fleet:
            try:
                await self._start_member()
            except Exception:  # membership.member.FormatRefused: not a member of this fleet
                await self.shutdown()
                raise

    async def _start_member(self) -> None:
        from membership.member import FormatRefused, Member
        from proxy.member_link import member_config, rejoin, start_member
        from proxy.runtime import JOIN_WAIT_S, await_admission, node_formats

        assert self.loop is not None
        loop = self.loop
        member = Member(member_config(self.config, self.node_id), formats=node_formats())
        await self.loop.run_in_executor(None, start_member, member, self.local.host, sorted(self.brokers.values()))
        try:  # serve only in a fleet whose state format this node reads (proxy.runtime, the same rule)
            joined = await self.loop.run_in_executor(None, member.wait_joined, JOIN_WAIT_S)
        except FormatRefused:
            member.stop()
            raise
        if not joined:
            def refused(exc: Exception) -> None:
                self.refused = exc
                loop.call_soon_threadsafe(self._stopped.set)

            self.loop.run_in_executor(None, await_admission, member, self._stopped.is_set, refused)
        self.member = member
        member.subscribe(lambda snapshot: loop.call_soon_threadsafe(self._push, snapshot))
        loop.run_in_executor(None, rejoin, member, self.node_id, self._stopped.is_set)

    async def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise OSError(f"node {self.node_id}: not {what} within {timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def _reload_async(self) -> dict[str, Any]:
        return self.reload("admin")

    async def _connections(self) -> int:
        return sum(r.status.connections for r in (await self.ask_all(ASK_STATUS)).values()
                   if isinstance(r, WorkerReport))

    async def shutdown(self) -> None:
        """SIGTERM: publish a map without this node, drain every worker's clients, then stop the workers."""
        log.info("stopping: draining clients first",
                 extra={"node": self.node_id, "drain_timeout_s": self.config.limits.drain_timeout_s})
        self.ready = False
        assert self.loop is not None
        # A refused node is no member of this fleet: nothing of it to move.
        if self.member is not None and self.refused is None and self.member.status().view.has_quorum:
            try:
                timeout = self.config.limits.drain_timeout_s
                await self.loop.run_in_executor(None, lambda: self.member.drain(self.node_id, timeout=timeout))
            except Exception as exc:
                log.warning("could not publish a map without this node", extra={"reason": repr(exc)})
        await self.ask_all(ASK_DRAIN_ALL)
        deadline = time.monotonic() + self.config.limits.drain_timeout_s
        while time.monotonic() < deadline and await self._connections():
            await asyncio.sleep(0.05)
        self._stopping = True
        handles = list(self.handles.values())
        for handle in handles:
            handle.channel.send(Stop())
        await asyncio.gather(*(self.loop.run_in_executor(None, self._reap, h) for h in handles))
        if self.admin is not None:
            self.admin.stop()
        if self.member is not None:
            self.member.stop()
        log.info("node stopped", extra={"node": self.node_id, "workers": len(handles)})
