"""Outgoing TCP connections from a chosen source address, without the kernel's port search at bind;
listening sockets on the highest descriptors, so that a killed node stops accepting first.

A node connects to its brokers from its own address (proxy.hosts.source_address):
``bind((host, 0))`` then ``connect``. A plain ``bind`` to port 0 makes the kernel pick a
free local port right away, for any destination, searching the port range and checking
each candidate against the sockets bound to that port. With tens of thousands of
sockets open on the host (a connection storm: the clients, the node's upstream sockets,
the brokers' side, the last storm's TIME_WAIT) that search was a third of a node
worker's CPU at 10,000 clients and nothing at 4,000 (``perf``: ``inet_csk_get_port``,
``inet_bhash2_conflict`` ...; BENCHMARKS.md). ``IP_BIND_ADDRESS_NO_PORT``
(Linux 4.2+) defers the port to ``connect``, which only needs the 4-tuple to be unique
(and may reuse a local port toward another destination). Where the option is missing
the bind is a plain one.

When a process dies without running any code of its own (SIGKILL, a crash, the OOM killer),
the kernel closes its descriptors in order and defers each socket's release (``fput``'s
task work), then runs those releases last-queued first: the highest descriptor is released
first. A listener made at start-up has one of the lowest, so it went on completing
handshakes until the kernel had closed every connection of the node, and each client that
dialled the address meanwhile was accepted, then reset (4,000 connections held: the
listener accepted ~1,900 connects over 85 ms on an idle host; ~0.4 s in a failover storm on
this 2-core machine, BENCHMARKS.md session 34). :func:`listening_socket` moves a listener's
descriptor above the ones connections take (:func:`high_descriptor_floor`): killed, the
node refuses new connections within a few milliseconds, and they go to the survivors.
"""

from __future__ import annotations

import asyncio
import fcntl
import resource
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

__all__ = ("IP_BIND_ADDRESS_NO_PORT", "MAX_SYN_RESENDS", "SYN_RESEND_S", "bound_socket", "connect_resending",
           "create_connection_from", "first_connection", "high_descriptor_floor", "listening_socket",
           "open_connection_from", "reset_on_close")

# Python defines the constant from 3.12 on; its value in Linux's <linux/in.h>.
IP_BIND_ADDRESS_NO_PORT: int | None = getattr(socket, "IP_BIND_ADDRESS_NO_PORT",
                                              24 if sys.platform.startswith("linux") else None)
# connect_resending: an upstream SYN unanswered this long is sent again on a fresh socket, at
# most this many times per connect (the caller's timeout bounds the whole).
SYN_RESEND_S = 0.25
MAX_SYN_RESENDS = 8
# Listening sockets take descriptors from this far below the descriptor limit up (capped at
# HIGH_DESCRIPTORS_CEILING: the kernel's table grows to the highest descriptor, 8 bytes each).
HIGH_DESCRIPTORS = 1024
HIGH_DESCRIPTORS_CEILING = 1 << 16
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST and drops what is queued
P = TypeVar("P", bound=asyncio.BaseProtocol)
T = TypeVar("T")
A = TypeVar("A")


def reset_on_close(sock: Any) -> None:
    """Make ``sock`` (a socket, or a transport's socket-like) send an RST when it closes (SO_LINGER
    0), however much is queued to send; a socket closed meanwhile is left alone."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass


def bound_socket(local: tuple[str, int]) -> socket.socket:
    """A non-blocking TCP socket bound to ``local`` (host, port); with port 0 the port is
    chosen at connect (``IP_BIND_ADDRESS_NO_PORT``, see the module doc)."""
    family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        if local[1] == 0 and IP_BIND_ADDRESS_NO_PORT is not None:
            try:
                sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            except OSError:  # not this kernel or family: a plain bind
                pass
        sock.bind(local)
    except BaseException:
        sock.close()
        raise
    return sock


def high_descriptor_floor(nofile: int | None = None) -> int | None:
    """The lowest descriptor a listening socket is moved to: ``HIGH_DESCRIPTORS`` below the
    soft descriptor limit (``nofile``: that limit, default this process's), at most
    ``HIGH_DESCRIPTORS_CEILING``; None where the limit leaves no room above the connections."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile == resource.RLIM_INFINITY or nofile < 0:
        nofile = HIGH_DESCRIPTORS_CEILING
    floor = min(nofile, HIGH_DESCRIPTORS_CEILING) - HIGH_DESCRIPTORS
    return floor if floor >= HIGH_DESCRIPTORS else None


def _moved_high(sock: socket.socket) -> socket.socket:
    """``sock`` on the lowest free descriptor at or above :func:`high_descriptor_floor` (the
    original descriptor closed); ``sock`` itself where there is none."""
    floor = high_descriptor_floor()
    if floor is None or sock.fileno() >= floor:
        return sock
    try:
        fd = fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, floor)
    except OSError:  # every descriptor up there taken: it stays where it is
        return sock
    moved = socket.socket(sock.family, sock.type, sock.proto, fileno=fd)
    moved.setblocking(sock.getblocking())
    sock.close()
    return moved


def listening_socket(address: tuple[Any, ...], family: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``address`` (a ``getaddrinfo`` sockaddr of ``family``), not yet
    listening, on a high descriptor (see the module doc); the options ``loop.create_server``
    sets: SO_REUSEADDR, SO_REUSEPORT if asked, IPV6_V6ONLY. A failed bind raises OSError with
    the errno and the address, as ``create_server`` does."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise OSError(exc.errno, f"error while attempting to bind on address {address!r}: "
                                     f"{(exc.strerror or str(exc)).lower()}") from None
        sock.setblocking(False)
        return _moved_high(sock)
    except BaseException:
        sock.close()
        raise


async def connect_resending(local: tuple[str, int], address: tuple[str, int], *, resend_s: float | None,
                            on_resend: Callable[[], None] = lambda: None) -> socket.socket:
    """A socket bound to ``local`` and connected to ``address``. Without an answer within
    ``resend_s`` the attempt is dropped and made again on a fresh socket, a fresh SYN at once,
    up to ``MAX_SYN_RESENDS`` times (then the last attempt waits as long as the caller lets
    it); ``on_resend()`` hears of each. None: one attempt, the kernel's own retransmissions.

    A broker whose accept queue is full drops the SYN (Kafka's is 50 deep by default), and the
    kernel sends it again only after TCP's initial retransmission timeout, 1 s, then 3 s: a
    reconnect storm's unlucky connects each lost a second, a real client's among them
    (BENCHMARKS.md, session 32: an aiokafka consumer's coordinator connection answered 1.005 s
    after it was made). The brokers behind a node are near it: a SYN-ACK takes well under a
    millisecond to a few, so an unanswered SYN after ``resend_s`` was dropped. The dropped
    attempt's socket is closed: should its SYN-ACK still come, the kernel answers it with an RST."""
    loop = asyncio.get_running_loop()
    for attempt in range(MAX_SYN_RESENDS + 1):
        sock = bound_socket(local)
        try:
            if resend_s is None or attempt == MAX_SYN_RESENDS:
                await loop.sock_connect(sock, address)
                return sock
            try:
                async with asyncio.timeout(resend_s):
                    await loop.sock_connect(sock, address)
                return sock
            except TimeoutError:
                sock.close()
                on_resend()
        except BaseException:
            sock.close()
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")


async def create_connection_from(factory: Callable[[], P], host: str, port: int, local: tuple[str, int] | None,
                                 *, resend_s: float | None = None, on_resend: Callable[[], None] = lambda: None,
                                 **kwargs: Any) -> tuple[asyncio.Transport, P]:
    """``loop.create_connection(factory, host, port, local_addr=local, **kwargs)``, with the
    source port chosen at connect (see the module doc), and a SYN left unanswered
    ``resend_s`` sent again on a fresh socket (:func:`connect_resending`). ``kwargs``: ``ssl``,
    ``server_hostname``, ``ssl_handshake_timeout``."""
    loop = asyncio.get_running_loop()
    if local is None:
        return await loop.create_connection(factory, host, port, **kwargs)  # type: ignore[return-value]
    sock = await connect_resending(local, (host, port), resend_s=resend_s, on_resend=on_resend)
    try:
        return await loop.create_connection(factory, sock=sock, **kwargs)  # type: ignore[return-value]
    except BaseException:
        sock.close()
        raise


async def open_connection_from(host: str, port: int,
                               local: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_connection(host, port, local_addr=local)``, the source port chosen at connect."""
    sock = bound_socket(local)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        return await asyncio.open_connection(sock=sock)
    except BaseException:
        sock.close()
        raise



async def first_connection(connect: Callable[[A], Awaitable[T]], addresses: Sequence[A], *, timeout_s: float,
                           timeout_retries: int, stop: Callable[[], bool],
                           failed: Callable[[A, BaseException], None],
                           wait_turn: Callable[[A], Awaitable[None]] | None = None) -> tuple[T, A] | None:
    """The first of ``addresses`` that ``connect`` reaches within ``timeout_s``, in order; None
    when none did, or ``stop()`` turned true between attempts. ``failed(address, error)``
    hears of every failed attempt.

    A broker whose accept queue is full drops the SYN (Kafka's is 50 deep by default: a
    storm of reconnecting clients fills it): the kernel sends it again 1 s, then 3 s later,
    and a 5 s timeout gives up before the fourth. A client connected to the broker
    itself would have waited on; so when the last address left timed out, it is tried
    again, up to ``timeout_retries`` more times, at once (a fresh SYN instead of the
    kernel's next one, 4 s later). A refused or failed connect is not retried: the next
    address, or None.

    ``wait_turn(address)``, if given, is awaited before each attempt, outside its timeout
    (proxy.connect_pacing: a bounded number of connects in flight per broker)."""
    if not addresses:
        return None
    last = len(addresses) - 1
    for index, address in enumerate(addresses):
        for attempt in range(1 + (timeout_retries if index == last else 0)):
            if stop():
                return None
            if wait_turn is not None:
                await wait_turn(address)
                if stop():
                    return None
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for: no second task per connect
                    return await connect(address), address
            except TimeoutError as exc:  # the deadline, or the kernel's ETIMEDOUT
                failed(address, exc)
                continue
            except OSError as exc:
                failed(address, exc)
                break
    return None
