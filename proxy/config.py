"""Node and fleet configuration: one TOML file describes the whole fleet.

``kproxy run --config F --node N`` picks node N out of ``[[nodes]]``. A single
node needs only ``[upstream]`` and one ``[[nodes]]`` entry; the ``[fleet]``
section (Raft) is optional. Every error names the offending field; a key this
reference does not list is an error suggesting the closest known name, and a
secret written in the file (``admin.token``, ``fleet.password``) is refused:
secrets come from the environment variables the ``*_env`` keys name. The
operator's reference of every field is README.md's "Field reference" (a unit
test keeps it complete)::

    [upstream]
    bootstrap = ["127.0.0.1:19092"]     # required, host:port list
    refresh_interval_s = 10.0
    release_after_s = 300.0              # a broker gone from Metadata this long is released

    [ports]                              # how broker identities map to ports
    base = 9100                          # broker B is served on base + B, or:
    # map = { "1" = 9101, "2" = 9102 }   # an explicit map (wins over base)

    [[nodes]]
    id = "p1"
    host = "127.0.0.11"                  # bind address (advertised too unless advertised_host)
    advertised_host = "proxy-1.example"  # optional: what clients and peers are told (a name or an IP)
    bootstrap_port = 9092
    port_base = 9100                     # optional: this node's broker ports (wins over [ports].base)
    admin_port = 9400                    # optional: admin HTTP endpoint
    raft_port = 9500                     # required with [fleet]
    rack = "rack-1"                      # optional
    workers = "auto"                     # data-path processes: an integer >= 1, or "auto" (one per core)
    # floating_host = "10.0.1.111"       # with [addresses]: the advertised address, which floats

    [limits]
    max_frame_bytes = 104857600          # Kafka's socket.request.max.bytes
    high_water_bytes = 1048576           # pause the other side above this
    connect_timeout_s = 5.0
    fetch_max_version = 15               # >= 16 rewrites KIP-951 node_endpoints (buffers Fetch)
    splice_min_bytes = 65536             # splice(2) pass-through response bodies this large; 0: never
    listen_backlog = 4096                # accept queue of every listener (capped by net.core.somaxconn)
    max_connections = 50000              # client connections per node; more are refused
    accepts_per_source_per_s = 1000      # new connections per second per source address; 0: no limit
    drain_timeout_s = 5.0                # SIGTERM: longest wait for clients to leave before exiting
    bootstrap_pool = 8                   # idle broker connections kept per broker for the next client (proxy.upstream_pool); 0: none
    share_upstream = false               # a client connection that only asks borrows a broker connection per request
    api_versions_answer_s = 5.0          # ApiVersions answered by the node from the broker's last answer this long, broker connection at the first other request; 0: never
    coalesce_metadata = true             # identical Metadata requests asked at once get one broker round trip
    fair_accept = true                   # new connections opened a host at a time, hosts with the fewest waiting first

    [logging]
    level = "INFO"
    format = "json"                      # or "text"

    [admin]
    token_env = "KPROXY_ADMIN_TOKEN"     # bearer token for POST actions

    [fleet]
    password_env = "KPROXY_RAFT_PASSWORD"
    address_takeover = true              # survivors also serve a down node's address (floating IP)
    member_priority = 10                 # Raft and heartbeats run SCHED_RR at this priority where allowed; 0: never

    [debug]
    tap_dir = "/tmp/tap"                 # tests only: copy every byte sent to clients here

    [security]                           # TLS and SASL: see proxy.security_config

    [addresses]                          # floating addresses: see proxy.addresses (default: none)
    mover = "linux"                      # none | netns | linux | command
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import attrs

from membership.config import unknown_key_message
from proxy.addresses.config import KEYS as MOVER_KEYS
from proxy.addresses.config import NONE as MOVER_NONE
from proxy.addresses.config import MoverConfig, MoverConfigError, parse_mover_config
from proxy.config_fields import MAX_PORT, ConfigError, HostPort, parse_host_port
from proxy.config_fields import check_keys as _check_keys
from proxy.config_fields import get_field as _get
from proxy.config_fields import host_name as _host
from proxy.config_fields import port_number as _port
from proxy.config_fields import positive as _positive
from proxy.config_fields import secret as _secret
from proxy.hosts import is_wildcard, join_host_port
from topology import PortScheme
from topology import ProxyNode as TopologyNode

if TYPE_CHECKING:
    from proxy.security_config import SecurityConfig

# Kafka's own default for socket.request.max.bytes: the largest request a broker
# accepts. A response can be as large as fetch.max.bytes (50 MiB default), so the
# same bound covers both directions.
DEFAULT_MAX_FRAME_BYTES = 104_857_600
# With ``ports.base`` the ports base .. base+255 are reserved for broker ids 0..255;
# a node's own ports may not fall inside that window.
BASE_WINDOW = 256


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 host in brackets (a node's admin endpoint)."""
    return f"http://{join_host_port(host, port)}"


@attrs.frozen
class NodeConfig:
    id: str
    # The address the node binds (data listeners, admin, Raft). A wildcard (0.0.0.0, ::) binds
    # every address of the host; then ``advertised_host`` says what clients and peers dial.
    host: str
    bootstrap_port: int
    admin_port: int | None = None
    raft_port: int | None = None
    rack: str | None = None
    # Data-path worker processes sharing the node's listeners (proxy.supervisor).
    # A file that leaves it out gets one per core ("auto"); a config built in code
    # gets 1, the single-process node.
    workers: int = 1
    # The node's advertised address when addresses float ([addresses] mover netns, linux or
    # command, proxy.addresses): whichever host serves the node holds it; ``host`` stays the
    # host's own address (Raft, admin, the upstream connections).
    floating_host: str | None = None
    # What clients (Metadata, FindCoordinator, ...), peers (Raft, heartbeats) and the CLI are
    # told: an IP or a DNS name reaching ``host`` from outside (NAT, a container's published
    # ports). None: ``host`` itself.
    advertised_host: str | None = None
    # This node's port of broker B is port_base + B (nodes sharing one address, such as ::1,
    # differ by it); None: ``[ports]``.
    port_base: int | None = None

    @property
    def advertised(self) -> str:
        """The host clients and the other nodes dial to reach this node."""
        return self.advertised_host or self.host


# Fetch v16+ responses carry KIP-951 node_endpoints (broker addresses) in a
# tagged field at the *end* of the frame, so rewriting them means holding every
# Fetch response whole. Capping Fetch at v15 in ApiVersions keeps Fetch
# cut-through; clients then learn new leaders from Metadata (as before KIP-951).
# Measured in BENCHMARKS.md; set 18 (or higher) to rewrite instead.
DEFAULT_FETCH_MAX_VERSION = 15

# The rest of a pass-through response frame (a Fetch response, mostly) at least
# this large is moved broker socket -> pipe -> client socket with splice(2),
# never entering user space (proxy/splice.py; measured in BENCHMARKS.md).
# Below it, the few syscalls a splice costs more than the copy saves. 0 disables.
DEFAULT_SPLICE_MIN_BYTES = 64 << 10

# When a node dies, its clients reconnect to the survivors in the same second:
# thousands of SYNs at once. A full accept queue drops them and the clients
# wait out SYN retransmits (1, 3, 7 s ...), so the queue is sized for a storm;
# the kernel caps it at net.core.somaxconn (proxy.listeners logs the cap).
DEFAULT_LISTEN_BACKLOG = 4096
# Client connections one node holds at most (each costs two sockets, so twice
# as many file descriptors, plus some KiB of memory); beyond it new ones are
# refused and the ones it has keep being served (proxy.admission).
DEFAULT_MAX_CONNECTIONS = 50_000
# New connections per second from one source address (a token bucket holding
# one second's worth): generous enough for a host of clients reconnecting at
# once, low enough that one runaway client cannot take the node's accept loop.
DEFAULT_ACCEPTS_PER_SOURCE_PER_S = 1000
# SIGTERM drains a node (DESIGN §4): the fleet moves its identities, its clients are closed once
# their in-flight responses are out; the node exits after this long even if some are left.
DEFAULT_DRAIN_TIMEOUT_S = 5.0
# A client that leaves at a request boundary, or a client connection that only asks at each
# answer, leaves its broker connection to the next one (proxy.upstream_pool): this many kept per
# broker address, in each worker.
DEFAULT_BOOTSTRAP_POOL = 8
DEFAULT_API_VERSIONS_ANSWER_S = 5.0  # proxy.local_answers


@attrs.frozen
class Limits:
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    high_water_bytes: int = 1 << 20
    connect_timeout_s: float = 5.0
    fetch_max_version: int = DEFAULT_FETCH_MAX_VERSION
    splice_min_bytes: int = DEFAULT_SPLICE_MIN_BYTES
    listen_backlog: int = DEFAULT_LISTEN_BACKLOG
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    accepts_per_source_per_s: float = DEFAULT_ACCEPTS_PER_SOURCE_PER_S
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    bootstrap_pool: int = DEFAULT_BOOTSTRAP_POOL
    share_upstream: bool = False
    api_versions_answer_s: float = DEFAULT_API_VERSIONS_ANSWER_S
    coalesce_metadata: bool = True
    fair_accept: bool = True


@attrs.frozen
class FleetConfig:
    """Raft and failure detection; relationships are validated by membership.config."""

    password: str
    raft_min_timeout_s: float = 0.3
    raft_max_timeout_s: float = 0.6
    # A frozen or partitioned node is declared down after this: three beats (0.2 s) missed.
    dead_after_s: float = 0.6
    lease_s: float = 1.5        # without quorum this long, a node advertises itself for unreachable owners
    rebalance_delay_s: float = 1.0
    # A node that is down or draining leaves its host:ports behind; clients that
    # cached them (librdkafka's coordinator connection does) keep dialling them.
    # With takeover, the owner of each identity also listens on the vacant node's
    # address (SO_REUSEPORT, so the node can bind again when it comes back). That
    # needs the address to be bindable here: any 127/8 address on loopback, a
    # floating IP on real hosts (a failed bind is logged, nothing else changes).
    address_takeover: bool = True
    # The member's threads (Raft, heartbeats; with workers, the supervisor's too) run SCHED_RR at
    # this priority where the process may (membership.realtime); 0: as every other thread.
    member_priority: int = 10


@attrs.frozen
class Config:
    nodes: tuple[NodeConfig, ...]
    upstream: tuple[HostPort, ...]
    refresh_interval_s: float = 10.0
    release_after_s: float = 300.0  # upstream.release_after_s (proxy.broker_roster)
    port_base: int | None = None
    port_map: Mapping[int, int] = attrs.field(factory=dict)
    limits: Limits = Limits()
    log_level: str = "INFO"
    log_format: str = "json"
    admin_token: str | None = None
    fleet: FleetConfig | None = None
    tap_dir: str | None = None
    source: str = "<memory>"
    security: SecurityConfig | None = None  # [security] (TLS, the node's SASL login); None: plaintext
    addresses: MoverConfig = MoverConfig()  # [addresses]: the floating-address mover (proxy.addresses)

    def node(self, node_id: str) -> NodeConfig:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ConfigError("nodes", f"no node with id {node_id!r} (known: {[n.id for n in self.nodes]})")


def proxy_nodes(config: Config) -> tuple[TopologyNode, ...]:
    """Every node of the config as ``topology.ProxyNode``: its host, bootstrap
    port and the port scheme ``[ports]`` gives every node. The one place that
    turns the config into the fleet's node table (the data path binds, and
    membership advertises, from what this returns)."""
    try:
        return tuple(TopologyNode(id=n.id, host=n.floating_host or n.advertised, bootstrap_port=n.bootstrap_port,
                                  rack=n.rack, ports=_port_scheme(config, n))
                     for n in config.nodes)
    except ValueError as exc:
        raise ConfigError("nodes", str(exc)) from None


def _port_scheme(config: Config, node: NodeConfig) -> PortScheme:
    base = config.port_base if node.port_base is None else node.port_base
    return PortScheme(base=base, explicit=dict(config.port_map))


def proxy_node(config: Config, node_id: str) -> TopologyNode:
    """Node ``node_id`` of the config as ``topology.ProxyNode`` (see :func:`proxy_nodes`)."""
    config.node(node_id)  # a ConfigError naming the known ids
    return next(n for n in proxy_nodes(config) if n.id == node_id)


# --------------------------------------------------------------- loading
# The keys each section accepts. Sections that map onto an attrs class take its field
# names, so a field added there is accepted here; anything else exits 2 naming the key.
SECTIONS = ("upstream", "ports", "nodes", "limits", "logging", "admin", "fleet", "debug", "security", "addresses")
SECTION_KEYS: dict[str, frozenset[str]] = {
    "upstream": frozenset({"bootstrap", "refresh_interval_s", "release_after_s"}),
    "ports": frozenset({"base", "map"}),
    "nodes": frozenset(f.name for f in attrs.fields(NodeConfig)),
    "limits": frozenset(f.name for f in attrs.fields(Limits)),
    "logging": frozenset({"level", "format"}),
    "admin": frozenset({"token_env", "token"}),
    "fleet": frozenset(f.name for f in attrs.fields(FleetConfig)) | {"password_env"},
    "debug": frozenset({"tap_dir"}),
    # Tables of their own (proxy.security_config checks the keys inside each).
    "security": frozenset({"listeners", "upstream", "upstream_sasl", "admin"}),
    "addresses": MOVER_KEYS,
}
# Secrets never go in the file (README): a file that holds one is refused, naming the
# ``*_env`` key to use instead. Only ``parse`` of an in-memory mapping (tests, tools) takes them inline.
INLINE_SECRETS = {"admin.token": "admin.token_env", "fleet.password": "fleet.password_env",
                  "security.upstream_sasl.password": "security.upstream_sasl.password_env"}


def load(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError("--config", f"file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{p} is not valid TOML: {exc}") from None
    return parse(raw, env=os.environ if env is None else env, source=str(p), inline_secrets=False)


def parse(raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None, source: str = "<memory>",
          inline_secrets: bool = True) -> Config:
    """The fleet config from a TOML mapping; every unknown key, at the top or inside a
    section, is a ConfigError naming it. ``inline_secrets=False`` (a file) refuses secrets."""
    env = os.environ if env is None else env
    for key in raw:
        if key not in SECTIONS:
            raise ConfigError(key, unknown_key_message(key, SECTIONS, what="section"))
    for name in SECTIONS:
        if name != "nodes" and isinstance(raw.get(name), dict):
            _check_keys(raw[name], name, SECTION_KEYS[name])
    upstream, refresh, release_after = _parse_upstream(_get(raw, "upstream", "upstream", dict))
    base, port_map = _parse_ports(_get(raw, "ports", "ports", dict, {}))
    nodes = _parse_nodes(_get(raw, "nodes", "nodes", list))
    limits = _parse_limits(_get(raw, "limits", "limits", dict, {}))
    level, fmt = _parse_logging(_get(raw, "logging", "logging", dict, {}))
    token = _secret(_get(raw, "admin", "admin", dict, {}), "token", "admin", env, inline_secrets)
    fleet = _parse_fleet(_get(raw, "fleet", "fleet", dict), nodes, env, inline_secrets) if "fleet" in raw else None
    _check_node_ports(nodes, base, port_map)
    tap_dir = _get(_get(raw, "debug", "debug", dict, {}), "tap_dir", "debug.tap_dir", str, None)
    security = None
    if "security" in raw:
        from proxy.security_config import parse_security  # it builds on this module's helpers

        security = parse_security(_get(raw, "security", "security", dict), env, inline_secrets)
    addresses = _parse_addresses(_get(raw, "addresses", "addresses", dict, {}), nodes)
    return Config(
        tap_dir=tap_dir, security=security, addresses=addresses,
        nodes=nodes, upstream=upstream, refresh_interval_s=refresh, release_after_s=release_after,
        port_base=base, port_map=port_map,
        limits=limits, log_level=level, log_format=fmt, admin_token=token, fleet=fleet, source=source,
    )


def _parse_addresses(table: Mapping[str, Any], nodes: tuple[NodeConfig, ...]) -> MoverConfig:
    """``[addresses]`` and the nodes' ``floating_host``: every node has one exactly when a mover
    moves addresses, inside the mover's networks and apart from every node's own ``host``."""
    try:
        mover = parse_mover_config(table)
    except MoverConfigError as exc:
        raise ConfigError("addresses", str(exc)) from None
    hosts = {n.host for n in nodes}
    for i, n in enumerate(nodes):
        path = f"nodes[{i}].floating_host"
        if mover.kind == MOVER_NONE:
            if n.floating_host is not None:
                raise ConfigError(path, "set [addresses] mover (netns, linux or command) for a floating address")
            continue
        if n.floating_host is None:
            raise ConfigError(path, f"the {mover.kind} mover moves each node's advertised address: set it")
        try:
            ip = ipaddress.IPv4Address(n.floating_host)
        except ValueError:
            raise ConfigError(path, f"{n.floating_host!r} is not an IPv4 address") from None
        if not mover.allows(ip):
            raise ConfigError(path, f"{ip} is outside addresses.networks ({', '.join(map(str, mover.networks))})")
        if n.floating_host in hosts:
            raise ConfigError(path, f"{ip} is a node's own host address, not a floating one")
    floating = [n.floating_host for n in nodes if n.floating_host]
    if len(set(floating)) != len(floating):
        raise ConfigError("nodes", "two nodes share one floating_host")
    return mover


def _parse_upstream(upstream_raw: Mapping[str, Any]) -> tuple[tuple[HostPort, ...], float, float]:
    boots = _get(upstream_raw, "bootstrap", "upstream.bootstrap", list)
    if not boots:
        raise ConfigError("upstream.bootstrap", "must list at least one host:port")
    upstream = tuple(parse_host_port(v, f"upstream.bootstrap[{i}]") for i, v in enumerate(boots))
    refresh = _positive(_get(upstream_raw, "refresh_interval_s", "upstream.refresh_interval_s", float, 10.0),
                        "upstream.refresh_interval_s")
    release_after = _get(upstream_raw, "release_after_s", "upstream.release_after_s", float, 300.0)
    if release_after < 0:
        raise ConfigError("upstream.release_after_s", f"must be >= 0, got {release_after!r}")
    return upstream, refresh, release_after


def _parse_ports(ports_raw: Mapping[str, Any]) -> tuple[int | None, dict[int, int]]:
    base = _get(ports_raw, "base", "ports.base", int, None)
    if base is not None and not 0 < base < MAX_PORT:
        raise ConfigError("ports.base", f"must be a port number, got {base}")
    port_map: dict[int, int] = {}
    for k, v in _get(ports_raw, "map", "ports.map", dict, {}).items():
        try:
            bid = int(k)
        except ValueError:
            raise ConfigError(f"ports.map.{k}", "keys must be broker ids (integers)") from None
        port_map[bid] = _port(v, f"ports.map.{k}")
    if len(set(port_map.values())) != len(port_map):
        raise ConfigError("ports.map", "two broker ids map to the same port")
    return base, port_map


def _parse_node(n: Any, path: str) -> NodeConfig:
    if not isinstance(n, dict):
        raise ConfigError(path, "must be a table")
    _check_keys(n, path, SECTION_KEYS["nodes"])
    admin_port = _get(n, "admin_port", f"{path}.admin_port", int, None)
    raft_port = _get(n, "raft_port", f"{path}.raft_port", int, None)
    advertised = _get(n, "advertised_host", f"{path}.advertised_host", str, None)
    port_base = _get(n, "port_base", f"{path}.port_base", int, None)
    node = NodeConfig(
        id=_get(n, "id", f"{path}.id", str),
        host=_host(_get(n, "host", f"{path}.host", str), f"{path}.host"),
        advertised_host=None if advertised is None else _host(advertised, f"{path}.advertised_host"),
        port_base=None if port_base is None else _port(port_base, f"{path}.port_base"),
        bootstrap_port=_port(_get(n, "bootstrap_port", f"{path}.bootstrap_port", int), f"{path}.bootstrap_port"),
        admin_port=None if admin_port is None else _port(admin_port, f"{path}.admin_port"),
        raft_port=None if raft_port is None else _port(raft_port, f"{path}.raft_port"),
        rack=_get(n, "rack", f"{path}.rack", str, None),
        workers=_workers(n.get("workers", "auto"), f"{path}.workers"),
        floating_host=_get(n, "floating_host", f"{path}.floating_host", str, None),
    )
    if not node.id:
        raise ConfigError(f"{path}.id", "must not be empty")
    return node


# More worker processes than this is a typo, not a host.
MAX_WORKERS = 256


def _workers(value: Any, path: str) -> int:
    """``workers``: an integer 1..MAX_WORKERS, or "auto" (os.cpu_count())."""
    if value == "auto":
        return max(1, os.cpu_count() or 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORKERS:
        raise ConfigError(path, f'must be "auto" or an integer 1..{MAX_WORKERS}, got {value!r}')
    return value


def _parse_nodes(nodes_raw: list[Any]) -> tuple[NodeConfig, ...]:
    if not nodes_raw:
        raise ConfigError("nodes", "must list at least one node")
    nodes = tuple(_parse_node(n, f"nodes[{i}]") for i, n in enumerate(nodes_raw))
    ids = [n.id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ConfigError("nodes", f"node ids must be unique, got {ids}")
    addrs = [(n.advertised.lower(), n.bootstrap_port) for n in nodes]
    if len(set(addrs)) != len(addrs):
        raise ConfigError("nodes", "two nodes share one advertised host and bootstrap_port")
    return nodes


def _parse_limits(limits_raw: Mapping[str, Any]) -> Limits:
    limits = Limits(
        max_frame_bytes=_get(limits_raw, "max_frame_bytes", "limits.max_frame_bytes", int, DEFAULT_MAX_FRAME_BYTES),
        high_water_bytes=_get(limits_raw, "high_water_bytes", "limits.high_water_bytes", int, 1 << 20),
        connect_timeout_s=_get(limits_raw, "connect_timeout_s", "limits.connect_timeout_s", float, 5.0),
        fetch_max_version=_get(limits_raw, "fetch_max_version", "limits.fetch_max_version", int,
                               DEFAULT_FETCH_MAX_VERSION),
        splice_min_bytes=_get(limits_raw, "splice_min_bytes", "limits.splice_min_bytes", int,
                              DEFAULT_SPLICE_MIN_BYTES),
        listen_backlog=_get(limits_raw, "listen_backlog", "limits.listen_backlog", int, DEFAULT_LISTEN_BACKLOG),
        max_connections=_get(limits_raw, "max_connections", "limits.max_connections", int,
                             DEFAULT_MAX_CONNECTIONS),
        accepts_per_source_per_s=_get(limits_raw, "accepts_per_source_per_s", "limits.accepts_per_source_per_s",
                                      float, float(DEFAULT_ACCEPTS_PER_SOURCE_PER_S)),
        drain_timeout_s=_get(limits_raw, "drain_timeout_s", "limits.drain_timeout_s", float, DEFAULT_DRAIN_TIMEOUT_S),
        bootstrap_pool=_get(limits_raw, "bootstrap_pool", "limits.bootstrap_pool", int, DEFAULT_BOOTSTRAP_POOL),
        share_upstream=_get(limits_raw, "share_upstream", "limits.share_upstream", bool, False),
        api_versions_answer_s=_get(limits_raw, "api_versions_answer_s", "limits.api_versions_answer_s", float,
                                   DEFAULT_API_VERSIONS_ANSWER_S),
        coalesce_metadata=_get(limits_raw, "coalesce_metadata", "limits.coalesce_metadata", bool, True),
        fair_accept=_get(limits_raw, "fair_accept", "limits.fair_accept", bool, True),
    )
    if limits.splice_min_bytes != 0 and not 4096 <= limits.splice_min_bytes <= 1 << 30:
        raise ConfigError("limits.splice_min_bytes", "must be 0 (never splice) or between 4 KiB and 1 GiB")
    if not 4 <= limits.fetch_max_version <= 100:
        raise ConfigError("limits.fetch_max_version", "must be between 4 (Kafka 4's oldest Fetch) and 100")
    if not 1024 <= limits.max_frame_bytes <= 1 << 30:
        raise ConfigError("limits.max_frame_bytes", "must be between 1 KiB and 1 GiB")
    if not 4096 <= limits.high_water_bytes <= 1 << 30:
        raise ConfigError("limits.high_water_bytes", "must be between 4 KiB and 1 GiB")
    _positive(limits.connect_timeout_s, "limits.connect_timeout_s")
    _positive(limits.drain_timeout_s, "limits.drain_timeout_s")
    if not 1 <= limits.listen_backlog <= 1 << 20:
        raise ConfigError("limits.listen_backlog", "must be between 1 and 1048576 (the kernel caps it at somaxconn)")
    if not 1 <= limits.max_connections <= 10_000_000:
        raise ConfigError("limits.max_connections", "must be between 1 and 10000000")
    if not 0 <= limits.accepts_per_source_per_s <= 1e6:
        raise ConfigError("limits.accepts_per_source_per_s", "must be 0 (no limit) or a rate up to 1000000")
    if not 0 <= limits.bootstrap_pool <= 1024:
        raise ConfigError("limits.bootstrap_pool", "must be between 0 (keep none) and 1024")
    if not 0 <= limits.api_versions_answer_s <= 3600:
        raise ConfigError("limits.api_versions_answer_s", "must be between 0 (never answer) and 3600 seconds")
    return limits


def _parse_logging(logging_raw: Mapping[str, Any]) -> tuple[str, str]:
    level = _get(logging_raw, "level", "logging.level", str, "INFO").upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError("logging.level", f"must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    fmt = _get(logging_raw, "format", "logging.format", str, "json")
    if fmt not in {"json", "text"}:
        raise ConfigError("logging.format", f"must be 'json' or 'text', got {fmt!r}")
    return level, fmt


def _parse_fleet(fleet_raw: Mapping[str, Any], nodes: tuple[NodeConfig, ...], env: Mapping[str, str],
                 inline_secrets: bool = True) -> FleetConfig:
    password = _secret(fleet_raw, "password", "fleet", env, inline_secrets)
    if password is None:
        raise ConfigError("fleet.password", "Raft traffic is pickle: a password (or password_env) is required")
    fleet = FleetConfig(
        password=password,
        raft_min_timeout_s=_get(fleet_raw, "raft_min_timeout_s", "fleet.raft_min_timeout_s", float, 0.3),
        raft_max_timeout_s=_get(fleet_raw, "raft_max_timeout_s", "fleet.raft_max_timeout_s", float, 0.6),
        dead_after_s=_get(fleet_raw, "dead_after_s", "fleet.dead_after_s", float, 0.6),
        lease_s=_get(fleet_raw, "lease_s", "fleet.lease_s", float, 1.5),
        rebalance_delay_s=_get(fleet_raw, "rebalance_delay_s", "fleet.rebalance_delay_s", float, 1.0),
        address_takeover=_get(fleet_raw, "address_takeover", "fleet.address_takeover", bool, True),
        member_priority=_get(fleet_raw, "member_priority", "fleet.member_priority", int, 10),
    )
    if not 0 <= fleet.member_priority <= 99:
        raise ConfigError("fleet.member_priority", "must be between 0 (never real-time) and 99")
    for name in ("raft_min_timeout_s", "raft_max_timeout_s", "dead_after_s", "lease_s"):
        _positive(getattr(fleet, name), f"fleet.{name}")
    if fleet.raft_max_timeout_s <= fleet.raft_min_timeout_s:
        raise ConfigError("fleet.raft_max_timeout_s", "must be greater than fleet.raft_min_timeout_s")
    for i, n in enumerate(nodes):
        if n.raft_port is None:
            raise ConfigError(f"nodes[{i}].raft_port", "is required when [fleet] is configured")
    return fleet


def _check_node_ports(nodes: tuple[NodeConfig, ...], base: int | None, port_map: Mapping[int, int]) -> None:
    """A node's own ports differ from each other and from every broker identity port; its hosts
    are valid; nodes sharing an address (advertised or bound: ``::1`` for several nodes) use
    disjoint ports."""
    for i, n in enumerate(nodes):
        node_base = base if n.port_base is None else n.port_base
        key_base = "ports.base" if n.port_base is None else f"nodes[{i}].port_base"
        if node_base is None and not port_map:
            raise ConfigError("ports", "set ports.base (broker B on base + B), ports.map or every node's port_base")
        if node_base is not None and node_base + BASE_WINDOW - 1 > MAX_PORT:
            raise ConfigError(key_base, f"{node_base} + {BASE_WINDOW - 1} (the highest broker id's port) "
                                        f"exceeds {MAX_PORT}")
        used = _own_ports(n)
        ports = [p for _, p in used]
        if len(set(ports)) != len(ports):
            raise ConfigError(f"nodes[{i}]", f"bootstrap/admin/raft ports must differ, got {dict(used)}")
        for key, p in used:
            if p in port_map.values() or (node_base is not None and node_base <= p < node_base + BASE_WINDOW):
                raise ConfigError(f"nodes[{i}].{key}", f"port {p} collides with the broker identity ports")
        _check_ip(n.host, f"nodes[{i}].host")
        if n.advertised_host is not None:
            _check_ip(n.advertised_host, f"nodes[{i}].advertised_host")
            if is_wildcard(n.advertised_host):
                raise ConfigError(f"nodes[{i}].advertised_host", f"{n.advertised_host} binds every address but "
                                  "clients cannot dial it: give this node's IP or DNS name")
        elif is_wildcard(n.host):
            raise ConfigError(f"nodes[{i}].advertised_host", f"is required when host is {n.host} (every address): "
                              "clients and peers need an IP or DNS name to dial")
    _check_shared_addresses(nodes, base, port_map)


def _own_ports(n: NodeConfig) -> list[tuple[str, int]]:
    used = [("bootstrap_port", n.bootstrap_port)]
    return used + [(k, getattr(n, k)) for k in ("admin_port", "raft_port") if getattr(n, k) is not None]


def _check_shared_addresses(nodes: tuple[NodeConfig, ...], base: int | None, port_map: Mapping[int, int]) -> None:
    """Two nodes advertised at one address (several on ``::1``) must not share a port: their own
    ports and their broker port windows (``base`` .. ``base + 255``, the map's ports) are disjoint.
    Bind hosts are not compared: nodes on different hosts may bind the same wildcard or the same
    private address (a container's 172.17.0.2); a clash on one host is the kernel's to report."""
    claimed: dict[tuple[str, int], str] = {}
    for i, n in enumerate(nodes):
        node_base = base if n.port_base is None else n.port_base
        ports = [p for _, p in _own_ports(n)] + list(port_map.values())
        if node_base is not None:
            ports += range(node_base, node_base + BASE_WINDOW)
        host = n.advertised.lower()
        for p in set(ports):
            other = claimed.setdefault((host, p), n.id)
            if other != n.id:
                raise ConfigError(f"nodes[{i}]", f"nodes {other} and {n.id} both use {host} port {p}: nodes "
                                  "sharing an address need their own ports (nodes[].port_base, bootstrap_port, "
                                  "admin_port, raft_port)")


def _check_ip(host: str, path: str) -> None:
    """Hosts may be names; an IP literal must at least parse."""
    if host.replace(".", "").isdigit() or ":" in host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(path, f"{host!r} is not a valid IP address") from None
