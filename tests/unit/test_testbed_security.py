"""The test bed's CA and certificates (chaos.testbed.security): a TLS handshake in memory."""

from __future__ import annotations

import datetime
import ssl

import pytest

from chaos.testbed.security import Protocol, TestbedSecurity, client_settings, issue

pytestmark = [pytest.mark.unit]


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str) -> None:
    """Run a TLS handshake between two contexts over memory BIOs; raise ssl.SSLError on failure."""
    bios = [ssl.MemoryBIO() for _ in range(4)]
    s = server.wrap_bio(bios[0], bios[1], server_side=True)
    c = client.wrap_bio(bios[2], bios[3], server_hostname=server_hostname)
    done = [False, False]
    for _ in range(10):
        for i, side in enumerate((c, s)):
            if done[i]:
                continue
            try:
                side.do_handshake()
                done[i] = True
            except ssl.SSLWantReadError:
                pass
        bios[0].write(bios[3].read())  # client -> server
        bios[2].write(bios[1].read())  # server -> client
        if all(done):
            return
    raise AssertionError("handshake did not finish")


def server_context(cert, key) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx


def test_proxy_certificate_names_every_node_address(tmp_path):
    sec = TestbedSecurity.create(tmp_path, Protocol.SASL_SSL)
    client = sec.client.ssl_context()
    for host in ("127.0.0.11", "127.0.0.13", "localhost"):
        handshake(server_context(sec.proxy.cert, sec.proxy.key), client, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server_context(sec.proxy.cert, sec.proxy.key), client, "127.0.0.200")


def test_a_certificate_from_another_ca_is_refused(tmp_path):
    mine = TestbedSecurity.create(tmp_path / "a", Protocol.SSL)
    other = TestbedSecurity.create(tmp_path / "b", Protocol.SSL)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server_context(other.proxy.cert, other.proxy.key), mine.client.ssl_context(), "127.0.0.11")


def test_an_expired_certificate_is_refused(tmp_path):
    sec = TestbedSecurity.create(tmp_path, Protocol.SSL)
    past = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    old = issue(sec.ca_object(), tmp_path / "old", ("127.0.0.11",), not_before=past,
                not_after=past + datetime.timedelta(days=1))
    with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
        handshake(server_context(old.cert, old.key), sec.client.ssl_context(), "127.0.0.11")


def test_state_is_kept_and_secrets_are_private(tmp_path):
    sec = TestbedSecurity.create(tmp_path, Protocol.SASL_SSL)
    again = TestbedSecurity.create(tmp_path, Protocol.SASL_SSL)
    assert again.password == sec.password and again.ca.read_bytes() == sec.ca.read_bytes()
    for path in (sec.proxy.key, sec.broker.bundle, tmp_path / "ca.key", tmp_path / "security.json"):
        assert path.stat().st_mode & 0o077 == 0, path
    assert b"BEGIN PRIVATE KEY" in sec.broker.key.read_bytes()  # PKCS#8: what Java's PEM keystore reads


def test_broker_props_and_client_settings(tmp_path):
    sec = TestbedSecurity.create(tmp_path, Protocol.SASL_SSL)
    props = sec.broker_props("SASL_SSL", reauth_ms=5000)
    assert props["ssl.keystore.type"] == "PEM" and props["connections.max.reauth.ms"] == 5000
    assert props["sasl.enabled.mechanisms"] == "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512,OAUTHBEARER"
    assert f'password="{sec.password}"' in props["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
    assert sec.format_args()[1] == f"SCRAM-SHA-256=[name=kproxy,password={sec.password}]"
    conf = client_settings(sec.client, "confluent")
    assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.mechanisms"] == "SCRAM-SHA-512"
    assert conf["ssl.ca.location"] == str(sec.ca)
    java = client_settings(sec.client.with_cert(sec.client_cert), "java")
    assert java["ssl.keystore.location"] == str(sec.client_cert.bundle)
    assert client_settings(None, "java") == {}
    assert sec.client.describe().get("password") is None  # printed settings never carry the password


def test_client_security_file_round_trips_and_is_private(tmp_path):
    """A drill's workload process reads its TLS/SASL settings from this file (0600, password inside)."""
    import stat

    from chaos.clients.workload import command, parser
    from chaos.testbed.security import CertFiles, ClientSecurity

    cert = CertFiles(tmp_path / "c.crt", tmp_path / "c.key", tmp_path / "c.pem")
    sent = ClientSecurity(Protocol.SASL_SSL, ca=tmp_path / "ca.pem", mechanism="SCRAM-SHA-256", password="s3cret",
                          client_cert=cert, check_hostname=False)
    path = sent.save(tmp_path / "client-security.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ClientSecurity.load(path) == sent
    assert ClientSecurity.load(path).password == "s3cret"
    cmd = command("producer", "java", bootstrap="h:1", topic="t", trace_dir=tmp_path, client_id="c", run_id="r",
                  rate=5, prefix=1, security_file=path)
    assert "s3cret" not in " ".join(cmd)
    assert parser().parse_args(cmd[3:]).security_file == str(path)
    plain = command("producer", "java", bootstrap="h:1", topic="t", trace_dir=tmp_path, client_id="c", run_id="r",
                    rate=5, prefix=1)
    assert parser().parse_args(plain[3:]).security_file is None
