"""What every paced (long-running) workload shares, whatever its family: the record
numbering, stopping on SIGTERM or a deadline, the fixed-rate pacer, the trace events of a
producer or consumer, the commit retry. The family adapters (``chaos.clients.*_client``) run
the client loops on top of it; ``chaos.clients.workload`` is the process entry.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from chaos.clients.settings import (COMMIT_RETRY_S, KEY_SPREAD, MAX_BEHIND_S, MAX_LIFETIME_S, RETRY_BACKOFF_MAX_MS,
                                    RETRY_BACKOFF_MS)
from chaos.trace import TraceWriter

log = logging.getLogger("kproxy.workloads")


# ------------------------------------------------------------------ records
def record_value(prefix: int, seq: int) -> str:
    """The wire value (and trace key) of record ``seq`` of producer ``prefix``."""
    return f"{prefix}.{seq}"


def wire_key(seq: int) -> bytes:
    return str(seq % KEY_SPREAD).encode()


def parse_value(value: bytes | str | None) -> tuple[str, int] | None:
    """``b"7.42"`` -> ``("7.42", 42)`` (trace key, seq); None if it is not one of ours."""
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    prefix, dot, seq = text.partition(".")
    if not dot or not prefix.isdigit() or not seq.isdigit():
        return None
    return text, int(seq)


# ---------------------------------------------------------------- stopping
class Stop:
    """Set by SIGTERM/SIGINT or when ``duration_s`` has passed."""

    def __init__(self, duration_s: float | None) -> None:
        self.event = threading.Event()
        self.deadline = time.monotonic() + (MAX_LIFETIME_S if duration_s is None else duration_s)
        self.on_signal: list[Any] = []

    def install(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            self.event.set()
            for fn in self.on_signal:
                fn(signum)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def requested(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.event.set()
        return self.event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (bounded by the duration); True if stop was requested."""
        timeout_s = min(timeout_s, max(0.0, self.deadline - time.monotonic()))
        self.event.wait(max(0.0, timeout_s))
        return self.requested()


class Pacer:
    """Fixed-rate schedule: the instant of send ``i`` is ``t0 + i / rate``."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.interval_s = 1.0 / rate
        self.next_t = time.monotonic()

    def delay_s(self) -> float:
        now = time.monotonic()
        if now - self.next_t > MAX_BEHIND_S:  # after a stall: resume the pace, no burst
            self.next_t = now
        return max(0.0, self.next_t - now)

    def advance(self) -> None:
        self.next_t += self.interval_s


# --------------------------------------------------------------- producers
class ProducerTrace:
    """Trace events of one producer, plus counts for its exit line."""

    def __init__(self, writer: TraceWriter, client_id: str, family: str, topic: str, prefix: int) -> None:
        self.w = writer
        self.common = {"client_id": client_id, "family": family, "topic": topic}
        self.prefix = prefix
        self.sent = self.acked = self.errors = 0
        self._lock = threading.Lock()

    def send(self, seq: int) -> None:
        self.sent += 1
        self.w.client("send", key=record_value(self.prefix, seq), seq=seq, **self.common)

    def ack(self, seq: int, partition: int, offset: int, detail: str | None = None) -> None:
        with self._lock:
            self.acked += 1
        self.w.client("ack", key=record_value(self.prefix, seq), seq=seq, partition=partition, offset=offset,
                      detail=detail, **self.common)

    def error(self, detail: str, seq: int | None = None) -> None:
        with self._lock:
            self.errors += 1
        key = None if seq is None else record_value(self.prefix, seq)
        self.w.client("error", key=key, seq=seq, detail=detail[:500], **self.common)

    def outstanding(self) -> int:
        with self._lock:
            return self.sent - self.acked - self.errors

    def counts(self) -> dict[str, int]:
        return {"sent": self.sent, "acked": self.acked, "errors": self.errors}


# --------------------------------------------------------------- consumers
class ConsumerTrace:
    def __init__(self, writer: TraceWriter, client_id: str, family: str, topic: str, group: str) -> None:
        self.w = writer
        self.common = {"client_id": client_id, "family": family, "topic": topic, "group": group}
        self.consumed = self.errors = self.foreign = 0

    def consume(self, value: bytes | str | None, partition: int, offset: int, detail: str | None = None) -> None:
        parsed = parse_value(value)
        if parsed is None:
            self.foreign += 1
            self.error(f"foreign record at {partition}:{offset}: {value!r:.80}")
            return
        key, seq = parsed
        self.consumed += 1
        self.w.client("consume", key=key, seq=seq, partition=partition, offset=offset, detail=detail, **self.common)

    def error(self, detail: str) -> None:
        self.errors += 1
        self.w.client("error", detail=detail[:500], **self.common)

    def counts(self) -> dict[str, int]:
        return {"consumed": self.consumed, "errors": self.errors, "foreign": self.foreign}


class CommitRetry:
    """What to do after a failed commit: retry after a backoff, bounded by ``COMMIT_RETRY_S``,
    or give up at once when only a poll can cure the error. A commit refused because the
    group is rebalancing (or this member's generation is gone) never succeeds before the
    consumer polls again, which is what rejoins the group; retrying it in a loop kept
    kafka-python out of its group for the whole 10 s of retries, again and again. Given up,
    the commit is just not made: the next one covers those offsets too (commits are
    cumulative). Only if the rejoin hands a partition to another member are its records
    since the last commit read again, which the drill counts as duplicated, as it would
    after any failed commit."""

    __slots__ = ("t", "rebalancing", "deadline", "backoff_s", "attempts")

    def __init__(self, t: ConsumerTrace, rebalancing: Callable[[BaseException], bool]) -> None:
        self.t = t
        self.rebalancing = rebalancing
        self.deadline = time.monotonic() + COMMIT_RETRY_S
        self.backoff_s = RETRY_BACKOFF_MS / 1000
        self.attempts = 0

    def failed(self, exc: BaseException) -> float | None:
        """Record the failure; return the seconds to wait before the next attempt, or None."""
        self.t.error(f"commit failed: {type(exc).__name__}: {exc}")
        self.attempts += 1
        if self.rebalancing(exc) or self.attempts >= 1000 or time.monotonic() + self.backoff_s > self.deadline:
            return None
        delay, self.backoff_s = self.backoff_s, min(self.backoff_s * 2, RETRY_BACKOFF_MAX_MS / 1000)
        return delay


def commit_with_retry(commit: Callable[[], Any], t: ConsumerTrace,
                       rebalancing: Callable[[BaseException], bool]) -> None:
    """Call ``commit()`` until it succeeds or :class:`CommitRetry` gives up."""
    retry = CommitRetry(t, rebalancing)
    while True:
        try:
            commit()
            return
        except Exception as exc:
            delay = retry.failed(exc)
            if delay is None:
                return
            time.sleep(delay)  # retry backoff (a rate, not a condition)


def is_instance(*types: type[BaseException]) -> Callable[[BaseException], bool]:
    return lambda exc: isinstance(exc, types)


def watch_parent(stop: Stop, period_s: float = 1.0) -> threading.Thread:
    """Stop (cleanly, as on SIGTERM) when the parent process dies: no orphan keeps producing.

    Not PR_SET_PDEATHSIG: it fires when the parent *thread* exits, and trio spawns processes
    from worker threads that end while the child lives on.
    """
    parent = os.getppid()

    def run() -> None:
        while not stop.wait(period_s):  # bounded by the stop deadline
            if os.getppid() != parent:
                log.warning("parent %d is gone: stopping", parent)
                stop.event.set()
                for fn in stop.on_signal:
                    fn(signal.SIGTERM)

    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread
