"""Tickle ACKs: how the host that took a floating address resets the clients of the node that
held it (CTDB's trick after an IP takeover).

Moving the address resets only the clients that send something (the new host's kernel has no
such connection: RST). A client waiting silently for a response (a consumer's long fetch) would
wait until its request timeout. So the new host sends each of those clients a bare ACK from the
floating address, with sequence numbers the client does not expect: the client answers with a
challenge ACK (RFC 5961 §4), which reaches the new host (the address is here now), whose kernel
has no such connection and answers with RST: the client sees its connection reset at once.

``tickle_segment`` builds the TCP segment (pure, tested without root); ``send_segments`` sends
segments from a raw IPv4 socket bound to the floating address (the kernel adds the IP header;
needs CAP_NET_RAW). The peers' client lists come from ``proxy.addresses.peers``.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket
import struct
from collections.abc import Iterable

import attrs

log = logging.getLogger("kproxy.addresses")

TCP_HEADER = struct.Struct("!HHIIBBHHH")  # ports, seq, ack, data offset, flags, window, checksum, urgent
TCP_ACK = 0x10
IPPROTO_TCP = 6
WINDOW = 1024


@attrs.frozen(slots=True)
class ClientPair:
    """One client connection of a node: the node's port it reached, the client's address, and
    the node's address it reached when that is not the node's own (a stand-in on a vacant
    node's floating address: whoever takes that address next must tickle it too)."""

    local_port: int
    client_ip: str
    client_port: int
    local_ip: str | None = None
    # The connection carried group-coordinator requests: tickled a moment after the others
    # (proxy.addresses.floating.TICKLE_GROUP_DELAY_S). On the wire as the list's "group" key (the
    # indices of such pairs), which a node from before it ignores.
    group: bool = attrs.field(default=False, eq=False)

    def to_json(self) -> list[object]:
        if self.local_ip is None:
            return [self.local_port, self.client_ip, self.client_port]
        return [self.local_port, self.client_ip, self.client_port, self.local_ip]

    @classmethod
    def from_json(cls, value: object) -> "ClientPair":
        if not isinstance(value, list) or len(value) not in (3, 4):
            raise ValueError(f"a client pair is [local_port, client_ip, client_port(, local_ip)], got {value!r}")
        local, ip, port = value[:3]
        ipaddress.IPv4Address(ip)
        if not all(isinstance(p, int) and 0 < p < 65536 for p in (local, port)):
            raise ValueError(f"ports out of range in {value!r}")
        local_ip = None
        if len(value) == 4:
            local_ip = str(ipaddress.IPv4Address(value[3]))
        return cls(local, ip, port, local_ip)


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071): ones' complement of the ones' complement sum of 16-bit words."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def pseudo_header(src: ipaddress.IPv4Address, dst: ipaddress.IPv4Address, length: int) -> bytes:
    return src.packed + dst.packed + struct.pack("!BBH", 0, IPPROTO_TCP, length)


def tickle_segment(src: str, src_port: int, dst: str, dst_port: int, seq: int, ack: int) -> bytes:
    """A bare TCP ACK (20 bytes, no options, no data) from ``src:src_port`` to ``dst:dst_port``
    with the checksum over the IPv4 pseudo-header."""
    s, d = ipaddress.IPv4Address(src), ipaddress.IPv4Address(dst)
    header = TCP_HEADER.pack(src_port, dst_port, seq & 0xFFFFFFFF, ack & 0xFFFFFFFF, 5 << 4, TCP_ACK, WINDOW, 0, 0)
    csum = checksum(pseudo_header(s, d, len(header)) + header)
    return header[:16] + struct.pack("!H", csum) + header[18:]


def tickle_segments(floating_ip: str, pairs: Iterable[ClientPair],
                    rng: random.Random | None = None) -> list[tuple[bytes, str]]:
    """The tickle ACK of each client of ``pairs`` from ``floating_ip``, with its destination,
    ordered by client address and port: the connections of one client host go out back to back
    (see :func:`send_segments`)."""
    rng = rng or random.Random()
    return [(tickle_segment(floating_ip, p.local_port, p.client_ip, p.client_port,
                            rng.getrandbits(32), rng.getrandbits(32)), p.client_ip)
            for p in sorted(set(pairs), key=lambda p: (ipaddress.IPv4Address(p.client_ip), p.client_port,
                                                       p.local_port))]


def send_segments(floating_ip: str, segments: Iterable[tuple[bytes, str]]) -> int:
    """Send ``segments`` (:func:`tickle_segments`) from ``floating_ip`` (held by this host);
    returns how many were sent.

    Called from the event loop's thread, not an executor: a client is reset the moment its
    tickle goes out, and the sends must follow each other within microseconds. A client whose
    connections are reset milliseconds apart may send a request into one not reset yet and
    lose it (seen: librdkafka's coordinator lookup went out on a connection reset 11 ms after
    the coordinator's, and its next lookup came 1 s later); an executor thread sending them
    waited for the busy loop thread's GIL after every send. A raw socket's send does not
    block (the kernel drops what its queue cannot take)."""
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP) as s:
        s.setblocking(False)
        s.bind((floating_ip, 0))
        for segment, client_ip in segments:
            try:
                s.sendto(segment, (client_ip, 0))
                sent += 1
            except OSError as exc:  # one unreachable client must not stop the others
                log.debug("tickle ACK not sent", extra={"client": client_ip, "reason": str(exc)})
    return sent

