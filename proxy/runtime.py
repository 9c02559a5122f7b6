"""One proxy node process: data path + (optional) fleet member + admin endpoint.

``run(config, node_id)`` is what ``kproxy run`` calls (after taking the node's
lock, cli/instance_lock.py). It installs uvloop, binds the admin endpoint and
checks the Raft ports first (a port in use ends the start before any data
listener takes a client), then starts the data path (which discovers the
upstream brokers and binds its listeners), then joins the fleet when
``[fleet]`` is configured (not before: a member is assigned identities soon
after it is heard, and must be listening by then), and stops cleanly on
SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import uvloop

from proxy.admin import AdminServer
from proxy.config import Config, http_url
from proxy.datapath import DataPath
from proxy.status import NodeStatus, node_status
from proxy.tls import admin_context

GRACEFUL_DRAIN_S = 5.0

log = logging.getLogger("kproxy.runtime")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}
KILL_DELAY_S = 0.1  # POST /kill: the answer goes out first


class NodeRuntime:
    def __init__(self, config: Config, node_id: str) -> None:
        self.config = config
        self.node_id = node_id
        self.local = config.node(node_id)
        self.datapath = DataPath(config, node_id, fleet=config.fleet is not None)
        self.link: Any = None  # proxy.member_link.MemberLink when [fleet] is configured
        self.admin: AdminServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stopped = asyncio.Event()
        self.ready = False

    # ---------------------------------------------------------- admin hooks
    def _call_in_loop(self, fn: Any, *args: Any, timeout: float = 10.0) -> Any:
        assert self.loop is not None

        async def call() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def status(self) -> NodeStatus:
        datapath, serving = self._call_in_loop(lambda: (self.datapath.status(), self.datapath.serving))
        return node_status(datapath, serving, self.link.member.status() if self.link is not None else None,
                           pid=os.getpid(), ready=self.ready,
                           # Where every node of the fleet answers: `cluster --admin URL` needs only one.
                           admin_endpoints={n.id: http_url(n.advertised, n.admin_port) for n in self.config.nodes
                                            if n.admin_port is not None})

    def _ready(self) -> bool:
        """Serving, and a listener for every known broker (a port taken by someone else is not)."""
        return self.ready and not self._call_in_loop(lambda: self.datapath.unbound)

    def _kill(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("signal", "KILL")).upper()
        if name not in SIGNALS:
            raise ValueError(f"signal must be one of {sorted(SIGNALS)}")
        assert self.loop is not None
        # A moment later, so that this answer reaches the caller before the node dies or stops.
        self.loop.call_soon_threadsafe(self.loop.call_later, KILL_DELAY_S, os.kill, os.getpid(), SIGNALS[name])
        return {"node": self.node_id, "signal": name, "in_s": KILL_DELAY_S}

    def _refuse_while_joining(self) -> None:
        if self.config.fleet is not None and self.link is None:  # the admin endpoint is up before Raft
            raise TimeoutError(f"node {self.node_id} is starting: not in the fleet yet, ask again")

    def _drain(self, body: dict[str, Any]) -> dict[str, Any]:
        target = str(body.get("node", self.node_id))
        self._refuse_while_joining()
        if self.link is None:
            if target != self.node_id:
                raise LookupError(f"node {target!r} is not this node and there is no fleet to forward to")
            moved = self._call_in_loop(self.datapath.drain_all)
            return {"node": target, "connections_drained": moved}
        if target not in {n.id for n in self.config.nodes}:
            raise LookupError(f"no node {target!r} in the fleet")
        epoch = self.link.member.drain(target)  # publishes the new map; the node drains on seeing it
        return {"node": target, "epoch": epoch}

    def _undrain(self, body: dict[str, Any]) -> dict[str, Any]:
        target = str(body.get("node", self.node_id))
        self._refuse_while_joining()
        if self.link is None:
            raise LookupError("no fleet: nothing to undrain")
        if target not in {n.id for n in self.config.nodes}:
            raise LookupError(f"no node {target!r} in the fleet")
        return {"node": target, "epoch": self.link.member.undrain(target)}

    # -------------------------------------------------------------- running
    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._start_admin()
        try:
            await self._start_serving()
        except BaseException:
            if self.admin is not None:
                self.admin.stop()
            raise
        self.ready = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopped.set)
        self.loop.add_signal_handler(signal.SIGHUP, self.datapath.reload_certificates)  # proxy.tls rotation
        log.info("node ready", extra={"node": self.node_id, "bootstrap": self.datapath.bootstrap_address,
                                      "admin": self.admin.address if self.admin else None})
        try:
            await self._stopped.wait()
        finally:
            await self.shutdown()

    def _start_admin(self) -> None:
        """Bound before any data listener (it reports "not ready" until the node serves)."""
        if self.local.admin_port is None:
            return
        self.admin = AdminServer(
            self.local.host, self.local.admin_port, token=self.config.admin_token,
            status=lambda: self.status().to_json(),
            metrics=self.datapath.metrics.render, ready=self._ready,
            actions={"kill": self._kill, "drain": self._drain, "undrain": self._undrain},
            ssl_context=admin_context(self.config.security.admin)
            if self.config.security is not None and self.config.security.admin is not None else None)
        self.admin.start()

    async def _start_serving(self) -> None:
        """Raft ports checked, then the data listeners, then the fleet (see the module doc)."""
        assert self.loop is not None
        if self.config.fleet is not None:
            from proxy.member_link import check_raft_ports

            check_raft_ports(self.config, self.node_id)
        await self.datapath.start()
        if self.config.fleet is not None:
            from membership.member import Member
            from proxy.member_link import MemberLink, member_config

            self.link = MemberLink(self.datapath, Member(member_config(self.config, self.node_id)), self.loop)
            await self.loop.run_in_executor(None, self.link.start)  # blocks until Raft is up
            self.loop.run_in_executor(None, self._rejoin)

    def _rejoin(self) -> None:
        from proxy.member_link import rejoin

        rejoin(self.link.member, self.node_id, self._stopped.is_set)

    async def graceful_drain(self) -> None:
        """SIGTERM: publish a map without this node first, then move its clients (DESIGN §4)."""
        if self.link is not None and self.link.member.status().view.has_quorum:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.link.member.drain(self.node_id, timeout=GRACEFUL_DRAIN_S))
            except Exception as exc:
                log.warning("could not publish a map without this node", extra={"reason": repr(exc)})
        self.datapath.drain_all()
        deadline = time.monotonic() + GRACEFUL_DRAIN_S
        while self.datapath.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        log.info("stopping: draining clients first", extra={"node": self.node_id, "drain_timeout_s": GRACEFUL_DRAIN_S})
        self.ready = False
        await self.graceful_drain()
        if self.admin is not None:
            self.admin.stop()
        await self.datapath.stop()
        if self.link is not None:
            self.link.member.stop()
        log.info("node stopped", extra={"node": self.node_id, "connections_left": self.datapath.connections})


def run(config: Config, node_id: str) -> None:
    """One node: one process (``workers = 1``), or a supervisor and its data-path workers."""
    if config.node(node_id).workers > 1:
        from proxy.supervisor import Supervisor

        uvloop.run(Supervisor(config, node_id).serve())
        return
    uvloop.run(NodeRuntime(config, node_id).serve())
