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

import functools
import hashlib
import hmac
import struct
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

NOBODY: frozenset[str] = frozenset()
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


_BLOCK = hashlib.sha256().block_size
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))
_V1 = struct.Struct("!QB")
_V2 = struct.Struct("!QBB")
_V3 = struct.Struct("!QBQB")


@functools.lru_cache(maxsize=16)
def _pads(key: bytes) -> tuple[hashlib._Hash, hashlib._Hash]:
    """HMAC-SHA256's inner and outer hashes with the padded key already absorbed (RFC 2104)."""
    if len(key) > _BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_BLOCK, b"\0")
    return hashlib.sha256(key.translate(_IPAD)), hashlib.sha256(key.translate(_OPAD))


def _mac(key: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body``, truncated. The same bytes as ``hmac.digest(key, body, "sha256")``
    (tests/unit/test_idle_memos.py checks it), from copies of the keyed hashes: OpenSSL's one-shot
    HMAC sets the key up again on every call, most of its cost (two MACs per datagram, every beat)."""
    inner, outer = _pads(key)
    h = inner.copy()
    h.update(body)
    o = outer.copy()
    o.update(h.digest())
    return o.digest()[:MAC_BYTES]


def encode(key: bytes, node_id: str, incarnation: bytes, seq: int, hears_you: bool | None = True,
           term: int | None = None, leader: bool = False) -> bytes:
    """A ``KPH3`` datagram; ``KPH2`` when ``term`` is None and ``KPH1`` when ``hears_you`` is None
    too (to a peer that speaks only that)."""
    nid = node_id.encode()
    if hears_you is None:
        body = MAGIC_V1 + incarnation + _V1.pack(seq, len(nid)) + nid
    elif term is None:
        body = MAGIC_V2 + incarnation + _V2.pack(seq, HEARS_YOU if hears_you else 0, len(nid)) + nid
    else:
        flags = (HEARS_YOU if hears_you else 0) | (LEADER if leader else 0)
        body = MAGIC + incarnation + _V3.pack(seq, flags, term, len(nid)) + nid
    return body + _mac(key, body)


def decode(key: bytes, data: bytes) -> Beat | None:
    """The datagram's content, or None when malformed or not authentic."""
    size = len(data)
    if size > MAX_DATAGRAM or size < _HEAD_V1 + MAC_BYTES:
        return None
    body = data[:-MAC_BYTES]
    if not hmac.compare_digest(data[-MAC_BYTES:], _mac(key, body)):
        return None
    size -= MAC_BYTES
    magic = body[:4]
    term: int | None = None
    hears_you: bool | None
    if magic == MAGIC:
        if size < _HEAD:
            return None
        seq, flags, term, n = _V3.unpack_from(body, 4 + _INCARNATION)
        head, hears_you = _HEAD, bool(flags & HEARS_YOU)
    elif magic == MAGIC_V2:
        if size < _HEAD_V2:
            return None
        seq, flags, n = _V2.unpack_from(body, 4 + _INCARNATION)
        head, hears_you, flags = _HEAD_V2, bool(flags & HEARS_YOU), 0
    elif magic == MAGIC_V1:
        seq, n = _V1.unpack_from(body, 4 + _INCARNATION)
        head, hears_you, flags = _HEAD_V1, None, 0
    else:
        return None
    if size != head + n:
        return None
    try:
        return Beat(body[head:].decode(), body[4 : 4 + _INCARNATION], seq, hears_you, term, bool(flags & LEADER))
    except UnicodeDecodeError:
        return None


class Liveness:
    """What the heartbeat datagrams say about each peer; time comes from the caller.

    ``heard(peer)`` at ``t``: a datagram from it arrived at ``t``; ``refused`` at ``t``: its host
    answered "port unreachable" (its process is gone); ``hears_us``: what its latest datagram
    said about hearing us. Live: heard within ``suspect_timeout``, not refused since, and it
    hears us."""

    __slots__ = ("self_id", "peers", "suspect_timeout", "_heard", "_heard_view", "_refused", "_last", "_hears_us",
                 "_contact", "_judged_at", "_changes", "_flags", "_audible", "_hearing_memo", "_live_memo",
                 "_expiry_memo", "_refusals", "_refused_memo")

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
        # The views below are asked several times per wake-up, and most wake-ups change nothing: each
        # is kept until an input changes (``_changes`` counts them; ``_flags`` counts the changes of
        # what peers say about hearing us; ``_audible`` the inputs that may change whom we hear, see
        # heard()) or time makes it wrong, and a set recomputed equal to the one kept is returned as
        # that same object (the member's own memos compare by identity).
        # hearing: (computed at, _audible, the set, the earliest arrival in it).
        self._changes = 0
        self._flags = 0
        self._audible = 0
        self._hearing_memo: tuple[float, int, frozenset[str], float | None] | None = None
        self._live_memo: tuple[frozenset[str], int, frozenset[str]] | None = None
        self._expiry_memo: tuple[int, float, float] | None = None
        # refused_peers: (_refusals, the set); _refusals counts refusals and the datagrams that take
        # a peer out of the set (the only inputs that change it).
        self._refusals = 0
        self._refused_memo: tuple[int, frozenset[str]] = (0, NOBODY)

    def set_peers(self, peers: Iterable[str]) -> None:
        self._changes += 1
        self._flags += 1
        self._audible += 1
        self._refusals += 1
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
        before = self._heard.get(peer)
        if before is not None and self._refused.get(peer, float("-inf")) >= before:
            self._refusals += 1  # it was in refused_peers(): heard again, it leaves it
        self._heard[peer] = now
        kept = self._hearing_memo
        # A peer in the kept hearing set heard again, no earlier than before: still heard wherever
        # the kept set is used (its earliest arrival, kept, is no later than this one), and still
        # after any refusal. Anything else may change the set.
        if kept is None or before is None or now < before or peer not in kept[2]:
            self._audible += 1
        if peer not in self._hears_us or self._hears_us[peer] != beat.hears_you:
            self._flags += 1
        self._hears_us[peer] = beat.hears_you
        if beat.hears_you is not False:
            self._contact.add(peer)
        return True

    def refused(self, peer: str, now: float) -> None:
        if peer in self.peers:
            self._changes += 1
            self._audible += 1
            self._refusals += 1
            self._refused[peer] = now

    # ---- view --------------------------------------------------------------------------------

    def hears(self, peer: str, now: float) -> bool:
        """We heard ``peer`` within suspect_timeout and its host has not refused a datagram
        since (its process is gone): what our datagrams to it say."""
        heard = self._heard.get(peer)
        if heard is None or now - heard > self.suspect_timeout:
            return False
        return heard > self._refused.get(peer, float("-inf"))

    def refused_peers(self) -> frozenset[str]:
        """The peers we heard once whose host refused a datagram since (membership.heartbeat:
        "port unreachable"): their process is gone, for certain and at once, where silence
        would take ``suspect_timeout`` to mean anything. A peer never heard is not in it (a
        fleet starting: its peers' processes may not be up yet). Kept until an input changes."""
        memo = self._refused_memo
        if memo[0] == self._refusals:
            return memo[1]
        gone = frozenset([p for p, at in self._refused.items()
                          if p in self._heard and at >= self._heard[p]]) or NOBODY
        self._refused_memo = (self._refusals, gone)
        return gone

    def heard_at(self) -> Mapping[str, float]:
        """When each peer's latest datagram arrived (peers never heard are absent); a read-only
        view, no copy (the member passes it on every tick)."""
        return self._heard_view

    def hearing(self, now: float) -> frozenset[str]:
        """The peers :meth:`hears` at ``now``. With no input changed since it was computed at
        ``t0 <= now`` (but a peer in it heard again, :meth:`heard`), the set is the same as long as
        ``now - oldest <= suspect_timeout`` for the earliest arrival ``oldest`` in it: a peer in it
        arrived no earlier, so it is still heard, and one out of it was out for a reason that does
        not change or went stale before ``t0`` (``now - heard`` only grows with ``now``). Then the
        same object is returned."""
        memo = self._hearing_memo
        if (memo is not None and memo[1] == self._audible and memo[0] <= now
                and (memo[3] is None or now - memo[3] <= self.suspect_timeout)):
            return memo[2]
        heard = frozenset([p for p in self.peers if self.hears(p, now)])
        if memo is not None and heard == memo[2]:
            heard = memo[2]
        oldest = min([self._heard[p] for p in heard]) if heard else None
        self._hearing_memo = (now, self._audible, heard, oldest)
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
        hearing = self.hearing(now)
        memo = self._live_memo
        if memo is not None and memo[0] is hearing and memo[1] == self._flags:
            return memo[2]
        live = frozenset([self.self_id, *(p for p in hearing if self._hears_us.get(p) is not False)])
        if memo is not None and live == memo[2]:
            live = memo[2]
        self._live_memo = (hearing, self._flags, live)
        return live

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
        if self.refused_peers():
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
        memo = self._expiry_memo
        if memo is not None and memo[0] == self._changes and memo[1] == judged:
            return memo[2]
        due = min([self._heard[p] + self.suspect_timeout for p in self.hearing(judged)], default=float("inf"))
        self._expiry_memo = (self._changes, judged, due)
        return due

    def contact_with_all(self) -> bool:
        """Every peer has sent us a datagram saying it hears us (:meth:`has_contact`)."""
        return self.peers <= self._contact

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
