"""The response direction (broker -> client): :class:`ResponseSplitter` cuts
pass-through frames through as they arrive and collects the frames a
:class:`FrameRewriter` wants whole. See :mod:`proxy.codec`."""

from __future__ import annotations

import struct

from collections.abc import Callable, Sequence
from typing import Protocol

from proxy._wire import Buffer
from proxy.errors import FrameSizeError
from proxy.errors import UnknownBroker
from proxy.framing import DEFAULT_MAX_FRAME_SIZE
from proxy.framing import CorrelationTable

_I32 = struct.Struct(">i")
_LEN = struct.Struct(">i")


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
        # Told of every frame the rewriter handled (its key, version and new payload's pieces, views
        # valid only during the call): proxy.local_answers learns ApiVersions answers so.
        self.observer: Callable[[int, int, Sequence[Buffer]], None] | None = None

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

    def _process(self, data: Buffer, out: list[Buffer]) -> None:
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
                pos = self._collect(mv, pos, n, out)
                if pos < 0:
                    return
                continue
            # _HEAD: need length (4) + correlation id (4)
            in_chunk = not head and n - pos >= 8
            if in_chunk:
                length, correlation_id = struct.unpack_from(">ii", mv, pos)
            else:
                if run >= 0:  # the frame's head starts here: end the run
                    out.append(mv[run:pos])
                    run = -1
                pos, length, correlation_id = self._head_across_chunks(mv, pos, n)
                if correlation_id is None:  # the chunk ended inside the head
                    break
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
                pos = self._begin_collect(mv, pos, n, length, in_chunk, out)
                if pos < 0:
                    return
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

    def _head_across_chunks(self, mv: memoryview, pos: int, n: int) -> tuple[int, int, int | None]:
        """Add to ``_head`` a frame head split over chunks: (new position,
        length, correlation id), the id None while the head is incomplete."""
        head = self._head
        take = min(8 - len(head), n - pos)
        head += mv[pos : pos + take]
        pos += take
        if len(head) < 4:
            return pos, 0, None
        length = _LEN.unpack_from(head, 0)[0]
        self._check_length(length)
        if len(head) < 8:
            return pos, length, None
        return pos, length, _I32.unpack_from(head, 4)[0]

    def _collect(self, mv: memoryview, pos: int, n: int, out: list[Buffer]) -> int:
        """Add ``mv[pos:n]`` to the frame collected for rewriting, rewrite it
        once whole; the new position, or -1 if the rewrite stalled (the rest
        of the chunk is then queued)."""
        take = min(self._remaining, n - pos)
        self._frame += mv[pos : pos + take]
        pos += take
        self._remaining -= take
        return self._collected(mv, pos, n, out) if self._remaining == 0 else pos

    def _begin_collect(
        self, mv: memoryview, pos: int, n: int, length: int, in_chunk: bool, out: list[Buffer]
    ) -> int:
        """Start collecting a frame to rewrite that this chunk does not hold
        whole (its head at ``pos`` in the chunk, or in ``_head``); returns as
        :meth:`_collect`."""
        if in_chunk:
            pos += 4  # the length prefix is recomputed
            self._frame = bytearray()
            self._remaining = length
        else:
            self._frame = bytearray(self._head[4:])
            self._remaining = length - 4
            self._head.clear()
        self._state = _COLLECT
        return self._collected(mv, pos, n, out) if self._remaining == 0 else pos  # 0: nothing to wait for

    def _collected(self, mv: memoryview, pos: int, n: int, out: list[Buffer]) -> int:
        """The collected frame is whole: rewrite it and read heads again; -1 if
        the rewrite stalled (the rest of the chunk, from ``pos``, is then queued)."""
        if not self._emit_rewrite(out):
            if pos < n:
                self._backlog.append(bytes(mv[pos:]))
            return -1
        self._state = _HEAD
        return pos

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
        if self.observer is not None:
            self.observer(api_key, api_version, result.pieces)
        return result

    @staticmethod
    def _emit_pieces(out: list[Buffer], pieces: Sequence[Buffer]) -> None:
        out.append(_LEN.pack(sum(len(p) for p in pieces)))
        out.extend(pieces)
