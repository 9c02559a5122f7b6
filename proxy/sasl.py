"""The node's own SASL login, for its discovery connections to SASL brokers.

Clients' SASL exchanges pass through the data path untouched (SaslHandshake and
SaslAuthenticate are ordinary requests; KIP-368 re-authentication too). Only the
node's control connection (:mod:`proxy.upstream`: Metadata for discovery) logs
in itself, with ``[security.upstream_sasl]``: SaslHandshake v1 then
SaslAuthenticate v2 frames (kio), PLAIN, SCRAM-SHA-256/512 (``scramp``) or
OAUTHBEARER with a configured token. Sans-IO: :class:`SaslLogin` turns server
messages into client messages; the shell moves the frames. Nothing here logs a
credential; errors carry the broker's error message only.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator

from kio.schema.request_header.v1.header import RequestHeader as RequestHeaderV1
from kio.schema.request_header.v2.header import RequestHeader as RequestHeaderV2
from kio.schema.response_header.v0.header import ResponseHeader as ResponseHeaderV0
from kio.schema.response_header.v1.header import ResponseHeader as ResponseHeaderV1
from kio.schema.sasl_authenticate.v2.request import SaslAuthenticateRequest
from kio.schema.sasl_authenticate.v2.response import SaslAuthenticateResponse
from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest
from kio.schema.sasl_handshake.v1.response import SaslHandshakeResponse
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import i16, i32

from proxy.security_config import UpstreamSasl

_correlation = itertools.count(1 << 20)
CLIENT_ID = "kproxy-discovery"


class SaslError(RuntimeError):
    """The broker refused the node's login (message: the broker's words, no credential)."""


def _frame(header: object, body: object, header_type: type, body_type: type) -> bytes:
    buf = io.BytesIO()
    entity_writer(header_type)(buf, header)
    entity_writer(body_type)(buf, body)
    payload = buf.getvalue()
    return len(payload).to_bytes(4, "big") + payload


def handshake_request(mechanism: str, correlation_id: int) -> bytes:
    header = RequestHeaderV1(request_api_key=i16(17), request_api_version=i16(1),
                             correlation_id=i32(correlation_id), client_id=CLIENT_ID)
    return _frame(header, SaslHandshakeRequest(mechanism=mechanism), RequestHeaderV1, SaslHandshakeRequest)


def authenticate_request(auth_bytes: bytes, correlation_id: int) -> bytes:
    header = RequestHeaderV2(request_api_key=i16(36), request_api_version=i16(2),
                             correlation_id=i32(correlation_id), client_id=CLIENT_ID)
    return _frame(header, SaslAuthenticateRequest(auth_bytes=auth_bytes), RequestHeaderV2, SaslAuthenticateRequest)


def read_handshake_response(payload: bytes, mechanism: str) -> None:
    _, used = entity_reader(ResponseHeaderV0)(payload, 0)
    response, _ = entity_reader(SaslHandshakeResponse)(payload, used)
    if int(response.error_code) != 0:
        raise SaslError(f"broker does not offer SASL mechanism {mechanism} (it offers {list(response.mechanisms)})")


def read_authenticate_response(payload: bytes) -> bytes:
    _, used = entity_reader(ResponseHeaderV1)(payload, 0)
    response, _ = entity_reader(SaslAuthenticateResponse)(payload, used)
    if int(response.error_code) != 0:
        raise SaslError(f"SASL login refused: {response.error_message or 'no message'}")
    return response.auth_bytes


def client_messages(login: UpstreamSasl) -> Iterator[bytes]:
    """The client's SASL messages; ``send()`` each server answer in (a generator, sans-IO)."""
    if login.mechanism == "PLAIN":
        yield f"\0{login.username}\0{login.password}".encode()
        return
    if login.mechanism == "OAUTHBEARER":
        yield f"n,,\x01auth=Bearer {login.password}\x01\x01".encode()
        return
    from scramp import ScramClient

    client = ScramClient([login.mechanism], login.username, login.password)
    server_first = yield client.get_client_first().encode()
    client.set_server_first(server_first.decode())
    server_final = yield client.get_client_final().encode()
    client.set_server_final(server_final.decode())  # raises if the server's proof is wrong


def next_correlation() -> int:
    return next(_correlation)
