"""A connection storm: N light Kafka clients connecting at once (asyncio, raw sockets).

Each light client opens one TCP connection to one address, sends ApiVersions,
Metadata (one topic), then one small Produce (acks=1) to that topic's
partition, one request at a time, each checked (correlation id, error code:
frames built and read with kio, :mod:`chaos.bench.frames`). A client is
*served* once its last answer came back, within its own deadline. Served
clients keep their connection open until every client is served or has
failed, so the far end holds all of them at once (``hold`` runs then: the
bench measures the proxy's memory there), then all close.

Clients leave from several source addresses (``sources``, 127.0.0.100 ... on
loopback): a reconnect storm comes from many client hosts, and the proxy's
accept rate limit is per source address (proxy.admission).

Used by ``kproxy bench storm`` (chaos.bench.storm) and by the storm test.
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import struct
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
from kafka.record.default_records import DefaultRecordBatchBuilder
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.schema.metadata.v12.response import MetadataResponse
from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData
from kio.schema.produce.v9.response import ProduceResponse
from kio.static.primitive import Records, i32Timedelta

from chaos.bench.frames import decode_response, make, request_frame

__all__ = ("DEFAULT_SOURCES", "LightRequests", "StormResult", "light_requests", "storm", "source_addresses")

_LEN = struct.Struct(">i")
CLIENT_DEADLINE_S = 60.0
DEFAULT_SOURCES = 20
RECORD_BYTES = 100
# Linux retransmits an unanswered SYN after 1 s (then 3, 7 ... s): a connect that
# took this long lost its first SYN.
SYN_RETRANSMIT_S = 0.9


def source_addresses(count: int = DEFAULT_SOURCES, first: int = 100) -> tuple[str, ...]:
    """``count`` loopback client addresses, 127.0.0.<first> on."""
    if not 1 <= count <= 255 - first:
        raise ValueError(f"between 1 and {255 - first} source addresses")
    return tuple(f"127.0.0.{first + i}" for i in range(count))


@attrs.frozen
class LightRequests:
    """The request frames of one light client (correlation ids 1, 2, 3 ...) and the
    response type of each, to check the answers with."""

    frames: tuple[bytes, ...]
    response_types: tuple[type, ...]
    topic: str | None


def light_requests(topic: str | None, partition: int = 0, *, produce: bool = True) -> LightRequests:
    """ApiVersions; Metadata of ``topic`` (of every topic if None); a one-record Produce
    (acks=1) to ``topic``/``partition`` unless ``produce`` is False or there is no topic."""
    frames = [request_frame(make(ApiVersionsRequest, client_software_name="kproxy-storm",
                                 client_software_version="1"), 1, "kproxy-storm")]
    types: list[type] = [ApiVersionsResponse]
    topics = None if topic is None else (make(MetadataRequestTopic, name=topic, topic_id=None),)
    frames.append(request_frame(make(MetadataRequest, topics=topics, allow_auto_topic_creation=False), 2,
                                "kproxy-storm"))
    types.append(MetadataResponse)
    if produce and topic is not None:
        builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                            producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
        builder.append(0, timestamp=None, key=None, value=b"s" * RECORD_BYTES, headers=[])
        data = make(TopicProduceData, name=topic,
                    partition_data=(make(PartitionProduceData, index=partition,
                                         records=Records(bytes(builder.build()))),))
        frames.append(request_frame(make(ProduceRequest, transactional_id=None, acks=1,
                                         timeout=i32Timedelta.parse(datetime.timedelta(seconds=10)),
                                         topic_data=(data,)), 3, "kproxy-storm"))
        types.append(ProduceResponse)
    return LightRequests(tuple(frames), tuple(types), topic)


def _error_of(body: Any) -> str | None:
    """The first Kafka error an answer carries, or None."""
    if isinstance(body, ApiVersionsResponse):
        return None if body.error_code == ErrorCode.none else f"ApiVersions {body.error_code.name}"
    if isinstance(body, MetadataResponse):
        bad = [t.error_code.name for t in body.topics if t.error_code != ErrorCode.none]
        return f"Metadata {bad[0]}" if bad else None
    if isinstance(body, ProduceResponse):
        bad = [p.error_code.name for t in body.responses for p in t.partition_responses
               if p.error_code != ErrorCode.none]
        return f"Produce {bad[0]}" if bad else None
    return None


@attrs.frozen
class StormResult:
    """One storm. Times in seconds: ``all_served_s`` from the storm's start to the last
    client served (None if none was); ``p50_s``/``p99_s`` per served client, from its
    own connect to its last answer. ``errors``: failure kind -> clients.
    ``connect_p99_s`` and ``slow_connects``: how long the TCP connects took; a
    connect of a second or more had its SYN dropped (the listener's accept
    queue was full) and retransmitted."""

    clients: int
    served: int
    failed: int
    all_served_s: float | None
    p50_s: float | None
    p99_s: float | None
    errors: dict[str, int]
    connect_p99_s: float | None = None
    slow_connects: int = 0  # connects that took a SYN retransmit (>= SYN_RETRANSMIT_S): a full accept queue


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


class _Storm:
    def __init__(self, host: str, port: int, requests: LightRequests, sources: Sequence[str], clients: int,
                 deadline_s: float) -> None:
        self.host, self.port, self.requests = host, port, requests
        self.sources = sources
        self.clients = clients
        self.deadline_s = deadline_s
        self.served: list[float] = []  # per client, from its connect to its last answer
        self.served_at: list[float] = []  # from the storm's start
        self.errors: Counter[str] = Counter()
        self.connected: list[float] = []  # per client that connected: how long the connect took
        self.finished = 0
        self.all_finished = asyncio.Event()
        self.release = asyncio.Event()
        self.start = 0.0

    def _finish(self) -> None:
        self.finished += 1
        if self.finished == self.clients:
            self.all_finished.set()

    async def client(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        begun = loop.time()
        writer = None
        try:
            async with asyncio.timeout(self.deadline_s):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, local_addr=(self.sources[index % len(self.sources)], 0))
                self.connected.append(loop.time() - begun)
                for correlation_id, (frame, body_type) in enumerate(
                        zip(self.requests.frames, self.requests.response_types), 1):
                    writer.write(frame)
                    (size,) = _LEN.unpack(await reader.readexactly(4))
                    got, body = decode_response(body_type, await reader.readexactly(size), framed=False)
                    if got != correlation_id:
                        raise ValueError(f"correlation id {got}, expected {correlation_id}")
                    error = _error_of(body)
                    if error is not None:
                        raise ValueError(error)
        except (OSError, EOFError, ValueError, TimeoutError) as exc:
            self.errors[_kind(exc)] += 1
            self._finish()
            if writer is not None:
                writer.transport.abort()
            return
        now = loop.time()
        self.served.append(now - begun)
        self.served_at.append(now - self.start)
        self._finish()
        await self.release.wait()
        writer.transport.abort()  # no TIME_WAIT left behind on this side

    def result(self) -> StormResult:
        served = sorted(self.served)
        return StormResult(
            clients=self.clients, served=len(served), failed=self.clients - len(served),
            all_served_s=round(max(self.served_at), 3) if self.served_at else None,
            p50_s=_round(_quantile(served, 0.5)), p99_s=_round(_quantile(served, 0.99)),
            errors=dict(self.errors.most_common()),
            connect_p99_s=_round(_quantile(sorted(self.connected), 0.99)),
            slow_connects=sum(1 for c in self.connected if c >= SYN_RETRANSMIT_S))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "deadline"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "closed by peer"
    if isinstance(exc, ValueError):
        return str(exc)
    return type(exc).__name__


async def storm(host: str, port: int, clients: int, requests: LightRequests, *,
                sources: Sequence[str] = source_addresses(), deadline_s: float = CLIENT_DEADLINE_S,
                hold: Callable[[], Awaitable[None]] | None = None) -> StormResult:
    """``clients`` light clients connect to ``host:port`` at once (see the module doc).
    ``hold`` runs once every client is served or failed, the served ones still connected."""
    run = _Storm(host, port, requests, sources, clients, deadline_s)
    run.start = asyncio.get_running_loop().time()
    tasks = [asyncio.ensure_future(run.client(i)) for i in range(clients)]
    try:
        await run.all_finished.wait()
        if hold is not None:
            await hold()
    finally:
        run.release.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return run.result()
