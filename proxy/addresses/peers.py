"""The client connections of the peers, for the tickle ACKs (``proxy.addresses.tickle``).

Each node lists its own clients (``GET /clients`` on its admin endpoint, bearer token: which
port each reached and the client's address and port) and numbers the list's versions
(:class:`ChangeCounter`, bumped by the data path at every accept and close). :class:`PeerClients`
keeps a *long poll* open to every peer, one thread each: ``GET /clients?after=V&wait=S``
answers as soon as the peer's list differs from version ``V`` (after ``SETTLE_S``, so that a
burst is one answer), or after ``S`` seconds unchanged. So a connection made a moment before
its node froze or was cut off is already in the lists of the node's peers (with a poll every
2 s it was not: its client, reconnected to the frozen host, was never tickled and waited out
its request timeout), while an idle fleet sends one request per peer every ``LONG_POLL_S``. A
peer that freezes or is cut off leaves its last list here for whoever takes its address (a
client that reconnected since just ignores a tickle). A peer that answers without a version (a
node from before this change) is polled every ``poll_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import httpx

from proxy.addresses.tickle import ClientPair

log = logging.getLogger("kproxy.addresses")

CLIENTS_POLL_S = 2.0
# A request's own timeout on top of the wait it asks for. A peer that freezes answers when it
# thaws: a timed-out request is asked again at once (the peer's socket backlog takes it while
# the peer is stopped), not plainly after ``poll_s``: in that gap the list of a peer that froze
# again moments after thawing could be one from before its clients came back (no tickle for them).
POLL_TIMEOUT_S = 3.0
TIMEOUT_RETRY_S = 0.05
# stop() waits this long for the pollers (daemons: one inside a long poll ends with its request).
STOP_JOIN_S = 1.0
# A long poll is answered after this long at the latest (the server caps what it is asked for).
LONG_POLL_S = 20.0
# The server waits this long after the first change before answering: a burst is one answer.
SETTLE_S = 0.02
# After an answer a poller asks again at once for a list of up to SMALL_LIST pairs, after
# poll_s for a longer one (each answer is the whole list: a storm must not cost a list per change).
SMALL_LIST = 1_000
SMALL_LIST_GAP_S = 0.05
# A node lists at most this many clients: a tickle per client is one small packet, and a list
# this long is well under a megabyte of JSON.
MAX_CLIENT_PAIRS = 20_000

Fetch = Callable[[str, str, float], Mapping[str, Any]]  # (url, token, timeout) -> the JSON body


class ChangeCounter:
    """A version number one thread bumps (the data path's loop, at every accept and close of a
    client connection) and others wait on; a bump costs a lock and a notify, no wake-up when
    nobody waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.version = 0

    def bump(self) -> None:
        with self._cond:
            self.version += 1
            self._cond.notify_all()

    def wait_past(self, seen: int, timeout_s: float) -> int:
        """The version once it differs from ``seen`` (another process' count after a restart
        differs too), or after ``timeout_s``, whichever first."""
        with self._cond:
            self._cond.wait_for(lambda: self.version != seen, timeout=max(0.0, timeout_s))
            return self.version


def listing(pairs: Callable[[], list[ClientPair]], counter: ChangeCounter, after: int | None, wait_s: float,
            sleep: Callable[[float], None] = time.sleep) -> tuple[int, list[ClientPair]]:
    """The server side of the long poll: (version, the list at that version or later)."""
    if after is not None and wait_s > 0 and counter.wait_past(after, wait_s) != after:
        sleep(SETTLE_S)
    version = counter.version  # read before listing: a change while listing is a newer version
    return version, pairs()


class ClientsFetcher:
    """``GET /clients`` over one persistent HTTP client (a new client per call costs 100+ ms of
    CPU); one per peer thread."""

    def __init__(self) -> None:
        self.http = httpx.Client(timeout=POLL_TIMEOUT_S)

    def __call__(self, url: str, token: str, timeout_s: float) -> Mapping[str, Any]:
        r = self.http.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
        r.raise_for_status()
        body = r.json()
        return body if isinstance(body, dict) else {}


class PeerClients:
    """The last client list of every peer (``peers``: node id -> its admin base URL), each kept
    fresh by a long poll of its own thread."""

    def __init__(self, peers: Mapping[str, str], token: str, *, poll_s: float = CLIENTS_POLL_S,
                 fetch: Fetch | None = None, long_poll_s: float = LONG_POLL_S) -> None:
        self.peers = dict(peers)
        self.token = token
        self.poll_s = poll_s
        self.long_poll_s = long_poll_s
        self._fetch = fetch
        self._latest: dict[str, tuple[ClientPair, ...]] = {}
        self._versions: dict[str, int | None] = {}
        self._answered: dict[str, float] = {}  # node -> monotonic time of its last answer
        self._failing: dict[str, str] = {}  # node -> why its last poll failed (until one succeeds)
        # node -> whether its last answer said it holds its own floating address (None: unknown,
        # its last poll failed, or a node from before this was answered)
        self._holds_own: dict[str, bool | None] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(node, fetch or ClientsFetcher()),
                                          name=f"kproxy-peer-clients-{node}", daemon=True) for node in self.peers]

    def of(self, node: str) -> tuple[ClientPair, ...]:
        return self._latest.get(node, ())

    def state(self, node: str) -> dict[str, Any]:
        """How current ``node``'s list is (for a log line when a take finds no client to tickle):
        pairs held, seconds since its last answer, the version asked after, why polls fail."""
        answered = self._answered.get(node)
        return {"pairs": len(self._latest.get(node, ())),
                "answer_age_s": None if answered is None else round(time.monotonic() - answered, 3),
                "version": self._versions.get(node), "failing": self._failing.get(node)}

    def holds_own(self, node: str) -> bool | None:
        """Did ``node``'s last answer say it holds its own floating address (None: unknown)?"""
        return self._holds_own.get(node)

    def at(self, address: str, owner: str) -> tuple[ClientPair, ...]:
        """Every client the peers last listed on ``address``, ``owner``'s floating address: the
        owner's own clients, and those a peer took while standing in for it there."""
        out: dict[tuple[int, str, int], ClientPair] = {}
        for node, pairs in list(self._latest.items()):
            for p in pairs:
                if p.local_ip == address or (p.local_ip is None and node == owner):
                    out.setdefault((p.local_port, p.client_ip, p.client_port), p)
        return tuple(out.values())

    def poll(self, node: str, fetch: Fetch | None = None) -> float | None:
        """Ask ``node`` once (a long poll once its version is known); keep what it answers, or
        its last list if it does not (frozen, cut off, restarting). Returns how long to wait
        before asking again (None: at once is fine only after an answer)."""
        fetch = fetch or self._fetch
        assert fetch is not None
        seen = self._versions.get(node)
        url = f"{self.peers[node]}/clients"
        timeout = POLL_TIMEOUT_S
        if seen is not None:
            url += f"?after={seen}&wait={self.long_poll_s:g}"
            timeout += self.long_poll_s
        try:
            body = fetch(url, self.token, timeout)
            raw = body.get("clients", [])
            group = {i for i in body.get("group") or () if isinstance(i, int)}
            pairs = tuple(attrs.evolve(p, group=True) if i in group else p
                          for i, p in enumerate(ClientPair.from_json(v) for v in list(raw)[:MAX_CLIENT_PAIRS]))
            version = body.get("version")
            holds = body.get("holds_own")
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
            self._holds_own[node] = None
            reason = f"{type(exc).__name__}: {exc}"
            if node not in self._failing:  # once per spell of failures, not once per poll
                log.info("peer's client list not read: keeping its last", extra={
                    "node": node, "reason": reason, "pairs": len(self._latest.get(node, ()))})
            self._failing[node] = reason
            if isinstance(exc, httpx.TimeoutException):
                return TIMEOUT_RETRY_S  # frozen or cut off: ask again at once (each ask lasts its timeout)
            self._versions[node] = None  # refused or cut short: ask plainly, it may have restarted
            return self.poll_s
        if self._failing.pop(node, None) is not None:
            log.info("peer's client list read again", extra={"node": node, "pairs": len(pairs)})
        self._latest[node] = pairs  # one assignment: readers on the loop see the old or the new
        self._holds_own[node] = holds if isinstance(holds, bool) else None
        self._answered[node] = time.monotonic()
        self._versions[node] = version if isinstance(version, int) else None
        if version is None:
            return self.poll_s  # a node from before the long poll
        return SMALL_LIST_GAP_S if len(pairs) <= SMALL_LIST else self.poll_s

    def _run(self, node: str, fetch: Fetch) -> None:
        while not self._stop.is_set():
            gap = self.poll(node, fetch)
            if gap and self._stop.wait(gap):
                return

    def start(self) -> "PeerClients":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop asking; a thread inside a long poll (daemon) ends with its request."""
        self._stop.set()
        deadline = time.monotonic() + STOP_JOIN_S
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
