"""The data path reads into buffers it reuses (proxy.buffers): the codec must
copy whatever it keeps across feeds, and the shell may reuse a buffer only
once no transport refers to it.

Every test here feeds memoryviews of one bytearray that is overwritten with
garbage right after each feed (after the returned segments were consumed, as
a transport that sent everything would), then checks the output stream.
"""

from __future__ import annotations

import datetime

import pytest

from kio.schema.produce.v9.request import ProduceRequest as ProduceRequestV9
from kio.schema.produce.v9.response import ProduceResponse as ProduceResponseV9
from kio.static.primitive import i32Timedelta

from chaos.bench import frames as fx
from proxy.buffers import MAX_LENT
from proxy.buffers import ReadBuffers
from proxy.codec import CorrelationTable
from proxy.codec import RequestTracker
from proxy.codec import ResponseSplitter
from proxy.errors import UnknownBroker
from proxy.rewrite import ResponseRewriter
from tests.unit.test_codec import metadata_fixture, proxy_address

pytestmark = pytest.mark.unit

GARBAGE = 0xA5


class Reused:
    """Feed ``data`` through one reused buffer, in chunks cut at ``cuts``."""

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)

    def chunks(self, data: bytes, cuts: list[int]):  # type: ignore[no-untyped-def]
        edges = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
        for a, b in zip(edges, edges[1:]):
            n = b - a
            self.buf[:n] = data[a:b]
            yield self.view[:n]
            self.buf[:] = bytes([GARBAGE]) * len(self.buf)  # the next read overwrites it


def consume(segments: list) -> bytes:
    """What a transport that sends everything at once does: copy out now."""
    return b"".join(bytes(s) for s in segments)


def produce_response(correlation_id: int) -> bytes:
    return fx.response_frame(fx.make(ProduceResponseV9, responses=()), correlation_id)


def response_stream(base: int = 0) -> tuple[bytes, bytes, list[tuple[int, int, int]]]:
    """Produce, Metadata, Produce, Metadata responses (correlation ids base+1..base+4):
    (from the broker, expected to the client, correlation table entries)."""
    meta2, expected2 = metadata_fixture(base + 2)
    meta4, expected4 = metadata_fixture(base + 4)
    stream = produce_response(base + 1) + meta2 + produce_response(base + 3) + meta4
    expected = produce_response(base + 1) + expected2 + produce_response(base + 3) + expected4
    return stream, expected, [(base + 1, 0, 9), (base + 2, 3, 12), (base + 3, 0, 9), (base + 4, 3, 12)]


def splitter(pending: list[tuple[int, int, int]], rewriter: ResponseRewriter) -> ResponseSplitter:
    table = CorrelationTable()
    for correlation_id, api_key, api_version in pending:
        table.add(correlation_id, api_key, api_version)
    return ResponseSplitter(table, rewriter)


def test_splitter_reused_buffer_every_split_point() -> None:
    stream, expected, pending = response_stream()
    assert expected != stream
    reused = Reused(len(stream))
    for i in range(len(stream) + 1):
        s = splitter(pending, ResponseRewriter(proxy_address))
        got = b"".join(consume(s.feed(chunk)) for chunk in reused.chunks(stream, [i]))
        assert got == expected, i
        assert s.at_frame_boundary and s.rewritten == 2


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 8, 9, 64])
def test_splitter_reused_buffer_small_reads(step: int) -> None:
    stream, expected, pending = response_stream()
    s = splitter(pending, ResponseRewriter(proxy_address))
    reused = Reused(step)
    got = b"".join(consume(s.feed(chunk)) for chunk in reused.chunks(stream, list(range(step, len(stream), step))))
    assert got == expected


@pytest.mark.parametrize("cut", [0, 5, 40, 200, 211, 250, 437])
def test_splitter_reused_buffer_while_stalled(cut: int) -> None:
    """Chunks queued while stalled, and the frame held for the retry, are copies."""
    stream, expected, pending = response_stream()
    known = {1: ("proxy.local", 30001)}
    s = splitter(pending, ResponseRewriter(known.get))
    reused = Reused(len(stream))
    first = len(produce_response(1)) + cut
    out = []
    for chunk in reused.chunks(stream, [first, first + 7, first + 120]):
        out.append(consume(s.feed(chunk)))
    assert isinstance(s.stalled, UnknownBroker)
    assert b"".join(out) == produce_response(1)
    known[2] = ("proxy.local", 30002)
    out.append(consume(s.resume()))
    assert s.stalled is None
    assert b"".join(out) == expected


def produce_request(correlation_id: int, transactional_id: str | None) -> bytes:
    body = fx.make(ProduceRequestV9, transactional_id=transactional_id, acks=-1,
                   timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)))
    return fx.request_frame(body, correlation_id, "client-with-a-long-id")


def test_tracker_reused_buffer_every_split_point() -> None:
    stream = produce_request(7, "tx-12345") + produce_request(8, None)
    reused = Reused(len(stream))
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1, 3):
            tracker = RequestTracker()
            headers = []
            for chunk in reused.chunks(stream, [i, j]):
                headers += tracker.feed(chunk)
            got = [(h.api_key, h.correlation_id, h.client_id, h.acks, h.transactional_id) for h in headers]
            assert got == [(0, 7, "client-with-a-long-id", -1, "tx-12345"),
                           (0, 8, "client-with-a-long-id", -1, None)], (i, j)
            assert tracker.at_frame_boundary


# -- the pool ---------------------------------------------------------------------------


class Holder:
    def __init__(self, pending: int) -> None:
        self.pending = pending

    def get_write_buffer_size(self) -> int:
        return self.pending


def test_read_buffers_lend_and_reclaim() -> None:
    buffers = ReadBuffers(64)
    first = buffers.view
    busy = Holder(10)
    buffers.release(busy)
    second = buffers.view
    assert second.obj is not first.obj and buffers.allocated == 2
    other = Holder(5)
    buffers.release(other)  # `busy` still holds `first`: a third buffer
    assert buffers.view.obj is not first.obj and buffers.view.obj is not second.obj and buffers.allocated == 3
    busy.pending = 0  # drained: `first` may be read into again
    buffers.release(Holder(1))
    assert buffers.view.obj is first.obj and buffers.allocated == 3


def test_read_buffers_forget_beyond_max_lent() -> None:
    buffers = ReadBuffers(16)
    for _ in range(MAX_LENT + 5):
        buffers.release(Holder(1))
    assert len(buffers._lent) == MAX_LENT
    assert buffers.allocated == MAX_LENT + 6


# -- the shell: a transport that keeps what it could not send ---------------------------


class HoldingTransport:
    """Sends ``send_per_write`` bytes per write at most; keeps the rest *by
    reference* (what uvloop does with a memoryview), like a slow client."""

    def __init__(self, send_per_write: int) -> None:
        self.send_per_write = send_per_write
        self.sent = bytearray()
        self.held: list = []

    def _send(self) -> None:
        budget = self.send_per_write
        while self.held and budget:
            seg = self.held[0]
            n = min(budget, len(seg))
            self.sent += bytes(seg[:n])
            budget -= n
            if n == len(seg):
                self.held.pop(0)
            else:
                self.held[0] = memoryview(seg)[n:]

    def write(self, data) -> None:  # type: ignore[no-untyped-def]
        self.writelines([data])

    def writelines(self, segments) -> None:  # type: ignore[no-untyped-def]
        self.held.extend(segments)
        self._send()

    def drain(self) -> None:
        while self.held:
            self._send()

    def get_write_buffer_size(self) -> int:
        return sum(len(s) for s in self.held)

    def pause_reading(self) -> None:
        pass


@pytest.mark.parametrize("send_per_write", [1 << 30, 100, 7])
def test_upstream_side_never_overwrites_bytes_a_transport_holds(send_per_write: int) -> None:
    from proxy import connection
    from proxy.config import Limits
    from proxy.drain import NodeDrain
    from proxy.metrics import ProxyMetrics
    from proxy.registry import ConnectionRegistry

    stream, expected, pending = b"", b"", []
    for base in (0, 10, 20):
        more = response_stream(base)
        stream, expected, pending = stream + more[0], expected + more[1], pending + more[2]
    # the copy path: no splice (tests/unit/test_splice.py)
    node = ConnectionRegistry("p1", Limits(max_frame_bytes=1 << 20, splice_min_bytes=0), ProxyMetrics("p1"),
                              ResponseRewriter(proxy_address), NodeDrain(takeover=False))
    pair = connection.Pair(node, 1)
    pair.shared = False  # the requests go into the table directly, as a bound connection's (Pair.shared)
    for correlation_id, api_key, api_version in pending:
        pair.codec.table.add(correlation_id, api_key, api_version)
    client = HoldingTransport(send_per_write)
    pair.client = client  # type: ignore[assignment]
    side = connection.UpstreamSide(pair)
    side._buffers = ReadBuffers(50)  # small reads: many of them
    pos = 0
    while pos < len(stream):
        view = side.get_buffer(-1)
        n = min(len(view), len(stream) - pos, 37)
        view[:n] = stream[pos:pos + n]
        pos += n
        side.buffer_updated(n)
        # the shell may now reuse the buffer for any read: scribble on it
        # unless it is lent
        if side._buffers.view.obj is not view.obj:
            continue
        view[:] = bytes([GARBAGE]) * len(view)
    client.drain()
    assert bytes(client.sent) == expected
    assert node.metrics.bytes_to_client == len(stream)
    if send_per_write < len(stream):
        assert side._buffers.lent_count > 0



def test_splitter_unchanged_rewrite_stays_one_pass_through_segment() -> None:
    """A Produce v11 response is address-carrying (KIP-951 node_endpoints) but
    usually has none: it goes out as part of the pass-through run, so a read
    of whole frames is still one write."""
    from kio.schema.produce.v11.response import ProduceResponse as ProduceResponseV11

    rewriter = ResponseRewriter(proxy_address)
    assert rewriter.wants(0, 11)
    v11 = fx.response_frame(fx.make(ProduceResponseV11, responses=()), 2)
    stream = produce_response(1) + v11 + produce_response(3)
    s = splitter([(1, 0, 9), (2, 0, 11), (3, 0, 9)], rewriter)
    out = s.feed(stream)
    assert len(out) == 1 and bytes(out[0]) == stream
    assert s.rewritten == 1 and s.at_frame_boundary
    # split inside it: collected, re-emitted unchanged
    s = splitter([(1, 0, 9), (2, 0, 11), (3, 0, 9)], rewriter)
    cut = len(produce_response(1)) + 10
    assert consume(s.feed(stream[:cut]) + s.feed(stream[cut:])) == stream
