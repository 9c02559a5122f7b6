"""TLS for the data path: the contexts, their rotation, and why a handshake failed.

Theory of operation
-------------------
The standard ``ssl`` module on uvloop terminates and originates TLS (DESIGN §10).
A node has at most three contexts, built once from ``[security]``
(:mod:`proxy.security_config`): the listeners' server context, the upstream
client context, the admin endpoint's. TLS 1.2 and 1.3 only.

A TLS listener accepts a plain TCP connection, admits it, then puts the loop's
own TLS protocol between the socket and the connection (:func:`start_server_tls`),
so that a failed handshake is seen with its peer and its cause: :func:`failure_reason` names it for the log line and
the ``kproxy_tls_handshake_failures_total{node,side,reason}`` counter; that one
connection is closed, nothing else changes. Bytes of a TLS connection are
encrypted in user space, so its responses never take the splice path
(:mod:`proxy.splice`); plaintext pairs keep it.

Rotation (:class:`CertificateReloader`): ``SSLContext.load_cert_chain`` on the
live context replaces the certificate for every handshake that starts after
it; established connections keep their session. The reloader does it on SIGHUP
and when the files' mtimes change (polled); a pair that does not load is logged
and the old one stays in use.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable

import attrs
from prometheus_client import Counter

from proxy.security_config import AdminTls, ListenerTls, UpstreamTls

log = logging.getLogger("kproxy.tls")

# A client that connects and never finishes its handshake holds a socket; Kafka's
# clients finish in milliseconds on loopback, a WAN in well under a second.
HANDSHAKE_TIMEOUT_S = 10.0

# reason -> the OpenSSL reason codes (ssl.SSLError.reason) that mean it, checked in order.
_REASONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("not_tls", ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG",
                 "RECORD_LAYER_FAILURE", "UNEXPECTED_RECORD", "WRONG_SSL_VERSION")),
    ("peer_rejected_certificate", ("TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE",
                                   "SSLV3_ALERT_CERTIFICATE_EXPIRED", "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
                                   "TLSV1_ALERT_DECRYPT_ERROR", "SSLV3_ALERT_CERTIFICATE_REVOKED")),
    ("no_client_certificate", ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "TLSV13_ALERT_CERTIFICATE_REQUIRED")),
    ("protocol_version", ("UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION", "NO_PROTOCOLS_AVAILABLE",
                          "NO_SHARED_CIPHER", "VERSION_TOO_LOW")),
)
REASONS = ("not_tls", "peer_rejected_certificate", "no_client_certificate", "protocol_version",
           "certificate_expired", "certificate_unverified", "timeout", "closed", "other")


def failure_reason(exc: BaseException) -> str:
    """One word for why a handshake failed (a label value: a short, fixed set)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "certificate_expired" if exc.verify_code == 10 else "certificate_unverified"  # X509_V_ERR_CERT_HAS_EXPIRED
    if isinstance(exc, TimeoutError) or (isinstance(exc, ConnectionAbortedError) and "longer" in str(exc)):
        return "timeout"  # asyncio aborts a handshake past ssl_handshake_timeout with the latter
    if isinstance(exc, ssl.SSLError):
        code = exc.reason or ""
        for reason, codes in _REASONS:
            if code in codes:
                return reason
        if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return "closed"
        return "other"
    if isinstance(exc, (ConnectionError, EOFError)):
        return "closed"
    return "other"


def describe(exc: BaseException) -> str:
    """The log text of a handshake failure (OpenSSL's words; never any payload)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{exc.reason}: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    return repr(exc)


class HandshakeFailures:
    """``kproxy_tls_handshake_failures_total{node,side,reason}`` on a node's registry; every
    reason exported at 0 from the start so that a rate() sees the first failure."""

    def __init__(self, registry: object, node_id: str) -> None:
        self.node_id = node_id
        self.counter = Counter("kproxy_tls_handshake_failures", "TLS handshakes that failed, by side and reason",
                               ["node", "side", "reason"], registry=registry)
        for side in ("client", "broker"):
            for reason in REASONS:
                self.counter.labels(node_id, side, reason)

    def failed(self, side: str, exc: BaseException) -> str:
        reason = failure_reason(exc)
        self.counter.labels(self.node_id, side, reason).inc()
        return reason


@attrs.frozen(eq=False)
class TlsEndpoint:
    """What a TLS listener needs: the (live, reloadable) server context and where failures count."""

    context: ssl.SSLContext
    failures: HandshakeFailures


TLS_ESTABLISHED = object()  # proxy.connection.ClientSide.tls once the TLS layer is in place


def _ssl_protocol_class(loop: asyncio.AbstractEventLoop) -> type:
    """The loop's own TLS protocol: uvloop's (Cython) on uvloop, the standard library's otherwise."""
    try:
        import uvloop.loop
    except ImportError:
        pass
    else:
        if isinstance(loop, uvloop.loop.Loop):
            return uvloop.loop.SSLProtocol  # type: ignore[no-any-return]
    from asyncio.sslproto import SSLProtocol

    return SSLProtocol


def start_server_tls(transport: asyncio.BaseTransport, app: asyncio.BaseProtocol,
                     context: ssl.SSLContext) -> asyncio.Future[None]:
    """Run the server side of a TLS handshake on a just-accepted ``transport``; ``app`` gets
    ``connection_made(tls_transport)`` when it succeeds. Returns the handshake's future (its
    exception says why it failed; the connection is closed then).

    Not ``loop.start_tls``: it is a coroutine, and under uvloop bytes read between accept and its
    first step reach the old protocol, not the TLS layer (a client's ClientHello is sent at once).
    Done here, in ``connection_made``, the TLS layer is in place before the loop's first read."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    tls = _ssl_protocol_class(loop)(loop, app, context, waiter, server_side=True, call_connection_made=True,
                                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
    transport.set_protocol(tls)  # type: ignore[attr-defined]
    tls.connection_made(transport)
    return waiter


def _base(purpose: ssl.Purpose) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    return ctx


def listener_context(cfg: ListenerTls) -> ssl.SSLContext:
    """The server context of a node's TLS listeners (mTLS when ``client_ca`` is set)."""
    ctx = _base(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.cert, cfg.key)
    if cfg.client_ca is not None:
        ctx.load_verify_locations(cfg.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.client_required else ssl.CERT_OPTIONAL
    return ctx


def upstream_context(cfg: UpstreamTls) -> ssl.SSLContext:
    """The client context toward TLS brokers: the CA bundle (or the system's), hostname checks on
    unless turned off, an optional client certificate."""
    ctx = _base(ssl.Purpose.SERVER_AUTH)
    if cfg.ca is not None:
        ctx.load_verify_locations(cfg.ca)
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = cfg.check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    if cfg.cert is not None and cfg.key is not None:
        ctx.load_cert_chain(cfg.cert, cfg.key)
    return ctx


def admin_context(cfg: AdminTls) -> ssl.SSLContext:
    ctx = _base(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.cert, cfg.key)
    return ctx


class CertificateReloader:
    """Loads a changed certificate chain and key into a live server context (see the module doc).

    ``check()`` compares the files' (mtime, size) with the last load and reloads when they
    differ; ``reload()`` loads unconditionally (SIGHUP). Both return whether a new pair is in
    use. Pure but for the file reads: the caller owns the timer."""

    def __init__(self, context: ssl.SSLContext, cert: str, key: str, *, what: str = "listeners",
                 stat: Callable[[str], os.stat_result] = os.stat) -> None:
        self.context = context
        self.cert = cert
        self.key = key
        self.what = what
        self._stat = stat
        self._seen = self._stamp()
        self.reloads = 0

    def _stamp(self) -> tuple[tuple[int, int], ...] | None:
        try:
            return tuple((s.st_mtime_ns, s.st_size) for s in (self._stat(self.cert), self._stat(self.key)))
        except OSError:
            return None

    def check(self) -> bool:
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return False
        return self._load(stamp, "file change")

    def reload(self) -> bool:
        return self._load(self._stamp(), "SIGHUP")

    def _load(self, stamp: tuple[tuple[int, int], ...] | None, why: str) -> bool:
        self._seen = stamp  # a broken pair is reported once, not at every poll
        try:
            # A scratch context first: a failed load can leave a context with the new
            # certificate and the old key, and every handshake would fail.
            _base(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
            self.context.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            log.error("certificate reload failed, the previous certificate stays in use",
                      extra={"tls": self.what, "cert": self.cert, "key": self.key, "trigger": why,
                             "reason": describe(exc)})
            return False
        self.reloads += 1
        log.info("certificate reloaded: new handshakes use it", extra={"tls": self.what, "cert": self.cert,
                                                                       "trigger": why})
        return True
