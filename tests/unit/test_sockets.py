"""proxy.sockets: connections leave from the source address asked for, the port chosen at connect."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest
import uvloop

from proxy.sockets import IP_BIND_ADDRESS_NO_PORT, bound_socket, create_connection_from, open_connection_from

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
