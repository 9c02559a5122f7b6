"""What a node's supervisor and its data-path workers say to each other (proxy.supervisor, proxy.worker).

One private socketpair per worker carries length-prefixed pickles of the typed
messages below, both ways. Pickle is safe here: the pair is created by the
supervisor and inherited by the worker it spawns, nobody else holds an end.
:class:`FrameReader` is the sans-IO decoder; :class:`Channel` the asyncio
protocol around it, used at both ends.

Supervisor -> worker: :class:`WorkerSetup` (first, once), :class:`ApplyMap`,
:class:`LearnBrokers`, :class:`Ask`, :class:`Reload`, :class:`Stop`. Worker -> supervisor: :class:`Ready`,
:class:`Applied`, :class:`BrokersChanged`, :class:`Answer`.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from typing import Any

import attrs

from membership.serving import ServingMap
from proxy.config import Config
from proxy.datapath import DataPathStatus
from proxy.upstream import UpstreamBroker

_LENGTH = struct.Struct(">I")
# A message is a serving map, a status or a node's metric families: kilobytes.
# Anything near this bound is a bug, not a bigger fleet.
MAX_MESSAGE_BYTES = 64 << 20


class WireError(ValueError):
    """The peer sent something that is not a message of this protocol."""


# ------------------------------------------------------------ supervisor -> worker
@attrs.frozen
class WorkerSetup:
    """The first message: what the worker serves, and the map to serve from the start."""

    config: Config
    node_id: str
    index: int
    serving: ServingMap | None


@attrs.frozen
class ApplyMap:
    serving: ServingMap


@attrs.frozen
class LearnBrokers:
    """Brokers another worker discovered: bind their listeners here too."""

    brokers: tuple[UpstreamBroker, ...]


@attrs.frozen
class Ask:
    """A question answered by an :class:`Answer` with the same ``id``."""

    id: int
    what: str  # one of ASKS


ASK_STATUS, ASK_METRICS, ASK_DRAIN_ALL = "status", "metrics", "drain_all"
ASKS = frozenset({ASK_STATUS, ASK_METRICS, ASK_DRAIN_ALL})


@attrs.frozen
class Reload:
    """SIGHUP or POST /reload at the supervisor: read the certificates again and, unless None,
    run with ``config`` (proxy.reload.plan_reload's: the reloadable fields of the file)."""

    config: Config | None


@attrs.frozen
class Stop:
    """Close the listeners and the connections left, then exit."""


# ------------------------------------------------------------ worker -> supervisor
@attrs.frozen
class Ready:
    """Listeners bound, the setup's map applied (``version``: its version, -1 without one)."""

    index: int
    pid: int
    brokers: tuple[UpstreamBroker, ...]
    version: int


@attrs.frozen
class Applied:
    """The map of this version is in effect in the worker."""

    version: int
    epoch: int


@attrs.frozen
class BrokersChanged:
    brokers: tuple[UpstreamBroker, ...]


@attrs.frozen
class WorkerReport:
    """The answer to ``Ask(what=ASK_STATUS)``."""

    status: DataPathStatus
    serving: ServingMap


@attrs.frozen
class Answer:
    id: int
    value: Any


def encode(message: object) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(body)} bytes is over {MAX_MESSAGE_BYTES}")
    return _LENGTH.pack(len(body)) + body


class FrameReader:
    """Bytes in (``feed``), whole messages out (``messages``); sans-IO."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[object]:
        self._buffer += data
        out = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_MESSAGE_BYTES:
                raise WireError(f"message length {length} is over {MAX_MESSAGE_BYTES}")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[_LENGTH.size:end])
            del self._buffer[:end]
            try:
                out.append(pickle.loads(body))
            except Exception as exc:
                raise WireError(f"undecodable message: {exc!r}") from None
        return out

    @property
    def pending(self) -> int:
        return len(self._buffer)


class Channel(asyncio.Protocol):
    """One end of a supervisor-worker pair: ``send`` messages, ``on_message`` for each received,
    ``on_closed`` once when the other end is gone (EOF, reset or a bad message)."""

    def __init__(self, on_message: Callable[[object], None], on_closed: Callable[[], None]) -> None:
        self.on_message = on_message
        self.on_closed = on_closed
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.reader.feed(data)
        except WireError:
            self.close()
            raise
        for message in messages:
            self.on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.on_closed()

    def send(self, message: object) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(encode(message))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
