"""Splicing large pass-through response bodies (proxy.splice, the shell in
proxy.connection): the codec's skip() against feeding the same bytes, and the
splice state machine on real loopback TCP sockets (127.0.0.23) driven by the
real UpstreamSide protocol on uvloop and on asyncio's own loop."""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import pytest
import uvloop
from click.testing import CliRunner

from cli.main import cli

from proxy import connection as server_mod
from proxy.buffers import read_buffers
from proxy.codec import ConnectionCodec
from proxy.codec import CorrelationTable
from proxy.codec import ResponseSplitter
from proxy.config import DEFAULT_SPLICE_MIN_BYTES
from proxy.config import ConfigError
from proxy.config import Limits
from proxy.config import parse
from proxy.drain import NodeDrain
from proxy.metrics import ProxyMetrics
from proxy.registry import ConnectionRegistry
from proxy.rewrite import ResponseRewriter
from proxy.splice import PipePool
from proxy.splice import Splice

pytestmark = pytest.mark.unit

HOST = "127.0.0.23"
FETCH, METADATA = 1, 3


def frame(correlation_id: int, body: bytes) -> bytes:
    return struct.pack(">ii", 4 + len(body), correlation_id) + body


def splitter(*pending: tuple[int, int, int], rewriter: ResponseRewriter | None = None) -> ResponseSplitter:
    table = CorrelationTable()
    for correlation_id, api_key, api_version in pending:
        table.add(correlation_id, api_key, api_version)
    return ResponseSplitter(table, rewriter)


def joined(segments) -> bytes:  # type: ignore[no-untyped-def]
    return b"".join(bytes(s) for s in segments)


# ------------------------------------------------------------ codec skip()
@pytest.mark.parametrize("head_cut", [3, 8, 20])
@pytest.mark.parametrize("skip_len", [0, 1, 500, "all"])
def test_skip_is_feeding_the_same_pass_through_bytes(head_cut, skip_len):
    """A frame fed up to ``head_cut``, then ``skip_len`` bytes skipped, then the
    rest fed: the same output (minus the skipped bytes) and the same state as
    feeding everything."""
    body = bytes(range(256)) * 8
    data = frame(1, body) + frame(2, b"next")
    fed, skipped = splitter((1, FETCH, 12), (2, FETCH, 12)), splitter((1, FETCH, 12), (2, FETCH, 12))
    first_fed = joined(fed.feed(data[:head_cut]))
    first_skipped = joined(skipped.feed(data[:head_cut]))
    assert first_fed == first_skipped
    remaining = skipped.remaining_pass_through
    assert remaining == fed.remaining_pass_through
    n = remaining if skip_len == "all" else skip_len
    if head_cut < 8:  # the head is not complete: nothing may be skipped yet
        assert remaining == 0
        with pytest.raises(ValueError):
            skipped.skip(1)
        return
    assert remaining == len(frame(1, body)) - head_cut
    middle = joined(fed.feed(data[head_cut:head_cut + n]))
    assert middle == data[head_cut:head_cut + n]
    skipped.skip(n)
    for s in (fed, skipped):
        assert s.remaining_pass_through == remaining - n
        assert s.at_frame_boundary == (n == remaining)
    rest_fed = joined(fed.feed(data[head_cut + n:]))
    rest_skipped = joined(skipped.feed(data[head_cut + n:]))
    assert rest_fed == rest_skipped == data[head_cut + n:]
    assert fed.at_frame_boundary and skipped.at_frame_boundary
    assert fed.frames == skipped.frames == 2
    assert not fed.table and not skipped.table


def test_skip_more_than_the_frame_is_refused():
    s = splitter((1, FETCH, 12))
    s.feed(frame(1, b"x" * 100)[:50])
    assert s.remaining_pass_through == 58
    with pytest.raises(ValueError):
        s.skip(59)
    with pytest.raises(ValueError):
        s.skip(-1)
    s.skip(58)
    assert s.at_frame_boundary and s.remaining_pass_through == 0


def test_nothing_to_skip_between_frames_or_while_collecting():
    # Between frames.
    s = splitter((1, FETCH, 12))
    assert s.remaining_pass_through == 0
    s.feed(frame(1, b"abc"))
    assert s.remaining_pass_through == 0 and s.at_frame_boundary
    # Collecting a frame the rewriter wants (Metadata): never pass-through.
    rewriter = ResponseRewriter(lambda broker_id: ("127.0.0.11", 9100 + broker_id))
    s = splitter((1, METADATA, 12), rewriter=rewriter)
    s.feed(frame(1, b"\0" * 100_000)[:1000])
    assert s.remaining_pass_through == 0
    with pytest.raises(ValueError):
        s.skip(1)


def test_a_connection_mid_spliced_frame_is_not_idle():
    """The drain closes a connection when ``codec.idle``: not while the rest of
    a frame is still on its way (the splice advances the codec at the end)."""
    codec = ConnectionCodec()
    codec.table.add(1, FETCH, 12)
    codec.responses.feed(frame(1, b"y" * 200_000)[:1000])
    assert not codec.table  # the request has its response (started)...
    assert not codec.idle  # ...but the response is not over
    codec.responses.skip(codec.responses.remaining_pass_through)
    assert codec.idle


# ------------------------------------------------- the shell, on real sockets
def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen(1)
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


class _Sink(asyncio.Protocol):
    """The client transport's protocol in these tests (ClientSide would connect upstream)."""

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class _ClientEnd(server_mod.ClientSide):
    """The real ClientSide (flow control, close on EOF) without dialling a broker: the rig has one."""

    def __init__(self, pair: server_mod.Pair) -> None:
        self.registry = pair.registry
        self.pair = pair
        self._buffers = read_buffers()
        self._view = self._buffers.view

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pass


class Rig:
    """A pair as the proxy builds it: ``broker`` and ``client`` are the far
    ends (plain sockets the test drives), the proxy's ends are uvloop/asyncio
    transports with the real UpstreamSide protocol and codec, and on the client
    side a sink or (``real_client``) the real ClientSide protocol."""

    def __init__(self, splice_min: int, recorded: list[Splice], *, real_client: bool = False) -> None:
        self.splice_min = splice_min
        self.recorded = recorded
        self.real_client = real_client

    async def start(self) -> "Rig":
        loop = asyncio.get_running_loop()
        limits = Limits(splice_min_bytes=self.splice_min)
        self.node = ConnectionRegistry("t", limits, ProxyMetrics("t"), None, NodeDrain(takeover=False))
        self.pair = server_mod.Pair(self.node, 1)
        self.pair.shared = False  # fetches go into the table directly: a bound connection's (Pair.shared)
        self.node.pairs.add(self.pair)  # as ConnectionRegistry.accept does
        self.node.metrics.active.inc()
        self.broker, proxy_up = tcp_pair()
        self.client, proxy_client = tcp_pair()
        self.broker.settimeout(10)
        self.client.settimeout(10)
        client_protocol = (lambda: _ClientEnd(self.pair)) if self.real_client else _Sink
        self.pair.client, _ = await loop.connect_accepted_socket(client_protocol, proxy_client)  # type: ignore
        self.pair.client.set_write_buffer_limits(high=limits.high_water_bytes)  # type: ignore[union-attr]
        self.pair.upstream, _ = await loop.connect_accepted_socket(  # type: ignore[assignment]
            lambda: server_mod.UpstreamSide(self.pair), proxy_up)
        return self

    def request(self, correlation_id: int) -> None:
        self.pair.codec.table.add(correlation_id, FETCH, 12)

    def close(self) -> None:
        self.pair.close("test over")
        self.broker.close()
        self.client.close()


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request, monkeypatch):  # type: ignore[no-untyped-def]
    """Run a coroutine on uvloop or asyncio's loop, with every Splice recorded."""
    recorded: list[Splice] = []

    class Recorded(Splice):
        __slots__ = ("waits",)

        def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*a, **kw)
            self.waits: list[int] = []
            recorded.append(self)

        def _wait(self, kind: int) -> None:
            self.waits.append(kind)
            super()._wait(kind)

    monkeypatch.setattr(server_mod, "Splice", Recorded)

    def runner(fn):  # type: ignore[no-untyped-def]
        loop = uvloop.new_event_loop() if request.param == "uvloop" else asyncio.new_event_loop()
        try:
            return loop.run_until_complete(asyncio.wait_for(fn(recorded), 30))
        finally:
            loop.close()

    return runner


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def recv_exactly(sock: socket.socket, n: int, *, chunk: int = 1 << 20, pause: float = 0.0) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) < n:
        data = await loop.run_in_executor(None, sock.recv, min(chunk, n - len(out)))
        if not data:
            raise EOFError(f"EOF after {len(out)} of {n} bytes")
        out += data
        if pause:
            await asyncio.sleep(pause)  # a slow reader (pacing, not a condition)
    return bytes(out)


async def send_paced(sock: socket.socket, data: bytes, pieces: int) -> None:
    loop = asyncio.get_running_loop()
    step = -(-len(data) // pieces)
    for i in range(0, len(data), step):
        await loop.run_in_executor(None, sock.sendall, data[i:i + step])
        await asyncio.sleep(0.005)  # pacing: the proxy sees the frame across several reads


def test_large_frame_is_spliced_in_order_with_the_frames_around_it(run):
    body = os.urandom(3 << 20)
    stream = frame(1, b"small") + frame(2, body) + frame(3, b"after")

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        fds = open_fds()
        rig = await Rig(64 << 10, recorded).start()
        for c in (1, 2, 3):
            rig.request(c)
        sender = asyncio.ensure_future(send_paced(rig.broker, stream, pieces=12))
        got = await recv_exactly(rig.client, len(stream))
        await sender
        assert got == stream
        assert recorded, "nothing was spliced"
        spliced = rig.node.metrics.spliced_bytes
        assert 0 < spliced <= len(body) and spliced == sum(j.count for j in recorded)
        assert rig.node.metrics.bytes_to_client == len(stream)
        assert rig.pair.splice is None and not rig.pair.closed
        assert rig.pair.codec.idle
        assert rig.pair.upstream.is_reading()  # type: ignore[union-attr]
        rig.close()
        await asyncio.sleep(0)
        assert open_fds() <= fds + 4  # the pool keeps idle pipes (2 fds each), nothing else
        return spliced

    run(scenario)


def test_a_body_in_many_pieces_arrives_whole_and_a_small_frame_after_it_at_once(run):
    """The splice follows the broker's pace (it wakes for every arrival), and once it is done the
    transport reads again: a small frame right behind the large one is not held back."""
    body = os.urandom(4 << 20)
    pieces = 128  # 32 KiB each, 5 ms apart
    stream = frame(1, body)

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        rig = await Rig(64 << 10, recorded).start()
        rig.request(1)
        rig.request(2)
        sender = asyncio.ensure_future(send_paced(rig.broker, stream, pieces=pieces))
        got = await recv_exactly(rig.client, len(stream))
        await sender
        assert got == stream
        wakeups = sum(j.wakeups for j in recorded)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, rig.broker.sendall, frame(2, b"tiny"))
        tail = await recv_exactly(rig.client, len(frame(2, b"tiny")))
        reading = rig.pair.upstream.is_reading()  # type: ignore[union-attr]
        rig.close()
        return wakeups, tail, reading

    wakeups, tail, reading = run(scenario)
    assert tail == frame(2, b"tiny")
    assert reading
    assert 0 < wakeups <= 4 * pieces, wakeups  # paced pieces wake it, a bounded number of times


def test_a_body_in_tiny_segments_does_not_stall_the_splice(run):
    """A short splice read counts as "drained" and the job waits for the broker: also when the read
    was short because the pipe ran out of slots (one per segment) with bytes left in the socket."""
    body = os.urandom(2 << 20)
    stream = frame(1, body) + frame(2, b"after")

    def send_tiny(sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(0, len(stream), 1000):  # ~2,100 segments, faster than the proxy reads them
            sock.sendall(stream[i:i + 1000])

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        rig = await Rig(64 << 10, recorded).start()
        rig.request(1)
        rig.request(2)
        loop = asyncio.get_running_loop()
        sender = loop.run_in_executor(None, send_tiny, rig.broker)
        got = await recv_exactly(rig.client, len(stream))
        await sender
        calls = sum(j.calls for j in recorded)
        rig.close()
        return got, calls

    got, calls = run(scenario)
    assert got == stream
    assert calls > 0, "nothing was spliced"


def test_slow_client_makes_the_splice_wait_for_the_client(run):
    body = os.urandom(4 << 20)
    stream = frame(1, body) + frame(2, b"after")

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        rig = await Rig(64 << 10, recorded).start()
        rig.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        rig.request(1)
        rig.request(2)
        sender = asyncio.ensure_future(send_paced(rig.broker, stream, pieces=2))
        got = await recv_exactly(rig.client, len(stream), chunk=64 << 10, pause=0.002)
        await sender
        assert got == stream
        assert recorded and any(2 in j.waits for j in recorded), "the splice never waited for the client"
        assert rig.node.metrics.spliced_bytes > 0
        assert not rig.pair.closed and rig.pair.codec.idle
        rig.close()

    run(scenario)


def test_broker_eof_mid_body_aborts_the_pair(run):
    body = os.urandom(2 << 20)
    cut = frame(1, body)[: 1 << 20]

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        fds = open_fds()
        rig = await Rig(64 << 10, recorded).start()
        rig.request(1)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, rig.broker.sendall, cut)
        # EOF in the middle of the body, right behind its first half.
        rig.broker.shutdown(socket.SHUT_WR)
        # The client gets bytes of the frame, then the connection ends (EOF or reset): never a whole frame.
        got = bytearray()
        while True:
            try:
                data = await loop.run_in_executor(None, rig.client.recv, 1 << 20)
            except ConnectionResetError:
                break
            if not data:
                break
            got += data
        rig.broker.close()
        assert bytes(got) == cut[: len(got)] and len(got) <= len(cut)
        assert recorded, "nothing was spliced"
        assert rig.pair.closed and rig.pair.splice is None
        assert rig.pair not in rig.node.pairs
        await asyncio.sleep(0)
        assert open_fds() <= fds + 2  # the client's socket object is still open in the test
        rig.client.close()

    run(scenario)


def test_closing_the_pair_mid_splice_releases_everything(run):
    body = os.urandom(8 << 20)

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        fds = open_fds()
        rig = await Rig(64 << 10, recorded).start()
        rig.request(1)
        loop = asyncio.get_running_loop()
        sender = loop.run_in_executor(None, rig.broker.sendall, frame(1, body))
        # The client does not read: the splice fills its socket and waits for it.
        for _ in range(1000):
            if recorded and recorded[-1].waits and recorded[-1].waits[-1] == 2:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the splice never waited for the client")
        assert rig.pair.splice is recorded[-1] and not rig.pair.codec.idle
        rig.pair.close("drain deadline (test)")
        assert rig.pair.splice is None and not recorded[-1].active
        rig.broker.close()  # the sender thread gets an error, or is done
        try:
            await sender
        except OSError:
            pass
        rig.client.close()
        await asyncio.sleep(0.05)
        assert open_fds() <= fds + 4  # idle pipes of the pool only

    run(scenario)


def test_splice_disabled_and_small_frames_are_copied(run):
    stream = frame(1, os.urandom(1 << 20)) + frame(2, os.urandom(40_000))

    async def scenario(recorded):  # type: ignore[no-untyped-def]
        for limit, body_expected_spliced in ((0, False), (1 << 30, False)):
            rig = await Rig(limit, recorded).start()
            rig.request(1)
            rig.request(2)
            sender = asyncio.ensure_future(send_paced(rig.broker, stream, pieces=8))
            assert await recv_exactly(rig.client, len(stream)) == stream
            await sender
            assert not recorded and rig.node.metrics.spliced_bytes == 0
            rig.close()

    run(scenario)


def test_pipe_pool_reuses_and_bounds_idle_pipes():
    pool = PipePool()
    pipes = [pool.take() for _ in range(6)]
    assert all(cap >= 4096 for _, _, cap in pipes)
    for p in pipes:
        pool.give(p)
    assert pool.take() in pipes
    pool.close()


# ------------------------------------------------------------------ config
CONFIG = {
    "upstream": {"bootstrap": ["127.0.0.1:19092"]},
    "ports": {"base": 9100},
    "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092}],
}


def test_splice_min_bytes_defaults_and_zero_disables():
    assert parse(CONFIG).limits.splice_min_bytes == DEFAULT_SPLICE_MIN_BYTES == 64 << 10
    assert parse({**CONFIG, "limits": {"splice_min_bytes": 0}}).limits.splice_min_bytes == 0
    assert parse({**CONFIG, "limits": {"splice_min_bytes": 1 << 20}}).limits.splice_min_bytes == 1 << 20


@pytest.mark.parametrize("value", [-1, 1, 4095, (1 << 30) + 1, "64k", 1.5, True])
def test_bad_splice_min_bytes_names_the_field(value):
    with pytest.raises(ConfigError) as info:
        parse({**CONFIG, "limits": {"splice_min_bytes": value}})
    assert info.value.field == "limits.splice_min_bytes"


def test_run_with_bad_splice_min_bytes_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
                   '[[nodes]]\nid = "p1"\nhost = "127.0.0.11"\nbootstrap_port = 9092\n'
                   '[limits]\nsplice_min_bytes = 100\n')
    result = CliRunner().invoke(cli, ["run", "--config", str(bad), "--node", "p1"])
    assert result.exit_code == 2
    assert "limits.splice_min_bytes" in result.output
