"""Upstream discovery: which brokers exist, where they listen, in which rack.

The proxy asks any reachable bootstrap broker for Metadata (no topics) with a
kio-encoded request on a short-lived connection. This is the control path, so
plain asyncio streams are fine here; the data path never waits on it. Toward a
TLS broker the connection is TLS (:class:`UpstreamSecurity`), toward a SASL
broker the node logs in first with its own credentials (:mod:`proxy.sasl`).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import ssl
import struct
from typing import Iterable

import attrs
from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse
from kio.schema.request_header.v2.header import RequestHeader
from kio.schema.response_header.v1.header import ResponseHeader
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import i16, i32

from proxy import sasl
from proxy.config import HostPort
from proxy.hosts import source_address
from proxy.logs import describe_error
from proxy.security_config import UpstreamSasl

log = logging.getLogger("kproxy.upstream")
_LEN = struct.Struct(">i")
_MAX_RESPONSE = 16 << 20
_correlation = itertools.count(1)
_write_header = entity_writer(RequestHeader)
_write_request = entity_writer(MetadataRequest)
_read_header = entity_reader(ResponseHeader)
_read_response = entity_reader(MetadataResponse)


@attrs.frozen(order=True)
class UpstreamBroker:
    node_id: int
    host: str
    port: int
    rack: str | None = None

    @property
    def address(self) -> HostPort:
        return HostPort(self.host, self.port)


class DiscoveryError(RuntimeError):
    """No bootstrap broker answered Metadata."""


@attrs.frozen
class UpstreamSecurity:
    """How the node's connections reach a broker: TLS (a client context, see proxy.tls) and,
    for its own control connections, a SASL login. Both None: plaintext."""

    tls: ssl.SSLContext | None = None
    login: UpstreamSasl | None = None

    def server_hostname(self, host: str) -> str | None:
        return host if self.tls is not None else None


PLAINTEXT = UpstreamSecurity()


def encode_metadata_request(correlation_id: int, client_id: str = "kproxy-discovery") -> bytes:
    buf = io.BytesIO()
    _write_header(buf, RequestHeader(request_api_key=i16(3), request_api_version=i16(12),
                                     correlation_id=i32(correlation_id), client_id=client_id))
    _write_request(buf, MetadataRequest(topics=(), allow_auto_topic_creation=False,
                                        include_topic_authorized_operations=False))
    payload = buf.getvalue()
    return _LEN.pack(len(payload)) + payload


def decode_metadata_response(payload: bytes, correlation_id: int) -> list[UpstreamBroker]:
    header, used = _read_header(payload, 0)
    if header.correlation_id != correlation_id:
        raise DiscoveryError(f"correlation id {header.correlation_id} != {correlation_id}")
    response, _ = _read_response(payload, used)
    return sorted(UpstreamBroker(int(b.node_id), b.host, int(b.port), b.rack) for b in response.brokers)


async def _read_frame(reader: asyncio.StreamReader, address: HostPort, timeout: float) -> bytes:
    size = _LEN.unpack(await asyncio.wait_for(reader.readexactly(4), timeout))[0]
    if not 0 < size <= _MAX_RESPONSE:
        raise DiscoveryError(f"{address}: bad response length {size}")
    return await asyncio.wait_for(reader.readexactly(size), timeout)


async def _login(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, login: UpstreamSasl,
                 address: HostPort, timeout: float) -> None:
    """SaslHandshake v1, then SaslAuthenticate v2 rounds until the mechanism is done."""
    writer.write(sasl.handshake_request(login.mechanism, sasl.next_correlation()))
    sasl.read_handshake_response(await _read_frame(reader, address, timeout), login.mechanism)
    messages = sasl.client_messages(login)
    message = next(messages)
    while True:
        writer.write(sasl.authenticate_request(message, sasl.next_correlation()))
        answer = sasl.read_authenticate_response(await _read_frame(reader, address, timeout))
        try:
            message = messages.send(answer)
        except StopIteration:
            return
        except Exception as exc:  # scramp: the server's proof does not verify
            raise sasl.SaslError(f"SASL login: the broker's answer does not verify ({type(exc).__name__})") from None


async def fetch_brokers(address: HostPort, timeout: float = 5.0, source: str | None = None,
                        security: UpstreamSecurity = PLAINTEXT) -> list[UpstreamBroker]:
    cid = next(_correlation)
    local = source_address(source, address.host) if source else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(address.host, address.port, local_addr=local, ssl=security.tls,
                                server_hostname=security.server_hostname(address.host)), timeout)
    try:
        if security.login is not None:
            await _login(reader, writer, security.login, address, timeout)
        writer.write(encode_metadata_request(cid))
        payload = await _read_frame(reader, address, timeout)
    finally:
        writer.close()
    return decode_metadata_response(payload, cid)


async def discover(candidates: Iterable[HostPort], timeout: float = 5.0,
                   source: str | None = None, security: UpstreamSecurity = PLAINTEXT) -> list[UpstreamBroker]:
    """Ask each candidate in turn (from ``source`` if given); the first answer wins."""
    errors = []
    for address in candidates:
        try:
            return await fetch_brokers(address, timeout, source, security)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, DiscoveryError, ValueError,
                sasl.SaslError) as exc:
            errors.append(f"{address}: {describe_error(exc)}")
    raise DiscoveryError("no upstream broker answered Metadata: " + "; ".join(errors))
