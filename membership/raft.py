"""The thin pysyncobj shell around the pure fleet state.

Each ``@replicated`` method applies one command to ``FleetState`` and returns
the ``Result``; nothing else happens in them (they run on every replica, in log
order, on the pysyncobj tick thread). Pitfalls handled here (DESIGN §9):

* pickle on the wire -> a password is mandatory (``MemberConfig`` refuses to
  start without one; pysyncobj then encrypts and authenticates every frame);
* pysyncobj binds 0.0.0.0 unless told -> ``bindAddress`` is always the
  member's own Raft address;
* batching adds ~100 ms per commit -> ``appendEntriesUseBatch=False``;
* ``connectionRetryTime`` 5 s, ``leaderFallbackTimeout`` 30 s -> tuned down;
* importing it replaces ``socket.inet_ntop`` with a Windows-only shim -> put back;
* the election timer runs on the leader's UDP beat (membership.election):
  pysyncobj's own election timeout is ``raft_backstop_timeout`` and an idle
  leader's append_entries are slow (``append_entries_period``);
* dynamic membership (``dynamicMembershipChange=True``): a change counts as
  soon as it is in the leader's log, and adding an unreachable node silently
  grows the quorum, so changes go one at a time and only when the nodes alive
  now can commit in the new configuration (membership/roster.py decides;
  :meth:`RaftReplica.change_members` executes).

Every access to pysyncobj's private, name-mangled internals lives in
:class:`RaftReplica` (``role``, ``leader_address``, ``keep_links_open``,
``on_link_lost``, ``trace_links``, ``catch_up_at_once``, ``cap_poll_wait``, ``subscribe_fd``), in :func:`election_deadline`
(``hasten_election``, ``hold_election``, ``defer_election``) and in :func:`bind_outgoing`; they
are written against pysyncobj ``PINNED_PYSYNCOBJ`` and checked against a real
``SyncObj`` by tests/integration/test_raft_private.py.

Versions: pysyncobj numbers the ``@replicated`` methods by their sorted names
and puts the number in the log, so a method added between existing names would
renumber them and a node of the next release would apply an old node's entries
to the wrong method. The commands that came with state formats (``SetFormat``,
and any later one) therefore go through one method, :meth:`versioned_command`,
whose name sorts last; the state checks each command against the committed
format (membership.formats).

``state`` is a class attribute holding the empty state; the first applied
command sets the instance attribute, which pysyncobj then includes in its
snapshots (it serialises instance attributes created after ``__init__``).
"""

from __future__ import annotations

import logging
from typing import Any

from collections.abc import Callable, Iterable

import _socket
import socket
import struct

from pysyncobj import SyncObj, SyncObjConf, replicated
from pysyncobj.monotonic import monotonic as raft_clock
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE

# pysyncobj's win_inet_pton (imported with its TCP connections) replaces socket.inet_ntop on every
# platform with a Windows-only shim that raises TypeError: whatever the process calls it from
# afterwards breaks (seen: pyroute2's netlink decoder in the floating-address mover, which could
# read no address). pysyncobj itself uses only inet_pton, which it leaves alone off Windows.
socket.inet_ntop = _socket.inet_ntop

from membership.commands import (
    REJECTED,
    BeginAdd,
    BeginRemove,
    Drain,
    FinishRemove,
    Join,
    MarkDown,
    MarkUp,
    Reassign,
    Result,
    SetBrokers,
    SetFormat,
    Undrain,
)
from membership.config import MemberConfig
from membership.state import FleetState

# The commands that came with state formats or after them: one replicated method (module doc).
VERSIONED = (SetFormat, BeginAdd, BeginRemove, FinishRemove)
log = logging.getLogger(__name__)

_CONNECTING, _CONNECTED = CONNECTION_STATE.CONNECTING, CONNECTION_STATE.CONNECTED
# A Raft link to a live peer (heard both ways on the beat) whose retransmission timer has backed off
# this many times has segments lost during a cut still unacknowledged: TCP sends nothing more on it
# until that timer, which doubles each time (0.2, 0.4 ... 6.4, 12.8 s), fires again. Reset instead
# (RaftReplica.keep_links_open). Measured (emulated hosts, partition-two, session 31): a follower's
# vote requests to its one surviving peer, sent 0.5 s after the leader's cut, arrived all at once
# 5.2 s later (terms 12-22), while the peer's own requests crossed the same connection in 1 ms;
# the segments stuck were append_entries it had sent as leader into an earlier cut of that peer,
# whose retransmissions fell just before one heal and inside the next cut.
STUCK_BACKOFF = 2
_ABORT_LINGER = struct.pack("ii", 1, 0)
# struct tcp_info's first bytes: state, ca_state, retransmits, probes, backoff (linux/tcp.h).
_TCPI_BACKOFF = 4


def stuck_backoff(sock: socket.socket) -> int:
    """The times a connection's retransmission (or zero-window probe) timer has backed off, if at
    least ``STUCK_BACKOFF``; else 0 (also when the kernel cannot tell)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_BACKOFF + 1)
    except (OSError, AttributeError):
        return 0
    backoff = info[_TCPI_BACKOFF] if len(info) > _TCPI_BACKOFF else 0
    return backoff if backoff >= STUCK_BACKOFF else 0


# pysyncobj's vote messages, as RaftReplica.trace_links names them.
_VOTES_OUT = {"request_vote": "vote_request_out", "response_vote": "vote_out"}
_VOTES_IN = {"request_vote": "vote_request_in", "response_vote": "vote_in"}

#: The pysyncobj version the private accessors below were written and tested against.
PINNED_PYSYNCOBJ = "0.3.17"
# Wake this much after a pysyncobj timer is due (RaftReplica.cap_poll_wait).
RAFT_TIMER_SLACK_S = 0.002
MIN_WAIT_S = 0.001
_ROLES = {0: "follower", 1: "candidate", 2: "leader"}


# pysyncobj's election timeout is drawn between the backstop and this many times it.
BACKSTOP_SPREAD = 1.5


def syncobj_conf(config: MemberConfig) -> SyncObjConf:
    backstop_max = round(config.raft_backstop_timeout * BACKSTOP_SPREAD, 4)
    conf = SyncObjConf(
        password=config.password,
        bindAddress=config.me.raft_bind_address,
        appendEntriesUseBatch=False,
        raftMinTimeout=config.raft_backstop_timeout,
        raftMaxTimeout=backstop_max,
        appendEntriesPeriod=config.append_entries_period,
        autoTickPeriod=config.autotick_period,
        # pysyncobj's rule (>= its election timeout); live peers' links are kept open anyway
        # (control.KeepLinksOpen), so this only drops links to peers the heartbeat lost.
        connectionTimeout=max(config.connection_timeout, backstop_max),
        connectionRetryTime=config.connection_retry_time,
        leaderFallbackTimeout=config.leader_fallback_timeout,
        dynamicMembershipChange=True,
        commandsWaitLeader=True,
        # Bounded bind retries: a port in use is reported by start(), not retried forever.
        bindRetryTime=0.1,
        maxBindRetries=20,
        # Snapshots in memory (the journal is in memory too): a restarted member
        # rejoins empty and is caught up by the leader.
        fullDumpFile=None,
        journalFile=None,
    )
    conf.validate()
    return conf


# pysyncobj 0.3.x keeps a follower's election deadline (seconds of its monotonic clock,
# CLOCK_MONOTONIC_RAW) in ``SyncObj.__raftElectionDeadline``, name-mangled, and has no
# accessor: the tick thread starts an election once it is past (and a peer is connected),
# and pysyncobj moves it on every append_entries and vote. Every read and write of it goes
# through election_deadline(); tests/unit/test_leader_beat.py fails if pysyncobj renames it.
ELECTION_DEADLINE = "_SyncObj__raftElectionDeadline"


def election_deadline(replica: SyncObj, new: float | None = None) -> float | None:
    """The replica's election deadline (None if pysyncobj has none); sets it first when
    ``new`` is given. Tick thread only (pysyncobj reads and writes it there unlocked)."""
    if new is not None:
        setattr(replica, ELECTION_DEADLINE, new)
    return getattr(replica, ELECTION_DEADLINE, None)


class RaftReplica(SyncObj):
    state: FleetState = FleetState()

    def __init__(self, config: MemberConfig) -> None:
        self._syncobj_conf = syncobj_conf(config)
        self._link_record: Callable[[str, str, dict[str, Any]], None] | None = None  # trace_links
        super().__init__(
            config.me.raft_address,
            [m.raft_address for m in config.peers],
            conf=self._syncobj_conf,
        )

    def _apply(self, command: object, kind: type | tuple[type, ...]) -> Result:
        if not isinstance(command, kind):
            names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            return Result(REJECTED, self.state.epoch, f"expected {names}")
        try:
            new, result = self.state.apply(command)
        except Exception:  # a bug: never let it wedge the log (pysyncobj would retry forever)
            log.exception("applying %r failed", command)
            return Result(REJECTED, self.state.epoch, "internal error")
        self.state = new
        return result

    @replicated
    def join(self, command: Join) -> Result:
        return self._apply(command, Join)

    @replicated
    def set_brokers(self, command: SetBrokers) -> Result:
        return self._apply(command, SetBrokers)

    @replicated
    def drain(self, command: Drain) -> Result:
        return self._apply(command, Drain)

    @replicated
    def undrain(self, command: Undrain) -> Result:
        return self._apply(command, Undrain)

    @replicated
    def mark_down(self, command: MarkDown) -> Result:
        return self._apply(command, MarkDown)

    @replicated
    def mark_up(self, command: MarkUp) -> Result:
        return self._apply(command, MarkUp)

    @replicated
    def reassign(self, command: Reassign) -> Result:
        return self._apply(command, Reassign)

    @replicated
    def versioned_command(self, command: SetFormat | BeginAdd | BeginRemove | FinishRemove) -> Result:
        """Every command added since state formats exist (see the module doc)."""
        return self._apply(command, VERSIONED)

    # ---- Raft membership (pysyncobj's dynamic membership) --------------------------------------

    def raft_members(self) -> frozenset[str]:
        """Raft addresses of the members in this replica's configuration, itself included
        (the configuration of its log: a change counts from the moment it is appended)."""
        return frozenset([self.selfNode.address, *(n.address for n in list(self.otherNodes))])

    def change_members(self, add: bool, raft_address: str, callback: Callable[[Any, int], None]) -> None:
        """Propose adding or removing one Raft member (forwarded to the leader if
        we are not it). pysyncobj denies it (REQUEST_DENIED) while another change
        is uncommitted, when the node is already in (add) or out (remove), and
        when the leader is asked to remove itself (:meth:`hand_over_leadership` first)."""
        if add:
            self.addNodeToCluster(raft_address, callback=callback)
        else:
            self.removeNodeFromCluster(raft_address, callback=callback)

    def hand_over_leadership(self, callback: Callable[[Any, int], None]) -> None:
        """Leader only: make the most caught-up connected follower leader (Raft TimeoutNow)."""
        self.transferLeadership(None, callback=callback)

    # ---- pysyncobj internals, in one place ----------------------------------------------------

    def role(self) -> str:
        """"follower", "candidate" or "leader" (pysyncobj has no public accessor)."""
        if self._isLeader():
            return "leader"
        return _ROLES.get(getattr(self, "_SyncObj__raftState", None), "follower")

    def leader_address(self) -> str | None:
        """The Raft address of the last known leader, or None."""
        node = self._getLeader()
        return getattr(node, "address", None) if node else None

    def connected_peers(self) -> set[str]:
        """Raft addresses of the peers this replica holds a connection to."""
        return {n.address for n in self.otherNodes if self.isNodeConnected(n)}

    def keep_links_open(self, addresses: Iterable[str]) -> int:
        """Mark the Raft connections to these (live) peers as read just now, so pysyncobj
        does not drop them as idle at the next send (see ``control.KeepLinksOpen``), and reset
        the ones stuck in TCP's retransmission backoff (:func:`stuck_backoff`).
        Returns the connections touched."""
        transport = getattr(self, "_SyncObj__transport", None)
        if transport is None:
            return 0
        wanted = set(addresses)
        now = raft_clock()
        touched = 0
        for node, conn in list(transport._connections.items()):
            address = getattr(node, "address", None)
            if address not in wanted or not hasattr(conn, "_TcpConnection__lastReadTime"):
                continue
            sock = getattr(conn, "_TcpConnection__socket", None)
            backoff = stuck_backoff(sock) if conn.state == _CONNECTED and sock is not None else 0
            if backoff:
                self._reset_stuck(conn, sock, str(address), backoff)
                continue
            conn._TcpConnection__lastReadTime = now
            touched += 1
        return touched

    def _reset_stuck(self, conn: Any, sock: socket.socket, address: str, backoff: int) -> None:
        """Abort a live peer's link stuck in retransmission backoff: an RST at once (SO_LINGER 0;
        a FIN would wait behind the unacknowledged data), so both ends connect anew, the node with
        the greater address at once, the other on the RST (pysyncobj's own rules)."""
        log.info("Raft link to a live peer reset: its data waits for a retransmission timer backed off "
                 "during a cut", extra={"peer": address, "backoff": backoff})
        if self._link_record is not None:
            self._link_record(address, "reset_stuck", {"backoff": backoff})
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT_LINGER)
        except OSError:
            pass  # closed meanwhile: disconnect() below does the rest
        conn.disconnect()

    def on_link_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(raft_address)`` on the tick thread whenever the Raft
        connection to a peer is lost (the peer's process died and its kernel
        reset the connection, or pysyncobj dropped an idle link), after
        pysyncobj's own handling."""
        transport = getattr(self, "_SyncObj__transport")
        own = transport._onNodeDisconnectedCallback

        def lost(node: Any) -> None:
            if own is not None:
                own(node)
            address = getattr(node, "address", None)
            if address is not None:
                callback(address)

        transport.setOnNodeDisconnectedCallback(lost)

    def trace_links(self, record: Callable[[str, str, dict[str, Any]], None]) -> None:
        """Call ``record(raft_address, what, fields)`` on the tick thread for what happens to the
        Raft links and the votes sent over them: ``connecting`` (a connect begun: this node has the
        greater address), ``up`` (keys exchanged), ``reset_stuck`` (with ``backoff``:
        :meth:`keep_links_open`), ``vote_request_in`` / ``vote_request_out`` (with
        ``term`` and ``sent``: False when the link was not up, and pysyncobj never sends a vote
        request again in the same term) and ``vote_in`` / ``vote_out``. Rare (faults and
        elections), cheap (one dict lookup per send), for the membership events in status(): the
        way to see why an election took several rounds. Chains after what is already hooked."""
        transport = getattr(self, "_SyncObj__transport")
        self._link_record = record
        own_connect, own_send = transport._connectIfNecessarySingle, transport.send
        own_message, own_connected = transport._onMessageReceivedCallback, transport._onNodeConnectedCallback

        def address(node: Any) -> str:
            return str(getattr(node, "address", node))

        def connect(node: Any) -> bool:
            conn = transport._connections.get(node)
            before = getattr(conn, "state", None)
            result = own_connect(node)
            after = getattr(transport._connections.get(node), "state", None)
            if after == _CONNECTING and before != _CONNECTING:
                record(address(node), "connecting", {})
            return result

        def send(node: Any, message: Any) -> bool:
            sent = own_send(node, message)
            kind = message.get("type") if isinstance(message, dict) else None
            if kind in _VOTES_OUT:
                record(address(node), _VOTES_OUT[kind], {"term": message.get("term"), "sent": bool(sent)})
            return sent

        def received(node: Any, message: Any) -> None:
            kind = message.get("type") if isinstance(message, dict) else None
            if kind in _VOTES_IN:
                record(address(node), _VOTES_IN[kind], {"term": message.get("term")})
            if own_message is not None:
                own_message(node, message)

        def connected(node: Any) -> None:
            record(address(node), "up", {})
            if own_connected is not None:
                own_connected(node)

        transport._connectIfNecessarySingle = connect
        transport.send = send
        transport.setOnMessageReceivedCallback(received)
        transport.setOnNodeConnectedCallback(connected)

    def catch_up_at_once(self) -> None:
        """As leader, send the next append_entries at once (not at the idle period, 0.75 s) when a
        peer's Raft link comes up and when a follower refuses entries that do not follow its log
        (``next_node_idx`` with ``reset``: a node restarted with an older log, or none). Each
        catch-up round waited a period: a node restarted after a kill learned the committed map
        that marked it up 1.7 s after its peers (emulated hosts, session 28), while a survivor
        had already given its floating address back. Runs on the tick thread, after pysyncobj's
        own handling."""
        transport = getattr(self, "_SyncObj__transport")
        own_message, own_connected = transport._onMessageReceivedCallback, transport._onNodeConnectedCallback

        def send_now() -> None:
            if self._isLeader():
                setattr(self, "_SyncObj__newAppendEntriesTime", 0.0)

        def received(node: Any, message: Any) -> None:
            if own_message is not None:
                own_message(node, message)
            if isinstance(message, dict) and message.get("type") == "next_node_idx" and message.get("reset"):
                send_now()

        def connected(node: Any) -> None:
            if own_connected is not None:
                own_connected(node)
            send_now()

        transport.setOnMessageReceivedCallback(received)
        transport.setOnNodeConnectedCallback(connected)

    def hasten_election(self, within_s: float) -> None:
        """Start an election within ``within_s`` unless the current deadline is
        earlier. Only ever makes it earlier; call on the tick thread, which
        owns it. At least MIN_WAIT_S ahead, so that the tick thread's wait ends
        at it (a deadline already past does not wake it: cap_poll_wait)."""
        current = election_deadline(self)
        if current is None:
            return
        soon = raft_clock() + max(within_s, MIN_WAIT_S)
        if soon < current:
            election_deadline(self, soon)

    def hold_election(self, for_s: float) -> None:
        """The leader proved it is alive: no election before ``for_s`` from now. Only ever
        makes the deadline later, and never one already past (an election the tick thread
        starts next: a leadership transfer's TimeoutNow, or a hastened one)."""
        current = election_deadline(self)
        now = raft_clock()
        if current is None or current <= now:
            return
        if now + for_s > current:
            election_deadline(self, now + for_s)

    def defer_election(self, for_s: float) -> None:
        """This node cannot win now: no election before ``for_s`` from now, even if the
        deadline is already past (pysyncobj checks it before the tick's callbacks run, so a
        deadline kept ``for_s`` ahead on every tick never fires). Only ever makes it later."""
        current = election_deadline(self)
        if current is None:
            return
        later = raft_clock() + for_s
        if later > current:
            election_deadline(self, later)

    def election_deadline_in(self) -> float | None:
        """Seconds until pysyncobj's election deadline (for tests and status)."""
        current = election_deadline(self)
        return None if current is None else current - raft_clock()

    def set_append_entries_period(self, seconds: float) -> None:
        """The idle leader's append_entries period from now on (pysyncobj reads it from its
        configuration object, ours, at every send)."""
        if self._syncobj_conf.appendEntriesPeriod != seconds:
            self._syncobj_conf.appendEntriesPeriod = seconds

    def cap_poll_wait(self, seconds_left: Callable[[], float]) -> None:
        """Make the tick thread's idle wait end at the first due timer: pysyncobj's
        own (:meth:`raft_timer_in`) or ours (``seconds_left()``, run on the tick
        thread before every wait); at the latest after autotick_period; at once
        on a socket event. The thread then wakes when something is due, not
        every append_entries_period whatever happens."""
        poller = self._poller
        poll = poller.poll

        def capped(timeout: float) -> None:
            ours, raft = seconds_left(), self.raft_timer_in()
            # A raft timer already past is one pysyncobj is not acting on (an
            # election deadline while connected to nobody): not a reason to spin.
            # One woken a hair early finds its timer not yet due (pysyncobj reads
            # CLOCK_MONOTONIC_RAW, poll() waits on CLOCK_MONOTONIC) and costs a
            # second wake-up: hence the slack.
            raft = raft + RAFT_TIMER_SLACK_S if raft > 0 else timeout
            # A timer of ours already due is acted on by the tick that follows at
            # once; the floor only bounds the spin should that tick keep failing.
            poll(min(timeout, max(ours, MIN_WAIT_S), raft))

        poller.poll = capped  # an instance attribute: this replica's poller only

    def raft_timer_in(self) -> float:
        """Seconds until pysyncobj's next timer: the leader's next append_entries,
        anyone else's election deadline (inf if unknown)."""
        due = getattr(self, "_SyncObj__newAppendEntriesTime", None) if self._isLeader() else election_deadline(self)
        return float("inf") if due is None else due - raft_clock()

    def subscribe_fd(self, fd: int, callback: Callable[[int, int], None]) -> None:
        """Watch ``fd`` for reads and errors in pysyncobj's own poller: the
        callback runs on the tick thread, so no extra thread is needed."""
        self._poller.subscribe(fd, callback, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)

    def unsubscribe_fd(self, fd: int) -> None:
        self._poller.unsubscribe(fd)

    def submit(self, command: object, callback) -> None:
        """Propose ``command`` through the replicated method of its type."""
        method = {
            Join: self.join,
            SetBrokers: self.set_brokers,
            Drain: self.drain,
            Undrain: self.undrain,
            MarkDown: self.mark_down,
            MarkUp: self.mark_up,
            Reassign: self.reassign,
            SetFormat: self.versioned_command,
            BeginAdd: self.versioned_command,
            BeginRemove: self.versioned_command,
            FinishRemove: self.versioned_command,
        }[type(command)]
        method(command, callback=callback)


# ---- outgoing source address ------------------------------------------------------------------
# pysyncobj binds its listening socket to ``bindAddress`` but opens its outgoing
# connections from whatever address the kernel picks (127.0.0.1 on loopback). A
# node is then not isolated by filtering its own address (the partition drill),
# and on a real host the source may be an interface the peers do not expect. One
# member per process (``kproxy run``) calls ``bind_outgoing(host)`` so every
# outgoing Raft socket is bound to the node's address first.

class _SourceBoundSockets:
    """Stands in for the ``socket`` module inside pysyncobj.tcp_connection only."""

    def __init__(self, real: Any, host: str) -> None:
        self._real = real
        self._host = host

    def socket(self, family: int = -1, type: int = -1, *args: Any) -> Any:  # noqa: A002
        s = self._real.socket(family, type, *args)
        if type == self._real.SOCK_STREAM:
            s.bind((self._host, 0))
        return s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def bind_outgoing(host: str) -> None:
    """Bind every outgoing pysyncobj connection of this process to ``host``."""
    import socket as real_socket

    import pysyncobj.tcp_connection as tcp_connection

    tcp_connection.socket = _SourceBoundSockets(real_socket, host)  # type: ignore[attr-defined]
