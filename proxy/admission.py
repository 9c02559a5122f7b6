"""Which new client connections a node takes: the decisions, no I/O.

Two limits protect a node that is already serving (issue 12, item 4):

* a cap on the client connections it holds (``limits.max_connections``):
  each costs two sockets and some KiB, and past the cap the node would run
  out of descriptors and fail the connections it has;
* a token bucket per source address (``limits.accepts_per_source_per_s``,
  holding one second's worth): one runaway client host reconnecting in a
  loop cannot take the accept loop from everyone else. 0 turns it off.

A refused connection is closed at once by the shell (:mod:`proxy.connection`);
the connections the node has are never touched. Refusals are counted by
reason, and logged at most once per source and reason per
:data:`LOG_INTERVAL_S` (with how many were refused since the last line), so
a storm of refusals is one line per source, not one per connection.

:class:`Admission` reads no clock of its own: every call gets ``now`` (the
loop's monotonic time), so tests drive it with a fake clock.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ("Admission", "Refusal", "RefusalReason", "LOG_INTERVAL_S", "FORGET_LOG_S", "PRUNE_INTERVAL_S")

# At most one log line per source and reason this often.
LOG_INTERVAL_S = 10.0
# A source whose refusals since its last line were never logged (it went quiet
# within the interval) is forgotten after this long.
FORGET_LOG_S = 6 * LOG_INTERVAL_S
# How often buckets that have refilled completely (and log states older than
# LOG_INTERVAL_S) are forgotten: such a bucket is the same as a new one, and
# without pruning every source ever seen would stay in memory.
PRUNE_INTERVAL_S = 10.0


class RefusalReason(enum.Enum):
    """Why; the value names the limit (``limits.<value>``) and is the metric's ``reason`` label."""

    NODE_CAP = "max_connections"
    SOURCE_RATE = "accepts_per_source_per_s"


@attrs.frozen
class Refusal:
    """A connection to refuse. ``log``: write the line for it (the first for
    this source and reason in ``LOG_INTERVAL_S``); ``refused_since_log``: how
    many of this source's connections were refused for this reason since the
    last line, this one included."""

    reason: RefusalReason
    source: str
    log: bool
    refused_since_log: int


@attrs.define
class _Bucket:
    tokens: float
    at: float


@attrs.define
class _LogState:
    logged_at: float
    refused: int


class Admission:
    """The admission decisions of one node (see the module doc).

    ``admit(source, open_connections, now)`` returns ``None`` (take it) or a
    :class:`Refusal`. ``open_connections`` is how many client connections the
    node holds before this one."""

    def __init__(self, max_connections: int, accepts_per_source_per_s: float) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self._logs: dict[tuple[str, RefusalReason], _LogState] = {}
        self._pruned_at: float | None = None
        self.refused: dict[RefusalReason, int] = {r: 0 for r in RefusalReason}
        self.retune(max_connections, accepts_per_source_per_s)

    def retune(self, max_connections: int, accepts_per_source_per_s: float) -> None:
        """New limits (a config reload): the next ``admit`` uses them. Connections held are
        not this object's business (a lower cap only refuses new ones); each source keeps
        its bucket, with no more tokens than the new capacity."""
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if accepts_per_source_per_s < 0:
            raise ValueError("accepts_per_source_per_s must be 0 (no limit) or positive")
        self.max_connections = max_connections
        self.rate = float(accepts_per_source_per_s)
        self.capacity = max(self.rate, 1.0)  # one second's worth, at least one connection
        for bucket in self._buckets.values():
            bucket.tokens = min(bucket.tokens, self.capacity)

    @property
    def tracked_sources(self) -> int:
        return len(self._buckets)

    def admit(self, source: str, open_connections: int, now: float) -> Refusal | None:
        self._maybe_prune(now)
        if self.rate:
            if not self._take_token(source, now):
                return self._refuse(RefusalReason.SOURCE_RATE, source, now)
        if open_connections >= self.max_connections:
            return self._refuse(RefusalReason.NODE_CAP, source, now)
        return None

    def _take_token(self, source: str, now: float) -> bool:
        bucket = self._buckets.get(source)
        if bucket is None:
            self._buckets[source] = _Bucket(self.capacity - 1.0, now)
            return True
        bucket.tokens = min(self.capacity, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        return False

    def _maybe_prune(self, now: float) -> None:
        if self._pruned_at is None:
            self._pruned_at = now
            return
        if now - self._pruned_at < PRUNE_INTERVAL_S:
            return
        self._pruned_at = now
        full = [s for s, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.capacity]
        for source in full:
            del self._buckets[source]
        # A source still refused logs again within an interval (which resets its state); one
        # quiet that long is forgotten, its unlogged count after FORGET_LOG_S (the metric has it).
        stale = [k for k, v in self._logs.items()
                 if now - v.logged_at >= (FORGET_LOG_S if v.refused else LOG_INTERVAL_S)]
        for key in stale:
            del self._logs[key]

    def _refuse(self, reason: RefusalReason, source: str, now: float) -> Refusal:
        self.refused[reason] += 1
        key = (source, reason)
        state = self._logs.get(key)
        if state is None:
            self._logs[key] = _LogState(now, 0)
            return Refusal(reason, source, log=True, refused_since_log=1)
        state.refused += 1
        if now - state.logged_at >= LOG_INTERVAL_S:
            count, state.refused, state.logged_at = state.refused, 0, now
            return Refusal(reason, source, log=True, refused_since_log=count)
        return Refusal(reason, source, log=False, refused_since_log=state.refused)
