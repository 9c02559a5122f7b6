"""ApiVersions answered by the node from the broker's last answer (sans-IO).

Every Kafka client connection asks ApiVersions first, and a broker sends the
same answer every time. A client connection connects to its broker only at its
first request the node does not answer itself (``Pair.lazy``; or, with
``limits.share_upstream``, borrows a broker connection per request while it
only asks; :mod:`proxy.connection`): in a reconnect storm every connection asks
ApiVersions first, and a client that asks nothing else (an idle one) costs the
broker no connection and the node no connect. The node keeps the last answer
(clamped, proxy.rewrite) per listener and request version, learned from an
exchange with the broker, and answers the next ones itself for
``limits.api_versions_answer_s`` (5 s: short enough that a broker restarted
with another version is seen within seconds, long enough that a reconnect
storm's thousands of ApiVersions cost the broker a handful of requests); an
expired answer is asked of the broker again; 0 answers none. A listener of a
broker identity has one broker behind it, so an answer never comes from
another broker than the one the client talks to (a rolling upgrade may run
brokers of different versions); the bootstrap listener's connections are
served by any broker anyway.

Only successful answers are kept (an UNSUPPORTED_VERSION answer depends on the
version asked and is rare). The broker never sees such a request: it is told
the client's software (KIP-511) by the connections that do reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy._wire import Buffer
from proxy.framing import API_VERSIONS, answer_head



class LocalAnswers:
    """The kept answers of one node's worker, by (listener, ApiVersions request version)."""

    __slots__ = ("_answers", "_clock", "ttl_s")

    def __init__(self, clock: Callable[[], float], ttl_s: float) -> None:
        self._answers: dict[tuple[int, int], tuple[bytes, float]] = {}
        self._clock = clock
        self.ttl_s = ttl_s

    def learn(self, listener: int, api_key: int, api_version: int, pieces: Sequence[Buffer]) -> None:
        """A response forwarded on ``listener``: its payload as ``pieces`` (correlation id first,
        no length prefix; views of a buffer about to be reused, so copied here). Kept if it is a
        successful ApiVersions answer."""
        if api_key != API_VERSIONS or self.ttl_s <= 0:
            return
        payload = b"".join(pieces)
        if len(payload) < 6 or payload[4:6] != b"\0\0":  # error_code != 0 (or too short to tell)
            return
        self._answers[(listener, api_version)] = (payload[4:], self._clock() + self.ttl_s)

    def answer(self, listener: int, api_version: int, correlation_id: int) -> bytes | None:
        """The whole response frame for an ApiVersions request of ``api_version`` with
        ``correlation_id`` on ``listener``, or None: none kept, or it expired (then forgotten)."""
        key = (listener, api_version)
        kept = self._answers.get(key)
        if kept is None:
            return None
        body, until = kept
        if self._clock() >= until:
            del self._answers[key]
            return None
        return answer_head(len(body), correlation_id) + body

    def retune(self, ttl_s: float) -> None:
        """A config reload: answers learned from now on are kept ``ttl_s``; 0 drops every one."""
        self.ttl_s = ttl_s
        if ttl_s <= 0:
            self._answers.clear()

    def __len__(self) -> int:
        return len(self._answers)
