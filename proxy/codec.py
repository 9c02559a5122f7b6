"""Sans-IO Kafka frame codec for the proxy data path (cut-through).

Theory of operation
-------------------
Every Kafka message on a TCP connection is a *frame*: an int32 big-endian
length followed by that many payload bytes. A request payload starts with a
request header (api_key, api_version, correlation_id, client_id[, tagged
fields]); a response payload starts with a response header (correlation_id[,
tagged fields]) that does *not* carry the api key. So the proxy keeps, per
client connection, a :class:`CorrelationTable` (correlation id -> api key and
version) filled from the requests and consumed by the responses
(DESIGN §2 decision 6).

Two objects, one per direction, no I/O (h11 style: bytes in, events/bytes out):

* :class:`RequestTracker` (client -> broker) *observes* the client's bytes. It
  buffers at most the bytes needed to peek the current frame's header (plus,
  for Produce, ``transactional_id`` and ``acks``: acks=0 has no response) and
  returns one :class:`RequestHeader` per frame whose header completed. The
  shell forwards the very same chunks to the broker, unchanged.
* :class:`ResponseSplitter` (broker -> client) returns the bytes to write to
  the client: pass-through slices of the chunks it was fed (it never waits for
  a whole frame it does not rewrite), and, for the frames an injected
  :class:`FrameRewriter` wants (address-carrying responses, ApiVersions), the
  rewritten frame once the whole frame has arrived.

Use from an I/O shell (asyncio protocol callbacks)::

    codec = ConnectionCodec(rewriter)             # one per client connection

    # client socket data_received(chunk):
    for header in codec.requests.feed(chunk):     # ProtocolError -> close both
        ...                                       # metrics, drain bookkeeping
    upstream.write(chunk)                         # forward unchanged, after feed

    # broker socket data_received(chunk):
    client.writelines(codec.responses.feed(chunk))
    if codec.responses.stalled is not None:       # UnknownBroker: bind, retry
        broker_transport.pause_reading()
        ...bind listeners for codec.responses.stalled.brokers, update mapping...
        client.writelines(codec.responses.resume())

Parts: :mod:`proxy.framing` (frame and header layouts, versions, the
correlation table), :mod:`proxy.request_tracker`, :mod:`proxy.response_splitter`;
this module joins them per connection and is where the data path imports them
from.

Errors: :class:`proxy.errors.ProtocolError` (peer sent garbage, close), see
:mod:`proxy.errors`. Anything else escaping is a bug.

Buffers: pass-through segments may be the chunk object itself or memoryviews
of it. Chunks may be memoryviews of a buffer the caller reuses (the shell
reads into one, see :mod:`proxy.buffers`): whatever the codec keeps across
``feed`` calls it copies (a partial length/header, a frame collected for
rewriting, a frame whose rewrite stalled, chunks queued while stalled), so
the caller may overwrite a chunk's buffer as soon as the segments ``feed``
returned are written (sent, or copied by the transport).
"""

from __future__ import annotations

from proxy.framing import API_VERSIONS
from proxy.framing import DEFAULT_MAX_FRAME_SIZE
from proxy.framing import DEFAULT_MAX_IN_FLIGHT
from proxy.framing import PRODUCE
from proxy.framing import UNSUPPORTED_VERSION
from proxy.framing import CorrelationTable
from proxy.framing import encode_frame
from proxy.framing import known_versions
from proxy.framing import preload
from proxy.framing import read_response_header
from proxy.framing import request_header_version
from proxy.framing import response_header_version
from proxy.request_tracker import RequestHeader
from proxy.request_tracker import RequestTracker
from proxy.response_splitter import FrameRewriter
from proxy.response_splitter import ResponseSplitter

__all__ = (
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MAX_IN_FLIGHT",
    "API_VERSIONS",
    "PRODUCE",
    "UNSUPPORTED_VERSION",
    "RequestHeader",
    "CorrelationTable",
    "RequestTracker",
    "FrameRewriter",
    "ResponseSplitter",
    "ConnectionCodec",
    "known_versions",
    "request_header_version",
    "response_header_version",
    "read_response_header",
    "encode_frame",
    "preload",
)


class ConnectionCodec:
    """The two directions of one proxied connection, sharing one table."""

    def __init__(
        self,
        rewriter: FrameRewriter | None = None,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self.table = CorrelationTable(max_in_flight)
        self.requests = RequestTracker(self.table, max_frame_size=max_frame_size)
        self.responses = ResponseSplitter(self.table, rewriter, max_frame_size=max_frame_size)

    @property
    def in_flight(self) -> int:
        """Requests still waiting for (the start of) their response."""
        return len(self.table)

    @property
    def idle(self) -> bool:
        """No request in flight and both streams between frames: the
        connection can be closed without cutting a message (graceful drain)."""
        return (
            not self.table
            and self.requests.at_frame_boundary
            and self.responses.at_frame_boundary
            and self.responses.stalled is None
        )
