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
from collections.abc import Callable, Mapping
from typing import Any

import uvloop

from membership.formats import FORMATS_ENV, SUPPORTED, FormatRange, parse_range
from proxy import logs
from proxy.addresses.peers import ChangeCounter, listing
from proxy.admin import AdminServer, membership_actions
from proxy.config import Config, ConfigError, http_url, load
from proxy.datapath import DataPath
from proxy.heap import settle_heap
from proxy.reload import ReloadPlan, plan_reload
from proxy.status import NodeStatus, node_status
from proxy.tls import admin_context

log = logging.getLogger("kproxy.runtime")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}
KILL_DELAY_S = 0.1  # POST /kill: the answer goes out first
# A starting node waits this long for the fleet to take its Join (a running fleet does in well
# under a second) before serving; a refusal (a state format it cannot read) ends it at once.
JOIN_WAIT_S = 2.0


def node_formats(env: Mapping[str, str] = os.environ) -> FormatRange:
    """The state formats this node reads and writes: this release's, or ``KPROXY_FORMATS``
    (a test hook: one commit plays two releases, membership.formats)."""
    text = env.get(FORMATS_ENV)
    if not text:
        return SUPPORTED
    try:
        return parse_range(text)
    except ValueError as exc:
        raise ConfigError(FORMATS_ENV, str(exc)) from None


def read_reload(config: Config) -> ReloadPlan:
    """The config file read again and compared with ``config`` (proxy.reload); a ConfigError
    (naming the field) if it cannot be read or is not valid: the running config then stays."""
    if config.source == "<memory>":
        raise ConfigError("--config", "this node's config was not read from a file: nothing to reload")
    return plan_reload(config, load(config.source))


def log_reload(plan: ReloadPlan, trigger: str, **extra: Any) -> None:
    log.info("config reloaded", extra={"trigger": trigger, **plan.to_json(), **extra})
    if plan.needs_restart:
        log.warning("config changes that take effect only after a restart: " + ", ".join(plan.needs_restart),
                    extra={"trigger": trigger, "needs_restart": list(plan.needs_restart)})


def await_admission(member: Any, stopped: Callable[[], bool], refused: Callable[[Exception], None]) -> None:
    """(A thread.) Wait until the fleet's state holds this node; a refusal (membership.member.
    FormatRefused) is handed to ``refused``, which stops the node."""
    from membership.member import FormatRefused

    while not stopped():
        try:
            if member.wait_joined(0.5):
                return
        except FormatRefused as exc:
            refused(exc)
            return


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
        self.peer_clients: Any = None  # proxy.addresses.peers.PeerClients with floating addresses
        self.clients_version = ChangeCounter()  # bumped at every accept and close with floating addresses
        self.refused: Exception | None = None  # membership.member.FormatRefused

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

    def reload(self, trigger: str) -> dict[str, Any]:
        """SIGHUP or POST /reload (on the loop): the certificates, then the config file, again.
        A file that does not load leaves the running config as it is (ConfigError out)."""
        certificates = self.datapath.reload_certificates()
        try:
            plan = read_reload(self.config)
        except ConfigError as exc:
            log.error("config not reloaded: the running config stays", extra={"trigger": trigger,
                                                                             "reason": str(exc)})
            raise
        self.config = plan.config
        logs.set_level(plan.config.log_level)
        self.datapath.reconfigure(plan.config)
        if self.admin is not None:
            self.admin.token = plan.config.admin_token
        log_reload(plan, trigger, certificates_reloaded=certificates)
        return {"node": self.node_id, **plan.to_json(), "certificates_reloaded": certificates}

    def _on_sighup(self) -> None:
        try:
            self.reload("SIGHUP")
        except ConfigError:
            pass  # logged; the node runs on

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
        self.datapath.watch_stalls()
        # As a worker does (proxy.heap): before, a one-process node walked its start-up heap (and
        # the Raft member's) in every full collection, 15% of its loop in a reconnect storm
        # (py-spy, BENCHMARKS.md session 32).
        settle_heap()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopped.set)
        self.loop.add_signal_handler(signal.SIGHUP, self._on_sighup)  # certificates and config (proxy.reload)
        log.info("node ready", extra={"node": self.node_id, "bootstrap": self.datapath.bootstrap_address,
                                      "admin": self.admin.address if self.admin else None})
        try:
            await self._stopped.wait()
        finally:
            await self.shutdown()
        if self.refused is not None:
            raise self.refused

    async def _admitted(self, member: Any) -> None:
        """Serve only in a fleet whose state format this node reads (membership.formats): a
        refusal stops the node before it serves (FormatRefused out of serve()). Without an
        answer within JOIN_WAIT_S (no quorum yet) it serves and a thread keeps watching."""
        from membership.member import FormatRefused

        assert self.loop is not None
        try:
            if await self.loop.run_in_executor(None, member.wait_joined, JOIN_WAIT_S):
                return
        except FormatRefused:
            member.stop()
            await self.datapath.stop()
            raise
        loop = self.loop

        def refused(exc: Exception) -> None:
            self.refused = exc
            loop.call_soon_threadsafe(self._stopped.set)

        loop.run_in_executor(None, await_admission, member, self._stopped.is_set, refused)

    def _clients(self, after: int | None = None, wait_s: float = 0.0) -> dict[str, Any]:
        """``GET /clients``: this node's clients (with ``after``: once their list differs from
        that version, or after ``wait_s``: proxy.addresses.peers), and the peers' it knows (what
        it would tickle)."""
        version, pairs = listing(lambda: self._call_in_loop(self.datapath.client_pairs), self.clients_version,
                                 after, wait_s)
        known = {n: [p.to_json() for p in self.peer_clients.of(n)] for n in self.peer_clients.peers} \
            if self.peer_clients else {}
        floating = self.datapath.floating
        return {"clients": [p.to_json() for p in pairs], "group": [i for i, p in enumerate(pairs) if p.group],
                "version": version, "known": known,
                "holds_own": floating is not None and floating.holds(self.node_id)}  # the admin thread

    def _share_clients(self) -> None:
        """With floating addresses: the fence asks the member whether it has quorum, and the
        peers' client lists are polled for tickle ACKs (over the admin endpoints; plain HTTP
        only: the pollers hold no CA for an HTTPS one)."""
        floating = self.datapath.floating
        if floating is None or self.link is None:
            return
        self.datapath.registry.on_change = self.clients_version.bump
        floating.on_own_change = self.clients_version.bump  # the peers' long polls learn it at once
        member = self.link.member
        floating.has_quorum = lambda: member.status().view.has_quorum
        if self.config.admin_token is None or (self.config.security is not None and self.config.security.admin):
            log.info("tickle ACKs off: the peers' client lists need plain-HTTP admin endpoints and a token")
            return
        from proxy.addresses.peers import PeerClients

        peers = {n.id: http_url(n.advertised, n.admin_port) for n in self.config.nodes
                 if n.id != self.node_id and n.admin_port is not None}
        self.peer_clients = floating.peer_clients = PeerClients(peers, self.config.admin_token).start()

    def _start_admin(self) -> None:
        """Bound before any data listener (it reports "not ready" until the node serves)."""
        if self.local.admin_port is None:
            return
        self.admin = AdminServer(
            self.local.host, self.local.admin_port, token=self.config.admin_token,
            status=lambda: self.status().to_json(),
            metrics=self.datapath.metrics.render, ready=self._ready,
            actions={"kill": self._kill, "drain": self._drain, "undrain": self._undrain,
                     "reload": lambda _body: self._call_in_loop(self.reload, "admin"),
                     **membership_actions(lambda: self.link.member if self.link is not None else None)},
            clients=self._clients if self.datapath.floating is not None else None,
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

            member = Member(member_config(self.config, self.node_id), formats=node_formats())
            self.link = MemberLink(self.datapath, member, self.loop)
            await self.loop.run_in_executor(None, self.link.start)  # blocks until Raft is up
            await self._admitted(member)
            self.loop.run_in_executor(None, self._rejoin)
            self._share_clients()

    def _rejoin(self) -> None:
        from proxy.member_link import rejoin

        rejoin(self.link.member, self.node_id, self._stopped.is_set)

    async def graceful_drain(self) -> None:
        """SIGTERM: publish a map without this node first, then move its clients (DESIGN §4)."""
        # A refused node is no member of this fleet: nothing of it to move.
        if self.link is not None and self.refused is None and self.link.member.status().view.has_quorum:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.link.member.drain(self.node_id, timeout=self.config.limits.drain_timeout_s))
            except Exception as exc:
                log.warning("could not publish a map without this node", extra={"reason": repr(exc)})
        self.datapath.drain_all()
        deadline = time.monotonic() + self.config.limits.drain_timeout_s
        while self.datapath.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        log.info("stopping: draining clients first",
                 extra={"node": self.node_id, "drain_timeout_s": self.config.limits.drain_timeout_s})
        self.ready = False
        await self.graceful_drain()
        if self.admin is not None:
            self.admin.stop()
        if self.peer_clients is not None:
            self.peer_clients.stop()
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
