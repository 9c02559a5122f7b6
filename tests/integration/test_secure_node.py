"""One TLS node (127.0.0.64, no fleet) in front of the SASL_SSL broker, with mTLS: every family
with a client certificate, none without; its certificate rotated on SIGHUP while a connection
made before keeps working."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import time

import pytest

from chaos.clients import batch as clients
from chaos.testbed.security import issue
from proxy import sasl
from tests.sockets import recv_exact

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.64"
BOOTSTRAP = f"{HOST}:9092"
API_VERSIONS_V0 = b"\x00\x00\x00\x0e\x00\x12\x00\x00\x00\x00\x00\x07\x00\x04kcat"


@pytest.fixture(scope="module")
def mtls_node(secure_kafka, tmp_path_factory):
    from chaos.testbed.proxies import NodeProcess, fleet_config

    sec = secure_kafka.security
    d = tmp_path_factory.mktemp("mtls-node")
    cert, key = d / "node.crt", d / "node.key"  # copies: the test rotates them
    shutil.copy(sec.proxy.cert, cert)
    shutil.copy(sec.proxy.key, key)
    section = sec.proxy_config(mtls=True)
    section["listeners"].update({"cert": str(cert), "key": str(key), "reload_interval_s": 0.0})
    cfg = fleet_config(d / "node.toml", secure_kafka.bootstrap, 1, first_ip=64, fleet=False,
                       extra={"security": section})
    node = NodeProcess(cfg, "p1", HOST, 9400, d / "p1.log").start()
    try:
        node.wait_ready(60)
        node.cert_files = (cert, key)  # type: ignore[attr-defined]
        yield node
    finally:
        node.stop()


@pytest.mark.parametrize("family", clients.FAMILIES)
def test_every_family_with_a_client_certificate(mtls_node, secure_kafka, topic_name, family):
    client = secure_kafka.security.proxy_client(mtls=True)
    acks = clients.produce(family, BOOTSTRAP, topic_name, 10, prefix=4, security=client)
    assert sorted(a.value for a in acks) == sorted(clients.values(4, 10))


def test_a_client_without_certificate_is_refused(mtls_node, secure_kafka, topic_name):
    context = secure_kafka.security.proxy_client().ssl_context()
    with socket.create_connection((HOST, 9092)) as raw, context.wrap_socket(raw, server_hostname=HOST) as tls:
        tls.settimeout(10)
        try:  # TLS 1.3: the server's refusal follows the client's view of the handshake
            tls.sendall(API_VERSIONS_V0)
            answer = tls.recv(1024)
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            answer = b""
        assert answer == b"", "a client without certificate was answered"
    deadline = time.monotonic() + 10
    while "no_client_certificate" not in _failure_lines(mtls_node) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "no_client_certificate" in _failure_lines(mtls_node)


def _failure_lines(node) -> str:  # type: ignore[no-untyped-def]
    return "\n".join(line for line in node.get("/metrics").text.splitlines()
                     if line.startswith("kproxy_tls_handshake_failures_total{") and not line.endswith(" 0.0"))


def _api_versions(tls: ssl.SSLSocket) -> bytes:
    tls.sendall(API_VERSIONS_V0)
    size = int.from_bytes(recv_exact(tls, 4), "big")
    return recv_exact(tls, size)


def test_sighup_rotates_the_certificate_and_old_connections_continue(mtls_node, secure_kafka, tmp_path):
    sec = secure_kafka.security
    context = sec.proxy_client(mtls=True).ssl_context()
    with socket.create_connection((HOST, 9092)) as raw, context.wrap_socket(raw, server_hostname=HOST) as before:
        before.settimeout(10)
        assert _api_versions(before)[:4] == (7).to_bytes(4, "big")  # correlation id 7
        old_der = before.getpeercert(binary_form=True)
        fresh = issue(sec.ca_object(), tmp_path / "rotated", (HOST, "rotated.kproxy.test"))
        cert, key = mtls_node.cert_files
        shutil.copy(fresh.cert, cert)
        shutil.copy(fresh.key, key)
        os.kill(mtls_node.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            with socket.create_connection((HOST, 9092)) as raw2, context.wrap_socket(raw2, server_hostname=HOST) as new:
                new_der = new.getpeercert(binary_form=True)
            if new_der != old_der or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        first_pem = fresh.cert.read_text().split("-----END CERTIFICATE-----")[0] + "-----END CERTIFICATE-----\n"
        assert new_der == ssl.PEM_cert_to_DER_cert(first_pem) != old_der
        # The connection from before goes on (its next step toward the SASL broker: the handshake).
        before.sendall(sasl.handshake_request("SCRAM-SHA-512", 8))
        size = int.from_bytes(recv_exact(before, 4), "big")
        sasl.read_handshake_response(recv_exact(before, size), "SCRAM-SHA-512")
    assert "certificate reloaded" in mtls_node.log_path.read_text()
