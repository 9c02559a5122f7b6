"""A Kafka-unaware TCP relay: the cheapest hop a user-space proxy can be, for a baseline.

``kproxy bench proxy`` runs its fetch phases through three arms: direct, the
kproxy node, and this relay. The relay parses nothing and rewrites nothing:
each accepted connection gets a connection to its target and two threads,
each moving bytes one way with blocking ``splice(2)`` through a 1 MiB pipe
(socket -> pipe -> socket, the bytes never enter the process). Its fetch
throughput and CPU per GB are what any proxy with a TCP hop can hope for on
the same machine; what kproxy loses beyond it is kproxy's own cost.

Kafka clients only stay on the relay if the brokers advertise it: the local
launcher gives each broker a second listener, RELAY, advertised at the
relay's address (``KafkaCluster(relay_host=...)``).

Run as a process (so its CPU is measured apart) and stopped by PID::

    python -m chaos.bench.relay --max-seconds 3600 127.0.0.33:19292=127.0.0.1:19292 ...

Only loopback addresses are accepted, on both sides.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import os
import socket
import sys
import threading
import time

from proxy.splice import F_SETPIPE_SZ, PIPE_BYTES  # the same 1 MiB pipes as kproxy's own splice

__all__ = ("Relay", "parse_route")


def _loopback(host: str) -> str:
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"{host}: the relay only listens on and connects to loopback addresses")
    return host


def parse_route(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """``LISTEN_HOST:PORT=TARGET_HOST:PORT`` -> ((host, port), (host, port)), both loopback."""
    try:
        listen, target = text.split("=", 1)
        lh, lp = listen.rsplit(":", 1)
        th, tp = target.rsplit(":", 1)
        return (_loopback(lh), int(lp)), (_loopback(th), int(tp))
    except ValueError as exc:
        raise ValueError(f"bad route {text!r} (want LISTEN_HOST:PORT=TARGET_HOST:PORT): {exc}") from None


def _pump(src: socket.socket, dst: socket.socket, moved: list[int]) -> None:
    """Move bytes src -> dst until EOF or an error on either; then shut both down."""
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default pipe size works too
        s, d = src.fileno(), dst.fileno()
        while True:
            n = os.splice(s, w, PIPE_BYTES, flags=os.SPLICE_F_MOVE)
            if n == 0:
                break
            moved[0] += n
            while n:
                n -= os.splice(r, d, n, flags=os.SPLICE_F_MOVE)
    except OSError:
        pass  # a reset or a closed peer ends this direction like EOF
    finally:
        os.close(r)
        os.close(w)
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Relay:
    """Listen on each route's address; relay every connection to the route's target."""

    def __init__(self, routes: list[tuple[tuple[str, int], tuple[str, int]]]) -> None:
        self.routes = routes
        self.moved = [0]  # bytes relayed, both directions (approximate: unsynchronised adds)
        self.connections = 0
        self._listeners: list[socket.socket] = []
        for (host, port), _ in routes:
            ls = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, port))
            ls.listen(128)
            self._listeners.append(ls)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [ls.getsockname()[:2] for ls in self._listeners]

    def start(self) -> "Relay":
        for ls, (_, target) in zip(self._listeners, self.routes):
            threading.Thread(target=self._accept, args=(ls, target), daemon=True, name=f"relay-{target}").start()
        return self

    def close(self) -> None:
        """Stop accepting (connections already relayed go on until either end closes)."""
        for ls in self._listeners:
            try:
                ls.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            ls.close()

    def _accept(self, ls: socket.socket, target: tuple[str, int]) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self.connections += 1
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(client, upstream, self.moved), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client, self.moved), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.bench.relay", description=__doc__.split("\n\n")[0])
    ap.add_argument("routes", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT (loopback only)")
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long at the latest")
    args = ap.parse_args(argv)
    try:
        routes = [parse_route(r) for r in args.routes]
    except ValueError as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 2
    relay = Relay(routes).start()
    print("relay listening on " + " ".join(f"{h}:{p}" for h, p in relay.addresses), flush=True)
    time.sleep(args.max_seconds)  # the bench stops it by PID long before
    return 0


if __name__ == "__main__":
    sys.exit(main())
