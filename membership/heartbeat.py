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
  ``suspect_timeout`` without a datagram from it.

Datagrams carry the sender's id, a per-process incarnation and a sequence
number, authenticated with HMAC-SHA256 under a key derived from the fleet
password; a datagram must also come from the peer's configured host (when that
is an IP literal). Everything runs on the pysyncobj tick thread: the sockets
are registered with its poller, so no extra thread is needed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

MAGIC = b"KPH1"
MAC_BYTES = 16
MAX_DATAGRAM = 512
# Datagrams read per readiness event: bounds the work of one tick.
MAX_READS_PER_EVENT = 64


def heartbeat_key(password: str) -> bytes:
    return hashlib.sha256(b"kproxy-heartbeat\0" + password.encode()).digest()


def encode(key: bytes, node_id: str, incarnation: bytes, seq: int) -> bytes:
    nid = node_id.encode()
    body = MAGIC + incarnation + struct.pack("!QB", seq, len(nid)) + nid
    return body + hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]


def decode(key: bytes, data: bytes) -> tuple[str, bytes, int] | None:
    """(node_id, incarnation, seq) or None when malformed or not authentic."""
    head = len(MAGIC) + 8 + 9
    if len(data) < head + MAC_BYTES or not data.startswith(MAGIC):
        return None
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]):
        return None
    incarnation = body[len(MAGIC) : len(MAGIC) + 8]
    seq, n = struct.unpack("!QB", body[len(MAGIC) + 8 : head])
    if len(body) != head + n:
        return None
    try:
        return body[head:].decode(), incarnation, seq
    except UnicodeDecodeError:
        return None


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
        self._heard: dict[str, float] = {}
        self._refused: dict[str, float] = {}
        self._last: dict[str, tuple[bytes, int]] = {}
        self._peer_ip = ({p: _ip_or_none(addr[0]) for p, addr in self.peers.items()} if origins is None
                         else {p: origins.get(p) for p in self.peers})
        self.rejected = 0  # datagrams that failed authentication or origin checks

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
            for book in (self._heard, self._refused, self._last):
                book.pop(peer, None)
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
        self._peer_ip = {p: _ip_or_none(addr[0]) for p, addr in new.items()}
        return added

    def close(self) -> None:
        for s in [self._recv, *self._send.values()]:
            if s is not None:
                s.close()
        self._recv = None
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
        if now < self._next_send:
            return
        # Beats go out on a grid of the clock (CLOCK_MONOTONIC is one clock for every
        # process of a host): the peers' datagrams then arrive together and a
        # receiver wakes once per beat instead of once per peer.
        self._next_send = (math.floor(now / self.interval) + 1) * self.interval
        data = self._next_datagram()
        for peer, s in self._send.items():
            self._send_to(peer, s, data, now)

    def probe(self, peer: str, now: float) -> None:
        """Send ``peer`` a datagram now, off the beat: when its process is gone
        its host answers "port unreachable" at once, which :meth:`on_peer_event`
        records as a refusal. Called when the Raft link to ``peer`` drops, so a
        dead process is seen within milliseconds, not at the next beat."""
        s = self._send.get(peer)
        if s is None:
            return
        self._send_to(peer, s, self._next_datagram(), now)
        self.on_peer_event(peer)  # on loopback the refusal is often there already

    def _next_datagram(self) -> bytes:
        self._seq += 1
        return encode(self._key, self.self_id, self._incarnation, self._seq)

    def _send_to(self, peer: str, s: socket.socket, data: bytes, now: float) -> None:
        try:
            s.send(data)
        except ConnectionRefusedError:
            self._refused[peer] = now
        except OSError as exc:  # buffer full, no route: a missed beat, nothing more
            log.debug("heartbeat to %s failed: %s", peer, exc)

    def on_readable(self) -> None:
        if self._recv is None:
            return
        now = self.clock()
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
        msg = decode(self._key, data)
        if msg is None:
            self.rejected += 1
            return
        peer, incarnation, seq = msg
        if peer not in self.peers or (self._peer_ip[peer] is not None and self._peer_ip[peer] != ip):
            self.rejected += 1
            return
        last = self._last.get(peer)
        if last is not None and last[0] == incarnation and seq <= last[1]:
            return  # duplicate or reordered: no news
        self._last[peer] = (incarnation, seq)
        self._heard[peer] = now

    def on_peer_event(self, peer: str) -> None:
        s = self._send.get(peer)
        if s is None:
            return
        for _ in range(MAX_READS_PER_EVENT):
            try:
                s.recv(MAX_DATAGRAM)  # nobody should send here; this surfaces a pending error
            except ConnectionRefusedError:
                self._refused[peer] = self.clock()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("heartbeat socket of %s: %s", peer, exc)
                return

    # ---- view --------------------------------------------------------------------------------

    def has_heard(self, peer: str) -> bool:
        """At least one datagram from ``peer`` since this process started."""
        return peer in self._heard

    def is_live(self, peer: str, now: float) -> bool:
        if peer == self.self_id:
            return True
        heard = self._heard.get(peer)
        if heard is None or now - heard > self.suspect_timeout:
            return False
        return heard > self._refused.get(peer, float("-inf"))

    def live(self, now: float) -> frozenset[str]:
        return frozenset([self.self_id, *(p for p in self.peers if self.is_live(p, now))])

    def next_expiry(self, now: float) -> float:
        """The clock's time at which the first live peer goes stale (suspect_timeout
        after its last datagram), inf if none will: the member wakes then."""
        due = [self._heard[p] + self.suspect_timeout for p in self.peers if self.is_live(p, now)]
        return min(due, default=float("inf"))

    def peer_status(self, now: float) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for p in sorted(self.peers):
            heard = self._heard.get(p)
            refused = self._refused.get(p)
            out[p] = {
                "live": self.is_live(p, now),
                "last_heard_ms_ago": None if heard is None else round((now - heard) * 1000, 1),
                "refused_ms_ago": None if refused is None else round((now - refused) * 1000, 1),
            }
        return out
