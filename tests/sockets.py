"""Reading Kafka frames from a blocking socket (plain or TLS) in tests."""

from __future__ import annotations

import socket


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; ConnectionError if the peer closes first."""
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed by the proxy")
        out += chunk
    return out


def read_frame(sock: socket.socket) -> bytes:
    """One whole frame, its 4-byte length prefix included."""
    head = recv_exact(sock, 4)
    return head + recv_exact(sock, int.from_bytes(head, "big"))
