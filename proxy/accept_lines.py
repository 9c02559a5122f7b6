"""Connections accepted but not opened yet, in a line per client host: sparse hosts first.

In a failover thousands of clients reconnect to the node that took a dead node's
identities in the same second, and the kernel queues them in arrival order: a
client arriving in the middle (a consumer looking for its group coordinator, on a
host with a handful of connections) waited behind every connection queued before
it, several hundred milliseconds on this machine (BENCHMARKS.md, session 41),
twice (its connection and its coordinator connection). With
``limits.fair_accept`` a worker takes everything the kernel queued at each
wake-up (an ``accept`` is cheap; opening the connection is not) into a line per
source address, and opens a bounded number per turn of its loop, one per host
per round, the hosts with the fewest waiting first: a host with one connection
waiting is served in the next turn, whatever the hosts with hundreds queued.

Sans-IO: the items are whatever the caller queues (an accepted socket and its
protocol factory); the caller accepts, opens and schedules (proxy.listeners).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class AcceptLines(Generic[T]):
    """Items in a line per source; :meth:`take` serves the sources round by round."""

    __slots__ = ("_lines", "_count")

    def __init__(self) -> None:
        self._lines: dict[Hashable, deque[T]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def put(self, source: Hashable, item: T) -> None:
        line = self._lines.get(source)
        if line is None:
            line = self._lines[source] = deque()
        line.append(item)
        self._count += 1

    def take(self, n: int) -> list[T]:
        """Up to ``n`` items: rounds of one per source, in each round the sources with the fewest
        waiting first (arrival order within a source)."""
        out: list[T] = []
        lines = self._lines
        while len(out) < n and lines:
            for source in sorted(lines, key=lambda s: len(lines[s])):
                line = lines[source]
                out.append(line.popleft())
                if not line:
                    del lines[source]
                if len(out) == n:
                    break
        self._count -= len(out)
        return out

    def drop(self, pred: Callable[[T], bool]) -> list[T]:
        """Remove and return the items for which ``pred`` is true (a listener closed: the kernel
        would have reset what its queue held; so does its owner with these)."""
        out: list[T] = []
        for source, line in list(self._lines.items()):
            kept: deque[T] = deque()
            for item in line:
                (out if pred(item) else kept).append(item)
            if kept:
                self._lines[source] = kept
            else:
                del self._lines[source]
        self._count -= len(out)
        return out
