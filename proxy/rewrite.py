"""Rewrite the broker addresses in Kafka responses (sans-IO).

Theory of operation
-------------------
Clients must never see a real broker address (DESIGN §3). The responses that
carry one are found *by introspecting kio's generated schemas*: an entity with
an int32 ``node_id``/``broker_id``, a string ``host`` and an int32 ``port``.
For the kio version installed (0.6.5) that is exactly the table of DESIGN §3:

=================  ==================================  ==========
API (key)          where                               versions
=================  ==================================  ==========
Produce (0)        node_endpoints (tagged field 0)     v10-v13
Fetch (1)          node_endpoints (tagged field 0)     v16-v18
Metadata (3)       brokers[]                           v0-v13
FindCoordinator    top-level node_id/host/port         v0-v3
(10)               coordinators[]                      v4-v6
DescribeCluster    brokers[]                           v0-v2
(60)
ShareFetch (78),   node_endpoints[]                    v1-v2
ShareAck. (79)
=================  ==================================  ==========

Nothing is decoded or re-encoded beyond the address entities: the rewriter
walks the response with a byte walker compiled from the kio schema
(:mod:`proxy._wire`), skipping everything it does not need (records, topics,
partitions, unknown tagged fields) and *splices* new ``host``/``port`` values
into the original bytes. A Metadata response at 10,000 partitions costs the
walk over its header and brokers array only; its topics are never touched,
not even copied (the result is a list of pieces: prefix, new brokers, and a
memoryview of the untouched rest).

The address mapping is injected and may change at any time:
``address_of(node_id) -> (host, port) | None``. ``None`` means the proxy has
no advertised address for that broker yet: the rewriter raises
:class:`~proxy.errors.UnknownBroker` with the real addresses of *all* such
brokers (never a response with a broker missing), so that the shell can bind
listeners first and retry. Every real broker address seen is reported to the
optional ``on_brokers`` callback (upstream discovery), before any error.

ApiVersions responses are clamped so that a client never negotiates a version
the proxy cannot parse: api keys kio does not know are removed, every range is
intersected with the versions kio knows (and optional per-key caps/floors).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import struct

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Final

import attrs

from kio.index import load_response_schema

from proxy._wire import AddressEntity
from proxy._wire import AddressSpan
from proxy._wire import Buffer
from proxy._wire import WireError
from proxy._wire import address_entity
from proxy._wire import element_type
from proxy._wire import encode_array_count
from proxy._wire import encode_string
from proxy._wire import encode_uvarint
from proxy._wire import field_steps
from proxy._wire import field_tag
from proxy._wire import is_address_entity
from proxy._wire import read_array_count
from proxy._wire import read_i16
from proxy._wire import read_uvarint
from proxy._wire import regular_fields
from proxy._wire import skip_tagged_fields
from proxy.codec import API_VERSIONS
from proxy.codec import UNSUPPORTED_VERSION
from proxy.codec import known_versions
from proxy.codec import read_response_header
from proxy.codec import response_header_version
from proxy.errors import AddressConflict
from proxy.errors import EmptyBrokerList
from proxy.errors import MalformedFrame
from proxy.errors import UnknownBroker
from proxy.errors import UnsupportedApi

__all__ = (
    "ADDRESS_APIS",
    "FULL_LIST_APIS",
    "DEFAULT_VERSION_FLOORS",
    "AddressOf",
    "BrokersSeen",
    "BrokerAddress",
    "RewriteResult",
    "ResponseRewriter",
    "address_versions",
)

# The api keys whose responses carry broker addresses (DESIGN §3).
ADDRESS_APIS: Final[Mapping[int, str]] = {
    0: "Produce",
    1: "Fetch",
    3: "Metadata",
    10: "FindCoordinator",
    60: "DescribeCluster",
    78: "ShareFetch",
    79: "ShareAcknowledge",
}
# Responses that list every broker of the cluster (not just some).
FULL_LIST_APIS: Final = frozenset({3, 60})

# Distinct ApiVersions bodies whose clamped form is kept (ResponseRewriter._clamp): one per
# broker version and request version in practice.
CLAMP_CACHE_ENTRIES = 64

# Lowest version the proxy lets a client negotiate, per api key, on top of
# kio's own lower bounds. SaslHandshake v0 (Kafka < 1.0 clients) is followed by
# raw SASL tokens without Kafka headers, which the request tracker would take
# for garbage; v1 wraps them in SaslAuthenticate requests. Every client we
# support (Java, librdkafka, kafka-python, aiokafka) uses v1 when offered.
DEFAULT_VERSION_FLOORS: Final[Mapping[int, int]] = {17: 1}

AddressOf = Callable[[int], "tuple[str, int] | None"]
BrokersSeen = Callable[[int, "tuple[BrokerAddress, ...]", bool], None]

_I32 = struct.Struct(">i")
_ENTRY = struct.Struct(">hhh")


@attrs.frozen(slots=True)
class BrokerAddress:
    """A broker address as found in (or written to) a response."""

    node_id: int
    host: str
    port: int
    rack: str | None = None


@attrs.frozen(slots=True)
class RewriteResult:
    """The rewritten payload (length prefix excluded) as pieces to write in
    order, and the real broker addresses the response carried."""

    pieces: tuple[Buffer, ...]
    brokers: tuple[BrokerAddress, ...] = ()
    complete: bool = False  # brokers is the full broker list (Metadata, DescribeCluster)
    changed: bool = True

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces)


# -- plans -------------------------------------------------------------------------

_INLINE, _ARRAY, _TAGGED = "inline", "array", "tagged"


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    kind: str
    header_version: int
    flexible: bool
    pre: tuple  # steps over the top-level fields before the addresses
    entity: AddressEntity
    tag: int | None  # for _TAGGED


@functools.cache
def _plan(api_key: int, api_version: int) -> _Plan | None:
    """Compile where the addresses sit in this response, or None if nowhere."""
    if api_key not in ADDRESS_APIS:
        return None
    versions = known_versions(api_key)
    if versions is None or api_version not in versions:
        return None
    schema = load_response_schema(api_key, api_version)
    header_version = response_header_version(api_key, api_version)
    flexible = bool(schema.__flexible__)
    fields = regular_fields(schema)
    if is_address_entity(schema):
        return _Plan(_INLINE, header_version, flexible, (), address_entity(schema, tagged=False), None)
    found = [
        f
        for f in dataclasses.fields(schema)
        if (et := element_type(f)) is not None and is_address_entity(et)
    ]
    if not found:
        return None
    if len(found) != 1:  # pragma: no cover - guards a future kio schema
        raise TypeError(f"api_key {api_key} v{api_version}: several address arrays")
    target = found[0]
    entity = address_entity(element_type(target))  # type: ignore[arg-type]
    tag = field_tag(target)
    if tag is None:
        pre = fields[: fields.index(target)]
        return _Plan(_ARRAY, header_version, flexible, tuple(field_steps(pre, flexible)), entity, None)
    return _Plan(_TAGGED, header_version, flexible, tuple(field_steps(fields, flexible)), entity, tag)


@functools.cache
def address_versions() -> Mapping[int, range]:
    """api key -> versions whose responses carry addresses (from kio)."""
    result = {}
    for api_key in ADDRESS_APIS:
        versions = [v for v in known_versions(api_key) or () if _plan(api_key, v) is not None]
        if versions:
            result[api_key] = range(min(versions), max(versions) + 1)
    return result


# -- the rewriter -------------------------------------------------------------------


class ResponseRewriter:
    """Rewrites address-carrying responses and clamps ApiVersions.

    Thread-compatible, not thread-safe (one event loop). One instance can serve
    every connection of a proxy node; ``counts`` aggregates over all of them.

    :param address_of: ``node_id -> (host, port)`` advertised for that broker,
        or ``None`` if the proxy has none yet (→ :class:`UnknownBroker`).
    :param on_brokers: called as ``on_brokers(api_key, brokers, complete)``
        with the *real* addresses a response carried; ``complete`` is True for
        Metadata and DescribeCluster (the full broker list).
    :param version_caps: extra per-key upper bounds for the ApiVersions clamp,
        e.g. ``{1: 15}`` keeps Fetch below v16 so Fetch responses are never
        buffered for rewriting (no KIP-951 node_endpoints then).
    :param version_floors: per-key lower bounds (default: SaslHandshake >= 1).
    :param clamp_api_versions: rewrite ApiVersions responses (default True).
    """

    def __init__(
        self,
        address_of: AddressOf,
        *,
        on_brokers: BrokersSeen | None = None,
        version_caps: Mapping[int, int] | None = None,
        version_floors: Mapping[int, int] = DEFAULT_VERSION_FLOORS,
        clamp_api_versions: bool = True,
    ) -> None:
        self.address_of = address_of
        self.on_brokers = on_brokers
        self.version_caps = dict(version_caps or {})
        self.version_floors = dict(version_floors)
        self._clamped: dict[tuple[int, bytes], bytes | None] = {}  # see _clamp
        self.clamp_api_versions = clamp_api_versions
        # Frames processed / frames actually changed, per api key.
        self.counts: collections.Counter[int] = collections.Counter()
        self.changed: collections.Counter[int] = collections.Counter()
        self._wanted = dict(address_versions())

    # -- FrameRewriter protocol (proxy.codec) --

    def wants(self, api_key: int, api_version: int) -> bool:
        if api_key == API_VERSIONS:
            return self.clamp_api_versions
        versions = self._wanted.get(api_key)
        return versions is not None and api_version in versions

    def rewrite(self, api_key: int, api_version: int, payload: Buffer) -> RewriteResult:
        """Rewrite one response payload (correlation id first, no length
        prefix). Raises MalformedFrame, EmptyBrokerList, UnknownBroker,
        AddressConflict."""
        try:
            if api_key == API_VERSIONS:
                result = self._clamp(api_version, payload)
            else:
                plan = _plan(api_key, api_version)
                if plan is None:
                    raise UnsupportedApi(api_key, api_version, side="broker")
                result = self._apply(api_key, plan, payload)
        except WireError as e:
            raise MalformedFrame(
                f"bad response api_key={api_key} v{api_version}: {e}", side="broker"
            ) from None
        except struct.error as e:
            raise MalformedFrame(
                f"bad response api_key={api_key} v{api_version}: {e}", side="broker"
            ) from None
        self.counts[api_key] += 1
        if result.changed:
            self.changed[api_key] += 1
        return result

    def rewrite_frame(self, api_key: int, api_version: int, frame: Buffer) -> bytes:
        """Convenience: a whole frame (length prefix included) in, bytes out."""
        view = memoryview(frame)
        length = _I32.unpack_from(view, 0)[0]
        if length != len(view) - 4:
            raise MalformedFrame("frame length does not match", side="broker")
        payload = self.rewrite(api_key, api_version, view[4:]).to_bytes()
        return _I32.pack(len(payload)) + payload

    def max_version(self, api_key: int) -> int | None:
        """Highest version of ``api_key`` a client may negotiate through us."""
        versions = known_versions(api_key)
        if versions is None:
            return None
        return min(versions[-1], self.version_caps.get(api_key, versions[-1]))

    # -- address rewriting --

    def _apply(self, api_key: int, plan: _Plan, payload: Buffer) -> RewriteResult:
        view = memoryview(payload)
        end = len(view)
        _, off = read_response_header(view, plan.header_version)
        for step in plan.pre:
            off = step(view, off, end)
        if off > end:
            raise WireError("response ends before its addresses")
        complete = api_key in FULL_LIST_APIS
        if plan.kind == _INLINE:
            span = plan.entity.parse(view, off, end)
            spans = [span]
            region = (span.host_start, span.port_start + 4)
            return self._splice(api_key, view, spans, region, plan.flexible, complete, None)
        if plan.kind == _ARRAY:
            spans, stop = self._parse_array(plan, view, off, end)
            if complete and not spans:
                raise EmptyBrokerList(
                    f"api_key={api_key} response lists no broker", side="broker"
                )
            region = (spans[0].start, stop) if spans else (off, off)
            return self._splice(api_key, view, spans, region, plan.flexible, complete, None)
        # _TAGGED: top-level tagged fields follow the regular fields
        count, off = read_uvarint(view, off, end)
        if count > end - off:
            raise WireError("tagged field count larger than the rest")
        result = None
        for _ in range(count):
            tag_start = off
            tag, off = read_uvarint(view, off, end)
            size, off = read_uvarint(view, off, end)
            value_end = off + size
            if value_end > end:
                raise WireError("tagged field past end")
            if tag == plan.tag:
                spans, stop = self._parse_array(plan, view, off, value_end)
                if stop != value_end:
                    raise WireError("node_endpoints does not fill its tagged field")
                result = (tag_start, off, value_end, spans)
            off = value_end
        if off != end:
            raise WireError(f"{end - off} bytes after the last tagged field")
        if result is None:
            return RewriteResult((view,), (), False, False)
        tag_start, value_start, value_end, spans = result
        return self._splice(
            api_key,
            view,
            spans,
            (tag_start, value_end),
            plan.flexible,
            False,
            (plan.tag, value_start),
        )

    @staticmethod
    def _parse_array(plan: _Plan, view: memoryview, off: int, end: int) -> tuple[list[AddressSpan], int]:
        count, off = read_array_count(view, off, end, plan.flexible)
        spans: list[AddressSpan] = []
        if count <= 0:
            return spans, off
        if count > end - off:
            raise WireError("array longer than the rest")
        parse = plan.entity.parse
        for _ in range(count):
            span = parse(view, off, end)
            spans.append(span)
            off = span.end
        return spans, off

    def _splice(
        self,
        api_key: int,
        view: memoryview,
        spans: Sequence[AddressSpan],
        region: tuple[int, int],
        flexible: bool,
        complete: bool,
        retag: tuple[int, int] | None,
    ) -> RewriteResult:
        """Replace host/port of every span inside ``region``; copy the rest.

        ``retag=(tag, value_start)``: the region is one tagged field whose tag
        and size prefix (before value_start) must be re-encoded.
        """
        for span in spans:
            # Kafka writes "no node" as id -1, host "", port -1 (Node.noNode()).
            # A negative id with a host would leak that host: refuse it.
            if span.node_id < 0 and span.host:
                raise WireError(f"negative node id {span.node_id} with host {span.host!r}")
        real = tuple(
            BrokerAddress(s.node_id, s.host, s.port, s.rack) for s in spans if s.node_id >= 0
        )
        if not real:  # nothing to rewrite (empty list, or error entries only)
            return RewriteResult((view,), (), complete, False)
        if self.on_brokers is not None:
            self.on_brokers(api_key, real, complete)
        advertised = self._resolve(api_key, real)
        start, stop = region
        parts: list[Buffer] = []
        cursor = retag[1] if retag is not None else start
        for span in spans:
            if span.node_id < 0:  # e.g. FindCoordinator error: no address at all
                continue
            host, port = advertised[span.node_id]
            parts.append(view[cursor : span.host_start])
            parts.append(encode_string(host, flexible))
            parts.append(view[span.host_end : span.port_start])
            parts.append(_I32.pack(port))
            cursor = span.port_start + 4
        parts.append(view[cursor:stop])
        middle = b"".join(parts)
        if retag is not None:
            middle = encode_uvarint(retag[0]) + encode_uvarint(len(middle)) + middle
        pieces = tuple(p for p in (view[:start], middle, view[stop:]) if len(p))
        return RewriteResult(pieces, real, complete, True)

    def _resolve(self, api_key: int, real: tuple[BrokerAddress, ...]) -> dict[int, tuple[str, int]]:
        address_of = self.address_of
        advertised: dict[int, tuple[str, int]] = {}
        missing: list[BrokerAddress] = []
        owner: dict[tuple[str, int], int] = {}
        for broker in real:
            node_id = broker.node_id
            if node_id in advertised:
                continue
            address = address_of(node_id)
            if address is None:
                missing.append(broker)
                continue
            host, port = address
            other = owner.setdefault((host, port), node_id)
            if other != node_id:
                raise AddressConflict(host, port, (other, node_id))
            advertised[node_id] = (host, port)
        if missing:
            raise UnknownBroker(api_key, missing)
        return advertised

    # -- ApiVersions --

    def _limits(self, api_key: int) -> tuple[int, int] | None:
        versions = known_versions(api_key)
        if versions is None:
            return None
        low = max(versions[0], self.version_floors.get(api_key, versions[0]))
        high = min(versions[-1], self.version_caps.get(api_key, versions[-1]))
        return low, high

    def _clamp(self, api_version: int, payload: Buffer) -> RewriteResult:
        """The clamped ApiVersions answer. A broker sends the same body every time, and every
        client connection asks first thing (a reconnect storm: one per client), so each
        distinct body (and version) is clamped once and kept (at most CLAMP_CACHE_ENTRIES)."""
        view = memoryview(payload)
        _, header_end = read_response_header(view, 0)  # ApiVersions: header v0 always
        key = (api_version, bytes(view[header_end:]))
        try:
            body = self._clamped[key]
        except KeyError:
            result = self._clamp_entries(api_version, view, header_end)
            body = result.to_bytes()[header_end:] if result.changed else None  # None: left as it is
            if len(self._clamped) >= CLAMP_CACHE_ENTRIES:
                self._clamped.clear()
            self._clamped[key] = body
        if body is None:
            return RewriteResult((view,), (), False, False)
        return RewriteResult((view[:header_end], body), (), False, True)

    def _clamp_entries(self, api_version: int, view: memoryview, off: int) -> RewriteResult:
        end = len(view)
        error_code = read_i16(view, off, end)
        off += 2
        # KIP-511: UNSUPPORTED_VERSION comes with a v0 body whatever was asked;
        # a version above kio's is read with kio's newest layout (the api_keys
        # entries have kept their shape since v3).
        known = known_versions(API_VERSIONS)
        assert known is not None
        body_version = 0 if error_code == UNSUPPORTED_VERSION else min(api_version, known[-1])
        flexible = bool(load_response_schema(API_VERSIONS, body_version).__flexible__)
        array_start = off
        count, off = read_array_count(view, off, end, flexible)
        if count <= 0:
            return RewriteResult((view,), (), False, False)
        if count * 6 > end - off:
            raise WireError("api_keys longer than the rest")
        kept: list[Buffer] = []
        changed = False
        for _ in range(count):
            entry = off
            if off + 6 > end:
                raise WireError("api_keys entry past end")
            api_key, low, high = _ENTRY.unpack_from(view, off)
            off += 6
            if flexible:
                off = skip_tagged_fields(view, off, end)
            limits = self._limits(api_key)
            new_low, new_high = (low, high) if limits is None else (max(low, limits[0]), min(high, limits[1]))
            if limits is None or new_low > new_high:
                changed = True  # drop the entry: the proxy cannot carry this api
                continue
            if (new_low, new_high) == (low, high):
                kept.append(view[entry:off])
            else:
                changed = True
                kept.append(_ENTRY.pack(api_key, new_low, new_high) + bytes(view[entry + 6 : off]))
        if not changed:
            return RewriteResult((view,), (), False, False)
        middle = encode_array_count(len(kept), flexible) + b"".join(kept)
        pieces = tuple(p for p in (view[:array_start], middle, view[off:]) if len(p))
        return RewriteResult(pieces, (), False, True)

