"""Sans-IO Kafka frame codec for the proxy data path (cut-through).

Theory of operation
-------------------
Every Kafka message on a TCP connection is a *frame*: an int32 big-endian
length followed by that many payload bytes. A request payload starts with a
request header (api_key, api_version, correlation_id, client_id[, tagged
fields]); a response payload starts with a response header (correlation_id[,
tagged fields]) that does *not* carry the api key. So the proxy keeps, per
client connection, a :class:`CorrelationTable` (correlation id -> api key and
version) filled from the requests and consumed by the responses
(DESIGN §2 decision 6).

Two objects, one per direction, no I/O (h11 style: bytes in, events/bytes out):

* :class:`RequestTracker` (client -> broker) *observes* the client's bytes. It
  buffers at most the bytes needed to peek the current frame's header (plus,
  for Produce, ``transactional_id`` and ``acks``: acks=0 has no response) and
  returns one :class:`RequestHeader` per frame whose header completed. The
  shell forwards the very same chunks to the broker, unchanged.
* :class:`ResponseSplitter` (broker -> client) returns the bytes to write to
  the client: pass-through slices of the chunks it was fed (it never waits for
  a whole frame it does not rewrite), and, for the frames an injected
  :class:`FrameRewriter` wants (address-carrying responses, ApiVersions), the
  rewritten frame once the whole frame has arrived.

Use from an I/O shell (asyncio protocol callbacks)::

    codec = ConnectionCodec(rewriter)             # one per client connection

    # client socket data_received(chunk):
    for header in codec.requests.feed(chunk):     # ProtocolError -> close both
        ...                                       # metrics, drain bookkeeping
    upstream.write(chunk)                         # forward unchanged, after feed

    # broker socket data_received(chunk):
    client.writelines(codec.responses.feed(chunk))
    if codec.responses.stalled is not None:       # UnknownBroker: bind, retry
        broker_transport.pause_reading()
        ...bind listeners for codec.responses.stalled.brokers, update mapping...
        client.writelines(codec.responses.resume())

Errors: :class:`proxy.errors.ProtocolError` (peer sent garbage, close), see
:mod:`proxy.errors`. Anything else escaping is a bug.

Buffers: pass-through segments may be the chunk object itself or memoryviews
of it. Chunks may be memoryviews of a buffer the caller reuses (the shell
reads into one, see :mod:`proxy.buffers`): whatever the codec keeps across
``feed`` calls it copies (a partial length/header, a frame collected for
rewriting, a frame whose rewrite stalled, chunks queued while stalled), so
the caller may overwrite a chunk's buffer as soon as the segments ``feed``
returned are written (sent, or copied by the transport).
"""

from __future__ import annotations

import functools
import struct

from collections.abc import Iterator
from collections.abc import Sequence
from typing import Final
from typing import NamedTuple
from typing import Protocol

from kio.index import load_request_schema
from kio.index import load_response_schema
from kio.schema.index import api_key_map
from kio.schema.index import schema_name_map

from proxy._wire import Buffer
from proxy._wire import WireError
from proxy._wire import field_steps
from proxy._wire import read_uvarint
from proxy._wire import regular_fields
from proxy._wire import skip_tagged_fields
from proxy.errors import DuplicateCorrelationId
from proxy.errors import FrameSizeError
from proxy.errors import MalformedFrame
from proxy.errors import ProtocolError
from proxy.errors import TooManyInFlight
from proxy.errors import UnknownBroker
from proxy.errors import UnknownCorrelationId
from proxy.errors import UnsupportedApi

__all__ = (
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_IN_FLIGHT",
    "API_VERSIONS",
    "PRODUCE",
    "RequestHeader",
    "CorrelationTable",
    "RequestTracker",
    "FrameRewriter",
    "ResponseSplitter",
    "ConnectionCodec",
    "known_versions",
    "request_header_version",
    "response_header_version",
    "read_response_header",
    "encode_frame",
    "preload",
)

# Largest frame accepted in either direction, length prefix excluded.
# 104857600 = 100 MiB is the broker's own default `socket.request.max.bytes`
# (Kafka rejects larger requests with the same rule), and it is above the
# default response sizes clients ask for (`fetch.max.bytes` 50 MiB,
# `max.partition.fetch.bytes` 1 MiB; a single batch larger than those is still
# returned, bounded by `message.max.bytes` ~1 MiB by default). A length above
# it is far more likely garbage (e.g. a TLS or HTTP client on a plaintext port:
# "GET " reads as 1195725856) than a real frame. Configurable per instance.
DEFAULT_MAX_FRAME_SIZE: Final = 104_857_600

# Most requests that may wait for a response on one connection. librdkafka's
# default `max.in.flight.requests.per.connection` is 1,000,000 (Java: 5), so a
# legitimate client never exceeds this; the cap bounds the table's memory
# (~100 B an entry) for a client that only writes. Configurable per instance.
DEFAULT_MAX_IN_FLIGHT: Final = 1_000_000

PRODUCE: Final = 0
API_VERSIONS: Final = 18
# Error code a broker answers an ApiVersions request it cannot parse with; the
# response then has a v0 body whatever version was asked (KIP-511).
UNSUPPORTED_VERSION: Final = 35

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_LEN = struct.Struct(">i")
# api_key, api_version, correlation_id, client_id length
_HEADER_FIXED = struct.Struct(">hhih")


# -- kio lookups (lazy: importing every kio schema takes seconds) --------------------


@functools.cache
def known_versions(api_key: int) -> range | None:
    """The versions of ``api_key`` kio knows (contiguous run ending at the
    highest), or None if kio does not know the api key."""
    name = api_key_map.get(api_key)
    if name is None or name not in schema_name_map:
        return None
    versions = sorted(schema_name_map[name])
    top = versions[-1]
    low = top
    while low - 1 in schema_name_map[name]:
        low -= 1
    return range(low, top + 1)


def _is_known(api_key: int, api_version: int) -> bool:
    versions = known_versions(api_key)
    return versions is not None and api_version in versions


@functools.cache
def _request_layout(api_key: int, api_version: int) -> tuple[int, bool, tuple | None]:
    """(header version, flexible, produce steps to `acks`) for a request.

    ApiVersions is special (KIP-511): a client may ask a version newer than
    the proxy knows; Kafka parses its header as v2 for any version >= 3.
    """
    if not _is_known(api_key, api_version):
        if api_key == API_VERSIONS and api_version > 0:
            return (2 if api_version >= 3 else 1), api_version >= 3, None
        raise UnsupportedApi(api_key, api_version)
    schema = load_request_schema(api_key, api_version)
    header_version = int(schema.__header_schema__.__version__)
    flexible = bool(schema.__flexible__)
    produce = None
    if api_key == PRODUCE:
        fields = regular_fields(schema)
        names = [f.name for f in fields]
        acks_at = names.index("acks")
        txn_at = names.index("transactional_id") if "transactional_id" in names else None
        if txn_at is not None and txn_at + 1 == acks_at:
            produce = (tuple(field_steps(fields[:txn_at], flexible)), True)
        else:  # generic: no transactional_id right before acks
            produce = (tuple(field_steps(fields[:acks_at], flexible)), False)
    return header_version, flexible, produce


def request_header_version(api_key: int, api_version: int) -> int:
    """Request header version (1 or 2) from kio; UnsupportedApi if unknown."""
    return _request_layout(api_key, api_version)[0]


@functools.cache
def response_header_version(api_key: int, api_version: int) -> int:
    """Response header version (0 or 1). ApiVersions responses always use v0."""
    if api_key == API_VERSIONS:
        return 0
    if not _is_known(api_key, api_version):
        raise UnsupportedApi(api_key, api_version, side="broker")
    schema = load_response_schema(api_key, api_version)
    return int(schema.__header_schema__.__version__)


def read_response_header(payload: Buffer, header_version: int) -> tuple[int, int]:
    """(correlation_id, body offset) of a response payload (no length prefix).

    Raises WireError (internal) on truncation; callers convert it.
    """
    end = len(payload)
    if end < 4:
        raise WireError("response shorter than its correlation id")
    correlation_id = _I32.unpack_from(payload, 0)[0]
    if header_version >= 1:
        return correlation_id, skip_tagged_fields(payload, 4, end)
    return correlation_id, 4


def preload(api_keys: Sequence[int] | None = None) -> None:
    """Import the kio schemas ahead of traffic (first use costs a few ms each)."""
    for api_key in api_keys if api_keys is not None else list(api_key_map):
        versions = known_versions(api_key)
        for version in versions or ():
            _request_layout(api_key, version)
            response_header_version(api_key, version)


def encode_frame(payload: Buffer) -> bytes:
    """Length prefix + payload (a convenience for tests and tools)."""
    return _LEN.pack(len(payload)) + bytes(payload)


# -- correlation table ---------------------------------------------------------------


class CorrelationTable:
    """Per-connection map correlation_id -> (api_key, api_version).

    Filled by :class:`RequestTracker` for every request that expects a
    response, consumed by :class:`ResponseSplitter`. Kafka answers in request
    order on a connection, but the table does not rely on it.
    """

    __slots__ = ("_pending", "max_in_flight")

    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self._pending: dict[int, tuple[int, int]] = {}
        self.max_in_flight = max_in_flight

    def add(self, correlation_id: int, api_key: int, api_version: int) -> None:
        pending = self._pending
        if correlation_id in pending:
            raise DuplicateCorrelationId(correlation_id)
        if len(pending) >= self.max_in_flight:
            raise TooManyInFlight(
                f"more than {self.max_in_flight} requests in flight", side="client"
            )
        pending[correlation_id] = (api_key, api_version)

    def pop(self, correlation_id: int) -> tuple[int, int]:
        try:
            return self._pending.pop(correlation_id)
        except KeyError:
            raise UnknownCorrelationId(correlation_id) from None

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, correlation_id: object) -> bool:
        return correlation_id in self._pending

    def __iter__(self) -> Iterator[int]:
        return iter(self._pending)

    def get(self, correlation_id: int) -> tuple[int, int] | None:
        return self._pending.get(correlation_id)


# -- request direction ---------------------------------------------------------------


class RequestHeader(NamedTuple):
    """What the tracker learned from one request frame."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    expects_response: bool  # False only for Produce with acks=0
    header_version: int  # request header version (1 or 2)
    frame_offset: int  # stream offset of the frame's length prefix
    frame_size: int  # bytes of the frame, length prefix included
    header_size: int  # bytes of the request header (after the length prefix)
    acks: int | None = None  # Produce only
    transactional_id: str | None = None  # Produce only

    @property
    def body_offset(self) -> int:
        """Stream offset of the request body (after the header)."""
        return self.frame_offset + 4 + self.header_size

    @property
    def frame_end(self) -> int:
        """Stream offset just past this frame."""
        return self.frame_offset + self.frame_size


class _Need(Exception):
    """Internal: the peeked bytes end before the header does."""

    __slots__ = ("total",)

    def __init__(self, total: int) -> None:
        self.total = total


def _peek_uvarint(buf: Buffer, off: int, avail: int) -> tuple[int, int]:
    try:
        return read_uvarint(buf, off, avail)
    except WireError:
        if avail - off < 5:  # ran out of bytes, not a 6-byte varint
            raise _Need(avail + 1) from None
        raise


def _peek_request(buf: Buffer, avail: int, frame_len: int, frame_offset: int) -> RequestHeader:
    """Parse the header (and Produce's acks) from ``buf[:avail]``.

    Raises _Need(total) with the number of payload bytes required to go on;
    never asks for more than the frame holds (MalformedFrame instead).
    """
    try:
        return _peek_request_inner(buf, avail, frame_len, frame_offset)
    except _Need as e:
        if e.total > frame_len:
            raise MalformedFrame(
                f"request header runs past the end of its {frame_len}-byte frame",
                side="client",
            ) from None
        raise
    except WireError as e:
        raise MalformedFrame(f"bad request header: {e}", side="client") from None


def _peek_request_inner(
    buf: Buffer, avail: int, frame_len: int, frame_offset: int
) -> RequestHeader:
    if avail < 4:
        raise _Need(4)
    api_key, api_version = struct.unpack_from(">hh", buf, 0)
    header_version, flexible, produce = _request_layout(api_key, api_version)
    if avail < 10:
        raise _Need(10)
    _, _, correlation_id, n = _HEADER_FIXED.unpack_from(buf, 0)
    off = 10
    client_id = None
    if n < -1:
        raise WireError(f"negative client_id length {n}")
    if n >= 0:
        if off + n > avail:
            raise _Need(off + n)
        client_id = str(buf[off : off + n], "utf-8", "replace")
        off += n
    if header_version >= 2:
        count, off = _peek_uvarint(buf, off, avail)
        for _ in range(count):
            _, off = _peek_uvarint(buf, off, avail)
            size, off = _peek_uvarint(buf, off, avail)
            off += size
            if off > avail:
                raise _Need(off)
    header_size = off
    acks = None
    transactional_id = None
    if produce is not None:
        steps, has_txn = produce
        if steps:  # generic layout: step over the fields before acks
            try:
                for step in steps:
                    off = step(buf, off, avail)
            except WireError:
                if avail >= frame_len:
                    raise
                raise _Need(avail + 1) from None
        if has_txn:  # transactional_id: nullable string, then acks
            if flexible:
                length, off = _peek_uvarint(buf, off, avail)
                length -= 1
            else:
                if off + 2 > avail:
                    raise _Need(off + 2)
                length = _I16.unpack_from(buf, off)[0]
                off += 2
            if length < -1:
                raise WireError(f"negative transactional_id length {length}")
            if length >= 0:
                if off + length > avail:
                    raise _Need(off + length)
                transactional_id = str(buf[off : off + length], "utf-8", "replace")
                off += length
        if off + 2 > avail:
            raise _Need(off + 2)
        acks = _I16.unpack_from(buf, off)[0]
    return RequestHeader(
        api_key,
        api_version,
        correlation_id,
        client_id,
        acks != 0,
        header_version,
        frame_offset,
        frame_len + 4,
        header_size,
        acks,
        transactional_id,
    )


_LENGTH, _PEEK, _SKIP = range(3)


class RequestTracker:
    """Observe the client -> broker byte stream; peek each request's header.

    ``feed(chunk)`` accepts chunks of any size and split (even one byte at a
    time) and returns a :class:`RequestHeader` for each frame whose header
    completed within this chunk, in stream order, after recording it in the
    correlation table (unless it expects no response). Buffers at most the
    bytes of the current frame up to the end of its header (Produce: up to
    ``acks``). After a :class:`ProtocolError` the tracker is dead: every later
    ``feed`` raises the same error.
    """

    def __init__(
        self,
        table: CorrelationTable | None = None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.table = table if table is not None else CorrelationTable()
        self.max_frame_size = max_frame_size
        self._state = _LENGTH
        self._buf = bytearray()  # partial length prefix or partial header
        self._need = 0  # payload bytes the header parse needs next
        self._frame_len = 0  # payload length of the current frame
        self._frame_offset = 0  # stream offset of its length prefix
        self._remaining = 0  # bytes of the current frame still to skip
        self._position = 0  # stream bytes consumed before the current chunk
        self._error: ProtocolError | None = None
        self.frames = 0  # headers peeked so far

    @property
    def position(self) -> int:
        """Bytes of the client stream observed so far."""
        return self._position

    @property
    def at_frame_boundary(self) -> bool:
        """True between frames (no partial frame observed)."""
        return self._state == _LENGTH and not self._buf

    @property
    def buffered(self) -> int:
        """Bytes held back for peeking (never forwarded by the tracker)."""
        return len(self._buf)

    def feed(self, data: Buffer) -> list[RequestHeader]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(memoryview(data))
        except ProtocolError as e:
            self._error = e
            raise

    def _feed(self, mv: memoryview) -> list[RequestHeader]:
        out: list[RequestHeader] = []
        n = len(mv)
        pos = 0
        base = self._position
        buf = self._buf
        while pos < n:
            state = self._state
            if state == _SKIP:
                take = min(self._remaining, n - pos)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _LENGTH
                continue
            if state == _LENGTH:
                if not buf and n - pos >= 4:
                    length = _LEN.unpack_from(mv, pos)[0]
                    self._frame_offset = base + pos
                    pos += 4
                else:
                    if not buf:
                        self._frame_offset = base + pos
                    take = min(4 - len(buf), n - pos)
                    buf += mv[pos : pos + take]
                    pos += take
                    if len(buf) < 4:
                        break
                    length = _LEN.unpack_from(buf, 0)[0]
                    buf.clear()
                if length < 0 or length > self.max_frame_size:
                    raise FrameSizeError(
                        f"request frame length {length} outside [0, {self.max_frame_size}]",
                        side="client",
                    )
                self._frame_len = length
                self._need = 4
                self._state = _PEEK
                if length == 0:
                    raise FrameSizeError("empty request frame", side="client")
                continue
            # _PEEK
            frame_len = self._frame_len
            if not buf:
                avail = min(n - pos, frame_len)
                try:
                    header = _peek_request(mv[pos : pos + avail], avail, frame_len, self._frame_offset)
                except _Need as e:
                    # Keep only what the header needs so far; wait for more.
                    self._need = e.total
                    take = min(e.total, avail)
                    buf += mv[pos : pos + take]
                    pos += take
                    continue
                pos += avail
                self._finish(header, frame_len - avail, out)
                continue
            take = min(self._need - len(buf), n - pos)
            buf += mv[pos : pos + take]
            pos += take
            if len(buf) < self._need:
                break
            try:
                header = _peek_request(buf, len(buf), frame_len, self._frame_offset)
            except _Need as e:
                self._need = e.total
                continue
            consumed = len(buf)
            buf.clear()
            self._finish(header, frame_len - consumed, out)
        self._position = base + n
        return out

    def _finish(self, header: RequestHeader, remaining: int, out: list[RequestHeader]) -> None:
        if header.expects_response:
            self.table.add(header.correlation_id, header.api_key, header.api_version)
        self.frames += 1
        out.append(header)
        self._remaining = remaining
        self._state = _SKIP if remaining else _LENGTH


# -- response direction --------------------------------------------------------------


class RewriteOutput(Protocol):
    """``pieces``: the new payload. An output may also say ``changed = False``:
    then its pieces are the payload unchanged (the splitter forwards the
    original frame, as pass-through)."""

    @property
    def pieces(self) -> Sequence[Buffer]: ...


class FrameRewriter(Protocol):
    """What the splitter needs from a rewriter (see proxy.rewrite)."""

    def wants(self, api_key: int, api_version: int) -> bool: ...

    def rewrite(self, api_key: int, api_version: int, payload: Buffer) -> RewriteOutput:
        """Rewrite a whole response payload (length prefix excluded); return
        the new payload as pieces. May raise UnknownBroker / RewriteError /
        ProtocolError."""
        ...


_HEAD, _PASS, _COLLECT, _STALLED = range(4)


class ResponseSplitter:
    """Turn the broker -> client byte stream into segments to write.

    ``feed(chunk) -> list[segment]``: segments are bytes-like (the chunk
    itself, memoryview slices of it, or new bytes) to be written to the client
    in order (``transport.writelines``). Frames the rewriter does not want are
    cut through as they arrive (only the 8 bytes of length + correlation id are
    held back when a chunk ends inside them). Frames it wants are collected
    whole, rewritten, and emitted with a corrected length prefix.

    If the rewrite raises :class:`proxy.errors.UnknownBroker`, the splitter
    *stalls*: ``feed`` returns what came before that frame, ``stalled`` holds
    the error, later chunks are queued; ``resume()`` retries (e.g. once the
    shell bound a listener and updated the mapping) and returns the segments
    it could produce. Any other error is fatal for the connection.
    """

    def __init__(
        self,
        table: CorrelationTable,
        rewriter: FrameRewriter | None = None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.table = table
        self.rewriter = rewriter
        self.max_frame_size = max_frame_size
        self._state = _HEAD
        self._head = bytearray()  # partial length + correlation id
        self._remaining = 0  # bytes of the current frame still to pass/collect
        self._frame = bytearray()  # payload being collected for rewriting
        self._api = (0, 0)  # (api_key, api_version) of the current frame
        self._stalled: UnknownBroker | None = None
        self._backlog: list[bytes] = []
        self._error: Exception | None = None
        self.frames = 0  # responses started
        self.rewritten = 0  # responses rewritten

    @property
    def stalled(self) -> UnknownBroker | None:
        """The UnknownBroker that stopped the stream, until ``resume`` succeeds."""
        return self._stalled

    @property
    def at_frame_boundary(self) -> bool:
        return self._state == _HEAD and not self._head and not self._backlog

    @property
    def remaining_pass_through(self) -> int:
        """Bytes of the current frame that will pass through untouched, when
        the splitter is cutting a frame through (else 0: between frames,
        collecting a frame to rewrite, stalled or failed). The shell may move
        up to that many bytes to the client itself, then call :meth:`skip`."""
        if self._state != _PASS or self._error is not None or self._stalled is not None or self._backlog:
            return 0
        return self._remaining

    def skip(self, n: int) -> None:
        """Advance as if ``n`` pass-through bytes had been fed (and the
        returned segments written): the shell forwarded them itself (splice)."""
        if not 0 <= n <= self.remaining_pass_through:
            raise ValueError(f"cannot skip {n} bytes: {self.remaining_pass_through} pass-through bytes remain")
        self._remaining -= n
        if self._remaining == 0:
            self._state = _HEAD

    def feed(self, data: Buffer) -> list[Buffer]:
        if self._error is not None:
            raise self._error
        if self._stalled is not None:
            self._backlog.append(bytes(data))
            return []
        out: list[Buffer] = []
        self._run(data, out)
        return out

    def resume(self) -> list[Buffer]:
        """Retry the stalled rewrite, then process the queued chunks."""
        if self._error is not None:
            raise self._error
        out: list[Buffer] = []
        if self._stalled is None:
            return out
        if not self._emit_rewrite(out):
            return out
        self._state = _HEAD
        backlog, self._backlog = self._backlog, []
        for i, chunk in enumerate(backlog):
            self._run(chunk, out)
            if self._stalled is not None:
                self._backlog.extend(backlog[i + 1 :])
                break
        return out

    def _run(self, data: Buffer, out: list[Buffer]) -> None:
        try:
            self._process(data, out)
        except Exception as e:
            self._error = e
            raise

    def _process(self, data: Buffer, out: list[Buffer]) -> None:  # noqa: C901
        mv = memoryview(data)
        n = len(mv)
        pos = 0
        run = -1  # start of the current pass-through run in this chunk
        head = self._head
        while pos < n:
            state = self._state
            if state == _PASS:
                if run < 0:
                    run = pos
                take = min(self._remaining, n - pos)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _HEAD
                continue
            if state == _COLLECT:
                take = min(self._remaining, n - pos)
                self._frame += mv[pos : pos + take]
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    if not self._emit_rewrite(out):
                        if pos < n:
                            self._backlog.append(bytes(mv[pos:]))
                        return
                    self._state = _HEAD
                continue
            # _HEAD: need length (4) + correlation id (4)
            in_chunk = not head and n - pos >= 8
            if in_chunk:
                length, correlation_id = struct.unpack_from(">ii", mv, pos)
            else:
                if run >= 0:  # the frame's head starts here: end the run
                    out.append(mv[run:pos])
                    run = -1
                take = min(8 - len(head), n - pos)
                head += mv[pos : pos + take]
                pos += take
                if len(head) < 4:
                    break
                length = _LEN.unpack_from(head, 0)[0]
                self._check_length(length)
                if len(head) < 8:
                    break
                correlation_id = _I32.unpack_from(head, 4)[0]
            self._check_length(length)
            api_key, api_version = self.table.pop(correlation_id)
            self.frames += 1
            self._api = (api_key, api_version)
            rewriter = self.rewriter
            if rewriter is not None and rewriter.wants(api_key, api_version):
                if in_chunk and n - pos >= 4 + length:
                    # The whole frame is in this chunk: rewrite it in place,
                    # without collecting a copy.
                    result = self._rewrite(mv[pos + 4 : pos + 4 + length])
                    if result is not None and not getattr(result, "changed", True):
                        # Nothing to rewrite (e.g. a Produce response without
                        # node_endpoints): the frame joins the pass-through run.
                        if run < 0:
                            run = pos
                        pos += 4 + length
                        continue
                    if run >= 0:
                        out.append(mv[run:pos])
                        run = -1
                    pos += 4 + length
                    if result is None:  # stalled: the rest waits for resume()
                        if pos < n:
                            self._backlog.append(bytes(mv[pos:]))
                        return
                    self._emit_pieces(out, result.pieces)
                    continue
                if run >= 0:
                    out.append(mv[run:pos])
                    run = -1
                if in_chunk:
                    pos += 4  # the length prefix is recomputed
                    self._frame = bytearray()
                    self._remaining = length
                else:
                    self._frame = bytearray(head[4:])
                    self._remaining = length - 4
                    head.clear()
                self._state = _COLLECT
                if self._remaining == 0:  # nothing more to wait for
                    if not self._emit_rewrite(out):
                        if pos < n:
                            self._backlog.append(bytes(mv[pos:]))
                        return
                    self._state = _HEAD
                continue
            if in_chunk:
                if run < 0:
                    run = pos
                self._remaining = length + 4
            else:
                out.append(bytes(head))
                head.clear()
                self._remaining = length - 4
            self._state = _PASS if self._remaining else _HEAD
        if run >= 0:
            out.append(data if run == 0 and pos == n and isinstance(data, bytes) else mv[run:pos])

    def _check_length(self, length: int) -> None:
        if length < 4 or length > self.max_frame_size:
            raise FrameSizeError(
                f"response frame length {length} outside [4, {self.max_frame_size}]",
                side="broker",
            )

    def _emit_rewrite(self, out: list[Buffer], payload: Buffer | None = None) -> bool:
        """Rewrite a whole frame's payload (default: the collected one) into
        ``out``; False if stalled (the payload is then kept for resume)."""
        result = self._rewrite(self._frame if payload is None else payload)
        if result is None:
            return False
        self._emit_pieces(out, result.pieces)
        return True

    def _rewrite(self, payload: Buffer) -> RewriteOutput | None:
        """Rewrite a whole frame's payload; None if stalled (a copy of the
        payload is then kept for resume)."""
        api_key, api_version = self._api
        assert self.rewriter is not None
        try:
            result = self.rewriter.rewrite(api_key, api_version, payload)
        except UnknownBroker as e:
            if payload is not self._frame:
                self._frame = bytearray(payload)  # a copy: the caller may reuse its buffer
            self._stalled = e
            self._state = _STALLED
            return None
        except Exception as e:
            self._error = e
            raise
        if self._frame:
            self._frame = bytearray()
        self._stalled = None
        self.rewritten += 1
        return result

    @staticmethod
    def _emit_pieces(out: list[Buffer], pieces: Sequence[Buffer]) -> None:
        out.append(_LEN.pack(sum(len(p) for p in pieces)))
        out.extend(pieces)


class ConnectionCodec:
    """The two directions of one proxied connection, sharing one table."""

    def __init__(
        self,
        rewriter: FrameRewriter | None = None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self.table = CorrelationTable(max_in_flight)
        self.requests = RequestTracker(self.table, max_frame_size=max_frame_size)
        self.responses = ResponseSplitter(self.table, rewriter, max_frame_size=max_frame_size)

    @property
    def in_flight(self) -> int:
        """Requests still waiting for (the start of) their response."""
        return len(self.table)

    @property
    def idle(self) -> bool:
        """No request in flight and both streams between frames: the
        connection can be closed without cutting a message (graceful drain)."""
        return (
            not self.table
            and self.requests.at_frame_boundary
            and self.responses.at_frame_boundary
            and self.responses.stalled is None
        )
