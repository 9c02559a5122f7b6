"""The copy path of proxy.connection (splice off) on real loopback TCP, uvloop and asyncio: a client
that does not read pauses the broker side, so the proxy holds at most about the high-water mark
plus one read; a broker connection that ends closes the client connection (never a hang), and a
client that goes away closes the broker connection."""

from __future__ import annotations

import asyncio
import os

import pytest

from proxy.buffers import READ_BUFFER_BYTES
from tests.unit.test_splice import Rig, frame, recv_exactly, run  # noqa: F401 - run is a fixture
from tests.waiting import until

pytestmark = pytest.mark.unit

DEADLINE_S = 10.0


async def _recv_end(sock) -> bytes:  # type: ignore[no-untyped-def]
    """The far end's next read: b"" when the proxy closed its side (EOF or a reset); a socket
    timeout (the rig's 10 s) fails the test, so a connection left hanging cannot pass."""
    try:
        return await asyncio.get_running_loop().run_in_executor(None, sock.recv, 1024)
    except ConnectionResetError:
        return b""


def test_a_client_that_does_not_read_pauses_the_broker_side(run):  # noqa: F811
    # 64 MiB: far more than the kernel's socket buffers on both hops can hold.
    stream = frame(1, os.urandom(64 << 20)) + frame(2, b"after")

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        rig = await Rig(0, recorded, real_client=True).start()  # splice off: every byte goes through the process
        rig.request(1)
        rig.request(2)
        loop = asyncio.get_running_loop()
        sender = loop.run_in_executor(None, rig.broker.sendall, stream)
        await until(lambda: not rig.pair.upstream.is_reading(), "the proxy pausing the broker side", timeout=DEADLINE_S)
        high_water = rig.node.limits.high_water_bytes
        assert rig.pair.client.get_write_buffer_size() <= high_water + READ_BUFFER_BYTES
        assert not sender.done()  # the broker is held back, not buffered in the proxy
        # The client reads: everything arrives, in order, and the broker gets to send the rest.
        assert await recv_exactly(rig.client, len(stream)) == stream
        await sender
        assert rig.pair.upstream.is_reading() and not recorded
        rig.close()

    run(scenario)


def test_the_broker_closing_between_frames_closes_the_client(run):  # noqa: F811
    first = frame(1, b"whole response")

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        rig = await Rig(0, recorded).start()
        rig.request(1)
        rig.request(2)  # still waiting for this one when the broker goes away
        rig.broker.sendall(first)
        assert await recv_exactly(rig.client, len(first)) == first
        rig.broker.close()
        assert await _recv_end(rig.client) == b""  # the client is not left hanging
        await until(lambda: rig.pair.closed, "the pair closing", timeout=DEADLINE_S)
        assert rig.pair not in rig.node.pairs
        rig.client.close()

    run(scenario)


def test_the_client_going_away_closes_the_broker_connection(run):  # noqa: F811
    async def scenario(recorded):  # type: ignore[no-untyped-def]
        rig = await Rig(0, recorded, real_client=True).start()
        rig.request(1)
        rig.client.close()
        assert await _recv_end(rig.broker) == b""  # the broker side sees the close
        assert rig.pair.closed and rig.pair not in rig.node.pairs
        rig.broker.close()

    run(scenario)

