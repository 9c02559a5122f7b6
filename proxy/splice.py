"""Zero-copy forwarding of a large pass-through response body with splice(2).

A Fetch response is cut through untouched (DESIGN §2.6), so copying its body
broker socket -> user space -> client socket buys nothing. For the rest of a
pass-through frame at least ``limits.splice_min_bytes`` long, the shell hands
the two sockets to a :class:`Splice`, which moves exactly that many bytes
broker socket -> pipe -> client socket with ``os.splice`` (the pages move, the
bytes are never copied into the process). Measured in BENCHMARKS.md ("Proxy
overhead"): about a third less CPU per GB forwarded than ``recv_into`` + ``send``.

uvloop owns a transport's fd (``loop.add_reader`` on it raises), so the shell
pauses the broker transport's reading, and :class:`Splice` works on ``dup``'ed
fds of both sockets, watched with ``loop.add_reader`` / ``loop.add_writer``.
The rules that keep the byte stream in order, kept by the shell
(``proxy.connection``):

* a splice starts only when the client transport has nothing buffered
  (``get_write_buffer_size() == 0``): everything written before is in the
  kernel, ahead of the spliced bytes;
* while it runs, nothing else is written to the client transport (only
  upstream reads produce writes to it, and they are paused);
* when ``count`` bytes went out, ``on_done`` tells the codec
  (``ResponseSplitter.skip``) and the broker transport reads again.

Backpressure: at most one pipe's worth is read from the broker before the
client took it; a client that does not read leaves the rest in the broker
socket (TCP flow control does the rest), exactly like a paused transport.

Wake-ups: the job wakes for whatever the broker sent and moves it on at once.
Waking up for runs of 256 KiB instead (SO_RCVLOWAT) saved callbacks but cost
fetch throughput: the client got the bytes later and the broker was held back
(BENCHMARKS.md, "The baseline hop": 533 vs 644 MB/s with and without it, side
by side). A try that finds nothing raises BlockingIOError, which costs more
than the splice: a short read counts as "the socket is drained" and a short
write as "the client is full", and the job waits (readiness is
level-triggered, so bytes that came meanwhile wake it at once).

Pipes come from a small per-thread (per event loop) pool: a pipe is needed only
while a splice runs, and an enlarged pipe counts against the user's
``fs.pipe-user-pages-soft`` (a pipe per connection would not scale).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
from typing import Callable

__all__ = ("AVAILABLE", "PIPE_BYTES", "Splice", "pipe_pool")

AVAILABLE = hasattr(os, "splice")  # Linux, Python 3.10+
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
# Pipe capacity asked for (capped by /proc/sys/fs/pipe-max-size; the kernel's
# default, 64 KiB, if the request is refused). One splice call moves at most this.
PIPE_BYTES = 1 << 20
MAX_IDLE_PIPES = 4
_FLAGS = (os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK) if AVAILABLE else 0
_READ, _WRITE = 1, 2


class PipePool:
    """Idle pipes of one event loop: ``(read_fd, write_fd, capacity)``."""

    def __init__(self, size: int = PIPE_BYTES) -> None:
        self.size = size
        self._idle: list[tuple[int, int, int]] = []
        self.created = 0

    def take(self) -> tuple[int, int, int]:
        if self._idle:
            return self._idle.pop()
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, self.size)
        except OSError:
            pass  # EPERM beyond the user's pipe pages: the default capacity still works
        try:
            capacity = fcntl.fcntl(w, F_GETPIPE_SZ)
        except OSError:
            capacity = 1 << 16
        self.created += 1
        return r, w, capacity

    def give(self, pipe: tuple[int, int, int]) -> None:
        """Return an *empty* pipe."""
        if len(self._idle) < MAX_IDLE_PIPES:
            self._idle.append(pipe)
        else:
            _close_pipe(pipe)

    def close(self) -> None:
        while self._idle:
            _close_pipe(self._idle.pop())


def _close_pipe(pipe: tuple[int, int, int]) -> None:
    os.close(pipe[0])
    os.close(pipe[1])


_local = threading.local()


def pipe_pool() -> PipePool:
    """The calling thread's (event loop's) pipe pool."""
    try:
        return _local.pipes  # type: ignore[no-any-return]
    except AttributeError:
        pool = _local.pipes = PipePool()
        return pool


class Splice:
    """Move exactly ``count`` bytes from socket ``src_fd`` to socket ``dst_fd``.

    Both fds are ``dup``'ed (the callers' fds stay theirs). :meth:`start` moves
    what it can at once and then continues from the loop's readiness
    callbacks. Exactly one of these ends it:

    * ``on_done()``: all ``count`` bytes went to ``dst``;
    * ``on_error(reason)``: EOF or an error on either socket (the pipe may
      hold bytes that never reached ``dst``: the connection is broken);
    * :meth:`cancel` by the owner (no callback).

    ``on_read(n)`` reports bytes taken from ``src`` as they come (metrics).
    Every path releases the readers/writers and closes the dup'ed fds.
    """

    __slots__ = ("loop", "count", "_src", "_dst", "_pipe", "_left", "_in_pipe", "_waiting", "_on_read", "_on_done",
                 "_on_error", "_pool", "active", "calls", "wakeups")

    def __init__(self, loop: asyncio.AbstractEventLoop, src_fd: int, dst_fd: int, count: int, *,
                 on_read: Callable[[int], None], on_done: Callable[[], None],
                 on_error: Callable[[str], None], pool: PipePool | None = None) -> None:
        if count <= 0:
            raise ValueError("nothing to splice")
        self.loop = loop
        self.count = count
        self._on_read = on_read
        self._on_done = on_done
        self._on_error = on_error
        self._left = count  # still to read from src
        self._in_pipe = 0  # read from src, not yet written to dst
        self._waiting = 0
        self.calls = 0  # splice(2) calls that moved bytes
        self.wakeups = 0  # readiness callbacks
        self._pool = pool or pipe_pool()
        self._pipe = self._pool.take()
        try:
            self._src = os.dup(src_fd)
            try:
                self._dst = os.dup(dst_fd)
            except OSError:
                os.close(self._src)
                raise
        except OSError:
            _close_pipe(self._pipe)
            raise
        self.active = True

    @property
    def in_pipe(self) -> int:
        return self._in_pipe

    def start(self) -> None:
        self._pump()

    def cancel(self) -> None:
        """Stop now (the connection is closing): no callback."""
        if self.active:
            self._release(keep_pipe=False)

    def _pump(self) -> None:
        # Short read: drained; short write: client full; then wait (module docstring, "Wake-ups").
        src, dst = self._src, self._dst
        r, w, capacity = self._pipe
        while True:
            drained = False
            room = capacity - self._in_pipe
            if self._left and room:
                want = self._left if self._left < room else room
                try:
                    n = os.splice(src, w, want, flags=_FLAGS)
                except BlockingIOError:  # nothing to read
                    n = -1
                except OSError as exc:
                    self._fail(f"broker socket error during splice: {exc}")
                    return
                if n == 0:
                    self._fail(f"broker closed the connection {self.count - self._left} bytes into "
                               f"a {self.count}-byte spliced response body")
                    return
                if n > 0:
                    self._left -= n
                    self._in_pipe += n
                    self.calls += 1
                    self._on_read(n)
                drained = n < want
            full = False
            if self._in_pipe:
                try:
                    n = os.splice(r, dst, self._in_pipe, flags=_FLAGS)
                except BlockingIOError:  # the client's socket buffer is full
                    n = 0
                except OSError as exc:
                    self._fail(f"client socket error during splice: {exc}")
                    return
                if n:
                    self._in_pipe -= n
                    self.calls += 1
                full = self._in_pipe > 0
            if not self._left and not self._in_pipe:
                self._release(keep_pipe=True)
                self._on_done()
                return
            if full:  # the pipe's bytes wait for the client (what the broker sent more stays in its socket)
                self._wait(_WRITE)
                return
            if drained:  # an empty pipe waits for the broker
                self._wait(_READ)
                return

    def _wake(self) -> None:
        self.wakeups += 1
        self._pump()

    def _wait(self, kind: int) -> None:
        if self._waiting == kind:
            return
        self._unwatch()
        if kind == _READ:
            self.loop.add_reader(self._src, self._wake)
        else:
            self.loop.add_writer(self._dst, self._wake)
        self._waiting = kind

    def _unwatch(self) -> None:
        if self._waiting == _READ:
            self.loop.remove_reader(self._src)
        elif self._waiting == _WRITE:
            self.loop.remove_writer(self._dst)
        self._waiting = 0

    def _fail(self, reason: str) -> None:
        self._release(keep_pipe=False)
        self._on_error(reason)

    def _release(self, *, keep_pipe: bool) -> None:
        self.active = False
        self._unwatch()
        os.close(self._src)
        os.close(self._dst)
        if keep_pipe and not self._in_pipe:
            self._pool.give(self._pipe)
        else:
            _close_pipe(self._pipe)
