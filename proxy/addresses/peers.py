"""The client connections of the peers, for the tickle ACKs (``proxy.addresses.tickle``).

Each node lists its own clients (``GET /clients`` on its admin endpoint, bearer token: which
port each reached and the client's address and port); :class:`PeerClients` polls every peer
every ``poll_s`` in a thread of its own and keeps the last list it got from each, so that when a
peer freezes or is cut off its list (seconds stale, which is fine: a client that reconnected
since just ignores a tickle) is still here for whoever takes its address.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import httpx

from proxy.addresses.tickle import ClientPair

log = logging.getLogger("kproxy.addresses")

CLIENTS_POLL_S = 2.0
POLL_TIMEOUT_S = 1.0
# A node lists at most this many clients: a tickle per client is one small packet, and a list
# this long is well under a megabyte of JSON.
MAX_CLIENT_PAIRS = 20_000

Fetch = Callable[[str, str], list[object]]  # (url, token) -> the JSON list


class ClientsFetcher:
    """``GET /clients`` over one persistent HTTP client (a new client per call costs 100+ ms of
    CPU: every 2 s per peer, that would be an idle node's biggest cost)."""

    def __init__(self) -> None:
        self.http = httpx.Client(timeout=POLL_TIMEOUT_S)

    def __call__(self, url: str, token: str) -> list[object]:
        r = self.http.get(url, headers={"Authorization": f"Bearer {token}"})
        r.raise_for_status()
        body = r.json()
        return body.get("clients", []) if isinstance(body, dict) else []


class PeerClients:
    """The last client list of every peer (``peers``: node id -> its admin base URL)."""

    def __init__(self, peers: Mapping[str, str], token: str, *, poll_s: float = CLIENTS_POLL_S,
                 fetch: Fetch | None = None) -> None:
        self.peers = dict(peers)
        self.token = token
        self.poll_s = poll_s
        self.fetch = fetch or ClientsFetcher()
        self._latest: dict[str, tuple[ClientPair, ...]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kproxy-peer-clients", daemon=True)

    def of(self, node: str) -> tuple[ClientPair, ...]:
        return self._latest.get(node, ())

    def poll_once(self) -> None:
        for node, base in self.peers.items():
            try:
                raw = self.fetch(f"{base}/clients", self.token)
                pairs = tuple(ClientPair.from_json(v) for v in raw[:MAX_CLIENT_PAIRS])
            except (httpx.HTTPError, ValueError) as exc:  # frozen, cut off, restarting: keep the last list
                log.debug("peer's clients not read", extra={"node": node, "reason": str(exc)})
                continue
            self._latest[node] = pairs  # one assignment: readers on the loop see the old or the new

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll_once()

    def start(self) -> "PeerClients":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=POLL_TIMEOUT_S * (len(self.peers) + 1))
