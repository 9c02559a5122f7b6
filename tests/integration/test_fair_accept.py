"""limits.fair_accept (proxy.listeners.FairServer, proxy.accept_lines) on real loopback sockets:
a connection from a host with one connection waiting is opened before the hundreds a busy host
queued ahead of it, every queued connection is opened, a closed server accepts no more and resets
what it accepted but had not opened, and a connection that fails to open leaves the others alone."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import uvloop

from proxy.listeners import OPEN_PER_TURN, FairAcceptor, FairServer
from proxy.metrics import ProxyMetrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HOST = "127.0.0.131"
DENSE, SPARSE = "127.0.0.132", "127.0.0.133"
QUEUED = 300


class Recorder(asyncio.Protocol):
    def __init__(self, opened: list[str]) -> None:
        self.opened = opened

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.opened.append(transport.get_extra_info("peername")[0])
        self.transport = transport


def connect_from(source: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect((HOST, port))  # the kernel completes it into the listener's queue
    return s


def listening() -> tuple[socket.socket, int]:
    """A socket listening on HOST (a queue long enough for every test's connections) and its port."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(1024)
    return listener, listener.getsockname()[1]


async def wait_until(condition: Callable[[], bool]) -> None:
    """Until ``condition()``, bounded (~10 s: every test needs a few turns of the loop)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)


def test_the_sparse_host_is_opened_first_and_every_queued_connection_is_opened():
    async def main() -> None:
        listener, port = listening()
        clients = [connect_from(DENSE, port) for _ in range(QUEUED)] + [connect_from(SPARSE, port)]
        opened: list[str] = []
        acceptor = FairAcceptor(asyncio.get_running_loop())
        server = FairServer(acceptor, listener, lambda: Recorder(opened))
        try:
            await wait_until(lambda: len(opened) == QUEUED + 1)
            assert len(opened) == QUEUED + 1
            assert opened.index(SPARSE) == 0, f"opened {opened.index(SPARSE)}th of {QUEUED + 1}"
            assert opened.count(DENSE) == QUEUED
            assert QUEUED > OPEN_PER_TURN  # in arrival order it would have come last, turns later
        finally:
            server.close()
            for c in clients:
                c.close()
        refused = socket.socket()
        try:
            with pytest.raises(ConnectionRefusedError):
                refused.connect((HOST, port))
        finally:
            refused.close()

    uvloop.run(main())


def test_a_closed_server_resets_what_it_queued_and_leaves_the_other_listeners_lines_alone():
    async def main() -> None:
        (kept_listener, kept_port), (closed_listener, closed_port) = listening(), listening()
        to_close = [connect_from(DENSE, closed_port) for _ in range(QUEUED)]
        to_keep = [connect_from(SPARSE, kept_port) for _ in range(10)]
        opened_closed: list[str] = []
        opened_kept: list[str] = []
        metrics = ProxyMetrics("n1")
        acceptor = FairAcceptor(asyncio.get_running_loop(), metrics.accept_waiting)
        closing = FairServer(acceptor, closed_listener, lambda: Recorder(opened_closed))
        kept = FairServer(acceptor, kept_listener, lambda: Recorder(opened_kept))
        try:
            kept._on_readable()
            closing._on_readable()  # everything queued is accepted into the lines, none opened yet
            waiting = lambda: metrics.registry.get_sample_value("kproxy_accept_waiting", {"node": "n1"})  # noqa: E731
            assert len(acceptor.lines) == QUEUED + 10 and waiting() == QUEUED + 10
            closing.close()
            assert len(acceptor.lines) == 10 and waiting() == 10
            await wait_until(lambda: len(opened_kept) == 10)
            assert len(opened_kept) == 10 and opened_closed == []
            for c in to_close:
                c.settimeout(5)
                with pytest.raises(ConnectionResetError):
                    c.recv(1)
        finally:
            kept.close()
            for c in to_close + to_keep:
                c.close()

    uvloop.run(main())


def test_a_connection_that_fails_to_open_is_closed_and_the_others_are_opened():
    async def main() -> None:
        listener, port = listening()
        clients = [connect_from(DENSE, port) for _ in range(5)]
        opened: list[str] = []
        made = 0

        def factory() -> Recorder:
            nonlocal made
            made += 1
            if made == 1:
                raise RuntimeError("no protocol for this one")
            return Recorder(opened)

        server = FairServer(FairAcceptor(asyncio.get_running_loop()), listener, factory)
        try:
            await wait_until(lambda: len(opened) == 4)
            assert len(opened) == 4 and made == 5
            closed = 0
            for c in clients:  # the first accepted (arrival order) was closed, the others are open
                c.settimeout(0.2)
                try:
                    closed += c.recv(1) == b""
                except (ConnectionResetError, TimeoutError):
                    pass
            assert closed == 1
        finally:
            server.close()
            for c in clients:
                c.close()

    uvloop.run(main())
