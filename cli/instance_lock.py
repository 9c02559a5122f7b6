"""One `kproxy run` per node address on a host: an abstract unix socket held for the process's life.

The lock is taken before the node binds anything, so a second start of the same node is refused
at once instead of sharing the node's ``SO_REUSEPORT`` data ports (and taking clients from it)
before failing on another port. The socket lives in the abstract namespace: the kernel releases
it when the process dies, however it dies (no stale lock file after SIGKILL), and like the node's
address it belongs to one network namespace. The holder answers each connection with one JSON
line describing itself, so the refusal names the running instance.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
from typing import Any

ANSWER_TIMEOUT_S = 1.0


class InstanceRunning(Exception):
    """Another process holds the node's lock; the message names it."""


def lock_name(host: str, port: int) -> str:
    return f"\0kproxy-node-{host}:{port}"


class InstanceLock:
    """The held lock; ``release()`` (or the process's exit) lets the next instance start."""

    def __init__(self, sock: socket.socket, answering: threading.Thread) -> None:
        self._sock = sock
        self._answering = answering

    def release(self, timeout_s: float = 5.0) -> None:
        try:  # wakes the answering thread's accept(); close alone would leave it holding the socket
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        # The name is free only once that thread is out of accept(): wait for it, or a take()
        # right after this could still find the lock held.
        self._answering.join(timeout_s)
        self._sock.close()


def take(host: str, port: int, about: dict[str, Any]) -> InstanceLock:
    """Hold the lock of the node serving ``host:port`` (its bootstrap address) until released or
    the process exits; ``about`` is what a refused second instance is told."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(lock_name(host, port))
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        raise InstanceRunning(_refusal(host, port, holder(host, port))) from None
    sock.listen(8)
    line = (json.dumps(about) + "\n").encode()
    answering = threading.Thread(target=_answer, args=(sock, line), name="kproxy-instance-lock", daemon=True)
    answering.start()
    return InstanceLock(sock, answering)


def holder(host: str, port: int) -> dict[str, Any] | None:
    """What the instance holding the lock says about itself (None: it does not answer, e.g. stopped)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(ANSWER_TIMEOUT_S)
            s.connect(lock_name(host, port))
            data = s.makefile("rb").readline(65536)
        about = json.loads(data)
        return about if isinstance(about, dict) else None
    except (OSError, ValueError):
        return None


def _answer(sock: socket.socket, line: bytes) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:  # closed: the lock is released
            return
        with conn:
            try:
                conn.sendall(line)
            except OSError:
                pass


def _refusal(host: str, port: int, about: dict[str, Any] | None) -> str:
    if about is None:
        return (f"another kproxy process already holds node address {host}:{port} on this host and does not "
                f"answer (stopped with SIGSTOP?); stop it first")
    return (f"node {about.get('node')} is already running for {host}:{port} on this host "
            f"(pid {about.get('pid')}, config {about.get('config')}, since {about.get('since')}); "
            f"stop it first (kill -TERM {about.get('pid')})")
