"""One data-path worker process of a node: ``python -m proxy.worker FD``, started by proxy.supervisor.

The worker runs a :class:`proxy.datapath.DataPath` whose listeners share their
addresses with the node's other workers (SO_REUSEPORT: the kernel spreads new
connections over them). It never decides anything about the fleet: the maps
come from the supervisor over the socketpair ``FD`` (proxy.worker_wire), each
acknowledged once in effect; the brokers it discovers go back the same way.

It dies with its supervisor: the kernel kills it when the supervisor's thread
that started it ends (PR_SET_PDEATHSIG), and it exits when the socketpair
reaches EOF. A SIGKILL drill of the node (its supervisor's PID) thus takes the
data path down at once, as it does a single-process node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

import attrs
import uvloop

from membership.serving import ServingMap
from proxy import logs
from proxy.datapath import DataPath
from proxy.heap import GC_THRESHOLDS, settle_heap  # noqa: F401 (GC_THRESHOLDS: tests, docs)
from proxy.profiling import profiled
from proxy.upstream import UpstreamBroker
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
    FrameReader,
    LearnBrokers,
    Ready,
    Reload,
    Stop,
    WorkerReport,
    WorkerSetup,
)

log = logging.getLogger("kproxy.worker")
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when the thread that spawned it ends."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def read_setup(sock: socket.socket) -> WorkerSetup:
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise SystemExit("supervisor gone before the setup")
        messages = reader.feed(data)
        if messages:
            setup = messages[0]
            if not isinstance(setup, WorkerSetup) or len(messages) > 1 or reader.pending:
                raise SystemExit(f"expected one WorkerSetup first, got {messages!r}")
            return setup


class Worker:
    def __init__(self, setup: WorkerSetup) -> None:
        self.setup = setup
        self.fleet = setup.config.fleet is not None
        self.datapath = DataPath(setup.config, setup.node_id, fleet=self.fleet, reuse_port=True)
        self.channel = Channel(self._on_message, self._supervisor_gone)
        self._stopped = asyncio.Event()
        self._last_version = -1

    async def serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        await loop.create_unix_connection(lambda: self.channel, sock=sock)
        self.datapath.on_brokers_changed(lambda brokers: self.channel.send(BrokersChanged(tuple(brokers))))
        await self.datapath.start()
        self.datapath.watch_stalls()
        if self.setup.serving is not None and self.fleet:
            self._apply(self.setup.serving, acknowledge=False)
        settle_heap()
        self.channel.send(Ready(self.setup.index, os.getpid(), self._brokers(), self._last_version))
        loop.add_signal_handler(signal.SIGTERM, self._stopped.set)
        # Ctrl-C reaches the whole process group: the supervisor drains and then stops the workers.
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        # A SIGHUP sent to the node's process group: the supervisor reloads and tells the workers.
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
        try:
            await self._stopped.wait()
        finally:
            await self.datapath.stop()

    def _brokers(self) -> tuple[UpstreamBroker, ...]:
        return tuple(sorted(self.datapath.brokers.values()))

    def _apply(self, serving: ServingMap, *, acknowledge: bool = True) -> None:
        if serving.version < self._last_version:
            return  # an older map overtaken by a newer one
        self._last_version = serving.version
        drained = self.datapath.apply_map(serving)
        if drained:
            log.info("moved clients away", extra={"epoch": serving.epoch, "connections": drained})
        if acknowledge:
            self.channel.send(Applied(serving.version, serving.epoch))

    def _on_message(self, message: object) -> None:
        if isinstance(message, ApplyMap):
            self._apply(message.serving)
        elif isinstance(message, LearnBrokers):
            self.datapath.registry.spawn(self.datapath.discovery.learn(list(message.brokers)))
        elif isinstance(message, Ask):
            self.channel.send(Answer(message.id, self._answer(message.what)))
        elif isinstance(message, Reload):
            self.datapath.reload_certificates()
            if message.config is not None:
                logs.set_level(message.config.log_level)
                self.datapath.reconfigure(message.config)
                log.info("config reloaded", extra={"limits": attrs.asdict(message.config.limits)})
        elif isinstance(message, Stop):
            self._stopped.set()
        else:
            log.error("unexpected message from the supervisor", extra={"message": repr(message)[:200]})

    def _answer(self, what: str) -> object:
        if what == ASK_STATUS:
            return WorkerReport(self.datapath.status(), self.datapath.serving)
        if what == ASK_METRICS:
            return list(self.datapath.metrics.registry.collect())
        if what == ASK_DRAIN_ALL:
            return self.datapath.drain_all()
        return None

    def _supervisor_gone(self) -> None:
        # The node died: go as it would, at once (the kernel closes every socket).
        log.warning("supervisor gone: exiting")
        logging.shutdown()
        os._exit(1)


def main(argv: list[str]) -> None:
    die_with_parent()
    fd = int(argv[0])
    supervisor = int(argv[1]) if len(argv) > 1 else None
    if supervisor is not None and os.getppid() != supervisor:
        raise SystemExit("supervisor gone before the worker started")  # it died before prctl took effect
    sock = socket.socket(fileno=fd)
    setup = read_setup(sock)
    config = setup.config
    logs.setup(config.log_level, config.log_format, setup.node_id, worker=setup.index)
    sock.setblocking(False)
    profiled(lambda: uvloop.run(Worker(setup).serve(sock)))


if __name__ == "__main__":
    main(sys.argv[1:])
