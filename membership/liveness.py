"""Two-way liveness from heartbeat datagrams (pure: no socket, no clock of its own).

A peer is live when *we hear it and it hears us*. Hearing alone is not enough: a host that
drops everything it receives but still sends (a one-way partition, a firewall rule, a broken
receive path) keeps beating, and its peers would keep it "up" while its clients' requests
vanish and Raft cannot reach it. So each datagram says whether its sender has heard the
*receiver* within ``suspect_timeout`` (one flag, judged on the sender's clock; datagrams are
sent per peer, so the flag is about the one who gets it). A peer whose latest datagram says
"I do not hear you" is not live, exactly as if we did not hear it: a one-way cut is treated
like a two-way one for that pair, and a host that hears nobody is declared down by all of
its peers (then fenced when it heals, like a partitioned one; proxy.takeover.Fence).

What it costs: a peer that stops hearing us says so in its next datagram, which the sender
sends at once (:meth:`Liveness.hearing` changed, see membership.heartbeat), so a one-way cut
is seen ``suspect_timeout`` plus one datagram's flight after the last beat heard, like a
silent peer. Process death (a refusal) is unchanged.

Wire format (authenticated with HMAC-SHA256 truncated to ``MAC_BYTES``, at most
``MAX_DATAGRAM`` bytes): ``KPH3`` incarnation(8) seq(u64) flags(u8) term(u64) id_len(u8) id mac,
where the flags say "I hear you" and "I am the Raft leader of ``term``" (a follower's election
timer runs on the leader's beat: membership.control). ``KPH2`` (the same without the term, from
nodes before the leader's beat) and ``KPH1`` (also without flags, from nodes before two-way
liveness) are still read, and answered in kind so that a mixed fleet (a rolling upgrade) keeps
hearing each other (membership.heartbeat picks the version per peer); a ``KPH1`` peer is taken
to hear us.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

MAGIC_V1 = b"KPH1"
MAGIC_V2 = b"KPH2"
MAGIC = b"KPH3"
MAC_BYTES = 16
MAX_DATAGRAM = 512
HEARS_YOU = 0x01
LEADER = 0x02
_INCARNATION = 8
_HEAD_V1 = len(MAGIC_V1) + _INCARNATION + 9  # magic, incarnation, seq, id length
_HEAD_V2 = len(MAGIC) + _INCARNATION + 10    # magic, incarnation, seq, flags, id length
_HEAD = _HEAD_V2 + 8                          # ... and the sender's Raft term before the id length


def heartbeat_key(password: str) -> bytes:
    return hashlib.sha256(b"kproxy-heartbeat\0" + password.encode()).digest()


@attrs.frozen(slots=True)
class Beat:
    """One authentic datagram: ``hears_you`` is None from a ``KPH1`` sender (it does not say);
    ``term`` is the sender's Raft term, None from a ``KPH1`` or ``KPH2`` sender; ``leader``: the
    sender is the Raft leader of ``term``."""

    node_id: str
    incarnation: bytes
    seq: int
    hears_you: bool | None
    term: int | None = None
    leader: bool = False


def _mac(key: bytes, body: bytes) -> bytes:
    # hmac.digest: OpenSSL's one-shot HMAC, no Python HMAC object (two per datagram, every beat).
    return hmac.digest(key, body, "sha256")[:MAC_BYTES]


def encode(key: bytes, node_id: str, incarnation: bytes, seq: int, hears_you: bool | None = True,
           term: int | None = None, leader: bool = False) -> bytes:
    """A ``KPH3`` datagram; ``KPH2`` when ``term`` is None and ``KPH1`` when ``hears_you`` is None
    too (to a peer that speaks only that)."""
    nid = node_id.encode()
    if hears_you is None:
        body = MAGIC_V1 + incarnation + struct.pack("!QB", seq, len(nid)) + nid
    elif term is None:
        body = MAGIC_V2 + incarnation + struct.pack("!QBB", seq, HEARS_YOU if hears_you else 0, len(nid)) + nid
    else:
        flags = (HEARS_YOU if hears_you else 0) | (LEADER if leader else 0)
        body = MAGIC + incarnation + struct.pack("!QBQB", seq, flags, term, len(nid)) + nid
    return body + _mac(key, body)


def decode(key: bytes, data: bytes) -> Beat | None:
    """The datagram's content, or None when malformed or not authentic."""
    if len(data) > MAX_DATAGRAM or len(data) < _HEAD_V1 + MAC_BYTES:
        return None
    body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(key, body)):
        return None
    incarnation = body[4 : 4 + _INCARNATION]
    hears_you: bool | None
    term: int | None = None
    flags = 0
    if body.startswith(MAGIC):
        if len(body) < _HEAD:
            return None
        seq, flags, term, n = struct.unpack("!QBQB", body[4 + _INCARNATION : _HEAD])
        head, hears_you = _HEAD, bool(flags & HEARS_YOU)
    elif body.startswith(MAGIC_V2):
        if len(body) < _HEAD_V2:
            return None
        seq, flags, n = struct.unpack("!QBB", body[4 + _INCARNATION : _HEAD_V2])
        head, hears_you, flags = _HEAD_V2, bool(flags & HEARS_YOU), 0
    elif body.startswith(MAGIC_V1):
        seq, n = struct.unpack("!QB", body[4 + _INCARNATION : _HEAD_V1])
        head, hears_you = _HEAD_V1, None
    else:
        return None
    if len(body) != head + n:
        return None
    try:
        return Beat(body[head:].decode(), incarnation, seq, hears_you, term, bool(flags & LEADER))
    except UnicodeDecodeError:
        return None


class Liveness:
    """What the heartbeat datagrams say about each peer; time comes from the caller.

    ``heard(peer)`` at ``t``: a datagram from it arrived at ``t``; ``refused`` at ``t``: its host
    answered "port unreachable" (its process is gone); ``hears_us``: what its latest datagram
    said about hearing us. Live: heard within ``suspect_timeout``, not refused since, and it
    hears us."""

    __slots__ = ("self_id", "peers", "suspect_timeout", "_heard", "_heard_view", "_refused", "_last", "_hears_us",
                 "_contact", "_judged_at", "_changes", "_hearing_memo")

    def __init__(self, self_id: str, peers: Iterable[str], suspect_timeout: float) -> None:
        self.self_id = self_id
        self.peers: frozenset[str] = frozenset(peers)
        self.suspect_timeout = suspect_timeout
        self._heard: dict[str, float] = {}
        self._heard_view = MappingProxyType(self._heard)
        self._refused: dict[str, float] = {}
        self._last: dict[str, tuple[bytes, int]] = {}
        self._hears_us: dict[str, bool | None] = {}
        self._contact: set[str] = set()
        # The latest time :meth:`live` judged the peers at: a peer heard then stays a timer of
        # :meth:`next_expiry` until a later judgement sees it stale, even once its expiry is past.
        self._judged_at = float("-inf")
        # hearing(now) is asked several times per tick with one ``now``: kept until an input changes.
        self._changes = 0
        self._hearing_memo: tuple[float, int, frozenset[str]] | None = None

    def set_peers(self, peers: Iterable[str]) -> None:
        self._changes += 1
        self.peers = frozenset(peers)
        for book in (self._heard, self._refused, self._last, self._hears_us):
            for gone in set(book) - self.peers:
                book.pop(gone)
        self._contact &= self.peers

    # ---- inputs ------------------------------------------------------------------------------

    def heard(self, beat: Beat, now: float) -> bool:
        """Account an authentic datagram from a peer; False when it is no news (a duplicate,
        a reordered one, or not from a peer)."""
        peer = beat.node_id
        if peer not in self.peers:
            return False
        last = self._last.get(peer)
        if last is not None and last[0] == beat.incarnation and beat.seq <= last[1]:
            return False
        self._last[peer] = (beat.incarnation, beat.seq)
        self._changes += 1
        self._heard[peer] = now
        self._hears_us[peer] = beat.hears_you
        if beat.hears_you is not False:
            self._contact.add(peer)
        return True

    def refused(self, peer: str, now: float) -> None:
        if peer in self.peers:
            self._changes += 1
            self._refused[peer] = now

    # ---- view --------------------------------------------------------------------------------

    def hears(self, peer: str, now: float) -> bool:
        """We heard ``peer`` within suspect_timeout and its host has not refused a datagram
        since (its process is gone): what our datagrams to it say."""
        heard = self._heard.get(peer)
        if heard is None or now - heard > self.suspect_timeout:
            return False
        return heard > self._refused.get(peer, float("-inf"))

    def heard_at(self) -> Mapping[str, float]:
        """When each peer's latest datagram arrived (peers never heard are absent); a read-only
        view, no copy (the member passes it on every tick)."""
        return self._heard_view

    def hearing(self, now: float) -> frozenset[str]:
        memo = self._hearing_memo
        if memo is not None and memo[0] == now and memo[1] == self._changes:
            return memo[2]
        heard = frozenset(p for p in self.peers if self.hears(p, now))
        self._hearing_memo = (now, self._changes, heard)
        return heard

    def speaks_v1(self, peer: str) -> bool:
        """Its latest datagram was a ``KPH1`` one: answer in kind (it cannot read ``KPH2``)."""
        return peer in self._hears_us and self._hears_us[peer] is None

    def has_contact(self, peer: str) -> bool:
        """At least once since this process started, ``peer`` sent us a datagram saying it
        hears us: the two of them have talked both ways."""
        return peer in self._contact

    def is_live(self, peer: str, now: float) -> bool:
        if peer == self.self_id:
            return True
        return self.hears(peer, now) and self._hears_us.get(peer) is not False

    def live(self, now: float) -> frozenset[str]:
        if now > self._judged_at:
            self._judged_at = now
        return frozenset([self.self_id, *(p for p in self.hearing(now) if self._hears_us.get(p) is not False)])

    def isolated(self, now: float, together_s: float) -> bool:
        """This node hears none of its (two or more) peers, none refused since it last heard
        it, and the last datagrams of all of them arrived within ``together_s`` of each other:
        they fell silent at once. A host whose receive path is cut sees exactly that; peers
        failing one after another (freeze-two) or a killed one (its host refuses) do not look
        like it. With a single peer the two cannot be told apart: never isolated."""
        if len(self.peers) < 2 or self.hearing(now):
            return False
        heard = [self._heard.get(p) for p in self.peers]
        if any(t is None for t in heard):
            return False
        if any(self._refused.get(p, float("-inf")) >= self._heard[p] for p in self.peers):
            return False
        times = [t for t in heard if t is not None]
        return max(times) - min(times) <= together_s

    def next_expiry(self, now: float) -> float:
        """The clock's time at which the first peer we heard at the last judgement (:meth:`live`)
        goes stale (the flag we send it flips, and it is no longer live), inf if none will. A
        time already past when the peer went stale after that judgement: the caller must judge
        again at once. (Judged only by ``now``, an expiry passing between the judgement and this
        call was dropped, and the peer's loss waited for the next beat (then 0.25 s).)"""
        judged = self._judged_at if self._judged_at > float("-inf") else now
        due = [self._heard[p] + self.suspect_timeout for p in self.peers if self.hears(p, judged)]
        return min(due, default=float("inf"))

    def peer_status(self, now: float) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for p in sorted(self.peers):
            heard, refused = self._heard.get(p), self._refused.get(p)
            out[p] = {
                "live": self.is_live(p, now),
                "hears_us": self._hears_us.get(p, False) is not False,
                "last_heard_ms_ago": None if heard is None else round((now - heard) * 1000, 1),
                "refused_ms_ago": None if refused is None else round((now - refused) * 1000, 1),
            }
        return out
