"""Draining, as decisions without I/O: one client connection, and the whole node.

Sans-IO (h11's ``_state.py`` style): the cores take events and the time and
return actions; the I/O shell (:mod:`proxy.datapath`) reads the connection,
executes the actions and arms the timers they ask for. No asyncio here.

One connection (:class:`ConnectionDrain`) is closed at its first idle moment:
every response it waits for delivered, no request cut in half. Closing there
costs the client only a reconnect; a request it wrote into a socket we no
longer read would instead fail and wait for the client's retry backoff (100 ms
in librdkafka and Java). After ``DRAIN_IDLE_GRACE_S`` without such a moment (a
client that always has requests in flight), reads stop and the in-flight
responses are flushed before the close; ``DRAIN_TIMEOUT_S`` bounds it all.

The node (:class:`NodeDrain`): without address takeover a draining node
refuses new connections at once (DESIGN §4). With it, the other nodes start
standing in on this node's ports when they apply the same commit, a few ms
from now or more; refusing before that would turn the reconnect of every
drained client into a connection error and a backoff. So the listeners stay
open for ``DRAIN_LISTENER_LINGER_S`` (sharing the ports with the stand-ins),
and a connection accepted meanwhile is served for ``DRAIN_NEW_CONNECTION_S``
and then drained like the rest.

A connection made to the node's own address for an identity the map gives to
another node (the client dialled an address from an older map) is served for
``DRAIN_ELSEWHERE_S`` and then drained, unless the identity came back meanwhile.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

DRAIN_TIMEOUT_S = 5.0
# A draining connection keeps forwarding requests for up to this long, waiting
# for a moment with nothing in flight to close at; then reads stop (DESIGN §4).
DRAIN_IDLE_GRACE_S = 0.25
# With address takeover a draining node keeps its listeners this long (until the
# stand-ins are listening too) and serves what it accepts for a moment before
# draining it.
DRAIN_LISTENER_LINGER_S = 1.0
DRAIN_NEW_CONNECTION_S = 0.1
# A connection made to this node's own address for an identity the map gives to another node is
# served this long, then drained. aiokafka and kafka-python reconnect a connection the drain of a
# moved identity closed to the address they knew (their metadata refresh, asked for by that
# close, is still on its way) and keep it whatever later Metadata says: left alone, such a
# client stays here for good, and a fault of this node then cuts all its connections at once,
# its metadata sources among them (a drill consumer waited for a stand-in on this node's
# address, 1.2 s; BENCHMARKS.md session 37). By now the client knows the owner's address.
DRAIN_ELSEWHERE_S = 1.0
# A connection that carried group-coordinator requests is drained this much
# later than the others. Its close makes the client look the coordinator up
# again (FindCoordinator on another of its connections); librdkafka drops a
# connection itself once Metadata shows its broker at a new address, failing
# what was in flight there, and a failed lookup is retried only at its 1 s
# coordinator-query interval (measured: 0.9-1 s without deliveries). Moved
# last, the lookup goes out after the client has followed the new map.
DRAIN_COORDINATOR_DELAY_S = 0.2
# A client sent to look its coordinator up (proxy.connection: a group request on a node's own
# address for an identity another node serves) may come back to this node for the same identity
# this many times per window and source host; past that the fleet's maps disagree (whoever
# answers its FindCoordinator names this address again) and its group requests are forwarded
# here: a loop of lookups would keep the group from its coordinator, serving it here is only
# not where the map says.
REDIRECTS_PER_WINDOW = 10
REDIRECT_WINDOW_S = 10.0
# Sources remembered at most (a storm of clients from as many hosts): older windows are dropped.
REDIRECT_SOURCES_KEPT = 4096
# OffsetCommit, OffsetFetch, JoinGroup, Heartbeat, LeaveGroup, SyncGroup,
# TxnOffsetCommit, ConsumerGroupHeartbeat, ShareGroupHeartbeat.
GROUP_API_KEYS = frozenset({8, 9, 11, 12, 13, 14, 28, 68, 76})

DRAINED = "identity moved: drained"
DEADLINE_REACHED = "identity moved: drain deadline reached"
REFUSED_WHILE_DRAINING = "node is draining"


class DrainState(enum.Enum):
    SERVING = "serving"  # not draining (also: a put-off drain called off)
    DRAIN_DUE = "drain due"  # a group connection, its drain put off by DRAIN_COORDINATOR_DELAY_S
    DRAINING = "draining"  # forwarding on, waiting for an idle moment (DRAIN_IDLE_GRACE_S)
    READS_STOPPED = "reads stopped"  # no new requests: flushing the in-flight responses
    CLOSED = "closed"


class DrainEvent(enum.Enum):
    START = "start"  # the connection's identity moved away, or the node drains
    START_GROUP = "start group"  # the same, for a connection that carried group-coordinator requests
    DELAY_DUE_MOVE = "delay due, still to move"
    DELAY_DUE_KEEP = "delay due, kept"  # undrained, or the identity came back meanwhile
    IDLE = "idle"  # nothing in flight, no partial frame, nothing unread
    UNREAD_PENDING = "unread pending"  # idle, but a request sits unread in the kernel
    RESPONSES_DONE = "responses done"  # reads stopped, every response delivered
    BUSY = "busy"  # something still in flight
    IDLE_GRACE_DUE = "idle grace due"
    DEADLINE_DUE = "deadline due"
    CLOSED = "closed"  # closed for another reason (peer gone, node stopping)


# ---- actions the shell executes, in order
@attrs.frozen(slots=True)
class Close:
    reason: str
    warning: bool = False


@attrs.frozen(slots=True)
class PauseReading:
    """Stop reading the client: no new requests."""


@attrs.frozen(slots=True)
class ScheduleTimer:
    """Feed ``event`` back at time ``at`` (the clock the core was given)."""

    event: DrainEvent
    at: float


@attrs.frozen(slots=True)
class CountDrained:
    """One more connection drained (metric)."""


@attrs.frozen(slots=True)
class CountDeferred:
    """A close put off because a request sat unread (metric)."""


DrainAction = Close | PauseReading | ScheduleTimer | CountDrained | CountDeferred


@attrs.frozen(slots=True)
class Observation:
    """What the shell sees of the connection at a decision point.

    ``unread`` is called only when it matters (it costs a syscall)."""

    idle: bool  # codec.idle: nothing in flight, both streams between frames
    reading: bool  # the client socket is read
    responses_done: bool  # nothing in the correlation table, responses between frames
    unread: Callable[[], int]  # bytes the kernel holds unread from the client


def classify(obs: Observation) -> DrainEvent:
    """An observation as the event the table acts on.

    Idle but a request in the kernel, not read yet: closing now would lose it
    (and reset the connection, the unread bytes make close() send RST). A lost
    OffsetCommit costs librdkafka a coordinator lookup (~0.75 s measured). Read
    and forward it; its response brings the next idle moment. With reads
    stopped, the request tracker may be mid-frame (a partial request the
    broker never answers): only responses matter then."""
    if obs.idle:
        return DrainEvent.UNREAD_PENDING if obs.reading and obs.unread() else DrainEvent.IDLE
    if not obs.reading and obs.responses_done:
        return DrainEvent.RESPONSES_DONE
    return DrainEvent.BUSY


class _Step(enum.Enum):
    """What entering a state does besides the actions listed in the table."""

    ARM_DRAIN = "count, check at once, arm the grace and deadline timers"
    ARM_DELAY = "arm the coordinator delay"
    CHECK = "classify the observation and feed the result"


_S, _E = DrainState, DrainEvent
_START = (_E.START, _E.START_GROUP)
_PROGRESS = (_E.IDLE, _E.UNREAD_PENDING, _E.RESPONSES_DONE, _E.BUSY)

#: (state, event) -> (next state, actions, step). Every pair is listed;
#: timers that fire after the state they were armed for moved on are no-ops.
TRANSITIONS: dict[tuple[DrainState, DrainEvent], tuple[DrainState, tuple[DrainAction, ...], _Step | None]] = {}


def _row(state: DrainState, events: tuple[DrainEvent, ...] | DrainEvent, to: DrainState,
         actions: tuple[DrainAction, ...] = (), step: _Step | None = None) -> None:
    for event in events if isinstance(events, tuple) else (events,):
        TRANSITIONS[(state, event)] = (to, actions, step)


for _state in DrainState:  # default: stay, do nothing; overridden below
    _row(_state, tuple(DrainEvent), _state)
    if _state is not _S.CLOSED:
        _row(_state, _E.CLOSED, _S.CLOSED)
_row(_S.SERVING, _E.START, _S.DRAINING, (CountDrained(),), _Step.ARM_DRAIN)
_row(_S.SERVING, _E.START_GROUP, _S.DRAIN_DUE, (), _Step.ARM_DELAY)
_row(_S.DRAIN_DUE, _E.DELAY_DUE_MOVE, _S.DRAINING, (CountDrained(),), _Step.ARM_DRAIN)
_row(_S.DRAIN_DUE, _E.DELAY_DUE_KEEP, _S.SERVING)
for _state in (_S.DRAINING, _S.READS_STOPPED):
    _row(_state, (_E.IDLE, _E.RESPONSES_DONE), _S.CLOSED, (Close(DRAINED),))
    _row(_state, _E.DEADLINE_DUE, _S.CLOSED, (Close(DEADLINE_REACHED, warning=True),))
_row(_S.DRAINING, _E.UNREAD_PENDING, _S.DRAINING, (CountDeferred(),))
_row(_S.READS_STOPPED, _E.UNREAD_PENDING, _S.READS_STOPPED, (CountDeferred(),))
_row(_S.DRAINING, _E.IDLE_GRACE_DUE, _S.READS_STOPPED, (PauseReading(),), _Step.CHECK)
del _state


class ConnectionDrain:
    """The drain of one client connection (see the module doc)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = DrainState.SERVING

    @property
    def draining(self) -> bool:
        """Reads of new requests are winding down (the shell's flow control asks)."""
        return self.state in (DrainState.DRAINING, DrainState.READS_STOPPED)

    def start(self, now: float, group: bool, obs: Observation) -> list[DrainAction]:
        return self.handle(DrainEvent.START_GROUP if group else DrainEvent.START, now, obs)

    def progress(self, now: float, obs: Observation) -> list[DrainAction]:
        """A response boundary, a finished splice, or any moment worth checking."""
        return self.handle(classify(obs), now, obs)

    def handle(self, event: DrainEvent, now: float, obs: Observation | None = None) -> list[DrainAction]:
        to, actions, step = TRANSITIONS[(self.state, event)]
        self.state = to
        out: list[DrainAction] = list(actions)
        if step is _Step.ARM_DELAY:
            out.append(ScheduleTimer(DrainEvent.DELAY_DUE_MOVE, now + DRAIN_COORDINATOR_DELAY_S))
        elif step is not None:
            assert obs is not None, f"{event} in {self.state} needs an observation"
            out += self.handle(classify(obs), now, obs)
            if step is _Step.ARM_DRAIN and self.state is not DrainState.CLOSED:
                out.append(ScheduleTimer(DrainEvent.IDLE_GRACE_DUE, now + DRAIN_IDLE_GRACE_S))
                out.append(ScheduleTimer(DrainEvent.DEADLINE_DUE, now + DRAIN_TIMEOUT_S))
        return out


# ----------------------------------------------------------------- the node
@attrs.frozen(slots=True)
class DrainConnections:
    """Start the drain of every connection not draining yet."""


@attrs.frozen(slots=True)
class CloseListeners:
    """Close the node's own listeners at ``at`` (now: at once)."""

    at: float


@attrs.frozen(slots=True)
class Refuse:
    """Close a just-accepted connection."""

    reason: str


@attrs.frozen(slots=True)
class DrainAt:
    """Drain a just-connected connection at ``at`` (``if_elsewhere``: if its identity is
    still served by another node then)."""

    at: float
    if_elsewhere: bool = False


@attrs.frozen(slots=True)
class Rebind:
    """Bind every listener again (bootstrap and identities)."""


NodeAction = DrainConnections | CloseListeners | Refuse | DrainAt | Rebind


class NodeDrain:
    """Whether the whole node drains, and what that means for its listeners and
    for connections accepted meanwhile (see the module doc)."""

    __slots__ = ("takeover", "draining")

    def __init__(self, takeover: bool) -> None:
        self.takeover = takeover
        self.draining = False

    def drain_all(self, now: float) -> list[NodeAction]:
        self.draining = True
        close_at = now + DRAIN_LISTENER_LINGER_S if self.takeover else now
        return [CloseListeners(close_at), DrainConnections()]

    def undrain(self) -> list[NodeAction]:
        if not self.draining:
            return []
        self.draining = False
        return [Rebind()]

    def accepted(self) -> list[NodeAction]:
        """A client connected (before its upstream connection is made)."""
        if self.draining and not self.takeover:
            return [Refuse(REFUSED_WHILE_DRAINING)]
        return []

    def connected(self, now: float, elsewhere: bool = False) -> list[NodeAction]:
        """Its upstream connection is made: accepted while stand-ins take over,
        it is served a moment, then moved; made for an identity another node
        serves (``elsewhere``), it is moved a while later unless the identity
        comes back."""
        if self.draining:
            return [DrainAt(now + DRAIN_NEW_CONNECTION_S)]
        return [DrainAt(now + DRAIN_ELSEWHERE_S, if_elsewhere=True)] if elsewhere else []

    def still_to_move(self, listener_owned_here: bool) -> bool:
        """A put-off drain is due: does the connection still have to go?"""
        return self.draining or not listener_owned_here


class RedirectBudget:
    """How many coordinator redirects each (source host, identity) may still get in its window."""

    __slots__ = ("limit", "window_s", "_spent")

    def __init__(self, limit: int = REDIRECTS_PER_WINDOW, window_s: float = REDIRECT_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._spent: dict[tuple[str, int], tuple[float, int]] = {}  # window start, redirects in it

    def allow(self, source: str, listener: int, now: float) -> bool:
        """Spend one redirect of ``source``'s budget for ``listener``; False when none is left."""
        key = (source, listener)
        start, spent = self._spent.get(key, (now, 0))
        if now - start >= self.window_s:
            start, spent = now, 0
        if spent >= self.limit:
            return False
        if key not in self._spent and len(self._spent) >= REDIRECT_SOURCES_KEPT:
            self._spent = {k: v for k, v in self._spent.items() if now - v[0] < self.window_s}
        self._spent[key] = (start, spent + 1)
        return True
