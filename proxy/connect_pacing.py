"""How many of a worker's upstream connects to one broker address are in flight at once.

Every client connection costs the node one upstream connect (proxy.datapath). In a
connection storm they come as fast as the node accepts clients, and a broker's accept
queue is short (Kafka's ``socket.listen.backlog.size``: 50). A full queue drops the SYN
(the kernel sends it again 1 s, then 3 s later) or the handshake's last ACK (the broker
resends its SYN-ACK after 1 s): the client waits seconds for a connection the broker
would have taken a few milliseconds later. A faster node made it worse (BENCHMARKS.md,
"Connection storm").

So each worker lets at most ``limit`` connects per broker address be unanswered: a turn
is taken before the connect and given back once the broker answered the connection's
first request (it was accepted then), once the connect failed, or ``hold_s`` after it
connected when no answer came (a client that says nothing must not hold a turn; a broker
busy with requests answers late without being short of accept queue). The limit adapts,
additive increase and multiplicative decrease as in TCP: each turn answered in time adds
``1 / limit``; a timed-out connect, a connect that took ``slow_s`` or longer (a SYN sent
again: the queue was full), or a first answer ``late_answer_s`` or more after the turn
began (the broker's SYN-ACK sent again: the handshake's last ACK found the queue full)
halves it, at most once per ``cut_every_s`` (the turns already in flight when it was cut
saw the same full queue). It starts at the broker's accept queue shared among the node's
workers.

Who gets the next turn: each client source address has its own line (FIFO within it),
so one busy host cannot starve the others. A source whose line was empty (a host with a
few connects, such as an application reconnecting after a failover) is served first, for
up to ``sparse_turns`` turns while its whole line fits in them (a storm's hosts all start
with an empty line: one whose line outgrows its turns joins the round at once, and an
application host asking later is not held behind their first turns); after that, and for
the hosts with long lines, round robin
(fq_codel's sparse-flow rule: without it an application host waits one round of every
busy host per connect it makes; BENCHMARKS.md, "Connect pacing back, with a line per
client source"). And a source with nothing in line does not wait while fewer than
``sparse_reserve`` such turns are out: its connect goes ahead of the busy hosts' lines, on
a few turns of their own, counted apart from ``limit`` (a cut limit does not take them
away). A reserve turn given back goes to the next connect of a host still within its front
turns (one with a few connects in line), never to the busy hosts' round: the application
hosts' connects that found the reserve out wait for a reserve turn, not behind the limit
that a storm's connects hold (a drill consumer's connects waited up to 1.17 s there,
BENCHMARKS.md session 34).

A broker that does not answer at all (its host cut off: every connect times out) is not
paced: after a timed-out connect, and until a connect to it is answered again, nobody
waits for a turn there. Waiting would only make its clients time out later, and a
bootstrap connection later move on to the next broker.

:class:`ConnectPacer` decides (pure: the caller passes the time); :class:`ConnectTurns`
is its asyncio shell, one per worker's data path.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import attrs

__all__ = ("BROKER_ACCEPT_QUEUE", "Admission", "ConnectPacer", "ConnectTurns", "PacingSettings", "Turn", "pacing_for_workers")

K = TypeVar("K", bound=Hashable)
W = TypeVar("W")
# Kafka's default socket.listen.backlog.size; a bit under it, the node's own share.
BROKER_ACCEPT_QUEUE = 50
_SHARE_OF_QUEUE = 40


@attrs.frozen
class PacingSettings:
    initial: int = 20
    floor: int = 2
    ceiling: int = 64
    slow_s: float = 0.5  # under the kernel's first retransmit (1 s): a connect this long waited for one
    cut_every_s: float = 1.0
    # Connected, no answer yet: the turn is given back after this long. Short: a broker slow to
    # answer is busy with requests, not short of accept queue, and a long hold starves the line.
    hold_s: float = 0.25
    # A first answer this late (from the turn's start) means the broker sent its SYN-ACK again
    # (1 s): the handshake's last ACK found its accept queue full. A busy broker answers later
    # than slow_s without any of that, so an answer is judged by this longer bound.
    late_answer_s: float = 1.0
    # Turns a source whose line was empty gets before the busy sources' round (0: none): a
    # host with a few connects is not held behind the hosts with thousands in line.
    sparse_turns: int = 8
    # Turns beside the limit for a source with nothing waiting (a host with a few connects goes
    # ahead of a line it is not part of); limit + reserve stays under the accept queue at start.
    sparse_reserve: int = 8

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.floor <= self.initial <= self.ceiling:
            raise ValueError(f"want 1 <= floor <= initial <= ceiling, got {self.floor}, {self.initial}, "
                             f"{self.ceiling}")


def pacing_for_workers(workers: int) -> PacingSettings:
    """The broker's accept queue (a little under it) shared among a node's ``workers``."""
    defaults = PacingSettings()
    return attrs.evolve(defaults, initial=max(defaults.floor, _SHARE_OF_QUEUE // max(1, workers)))


class Admission(enum.IntEnum):
    QUEUED = 0
    TURN = 1  # under the limit
    RESERVE = 2  # one of the sparse sources' reserve turns


class _Lane(Generic[W]):
    __slots__ = ("limit", "in_flight", "reserved", "lines", "sparse", "busy", "sparse_turns", "waiting", "cut_at",
                 "failing")

    def __init__(self, limit: float, sparse_turns: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.reserved = 0  # turns out of the sparse sources' reserve, beside in_flight
        # One line per client source address, FIFO within it. A source whose line was empty
        # (sparse: a host with a few connects) is served first, for up to ``sparse_turns``
        # turns, as long as its whole line fits in the turns it has left; then, and for every
        # other source, round robin (fq_codel's new and old flows).
        self.lines: dict[Hashable, deque[W]] = {}
        self.sparse: dict[Hashable, int] = {}  # source -> turns left at the front
        self.busy: dict[Hashable, None] = {}  # the round's order
        self.sparse_turns = sparse_turns
        self.waiting = 0
        self.cut_at = float("-inf")
        self.failing = False  # the last outcome was a timeout: no turns until an answer comes

    def queue(self, source: Hashable, waiter: W) -> None:
        line = self.lines.get(source)
        if line is None:
            line = self.lines[source] = deque()
            if self.sparse_turns > 0:
                self.sparse[source] = self.sparse_turns
            else:
                self.busy[source] = None
        line.append(waiter)
        self.waiting += 1
        left = self.sparse.get(source)
        if left is not None and len(line) > left:
            # More in line than its turns at the front: one of a storm's hosts, not a host with a
            # few connects. Every host's line is new when a storm begins: left at the front, the
            # busy hosts' first turns would all go before an application host that asked later
            # (BENCHMARKS.md, session 33: a drill consumer's connect waited 1.2 s in line).
            del self.sparse[source]
            self.busy[source] = None

    def next_waiter(self) -> W:
        if self.sparse:
            source = next(iter(self.sparse))
            waiter = self._take(source)
            if source in self.lines:
                left = self.sparse[source] - 1
                if left > 0:
                    self.sparse[source] = left
                else:
                    del self.sparse[source]
                    self.busy[source] = None
            return waiter
        source = next(iter(self.busy))
        waiter = self._take(source)
        if source in self.lines:
            del self.busy[source]
            self.busy[source] = None  # to the back of the round
        return waiter

    def _take(self, source: Hashable) -> W:
        line = self.lines[source]
        waiter = line.popleft()
        self.waiting -= 1
        if not line:
            self._forget(source)
        return waiter

    def _forget(self, source: Hashable) -> None:
        del self.lines[source]
        self.sparse.pop(source, None)
        self.busy.pop(source, None)

    def remove(self, source: Hashable, waiter: W) -> None:
        line = self.lines.get(source)
        if line is None or waiter not in line:
            return
        line.remove(waiter)
        self.waiting -= 1
        if not line:
            self._forget(source)


class ConnectPacer(Generic[K, W]):
    """Turns per key (a broker address); ``W``: whatever the caller queues for a turn."""

    def __init__(self, settings: PacingSettings = PacingSettings()) -> None:
        self.settings = settings
        self._lanes: dict[K, _Lane[W]] = {}

    def _lane(self, key: K) -> _Lane[W]:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(float(self.settings.initial), self.settings.sparse_turns)
        return lane

    def limit(self, key: K) -> int:
        return int(self._lane(key).limit)

    def in_flight(self, key: K) -> int:
        """Turns out under the limit (the reserve's apart: :meth:`reserved`)."""
        return self._lane(key).in_flight

    def reserved(self, key: K) -> int:
        return self._lane(key).reserved

    def waiting(self, key: K) -> int:
        return self._lane(key).waiting

    def least_loaded_first(self, keys: Sequence[K]) -> list[K]:
        """``keys`` ordered by their connects waiting or in flight, fewest first; ties keep
        their order (a round robin's). Where a connection may go to any broker (a bootstrap
        connection), it goes where it waits least, and a storm on one broker's identity is not
        made longer by the bootstrap connections of the same clients (Java's
        ``leastLoadedNode`` picks the same way, by requests in flight)."""
        def load(key: K) -> int:
            lane = self._lanes.get(key)
            return 0 if lane is None else lane.waiting + lane.in_flight + lane.reserved
        return sorted(keys, key=load)

    def admit(self, key: K, waiter: W, source: Hashable = None) -> Admission:
        """TURN or RESERVE: ``waiter`` has a turn now (counted in flight, or out of the
        reserve). QUEUED: it is in ``source``'s line (the client's address), and comes out of
        :meth:`release` when its turn comes. A source with nothing in line goes ahead on one
        of ``sparse_reserve`` reserve turns if one is free."""
        lane = self._lane(key)
        if lane.failing or (not lane.waiting and lane.in_flight < int(lane.limit)):
            lane.in_flight += 1
            return Admission.TURN
        if source not in lane.lines and lane.reserved < self.settings.sparse_reserve:
            lane.reserved += 1
            return Admission.RESERVE
        lane.queue(source, waiter)
        return Admission.QUEUED

    def withdraw(self, key: K, waiter: W, source: Hashable = None) -> None:
        """A queued ``waiter`` gave up before its turn came."""
        self._lane(key).remove(source, waiter)

    def observe(self, key: K, now: float, elapsed_s: float, *, timed_out: bool = False,
                slow_s: float | None = None) -> None:
        """A turn's outcome: its connect timed out, or the broker answered ``elapsed_s`` after
        the turn began (or the connect alone took that long); slow from ``slow_s`` (default:
        the settings')."""
        s = self.settings
        lane = self._lane(key)
        lane.failing = timed_out
        if timed_out or elapsed_s >= (s.slow_s if slow_s is None else slow_s):
            if now - lane.cut_at >= s.cut_every_s:
                lane.limit = max(float(s.floor), lane.limit / 2)
                lane.cut_at = now
        else:
            lane.limit = min(float(s.ceiling), lane.limit + 1 / lane.limit)

    def release(self, key: K, *, reserved: bool = False) -> list[W]:
        """A turn is given back (``reserved``: one of the reserve): the waiters whose turn it
        is now, in order, on turns of the same kind (counted in flight, or out of the reserve).
        A reserve turn goes to a source within its front turns, if one waits, or stays free."""
        lane = self._lane(key)
        if reserved:
            if lane.sparse:
                return [lane.next_waiter()]  # the reserve turn passes on: ``reserved`` unchanged
            lane.reserved -= 1
            return []
        lane.in_flight -= 1
        started: list[W] = []
        while lane.waiting and (lane.failing or lane.in_flight < int(lane.limit)):
            started.append(lane.next_waiter())
            lane.in_flight += 1
        return started


class Turn:
    """One upstream connect's turn (from :meth:`ConnectTurns.wait`). Give it back exactly
    once, whichever comes first: :meth:`failed`, :meth:`answered`, :meth:`abandon`, or
    ``hold_s`` after :meth:`connected`."""

    __slots__ = ("_turns", "key", "source", "reserved", "asked", "began", "connected_at", "_held", "_observed",
                 "_timer")

    def __init__(self, turns: ConnectTurns, key: Hashable, source: Hashable, asked: float, began: float, *,
                 reserved: bool = False) -> None:
        self._turns = turns
        self.key = key
        self.source = source
        self.reserved = reserved  # one of the sparse sources' reserve turns
        self.asked = asked  # when the connection asked for a turn: began - asked is its wait in line
        self.began = began
        self.connected_at: float | None = None
        self._held = True
        self._observed = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def held(self) -> bool:
        return self._held

    def clock_now(self) -> float:
        return self._turns.clock()

    def limit(self) -> int:
        """Its broker's limit now."""
        return self._turns.pacer.limit(self.key)

    def connected(self) -> None:
        """The connect succeeded: the turn is held until the first answer, ``hold_s`` at most."""
        turns = self._turns
        self.connected_at = turns.clock()
        elapsed = self.connected_at - self.began
        if elapsed >= turns.pacer.settings.slow_s:  # a SYN was sent again: say so now
            self._observe(elapsed)
        if self._held:
            self._timer = asyncio.get_running_loop().call_later(turns.pacer.settings.hold_s, self._give_back,
                                                                "held")

    def syn_resent(self) -> None:
        """The connect's SYN went unanswered and was sent again (proxy.sockets): the broker's
        accept queue was full, the same sign as a slow connect."""
        if not self._observed:
            self._observe(self._turns.pacer.settings.slow_s)

    def answered(self) -> None:
        """The broker's first bytes on this connection."""
        if not self._observed:
            self._observe(self._turns.clock() - self.began, self._turns.pacer.settings.late_answer_s)
        self._give_back("answered")

    def failed(self, *, timed_out: bool) -> None:
        if timed_out and not self._observed:
            now = self._turns.clock()
            self._observed = True
            self._turns.pacer.observe(self.key, now, now - self.began, timed_out=True)
        self._give_back("timed out" if timed_out else "failed")

    def abandon(self) -> None:
        """The connection closed, or its connect was cancelled."""
        self._give_back("abandoned")

    def _observe(self, elapsed: float, slow_s: float | None = None) -> None:
        self._observed = True
        self._turns.pacer.observe(self.key, self._turns.clock(), elapsed, slow_s=slow_s)

    def _give_back(self, how: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held:
            self._held = False
            self._turns.give_back(self.key, reserved=self.reserved)
            self._turns.on_given_back(self, how)


class ConnectTurns:
    """A worker's :class:`ConnectPacer` on its loop: waiters are futures."""

    def __init__(self, settings: PacingSettings = PacingSettings(),
                 clock: Callable[[], float] = time.monotonic, on_wait: Callable[[], None] = lambda: None,
                 on_given_back: Callable[[Turn, str], None] = lambda turn, how: None) -> None:
        """``on_wait``: called for each connect that has to wait for its turn (a metric);
        ``on_given_back(turn, how)``: each turn once it is given back (a trace), ``how``
        one of "answered", "held" (``hold_s`` passed), "failed", "timed out", "abandoned"."""
        self.pacer: ConnectPacer[Hashable, asyncio.Future[bool]] = ConnectPacer(settings)
        self.clock = clock
        self.on_wait = on_wait
        self.on_given_back = on_given_back

    async def wait(self, key: Hashable, source: Hashable = None) -> Turn:
        """A turn to connect to ``key`` for a client at ``source`` (its address), once one is free."""
        asked = self.clock()
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        admission = self.pacer.admit(key, fut, source)
        reserved = admission is Admission.RESERVE
        if admission is Admission.QUEUED:
            self.on_wait()
            try:
                reserved = await fut  # True: a reserve turn passed on (ConnectPacer.release)
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # the turn came with the cancellation
                    self.give_back(key, reserved=fut.result())
                else:
                    self.pacer.withdraw(key, fut, source)
                raise
        return Turn(self, key, source, asked, self.clock(), reserved=reserved)

    def give_back(self, key: Hashable, *, reserved: bool = False) -> None:
        for fut in self.pacer.release(key, reserved=reserved):
            if fut.done():  # cancelled while queued and not yet withdrawn: pass the turn on
                self.give_back(key, reserved=reserved)
            else:
                fut.set_result(reserved)
