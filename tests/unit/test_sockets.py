"""proxy.sockets: connections leave from the source address asked for, the port chosen at connect."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import uvloop

from proxy.sockets import (
    HIGH_DESCRIPTORS,
    IP_BIND_ADDRESS_NO_PORT,
    MAX_SYN_RESENDS,
    bound_socket,
    connect_resending,
    create_connection_from,
    first_connection,
    high_descriptor_floor,
    listening_socket,
    open_connection_from,
)
from tests.integration.test_raft import free_port

pytestmark = [pytest.mark.unit]
LINUX = sys.platform.startswith("linux")


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not LINUX, reason="IP_BIND_ADDRESS_NO_PORT is Linux's")
def test_bound_socket_defers_the_port_to_connect() -> None:
    sock = bound_socket(("127.0.0.77", 0))
    try:
        assert sock.getsockname() == ("127.0.0.77", 0)  # bound to the address, no port taken yet
        assert IP_BIND_ADDRESS_NO_PORT is not None
        assert sock.getsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT) == 1
        assert not sock.getblocking()
    finally:
        sock.close()


def test_a_given_port_is_bound_at_once() -> None:
    with socket.socket() as probe:  # a free port on that address
        probe.bind(("127.0.0.77", 0))
        port = probe.getsockname()[1]
    sock = bound_socket(("127.0.0.77", port))
    try:
        assert sock.getsockname() == ("127.0.0.77", port)
    finally:
        sock.close()


async def _echo_server() -> tuple[asyncio.AbstractServer, int, list[tuple[str, int]]]:
    peers: list[tuple[str, int]] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername"))
        writer.write(await reader.readexactly(5))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], peers


def test_streams_connect_from_the_source_address() -> None:
    async def main() -> tuple[tuple[str, int], bytes, list[tuple[str, int]], int]:
        server, port, peers = await _echo_server()
        async with server:
            reader, writer = await open_connection_from("127.0.0.1", port, ("127.0.0.78", 0))
            local = writer.get_extra_info("sockname")
            nodelay = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.write(b"hello")
            echoed = await reader.readexactly(5)
            writer.close()
            return local, echoed, peers, nodelay

    local, echoed, peers, nodelay = uvloop.run(main())
    assert local[0] == "127.0.0.78" and local[1] != 0
    assert peers == [local]  # the server saw the connection come from there
    assert echoed == b"hello"
    assert nodelay  # as create_connection's own sockets: requests are not held back (Nagle)


def test_protocol_connection_from_the_source_address_and_without_one() -> None:
    class Collect(asyncio.Protocol):
        def __init__(self) -> None:
            self.data = b""
            self.done = asyncio.get_running_loop().create_future()

        def data_received(self, data: bytes) -> None:
            self.data += data
            if len(self.data) == 5:
                self.done.set_result(self.data)

    async def main() -> list[tuple[str, bytes]]:
        server, port, _ = await _echo_server()
        out = []
        async with server:
            for local in (("127.0.0.79", 0), None):
                transport, protocol = await create_connection_from(Collect, "127.0.0.1", port, local)
                transport.write(b"abcde")
                out.append((transport.get_extra_info("sockname")[0], await protocol.done))
                transport.close()
        return out

    assert uvloop.run(main()) == [("127.0.0.79", b"abcde"), ("127.0.0.1", b"abcde")]


def test_a_failed_connect_raises_and_leaves_no_socket_open() -> None:
    with socket.socket() as closed_port:  # bound, never listening: a connect to it is refused
        closed_port.bind(("127.0.0.1", 0))
        port = closed_port.getsockname()[1]

        async def main() -> None:
            for _ in range(20):
                with pytest.raises(ConnectionRefusedError):
                    await create_connection_from(asyncio.Protocol, "127.0.0.1", port, ("127.0.0.80", 0))
                with pytest.raises(ConnectionRefusedError):
                    await open_connection_from("127.0.0.1", port, ("127.0.0.80", 0))

        before = _open_descriptors()
        uvloop.run(main())
        assert _open_descriptors() <= before + 2  # the loop's own (epoll, its wakeup pipe) at most


# ------------------------------------------------------------ first_connection
class FakeConnects:
    """``connect(address)`` per a script: address -> outcomes in order ("ok", "timeout", "refused")."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = {a: list(o) for a, o in script.items()}
        self.tried: list[str] = []

    async def connect(self, address: str) -> str:
        self.tried.append(address)
        outcome = self.script[address].pop(0)
        if outcome == "timeout":
            await asyncio.sleep(3600)  # first_connection's own deadline ends it
        if outcome == "refused":
            raise ConnectionRefusedError(111, "refused")
        return f"transport to {address}"


def _first(fake: FakeConnects, addresses: list[str], *, retries: int = 2,
           stop: Callable[[], bool] = lambda: False) -> tuple[object, list[tuple[str, str]]]:
    failures: list[tuple[str, str]] = []
    result = uvloop.run(first_connection(fake.connect, addresses, timeout_s=0.05, timeout_retries=retries,
                                         stop=stop, failed=lambda a, e: failures.append((a, type(e).__name__))))
    return result, failures


def test_the_first_address_that_answers_wins() -> None:
    fake = FakeConnects({"a": ["refused"], "b": ["ok"], "c": ["ok"]})
    result, failures = _first(fake, ["a", "b", "c"])
    assert result == ("transport to b", "b")
    assert fake.tried == ["a", "b"] and failures == [("a", "ConnectionRefusedError")]


def test_a_timeout_moves_on_while_other_addresses_are_left() -> None:
    fake = FakeConnects({"a": ["timeout"], "b": ["ok"]})
    result, failures = _first(fake, ["a", "b"])
    assert result == ("transport to b", "b")
    assert fake.tried == ["a", "b"] and failures == [("a", "TimeoutError")]


def test_the_last_address_is_tried_again_after_timeouts_only() -> None:
    fake = FakeConnects({"a": ["timeout", "timeout", "ok"]})
    assert _first(fake, ["a"])[0] == ("transport to a", "a")
    assert fake.tried == ["a", "a", "a"]

    fake = FakeConnects({"a": ["timeout", "timeout", "timeout", "ok"]})
    result, failures = _first(fake, ["a"])
    assert result is None and fake.tried == ["a", "a", "a"]  # 1 + timeout_retries attempts, no more
    assert failures == [("a", "TimeoutError")] * 3

    fake = FakeConnects({"a": ["refused", "ok"]})
    assert _first(fake, ["a"])[0] is None and fake.tried == ["a"]  # a refusal is an answer: no retry

    fake = FakeConnects({"a": ["timeout", "ok"]})
    assert _first(fake, ["a"], retries=0)[0] is None and fake.tried == ["a"]


def test_no_address_or_a_stop_ends_it() -> None:
    assert _first(FakeConnects({}), [])[0] is None
    fake = FakeConnects({"a": ["timeout", "ok"]})
    stops = iter([False, True])  # the client went away during the first attempt
    assert _first(fake, ["a"], stop=lambda: next(stops))[0] is None
    assert fake.tried == ["a"]


@contextlib.contextmanager
def _listener_with_a_full_queue(host: str) -> Iterator[tuple[socket.socket, tuple[str, int], list[socket.socket]]]:
    """A real listener that accepts nothing, its accept queue full (more connects than a backlog
    of 0 holds): the next SYN is dropped. It, its address, and the sockets queued (the test's
    accepts go there too), all closed on leaving."""
    listener = socket.socket()
    queued: list[socket.socket] = []
    try:
        listener.bind((host, 0))
        listener.listen(0)
        address = listener.getsockname()
        for _ in range(4):
            s = socket.socket()
            queued.append(s)
            s.setblocking(False)
            try:
                s.connect(address)
            except BlockingIOError:
                pass
        yield listener, address, queued
    finally:
        for s in queued:
            s.close()
        listener.close()


def _accept_all(listener: socket.socket, into: list[socket.socket]) -> None:
    """The broker catches up: its queue empties."""
    listener.setblocking(False)
    while True:
        try:
            into.append(listener.accept()[0])
        except BlockingIOError:
            return


def test_a_full_accept_queue_times_out_and_the_retry_gets_through() -> None:
    """A real listener that accepts nothing: its accept queue fills, the next SYN is dropped (the
    connect times out); once it accepts again, the retry connects."""
    async def main(listener: socket.socket, address: tuple[str, int],
                   queued: list[socket.socket]) -> tuple[object, list[str]]:
        outcomes: list[str] = []

        async def connect(addr: tuple[str, int]) -> asyncio.Transport:
            transport, _ = await create_connection_from(asyncio.Protocol, addr[0], addr[1], ("127.0.0.82", 0))
            return transport

        def failed(_: object, exc: BaseException) -> None:
            outcomes.append(type(exc).__name__)
            _accept_all(listener, queued)

        result = await first_connection(connect, [address], timeout_s=0.3, timeout_retries=2,
                                        stop=lambda: False, failed=failed)
        if result is not None:
            result[0].close()
        await asyncio.sleep(0)
        return result, outcomes

    with _listener_with_a_full_queue("127.0.0.81") as (listener, address, queued):
        result, outcomes = uvloop.run(main(listener, address, queued))
    assert outcomes == ["TimeoutError"]
    assert result is not None and result[1] == address


def test_a_dropped_syn_is_sent_again_on_a_fresh_socket_before_the_kernels_one_second() -> None:
    """A listener whose accept queue is full drops the SYN; the kernel would send it again 1 s
    later. connect_resending makes the attempt again after resend_s: once the queue has room
    (the listener accepted), the fresh SYN gets through."""
    resends: list[float] = []

    async def main(listener: socket.socket, address: tuple[str, int],
                   queued: list[socket.socket]) -> tuple[float, tuple[str, int]]:
        loop = asyncio.get_running_loop()

        def resent() -> None:
            resends.append(loop.time())
            _accept_all(listener, queued)

        began = loop.time()
        sock = await asyncio.wait_for(
            connect_resending(("127.0.0.84", 0), address, resend_s=0.1, on_resend=resent), 5)
        took = loop.time() - began
        peer = sock.getpeername()
        sock.close()
        return took, peer

    with _listener_with_a_full_queue("127.0.0.83") as (listener, address, queued):
        took, peer = uvloop.run(main(listener, address, queued))
    assert peer == address
    assert len(resends) >= 1  # the first SYN was dropped, the attempt made again
    assert took < 0.9  # through on a fresh SYN, not the kernel's retransmission 1 s after the first


def test_connect_resending_gives_up_resending_after_max_and_waits_on_the_last() -> None:
    """Never answered (a queue that stays full): MAX_SYN_RESENDS fresh attempts, then the last
    one waits on the kernel's retransmissions until the caller's timeout."""
    fds = _open_descriptors()
    resends: list[int] = []

    async def main(address: tuple[str, int]) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(MAX_SYN_RESENDS * 0.02 + 0.5):
                await connect_resending(("127.0.0.86", 0), address, resend_s=0.02,
                                        on_resend=lambda: resends.append(1))

    with _listener_with_a_full_queue("127.0.0.85") as (_, address, _queued):
        uvloop.run(main(address))
    assert len(resends) == MAX_SYN_RESENDS
    assert _open_descriptors() == fds  # every dropped attempt's socket closed


# ------------------------------------------------ listening sockets: a killed process stops accepting first
def test_a_listening_socket_takes_a_descriptor_above_the_connections_and_names_a_failed_bind() -> None:
    assert high_descriptor_floor(20_000) == 20_000 - HIGH_DESCRIPTORS
    assert high_descriptor_floor(1 << 20) == (1 << 16) - HIGH_DESCRIPTORS  # the table stays small
    assert high_descriptor_floor(1500) is None  # no room above the connections: left where it is
    floor = high_descriptor_floor()
    sock = listening_socket(("127.0.0.1", 0), socket.AF_INET, reuse_port=True)
    try:
        if floor is not None:
            assert sock.fileno() >= floor
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert not sock.getblocking()
        sock.listen(8)
        taken = sock.getsockname()
        with pytest.raises(OSError) as failed:  # a listener holds the port, and this one has no SO_REUSEPORT
            listening_socket(taken, socket.AF_INET, reuse_port=False)
        assert str(taken[1]) in str(failed.value) and "in use" in str(failed.value)
    finally:
        sock.close()


_HOLDER = """
import socket, sys, time
from proxy.sockets import listening_socket
host, port, moved, pairs = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "moved", int(sys.argv[4])
if moved:
    listener = listening_socket((host, port), socket.AF_INET, reuse_port=False)
else:
    listener = socket.socket()
    listener.bind((host, port))
listener.listen(4096)
side = socket.socket()
side.bind((host, 0))
side.listen(4096)
held = []
for _ in range(pairs):
    held.append(socket.create_connection(side.getsockname()))
    held.append(side.accept()[0])
print("ready", flush=True)
time.sleep(60)
"""


def _accepted_while_dying(host: str, moved: bool, pairs: int) -> int:
    """A process listening on ``host`` and holding ``pairs`` connections is SIGKILLed; how many
    connects its listener completed before the first one was refused (at most 10 s, 20,000 connects)."""
    port = free_port(host)
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, host, str(port), "moved" if moved else "plain",
                             str(pairs)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGKILL)
        accepted, deadline = 0, time.monotonic() + 10
        for _ in range(20_000):
            assert time.monotonic() < deadline, "the killed process's listener was never closed"
            probe = socket.socket()
            probe.settimeout(2)
            try:
                probe.connect((host, port))
            except ConnectionRefusedError:
                return accepted
            except (ConnectionResetError, TimeoutError):
                pass  # completed, then reset as the listener closed
            finally:
                probe.close()
            accepted += 1
        raise AssertionError("the killed process's listener was never closed")
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.skipif(not LINUX, reason="the kernel's order of a dead process's releases is Linux's")
def test_a_killed_process_refuses_connects_sooner_when_its_listener_sits_on_a_high_descriptor() -> None:
    """Side by side in one run: the listener on a start-up descriptor completes handshakes until
    the kernel has released every connection of the killed process (~1,000 here with 2,000 held
    on an idle host); moved high, it is released first."""
    plain = _accepted_while_dying("127.0.0.93", moved=False, pairs=2000)
    moved = _accepted_while_dying("127.0.0.93", moved=True, pairs=2000)
    assert plain > 4 * moved, (plain, moved)
