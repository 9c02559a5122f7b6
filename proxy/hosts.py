"""Host strings as a node binds, advertises and prints them: IPv4, IPv6 (bare in config and
Metadata, bracketed in ``host:port``), DNS names and wildcards. Pure; no I/O."""

from __future__ import annotations

import functools
import ipaddress


def join_host_port(host: str, port: int | None) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:9092``), as logs and messages show it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_wildcard(host: str) -> bool:
    """0.0.0.0 or :: — every address of the host: it can be bound, never advertised."""
    ip = _ip(host)
    return ip is not None and ip.is_unspecified


@functools.lru_cache(maxsize=1024)  # a storm reconnects thousands of clients to a handful of brokers
def source_address(bind_host: str, remote_host: str) -> tuple[str, int] | None:
    """The local address an outgoing connection from a node bound to ``bind_host`` leaves from.

    The node's own address when it binds one specific IP of the remote's family (on one test
    machine each node is then a separate host to the brokers and to the partition drill's
    filters); None (the kernel picks) for a wildcard or name bind, or across families (a node
    listening on IPv6 in front of IPv4 brokers). Called per connection, not per chunk."""
    local = _ip(bind_host)
    if local is None or local.is_unspecified:
        return None
    remote = _ip(remote_host)
    if remote is not None and remote.version != local.version:
        return None
    if remote is None and local.version == 6:  # a broker name: Kafka's listeners are IPv4 far more often
        return None
    return (bind_host, 0)
