"""Bad input at a TLS fleet: a plaintext client on a TLS port, a client that trusts another CA,
a TLS client on a plaintext port, a failed SASL login. Each is logged and counted, that one
connection is closed, and a good client at the same time is served."""

from __future__ import annotations

import socket
import ssl
import time

import attrs
import pytest

from chaos.clients import batch as clients
from chaos.testbed.security import Protocol, TestbedSecurity

pytestmark = [pytest.mark.integration]

NODE = ("127.0.0.61", 9092)
BOOTSTRAP = "127.0.0.61:9092,127.0.0.62:9092,127.0.0.63:9092"
API_VERSIONS_V0 = b"\x00\x00\x00\x0e\x00\x12\x00\x00\x00\x00\x00\x07\x00\x04kcat"


def failures(fleet, reason: str, side: str = "client") -> float:
    text = fleet.nodes["p1"].get("/metrics").text
    for line in text.splitlines():
        if line.startswith("kproxy_tls_handshake_failures_total{") and f'reason="{reason}"' in line \
                and f'side="{side}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no kproxy_tls_handshake_failures_total sample for {side}/{reason}")


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def closed_without_answer(sock: socket.socket) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_a_plaintext_client_on_a_tls_port_is_closed_and_counted(secure_fleet, topic_name):
    before = failures(secure_fleet, "not_tls")
    with socket.create_connection(NODE) as sock:
        sock.sendall(API_VERSIONS_V0)
        assert closed_without_answer(sock)
    wait_for(lambda: failures(secure_fleet, "not_tls") == before + 1)
    log = (secure_fleet.nodes["p1"].log_path).read_text()
    assert "TLS handshake with a client failed" in log and "WRONG_VERSION_NUMBER" in log
    acks = clients.produce("confluent", BOOTSTRAP, topic_name, 5, prefix=1, security=secure_fleet.client)
    assert len(acks) == 5  # everyone else is served


def test_a_client_trusting_another_ca_fails_and_the_node_says_so(secure_fleet, tmp_path):
    other = TestbedSecurity.create(tmp_path, Protocol.SSL)
    before = failures(secure_fleet, "peer_rejected_certificate")
    with socket.create_connection(NODE) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            other.client.ssl_context().wrap_socket(raw, server_hostname=NODE[0])
    wait_for(lambda: failures(secure_fleet, "peer_rejected_certificate") == before + 1)


def test_a_tls_client_on_a_plaintext_port_is_closed_with_a_hint(proxy):
    with socket.create_connection(("127.0.0.21", 9092)) as raw:
        ctx = ssl.create_default_context()
        with pytest.raises((ssl.SSLError, ConnectionResetError, OSError)):
            ctx.wrap_socket(raw, server_hostname="127.0.0.21")
    wait_for(lambda: "a TLS handshake on a plaintext listener" in proxy.log_path.read_text())
    metrics = proxy.get("/metrics").text
    assert 'kproxy_protocol_errors_total{node="p1",side="client"}' in metrics


def test_a_failed_sasl_login_closes_only_that_client(secure_fleet, secure_kafka, topic_name):
    bad = attrs.evolve(secure_fleet.client, password="wrong")
    with pytest.raises(Exception, match="(?i)authentication|bootstrap"):  # the library's own error
        clients.produce("kafka-python", BOOTSTRAP, topic_name, 1, prefix=1, security=bad, timeout=10)
    acks = clients.produce("kafka-python", BOOTSTRAP, topic_name, 5, prefix=2, security=secure_fleet.client)
    assert len(acks) == 5
    log = "".join(p.read_text() for p in (secure_fleet.state_dir / "logs").iterdir())
    assert "wrong" not in log and secure_kafka.security.password not in log  # no credential is ever logged
