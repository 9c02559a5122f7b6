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
is an IP literal). Everything runs on the pysyncobj tick thread: the sockets
are registered with its poller, so no extra thread is needed.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import select
import socket
import time
from collections.abc import Callable, Mapping

from membership.election import LeaderClaim
from membership.liveness import MAX_DATAGRAM, Liveness, decode, encode, heartbeat_key

log = logging.getLogger(__name__)

# Peers whose last datagrams arrived within this many beats of each other fell silent "at once".
ISOLATION_SPREAD_BEATS = 2
# Datagrams read per readiness event: bounds the work of one tick.
MAX_READS_PER_EVENT = 64
# After a grid point the tick thread reads the peers' beats of that point as they arrive for at
# most this long (Heartbeat._gather): one wake-up per beat instead of one per peer. It blocks the
# thread (Raft included) for at most this long, four times a second, and only while a peer it
# hears has not beaten yet.
GATHER_S = 0.008


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
        self._arrived: dict[str, float] = {}  # when each peer's latest authentic datagram arrived
        self._gatherer: select.poll | None = None

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
        self._recv = recv
        self._gatherer = select.poll()
        self._gatherer.register(recv.fileno(), select.POLLIN)
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
        self._arrived = {p: t for p, t in self._arrived.items() if p in new}
        self._peer_ip = {p: _ip_or_none(addr[0]) for p, addr in new.items()}
        return added

    def close(self) -> None:
        for s in [self._recv, *self._send.values()]:
            if s is not None:
                s.close()
        self._recv = None
        self._gatherer = None
        self._send.clear()

    def registrations(self) -> list[tuple[int, Callable[[int, int], None]]]:
        """(fd, callback(fd, event)) pairs for a pysyncobj poller."""
        assert self._recv is not None, "open() first"
        regs = [(self._recv.fileno(), lambda _fd, _ev: self.on_readable())]
        for peer, s in self._send.items():
            regs.append((s.fileno(), lambda _fd, _ev, peer=peer: self.on_peer_event(peer)))
        return regs

    # ---- events ------------------------------------------------------------------------------

    @property
    def next_send(self) -> float:
        """When :meth:`tick` sends the next beat (the clock's time)."""
        return self._next_send

    def tick(self, now: float) -> None:
        """Beat when due, and at once when whom we hear changed: a peer we stopped hearing
        learns it from our next datagram (two-way liveness, membership.liveness), and one we
        hear again sees us live without waiting for the beat; at once too when we became
        the leader (or stopped being it): the followers' election timers run on that."""
        hearing = self.view.hearing(now)
        told = (hearing, self.leader_term)
        if now < self._next_send and told == self._told:
            return
        on_grid = now >= self._next_send
        if on_grid:
            # Beats go out on a grid of the clock (CLOCK_MONOTONIC is one clock for every
            # process of a host): the peers' datagrams then arrive together and a
            # receiver wakes once per beat instead of once per peer.
            self._next_send = (math.floor(now / self.interval) + 1) * self.interval
        self._told = told
        self._seq += 1
        # One datagram per peer, but the same bytes for every peer with the same version and "hears
        # you" flag (the rest is this beat's): encoded (and MACed) once per kind, not once per peer.
        made: dict[tuple[int, bool | None], bytes] = {}
        for peer, s in self._send.items():
            self._send_to(peer, s, self._datagram(peer, hearing, made), now)
        if on_grid:
            self._gather(now)

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

    def on_readable(self) -> None:
        if self._recv is None:
            return
        now = self.clock()
        self._drain(now)
        if now < self._next_send:  # our own beat of this grid point is out (else: the tick sends it, then gathers)
            self._gather(self.clock())

    def _gather(self, now: float) -> None:
        """Read the peers' beats of the last grid point as they arrive, until every peer we
        hear has sent one since that point or GATHER_S after it. They all beat on the same
        grid of one clock, so their datagrams come within a few milliseconds of each other;
        each one waking the tick thread on its own ran pysyncobj's tick and the member's
        tick for it, most of an idle node's CPU. Waiting here costs no CPU."""
        grid = math.floor(now / self.interval) * self.interval
        until = grid + GATHER_S
        arrived = self._arrived
        while self._gatherer is not None and now < until:
            # hearing(now): the peers view.hears at now (kept between calls while nothing changed).
            if not any(arrived.get(p, -math.inf) < grid for p in self.view.hearing(now)):
                return
            if not self._gatherer.poll(1000 * (until - now)):
                return
            self._drain(self.clock())
            now = self.clock()

    def _drain(self, now: float) -> None:
        if self._recv is None:
            return
        for _ in range(MAX_READS_PER_EVENT):
            try:
                data, addr = self._recv.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("heartbeat recv: %s", exc)
                return
            self.receive(data, addr[0], now)

    def receive(self, data: bytes, ip: str, now: float) -> None:
        """Account one datagram from ``ip`` (the socket-free part of on_readable)."""
        beat = decode(self._key, data)
        peer = beat.node_id if beat is not None else ""
        if beat is None or peer not in self.peers or (self._peer_ip[peer] is not None and self._peer_ip[peer] != ip):
            self.rejected += 1
            return
        if not self.view.heard(beat, now):
            return
        self._arrived[peer] = now
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
