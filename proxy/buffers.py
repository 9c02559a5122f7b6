"""Reusable read buffers for the data path's ``asyncio.BufferedProtocol`` sides.

A ``Protocol`` gets a new ``bytes`` object per read (uvloop allocates it and
copies the bytes in): at 1 GB/s that is thousands of large allocations, page
faults and copies per second, most of the proxy's CPU. The proxy instead reads
into a buffer it reuses: ``get_buffer`` hands out :attr:`ReadBuffers.view`,
``buffer_updated(n)`` processes ``view[:n]`` and writes the pass-through slices
of it to the other side at once.

The catch: a transport keeps a reference to whatever part of a ``write()`` it
could not send at once (uvloop keeps the memoryview itself, see
``UVStream._exec_write``). So after writing, the shell checks
``transport.get_write_buffer_size()``: 0 means every byte is in the kernel and
the buffer may be read into again; anything else means the buffer is *lent*
to that transport, and :meth:`ReadBuffers.release` switches to another buffer
(one given back by a transport that has drained since, else a new one). What
the codec keeps across reads (partial headers, frames held for rewriting,
chunks queued while stalled) it copies (see :mod:`proxy.codec`).

One :class:`ReadBuffers` per thread (one event loop per thread) is shared by
every connection of that loop: a read and its processing run without any other
callback of the loop in between, and nothing refers to the buffer once
``buffer_updated`` has returned, unless it was lent.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ("READ_BUFFER_BYTES", "MAX_LENT", "ReadBuffers", "read_buffers")

# Bytes read per syscall at most. Larger reads mean fewer syscalls and Python
# callbacks per GB; a read returns what the socket holds, so a large buffer
# adds no latency.
READ_BUFFER_BYTES = 1 << 20
# Lent buffers remembered for reuse; beyond that they are left to the GC.
MAX_LENT = 16


class _Holder(Protocol):
    def get_write_buffer_size(self) -> int: ...


class ReadBuffers:
    """The current read buffer of a loop, plus the buffers lent to transports."""

    __slots__ = ("size", "view", "_lent", "allocated", "lent_count")

    def __init__(self, size: int = READ_BUFFER_BYTES) -> None:
        self.size = size
        self.view = memoryview(bytearray(size))
        self._lent: list[tuple[memoryview, _Holder]] = []
        self.allocated = 1  # buffers created (the first one included)
        self.lent_count = 0  # times the current buffer was lent

    def release(self, holder: _Holder) -> None:
        """``holder`` may still refer to bytes of the current buffer (its write
        buffer is not empty): leave the buffer to it, switch to another."""
        self.lent_count += 1
        lent = self._lent
        current = self.view
        for i, (view, transport) in enumerate(lent):
            if not transport.get_write_buffer_size():  # drained (or closed): nothing refers to it any more
                lent[i] = (current, holder)
                self.view = view
                return
        lent.append((current, holder))
        if len(lent) > MAX_LENT:
            del lent[0]
        self.view = memoryview(bytearray(self.size))
        self.allocated += 1


_local = threading.local()


def read_buffers() -> ReadBuffers:
    """The calling thread's (event loop's) shared read buffers."""
    try:
        return _local.buffers  # type: ignore[no-any-return]
    except AttributeError:
        buffers = _local.buffers = ReadBuffers()
        return buffers
