"""proxy.tls: contexts, why a handshake failed, certificate rotation; proxy.sasl messages."""

from __future__ import annotations

import datetime
import ssl

import pytest
from prometheus_client import CollectorRegistry

from chaos.testbed.security import Protocol, TestbedSecurity, issue
from proxy.security_config import ListenerTls, UpstreamSasl, UpstreamTls
from proxy.tls import CertificateReloader, HandshakeFailures, failure_reason, listener_context, upstream_context
from tests.unit.test_testbed_security import handshake

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    return TestbedSecurity.create(tmp_path_factory.mktemp("sec"), Protocol.SSL)


def failure(server: ssl.SSLContext, client: ssl.SSLContext, host: str = "127.0.0.11") -> tuple[str, str]:
    """The reason each side gives for a failed handshake (server, client)."""
    reasons = []
    bios = [ssl.MemoryBIO() for _ in range(4)]
    s = server.wrap_bio(bios[0], bios[1], server_side=True)
    c = client.wrap_bio(bios[2], bios[3], server_hostname=host)
    out = {"server": "", "client": ""}
    for _ in range(10):
        for name, side in (("client", c), ("server", s)):
            if out[name]:
                continue
            try:
                side.do_handshake()
                out[name] = "ok"
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                out[name] = failure_reason(exc)
        bios[0].write(bios[3].read())
        bios[2].write(bios[1].read())
    reasons = (out["server"], out["client"])
    return reasons


def test_a_client_with_another_ca_is_refused_and_the_server_says_why(bed, tmp_path):
    other = TestbedSecurity.create(tmp_path, Protocol.SSL)
    server = listener_context(ListenerTls(cert=str(bed.proxy.cert), key=str(bed.proxy.key)))
    assert failure(server, other.client.ssl_context()) == ("peer_rejected_certificate", "certificate_unverified")


def test_mtls_refuses_a_client_without_certificate_and_an_expired_one(bed, tmp_path):
    server = listener_context(ListenerTls(cert=str(bed.proxy.cert), key=str(bed.proxy.key), client_ca=str(bed.ca)))
    assert failure(server, bed.client.ssl_context())[0] in ("no_client_certificate", "ok")  # TLS 1.3: after Finished
    assert failure(server, bed.client.with_cert(bed.client_cert).ssl_context()) == ("ok", "ok")
    past = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    old = issue(bed.ca_object(), tmp_path / "old", ("client",), not_before=past,
                not_after=past + datetime.timedelta(days=1))
    tls12 = bed.client.with_cert(old).ssl_context()
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2  # the server's refusal is seen during the handshake
    assert failure(server, tls12)[0] == "certificate_expired"


def test_plaintext_bytes_on_a_tls_listener_are_named(bed):
    server = listener_context(ListenerTls(cert=str(bed.proxy.cert), key=str(bed.proxy.key)))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(b"\x00\x00\x00\x1f\x00\x12\x00\x03" + b"\x00" * 27)  # an ApiVersions request
    with pytest.raises(ssl.SSLError) as err:
        s.do_handshake()
    assert failure_reason(err.value) == "not_tls"
    assert failure_reason(TimeoutError()) == "timeout"
    assert failure_reason(ConnectionResetError()) == "closed"


def test_tls_1_1_is_refused(bed):
    server = listener_context(ListenerTls(cert=str(bed.proxy.cert), key=str(bed.proxy.key)))
    old = bed.client.ssl_context()
    old.minimum_version = old.maximum_version = ssl.TLSVersion.TLSv1_1
    server_reason, _ = failure(server, old)
    assert server_reason in ("protocol_version", "other")
    assert server_reason != "ok"


def test_upstream_context_checks_the_name_by_default(bed):
    server = listener_context(ListenerTls(cert=str(bed.proxy.cert), key=str(bed.proxy.key)))
    strict = upstream_context(UpstreamTls(ca=str(bed.ca)))
    assert failure(server, strict, host="10.9.9.9") == ("peer_rejected_certificate", "certificate_unverified")
    lax = upstream_context(UpstreamTls(ca=str(bed.ca), check_hostname=False))
    assert failure(server, lax, host="10.9.9.9") == ("ok", "ok")


def test_failures_are_counted_by_side_and_reason():
    registry = CollectorRegistry()
    failures = HandshakeFailures(registry, "p1")
    assert registry.get_sample_value("kproxy_tls_handshake_failures_total",
                                     {"node": "p1", "side": "client", "reason": "not_tls"}) == 0
    failures.failed("client", TimeoutError())
    assert registry.get_sample_value("kproxy_tls_handshake_failures_total",
                                     {"node": "p1", "side": "client", "reason": "timeout"}) == 1


def test_a_rotated_certificate_is_used_by_new_handshakes_only_once_it_loads(bed, tmp_path):
    cert, key = tmp_path / "node.crt", tmp_path / "node.key"
    cert.write_bytes(bed.proxy.cert.read_bytes())
    key.write_bytes(bed.proxy.key.read_bytes())
    context = listener_context(ListenerTls(cert=str(cert), key=str(key)))
    reloader = CertificateReloader(context, str(cert), str(key))
    assert not reloader.check()  # nothing changed
    other = TestbedSecurity.create(tmp_path / "other", Protocol.SSL)  # a new CA: old clients refuse it
    handshake(context, bed.client.ssl_context(), "127.0.0.11")
    # A key that does not match the certificate: refused, the old pair stays in use.
    cert.write_bytes(other.proxy.cert.read_bytes())
    assert not reloader.check() and reloader.reloads == 0
    handshake(context, bed.client.ssl_context(), "127.0.0.11")
    key.write_bytes(other.proxy.key.read_bytes() + b"\n")  # size changes: seen even within one mtime tick
    assert reloader.check() and reloader.reloads == 1
    handshake(context, other.client.ssl_context(), "127.0.0.11")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(context, bed.client.ssl_context(), "127.0.0.11")
    assert reloader.reload() and reloader.reloads == 2  # SIGHUP: unconditional


def test_sasl_scram_messages_follow_the_mechanism():
    from scramp import ScramMechanism

    from proxy import sasl

    mechanism = ScramMechanism("SCRAM-SHA-512")
    salt, stored, server_key, iterations = mechanism.make_auth_info("pw", iteration_count=4096)
    server = mechanism.make_server(lambda user: (salt, stored, server_key, iterations))
    messages = sasl.client_messages(UpstreamSasl("SCRAM-SHA-512", "kproxy", "pw"))
    server.set_client_first(next(messages).decode())
    client_final = messages.send(server.get_server_first().encode())
    server.set_client_final(client_final.decode())  # raises if the proof is wrong
    with pytest.raises(StopIteration):
        messages.send(server.get_server_final().encode())
    plain = sasl.client_messages(UpstreamSasl("PLAIN", "u", "p"))
    assert next(plain) == b"\0u\0p"
