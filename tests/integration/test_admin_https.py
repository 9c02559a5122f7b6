"""The admin endpoint over HTTPS ([security.admin]): a client that trusts the CA gets its answer,
one that does not is refused, and a plain-HTTP client gets nothing."""

from __future__ import annotations

import socket

import httpx
import pytest

from chaos.testbed.security import Protocol, TestbedSecurity
from proxy.admin import AdminServer
from proxy.security_config import AdminTls
from proxy.tls import admin_context

pytestmark = [pytest.mark.integration]  # loopback sockets, no Kafka


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.11", 0))
        return s.getsockname()[1]


def test_admin_over_https(tmp_path):
    bed = TestbedSecurity.create(tmp_path / "a", Protocol.SSL)
    other = TestbedSecurity.create(tmp_path / "b", Protocol.SSL)
    port = free_port()
    server = AdminServer("127.0.0.11", port, token="t", status=lambda: {"node": "p1"}, metrics=lambda: b"",
                         ready=lambda: True, actions={},
                         ssl_context=admin_context(AdminTls(cert=str(bed.proxy.cert), key=str(bed.proxy.key))))
    server.start()
    try:
        url = f"https://127.0.0.11:{port}"
        assert httpx.get(url + "/status", verify=bed.client.ssl_context(), timeout=5).json() == {"node": "p1"}
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/status", verify=other.client.ssl_context(), timeout=5)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.11:{port}/status", timeout=5)
        # the server is still there for the next good client
        assert httpx.get(url + "/healthz", verify=bed.client.ssl_context(), timeout=5).status_code == 200
    finally:
        server.stop()
