"""Kafka framing facts the codec works with: frame and header layouts, the
api versions kio knows, and the per-connection correlation table.

Sans-IO: no I/O library, no clock. See :mod:`proxy.codec` for the theory of
operation.
"""

from __future__ import annotations

import functools
import struct

from collections.abc import Iterator
from collections.abc import Sequence
from typing import Final

from kio.index import load_request_schema
from kio.index import load_response_schema
from kio.schema.index import api_key_map
from kio.schema.index import schema_name_map

from proxy._wire import Buffer
from proxy._wire import WireError
from proxy._wire import field_steps
from proxy._wire import regular_fields
from proxy._wire import skip_tagged_fields
from proxy.errors import DuplicateCorrelationId
from proxy.errors import TooManyInFlight
from proxy.errors import UnknownCorrelationId
from proxy.errors import UnsupportedApi

# Largest frame accepted in either direction, length prefix excluded.
# 104857600 = 100 MiB is the broker's own default `socket.request.max.bytes`
# (Kafka rejects larger requests with the same rule), and it is above the
# default response sizes clients ask for (`fetch.max.bytes` 50 MiB,
# `max.partition.fetch.bytes` 1 MiB; a single batch larger than those is still
# returned, bounded by `message.max.bytes` ~1 MiB by default). A length above
# it is far more likely garbage (e.g. a TLS or HTTP client on a plaintext port:
# "GET " reads as 1195725856) than a real frame. Configurable per instance.
DEFAULT_MAX_FRAME_SIZE: Final = 104_857_600

# Most requests that may wait for a response on one connection. librdkafka's
# default `max.in.flight.requests.per.connection` is 1,000,000 (Java: 5), so a
# legitimate client never exceeds this; the cap bounds the table's memory
# (~100 B an entry) for a client that only writes. Configurable per instance.
DEFAULT_MAX_IN_FLIGHT: Final = 1_000_000

PRODUCE: Final = 0
METADATA: Final = 3
API_VERSIONS: Final = 18
# Error code a broker answers an ApiVersions request it cannot parse with; the
# response then has a v0 body whatever version was asked (KIP-511).
UNSUPPORTED_VERSION: Final = 35

_I32 = struct.Struct(">i")
_LEN = struct.Struct(">i")


# -- kio lookups (lazy: importing every kio schema takes seconds) --------------------


@functools.cache
def known_versions(api_key: int) -> range | None:
    """The versions of ``api_key`` kio knows (contiguous run ending at the
    highest), or None if kio does not know the api key."""
    name = api_key_map.get(api_key)
    if name is None or name not in schema_name_map:
        return None
    versions = sorted(schema_name_map[name])
    top = versions[-1]
    low = top
    while low - 1 in schema_name_map[name]:
        low -= 1
    return range(low, top + 1)


def _is_known(api_key: int, api_version: int) -> bool:
    versions = known_versions(api_key)
    return versions is not None and api_version in versions


@functools.cache
def request_layout(api_key: int, api_version: int) -> tuple[int, bool, tuple | None]:
    """(header version, flexible, produce steps to `acks`) for a request.

    ApiVersions is special (KIP-511): a client may ask a version newer than
    the proxy knows; Kafka parses its header as v2 for any version >= 3.
    """
    if not _is_known(api_key, api_version):
        if api_key == API_VERSIONS and api_version > 0:
            return (2 if api_version >= 3 else 1), api_version >= 3, None
        raise UnsupportedApi(api_key, api_version)
    schema = load_request_schema(api_key, api_version)
    header_version = int(schema.__header_schema__.__version__)
    flexible = bool(schema.__flexible__)
    produce = None
    if api_key == PRODUCE:
        fields = regular_fields(schema)
        names = [f.name for f in fields]
        acks_at = names.index("acks")
        txn_at = names.index("transactional_id") if "transactional_id" in names else None
        if txn_at is not None and txn_at + 1 == acks_at:
            produce = (tuple(field_steps(fields[:txn_at], flexible)), True)
        else:  # generic: no transactional_id right before acks
            produce = (tuple(field_steps(fields[:acks_at], flexible)), False)
    return header_version, flexible, produce


def request_header_version(api_key: int, api_version: int) -> int:
    """Request header version (1 or 2) from kio; UnsupportedApi if unknown."""
    return request_layout(api_key, api_version)[0]


@functools.cache
def response_header_version(api_key: int, api_version: int) -> int:
    """Response header version (0 or 1). ApiVersions responses always use v0."""
    if api_key == API_VERSIONS:
        return 0
    if not _is_known(api_key, api_version):
        raise UnsupportedApi(api_key, api_version, side="broker")
    schema = load_response_schema(api_key, api_version)
    return int(schema.__header_schema__.__version__)


def read_response_header(payload: Buffer, header_version: int) -> tuple[int, int]:
    """(correlation_id, body offset) of a response payload (no length prefix).

    Raises WireError (internal) on truncation; callers convert it.
    """
    end = len(payload)
    if end < 4:
        raise WireError("response shorter than its correlation id")
    correlation_id = _I32.unpack_from(payload, 0)[0]
    if header_version >= 1:
        return correlation_id, skip_tagged_fields(payload, 4, end)
    return correlation_id, 4


def preload(api_keys: Sequence[int] | None = None) -> None:
    """Import the kio schemas ahead of traffic (first use costs a few ms each)."""
    for api_key in api_keys if api_keys is not None else list(api_key_map):
        versions = known_versions(api_key)
        for version in versions or ():
            request_layout(api_key, version)
            response_header_version(api_key, version)


_ANSWER_HEAD = struct.Struct(">ii")


def answer_head(body_size: int, correlation_id: int) -> bytes:
    """The first 8 bytes of a response frame the node answers itself (proxy.local_answers,
    proxy.single_flight): its length prefix and correlation id (the response header's first field
    in every version), for a body of ``body_size`` bytes after the correlation id."""
    return _ANSWER_HEAD.pack(body_size + 4, correlation_id)


def encode_frame(payload: Buffer) -> bytes:
    """Length prefix + payload (a convenience for tests and tools)."""
    return _LEN.pack(len(payload)) + bytes(payload)


# -- correlation table ---------------------------------------------------------------


class CorrelationTable:
    """Per-connection map correlation_id -> (api_key, api_version).

    Filled by :class:`RequestTracker` for every request that expects a
    response, consumed by :class:`ResponseSplitter`. Kafka answers in request
    order on a connection, but the table does not rely on it.
    """

    __slots__ = ("_pending", "max_in_flight")

    def __init__(self, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        self._pending: dict[int, tuple[int, int]] = {}
        self.max_in_flight = max_in_flight

    def add(self, correlation_id: int, api_key: int, api_version: int) -> None:
        pending = self._pending
        if correlation_id in pending:
            raise DuplicateCorrelationId(correlation_id)
        if len(pending) >= self.max_in_flight:
            raise TooManyInFlight(
                f"more than {self.max_in_flight} requests in flight", side="client"
            )
        pending[correlation_id] = (api_key, api_version)

    def pop(self, correlation_id: int) -> tuple[int, int]:
        try:
            return self._pending.pop(correlation_id)
        except KeyError:
            raise UnknownCorrelationId(correlation_id) from None

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, correlation_id: object) -> bool:
        return correlation_id in self._pending

    def __iter__(self) -> Iterator[int]:
        return iter(self._pending)

    def get(self, correlation_id: int) -> tuple[int, int] | None:
        return self._pending.get(correlation_id)
