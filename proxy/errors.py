"""Errors raised by the sans-IO core of the data path (codec and rewriter).

Three families, as in h11 (``RemoteProtocolError`` / ``LocalProtocolError``):

* :class:`ProtocolError` -- the *peer* sent bytes that are not valid Kafka
  protocol (negative or oversized frame length, a frame too short for its
  header, an api key or version kio does not know, a response whose
  correlation id was never requested, a body that ends early ...). The only
  sane reaction is to close that connection (and usually its partner
  connection). :attr:`ProtocolError.side` says who misbehaved.
* :class:`UnknownBroker` / :class:`AddressConflict` -- the bytes are fine but
  the injected address mapping cannot serve them. These are *not* protocol
  errors: the shell can act on them (bind a listener for the broker, then
  retry; or fix the mapping).
* Anything else escaping the core is a bug in the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Literal

if TYPE_CHECKING:
    from proxy.rewrite import BrokerAddress

__all__ = (
    "KProxyError",
    "ProtocolError",
    "FrameSizeError",
    "MalformedFrame",
    "UnsupportedApi",
    "UnknownCorrelationId",
    "DuplicateCorrelationId",
    "TooManyInFlight",
    "EmptyBrokerList",
    "RewriteError",
    "UnknownBroker",
    "AddressConflict",
)

Side = Literal["client", "broker", "unknown"]


class KProxyError(Exception):
    """Base class of every error the data-path core raises on purpose."""


class ProtocolError(KProxyError):
    """The peer violated the Kafka protocol; close the connection.

    ``side`` is ``"client"`` for bytes read from a client (request direction),
    ``"broker"`` for bytes read from a broker (response direction).
    """

    def __init__(self, message: str, *, side: Side = "unknown") -> None:
        super().__init__(message)
        self.side: Side = side

    def __str__(self) -> str:
        return f"[{self.side}] {super().__str__()}"


class FrameSizeError(ProtocolError):
    """The int32 length prefix is negative, too small for a header, or above
    the configured maximum frame size."""


class MalformedFrame(ProtocolError):
    """A header or body ends early, has an invalid length, or trailing bytes."""


class UnsupportedApi(ProtocolError):
    """The request names an api key or version that kio (hence the proxy) does
    not know, so its header and its response cannot be parsed."""

    def __init__(self, api_key: int, api_version: int, *, side: Side = "client") -> None:
        super().__init__(
            f"unsupported api_key={api_key} api_version={api_version}", side=side
        )
        self.api_key = api_key
        self.api_version = api_version


class UnknownCorrelationId(ProtocolError):
    """A response carries a correlation id that no pending request has."""

    def __init__(self, correlation_id: int) -> None:
        super().__init__(
            f"response with unknown correlation_id={correlation_id}", side="broker"
        )
        self.correlation_id = correlation_id


class DuplicateCorrelationId(ProtocolError):
    """A client reused a correlation id that is still waiting for a response:
    the two responses could not be told apart."""

    def __init__(self, correlation_id: int) -> None:
        super().__init__(
            f"correlation_id={correlation_id} is already in flight", side="client"
        )
        self.correlation_id = correlation_id


class TooManyInFlight(ProtocolError):
    """More requests waiting for a response than the configured limit."""


class EmptyBrokerList(ProtocolError):
    """A broker sent a Metadata / DescribeCluster response without brokers.

    The proxy never forwards a Metadata response with zero brokers
    (DESIGN §3); the client will retry on another connection."""


class RewriteError(KProxyError):
    """Base class of the errors of the address mapping (not of the bytes)."""


class UnknownBroker(RewriteError):
    """The mapping has no advertised address for one or more node ids.

    Carries the *real* addresses the broker reported so that the shell can
    bind a listener for each (DESIGN §2 decision 2: never advertise an address
    before its listener is bound), update the mapping and retry the rewrite
    (see :meth:`proxy.codec.ResponseSplitter.resume`).
    """

    def __init__(self, api_key: int, brokers: Sequence[BrokerAddress]) -> None:
        self.api_key = api_key
        self.brokers: tuple[BrokerAddress, ...] = tuple(brokers)
        ids = ", ".join(
            f"{b.node_id} ({b.host}:{b.port})" for b in self.brokers
        )
        super().__init__(f"no advertised address for node id(s) {ids} (api_key={api_key})")

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(b.node_id for b in self.brokers)


class AddressConflict(RewriteError):
    """The mapping gives one advertised host:port to two different node ids
    within one response (DESIGN §3 forbids it: the client would merge them)."""

    def __init__(self, host: str, port: int, node_ids: tuple[int, int]) -> None:
        super().__init__(
            f"advertised address {host}:{port} mapped to node ids {node_ids[0]} and {node_ids[1]}"
        )
        self.host = host
        self.port = port
        self.node_ids = node_ids
