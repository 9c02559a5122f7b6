"""The request direction (client -> broker): :class:`RequestTracker` peeks
each request's header and records it in the correlation table; the shell
forwards the very same chunks unchanged. See :mod:`proxy.codec`."""

from __future__ import annotations

import struct

from typing import NamedTuple

from proxy._wire import Buffer
from proxy._wire import WireError
from proxy._wire import read_uvarint
from proxy.errors import FrameSizeError
from proxy.errors import MalformedFrame
from proxy.errors import ProtocolError
from proxy.framing import DEFAULT_MAX_FRAME_SIZE
from proxy.framing import CorrelationTable
from proxy.framing import request_layout

_I16 = struct.Struct(">h")
_LEN = struct.Struct(">i")
# api_key, api_version, correlation_id, client_id length
_HEADER_FIXED = struct.Struct(">hhih")


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
    header_version, flexible, produce = request_layout(api_key, api_version)
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
