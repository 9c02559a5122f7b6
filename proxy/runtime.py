"""One proxy node process: data path + (optional) fleet member + admin endpoint.

``run(config, node_id)`` is what ``kproxy run`` calls. It installs uvloop, starts
the data path (which discovers the upstream brokers and binds its listeners),
joins the fleet when ``[fleet]`` is configured, serves the admin endpoint, and
stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

import uvloop

from proxy.admin import AdminServer
from proxy.config import Config
from proxy.server import ProxyNode

log = logging.getLogger("kproxy.runtime")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}


class NodeRuntime:
    def __init__(self, config: Config, node_id: str) -> None:
        self.config = config
        self.node_id = node_id
        self.local = config.node(node_id)
        self.proxy = ProxyNode(config, node_id)
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

    def status(self) -> dict[str, Any]:
        data = self._call_in_loop(self.proxy.status)
        epoch, owners = self.proxy.assignments.owners()
        data.update({"epoch": epoch, "assignment": {str(k): v for k, v in sorted(owners.items())},
                     "role": "standalone", "pid": os.getpid(), "ready": self.ready})
        return data

    def _kill(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("signal", "KILL")).upper()
        if name not in SIGNALS:
            raise ValueError(f"signal must be one of {sorted(SIGNALS)}")
        assert self.loop is not None
        self.loop.call_soon_threadsafe(os.kill, os.getpid(), SIGNALS[name])
        return {"node": self.node_id, "signal": name}

    def _drain(self, body: dict[str, Any]) -> dict[str, Any]:
        target = body.get("node", self.node_id)
        if target != self.node_id:
            raise LookupError(f"node {target!r} is not this node and there is no fleet to forward to")
        moved = self._call_in_loop(self.proxy.drain_all)
        return {"node": self.node_id, "connections_drained": moved}

    # -------------------------------------------------------------- running
    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.proxy.start()
        if self.local.admin_port is not None:
            self.admin = AdminServer(
                self.local.host, self.local.admin_port, token=self.config.admin_token, status=self.status,
                metrics=self.proxy.metrics.render, ready=lambda: self.ready,
                actions={"kill": self._kill, "drain": self._drain})
            self.admin.start()
        self.ready = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopped.set)
        log.info("node ready", extra={"node": self.node_id, "bootstrap": self.proxy.bootstrap_address,
                                      "admin": self.admin.address if self.admin else None})
        try:
            await self._stopped.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        self.ready = False
        if self.admin is not None:
            self.admin.stop()
        await self.proxy.stop()


def run(config: Config, node_id: str) -> None:
    uvloop.run(NodeRuntime(config, node_id).serve())
