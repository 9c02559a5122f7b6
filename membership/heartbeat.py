"""UDP heartbeats between fleet members: the failure detector's input.

Why our own heartbeat rather than pysyncobj's connection state (measured with
pysyncobj 0.3.17): ``partner_node_status_server_<addr>`` / ``isNodeConnected``
drops at once when a peer process dies (the kernel resets the TCP
connection), but it is checked only when a socket has an event: an idle
follower-to-follower connection to a frozen (SIGSTOP) peer stays "connected"
forever, the leader's view of a frozen follower depends on
``connection_timeout`` (which must also be >= the election timeout), and the
view differs by Raft role. A heartbeat gives every node the same kind of view
of every peer, whatever the roles, with its own timeout:

* every ``interval`` each node sends one small authenticated datagram to each
  peer from a socket *connected* to that peer;
* a peer whose process died makes its host answer ICMP "port unreachable":
  the connected socket reports ``ECONNREFUSED`` (the poller sees an error
  event at once), so process death is seen within one interval;
* and sooner: the dead process' kernel also resets its Raft connections, and
  the member then probes that peer at once (:meth:`Heartbeat.probe`), so process
  death is seen within milliseconds while the beat itself can stay slow (an
  idle node's CPU is mostly the wake-ups of its tick thread);
* a frozen or partitioned peer just stops sending: it is dead after
  ``suspect_timeout`` without a datagram from it;
* a peer that still sends but hears nothing (a one-way partition) says so: each
  datagram tells its receiver whether the sender hears it, and a peer that does
  not hear us is not live (membership.liveness, which holds the decisions).

Datagrams carry the sender's id, a per-process incarnation, a sequence
number, the "I hear you" flag and the sender's Raft term with an "I am the
leader" flag (:attr:`Heartbeat.leader_term`; a follower holds its election off
while the leader of its term beats, membership.control), authenticated with HMAC-SHA256 under a key derived from the fleet
password; a datagram must also come from the peer's configured host (when that
is an IP literal). Everything runs on the pysyncobj tick thread, so no extra
thread is needed: the sending sockets are registered with its poller (a refusal
wakes it at once); the receiving socket is not. The peers' datagrams are read
when the thread wakes for its own reasons (its beat, a timer, Raft), before
anything is judged, each accounted at the time the kernel received it
(``SO_TIMESTAMP``): a peer's datagrams never wake the thread. An idle node's
CPU is mostly its tick thread's wake-ups (on this machine ~0.1 ms of CPU each,
before any Python runs), and being woken for each arrival took two to three of
them per beat.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping

from membership.election import LeaderClaim
from membership.liveness import MAX_DATAGRAM, Liveness, decode, encode, heartbeat_key

log = logging.getLogger(__name__)

# Peers whose last datagrams arrived within this many beats of each other fell silent "at once".
ISOLATION_SPREAD_BEATS = 2
# Errors read per refusal event on a sending socket: bounds that work of one tick.
MAX_READS_PER_EVENT = 64
# Datagrams read per collect (Heartbeat.collect): a few beat intervals of a large fleet's.
MAX_READS_PER_COLLECT = 1024
# Linux's SO_TIMESTAMP (asm-generic; Python's socket module does not name it): each datagram read
# comes with the time the kernel received it, as a struct timeval of the wall clock.
SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29 if sys.platform == "linux" else None)
TIMEVAL = struct.Struct("@ll")
ANCILLARY = socket.CMSG_SPACE(TIMEVAL.size)


def _ip_or_none(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


class Heartbeat:
    def __init__(
        self,
        self_id: str,
        bind: tuple[str, int],
        peers: Mapping[str, tuple[str, int]],
        password: str,
        interval: float,
        suspect_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        origins: Mapping[str, str | None] | None = None,
    ) -> None:
        """``origins``: the source IP each peer's datagrams must come from (None: not checked);
        default: the IP of its address in ``peers``."""
        self.self_id = self_id
        self.bind = bind
        self.peers = dict(peers)
        self.interval = interval
        self.suspect_timeout = suspect_timeout
        self.clock = clock
        self._key = heartbeat_key(password)
        self._incarnation = os.urandom(8)
        self._seq = 0
        self._next_send = 0.0
        self._recv: socket.socket | None = None
        self._send: dict[str, socket.socket] = {}
        self.view = Liveness(self_id, self.peers, suspect_timeout)
        # Whom our last datagrams said we hear, and the term they said we lead.
        self._told: tuple[frozenset[str], int | None] = (frozenset(), None)
        self._peer_ip = ({p: _ip_or_none(addr[0]) for p, addr in self.peers.items()} if origins is None
                         else {p: origins.get(p) for p in self.peers})
        self.rejected = 0  # datagrams that failed authentication or origin checks
        # Set by the member before each tick: this node's Raft term, and whether it leads it.
        self.term = 0
        self.leader_term: int | None = None
        self._claims: dict[str, LeaderClaim] = {}
        self._speaks_v2: set[str] = set()  # peers whose latest datagram was KPH2 (no term)
        self._stamped = False  # the receiving socket's datagrams carry their arrival time
        # A datagram read later than this after it arrived is accounted this old (a wall-clock step
        # between its arrival and the read must not make a live peer look stale): the thread reads
        # at least once a beat, and a peer is stale only suspect_timeout after its last datagram.
        self._max_age = max(0.0, suspect_timeout - interval)

    # ---- sockets -----------------------------------------------------------------------------

    def open(self) -> None:
        host, port = self.bind
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        recv = socket.socket(family, socket.SOCK_DGRAM)
        try:
            recv.bind((host, port))
        except OSError:
            recv.close()
            raise
        recv.setblocking(False)
        self._stamped = False
        if SO_TIMESTAMP is not None:
            try:
                recv.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
                self._stamped = True
            except OSError as exc:  # then a datagram is accounted when it is read (at most a beat late)
                log.info("heartbeat datagrams carry no arrival time (%s): accounted when read", exc)
        self._recv = recv
        for peer, addr in sorted(self.peers.items()):
            self._send[peer] = self._sender(addr)

    def _sender(self, addr: tuple[str, int]) -> socket.socket:
        host, port = self.bind
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.bind((host, 0))  # our own address as the source, never another alias
        s.connect(addr)
        return s

    def set_peers(self, peers: Mapping[str, tuple[str, int]],
                  closing: Callable[[int], None]) -> list[tuple[int, Callable[[int, int], None]]]:
        """The fleet's members changed (a live membership change): beat to ``peers``
        from now on. ``closing(fd)`` is called for each socket before it is closed
        (unsubscribe it from the poller); returns the new sockets' registrations."""
        new = dict(peers)
        for peer in sorted(set(self.peers) - set(new)):
            s = self._send.pop(peer, None)
            if s is not None:
                closing(s.fileno())
                s.close()
        added = []
        for peer, addr in sorted(new.items()):
            if self.peers.get(peer) != addr and peer in self._send:  # moved: a new socket
                closing(self._send[peer].fileno())
                self._send.pop(peer).close()
            if peer not in self._send and self._recv is not None:
                self._send[peer] = self._sender(addr)
                added.append((self._send[peer].fileno(),
                              lambda _fd, _ev, peer=peer: self.on_peer_event(peer)))
        self.peers = new
        self.view.set_peers(new)
        self._speaks_v2 &= set(new)
        self._claims = {p: c for p, c in self._claims.items() if p in new}
        self._peer_ip = {p: _ip_or_none(addr[0]) for p, addr in new.items()}
        return added

    def close(self) -> None:
        for s in [self._recv, *self._send.values()]:
            if s is not None:
                s.close()
        self._recv = None
        self._send.clear()

    def registrations(self) -> list[tuple[int, Callable[[int, int], None]]]:
        """(fd, callback(fd, event)) pairs for a pysyncobj poller: the sending sockets, whose
        events are refusals. Not the receiving socket: :meth:`tick` reads it (:meth:`collect`)."""
        assert self._recv is not None, "open() first"
        regs = []
        for peer, s in self._send.items():
            regs.append((s.fileno(), lambda _fd, _ev, peer=peer: self.on_peer_event(peer)))
        return regs

    # ---- events ------------------------------------------------------------------------------

    @property
    def next_send(self) -> float:
        """When :meth:`tick` sends the next beat (the clock's time)."""
        return self._next_send

    def tick(self, now: float) -> None:
        """Read what the peers sent (:meth:`collect`), then beat when due, and at once when whom
        we hear changed: a peer we stopped hearing learns it from our next datagram (two-way
        liveness, membership.liveness), and one we hear again sees us live without waiting for
        the beat; at once too when we became the leader (or stopped being it): the followers'
        election timers run on that. Called at every wake-up of the tick thread."""
        self.collect(now)
        hearing = self.view.hearing(now)
        told = (hearing, self.leader_term)
        if now < self._next_send and told == self._told:
            return
        on_grid = now >= self._next_send
        if on_grid:
            # Beats go out on a grid of the clock (CLOCK_MONOTONIC is one clock for every
            # process of a host): every node of a host wakes at the same instants.
            self._next_send = (math.floor(now / self.interval) + 1) * self.interval
        self._told = told
        self._seq += 1
        # One datagram per peer, but the same bytes for every peer with the same version and "hears
        # you" flag (the rest is this beat's): encoded (and MACed) once per kind, not once per peer.
        made: dict[tuple[int, bool | None], bytes] = {}
        for peer, s in self._send.items():
            self._send_to(peer, s, self._datagram(peer, hearing, made), now)

    def probe(self, peer: str, now: float) -> None:
        """Send ``peer`` a datagram now, off the beat: when its process is gone
        its host answers "port unreachable" at once, which :meth:`on_peer_event`
        records as a refusal. Called when the Raft link to ``peer`` drops, so a
        dead process is seen within milliseconds, not at the next beat."""
        s = self._send.get(peer)
        if s is None:
            return
        self._seq += 1
        self._send_to(peer, s, self._datagram(peer, self.view.hearing(now)), now)
        self.on_peer_event(peer)  # on loopback the refusal is often there already

    def _datagram(self, peer: str, hearing: frozenset[str],
                  made: dict[tuple[int, bool | None], bytes] | None = None) -> bytes:
        """``peer``'s datagram of this beat (``_seq``, ``term``, ``leader_term``); ``made``: the
        ones already encoded for this beat, by version and flag (read and filled in)."""
        if self.view.speaks_v1(peer):
            kind: tuple[int, bool | None] = (1, None)
        else:
            kind = (2 if peer in self._speaks_v2 else 3, peer in hearing)
        data = None if made is None else made.get(kind)
        if data is None:
            if kind[0] == 1:
                data = encode(self._key, self.self_id, self._incarnation, self._seq, None)
            elif kind[0] == 2:
                data = encode(self._key, self.self_id, self._incarnation, self._seq, kind[1])
            else:
                term = self.term if self.leader_term is None else self.leader_term
                data = encode(self._key, self.self_id, self._incarnation, self._seq, kind[1], term,
                              leader=self.leader_term is not None)
            if made is not None:
                made[kind] = data
        return data

    def _send_to(self, peer: str, s: socket.socket, data: bytes, now: float) -> None:
        try:
            s.send(data)
        except ConnectionRefusedError:
            self.view.refused(peer, now)
        except OSError as exc:  # buffer full, no route: a missed beat, nothing more
            log.debug("heartbeat to %s failed: %s", peer, exc)

    def collect(self, now: float) -> None:
        """Read every datagram that arrived since the last call, each accounted at the time the
        kernel received it (``now`` minus its age, where the socket stamps datagrams; else
        ``now``). The tick thread calls it before judging anything (:meth:`tick`), so a
        judgement sees every datagram that arrived before it, as when each arrival woke it."""
        recv = self._recv
        if recv is None:
            return
        wall = time.time()
        for _ in range(MAX_READS_PER_COLLECT):
            try:
                data, ancillary, _flags, addr = recv.recvmsg(MAX_DATAGRAM, ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("heartbeat recv: %s", exc)
                return
            self.receive(data, addr[0], self._arrival(ancillary, now, wall) if self._stamped else now)

    def _arrival(self, ancillary: list[tuple[int, int, bytes]], now: float, wall: float) -> float:
        """When a datagram read at ``now`` (``wall`` on the wall clock) arrived, on our clock."""
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMP and len(raw) == TIMEVAL.size:
                sec, usec = TIMEVAL.unpack(raw)
                return now - min(max(wall - (sec + usec / 1e6), 0.0), self._max_age)
        return now

    def receive(self, data: bytes, ip: str, now: float) -> None:
        """Account one datagram from ``ip`` that arrived at ``now`` (the socket-free part of
        :meth:`collect`)."""
        beat = decode(self._key, data)
        peer = beat.node_id if beat is not None else ""
        if beat is None or peer not in self.peers or (self._peer_ip[peer] is not None and self._peer_ip[peer] != ip):
            self.rejected += 1
            return
        if not self.view.heard(beat, now):
            return
        if beat.term is None:
            self._speaks_v2.add(peer)  # also KPH1 senders: the view answers those in kind first
            self._claims.pop(peer, None)
            return
        self._speaks_v2.discard(peer)
        if beat.leader:
            self._claims[peer] = LeaderClaim(beat.term, now)
        else:
            self._claims.pop(peer, None)

    def on_peer_event(self, peer: str) -> None:
        s = self._send.get(peer)
        if s is None:
            return
        for _ in range(MAX_READS_PER_EVENT):
            try:
                s.recv(MAX_DATAGRAM)  # nobody should send here; this surfaces a pending error
            except ConnectionRefusedError:
                self.view.refused(peer, self.clock())
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("heartbeat socket of %s: %s", peer, exc)
                return

    # ---- view (membership.liveness) -----------------------------------------------------------

    def leader_claim(self, peer: str) -> LeaderClaim | None:
        """The latest datagram of ``peer`` claiming Raft leadership, if its latest said so."""
        return self._claims.get(peer)

    def speaks_leader_beat(self, peer: str) -> bool:
        """``peer`` has sent us a datagram and the latest carried a term (``KPH3``): it beats
        as a leader when it is one."""
        return self.view.has_contact(peer) and peer not in self._speaks_v2

    def legacy_peers(self) -> frozenset[str]:
        """Peers whose latest datagram carried no term (nodes before the leader's beat): their
        elections still run on Raft's own append_entries."""
        return frozenset(self._speaks_v2)

    def has_heard(self, peer: str) -> bool:
        """``peer`` and this process have talked both ways at least once (it sent us a
        datagram saying it hears us)."""
        return self.view.has_contact(peer)

    def heard_all(self) -> bool:
        """:meth:`has_heard` every peer."""
        return self.view.contact_with_all()

    def is_live(self, peer: str, now: float) -> bool:
        return self.view.is_live(peer, now)

    def live(self, now: float) -> frozenset[str]:
        return self.view.live(now)

    def isolated(self, now: float) -> bool:
        """Every peer fell silent within two beats of each other (membership.liveness): this
        host is more likely the one cut off."""
        return self.view.isolated(now, ISOLATION_SPREAD_BEATS * self.interval)

    def next_expiry(self, now: float) -> float:
        """When the member must wake: the first peer we hear goes stale then (inf if none)."""
        return self.view.next_expiry(now)

    def peer_status(self, now: float) -> dict[str, dict[str, object]]:
        return self.view.peer_status(now)
