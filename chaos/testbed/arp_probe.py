"""Who answers ARP for an address: the test bed's check that exactly one host holds a floating
address (what ``arping -D`` shows; iputils' arping is not installed everywhere).

``probe_frame`` is pure: an ARP request for ``ip`` with sender address 0.0.0.0 (RFC 5227's
probe: no neighbour learns anything from it). ``answering_macs`` sends it out of an interface
(AF_PACKET, CAP_NET_RAW) and collects the MACs of every reply for ``timeout_s``. Run it on the
clients' host: ``python -m chaos.testbed.arp_probe eth0 198.18.0.11`` prints the MACs as JSON.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import sys
import time
from pathlib import Path

ETH_P_ARP = 0x0806
ETH_P_IP = 0x0800
ARP_REQUEST, ARP_REPLY = 1, 2
BROADCAST = b"\xff" * 6
MIN_FRAME = 60


def probe_frame(mac: bytes, ip: ipaddress.IPv4Address) -> bytes:
    arp = struct.pack("!HHBBH", 1, ETH_P_IP, 6, 4, ARP_REQUEST) + mac + b"\0" * 4 + b"\0" * 6 + ip.packed
    frame = BROADCAST + mac + struct.pack("!H", ETH_P_ARP) + arp
    return frame + b"\0" * (MIN_FRAME - len(frame))


def reply_sender(frame: bytes, ip: ipaddress.IPv4Address) -> str | None:
    """The sender MAC of ``frame`` if it is an ARP reply from ``ip``, else None."""
    if len(frame) < 42 or struct.unpack("!H", frame[12:14])[0] != ETH_P_ARP:
        return None
    op = struct.unpack("!H", frame[20:22])[0]
    if op != ARP_REPLY or frame[28:32] != ip.packed:
        return None
    return frame[22:28].hex(":")


def answering_macs(interface: str, ip: str, timeout_s: float = 0.5, count: int = 2) -> set[str]:
    target = ipaddress.IPv4Address(ip)
    mac = bytes(int(p, 16) for p in Path(f"/sys/class/net/{interface}/address").read_text().strip().split(":"))
    found: set[str] = set()
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ARP)) as s:
        s.bind((interface, 0))
        s.settimeout(0.05)
        deadline = time.monotonic() + timeout_s
        for _ in range(count):
            s.send(probe_frame(mac, target))
        while time.monotonic() < deadline:
            try:
                frame = s.recv(2048)
            except TimeoutError:
                continue
            sender = reply_sender(frame, target)
            if sender is not None:
                found.add(sender)
    return found


if __name__ == "__main__":
    print(json.dumps(sorted(answering_macs(sys.argv[1], sys.argv[2]))))
