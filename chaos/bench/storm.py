"""`kproxy bench storm`: N light clients at once, through one kproxy node and directly.

What a proxy node meets when another one dies: its clients all reconnect in
the same second (issue 12). Against its own local 3-broker Kafka, for each N
(``--clients``, default 1,000 / 4,000 / 10,000), in one run:

* **direct**: N light clients (:mod:`chaos.bench.storm_load`: connect,
  ApiVersions, Metadata, one small Produce with acks=1) connect at once to
  the leader broker of a one-partition topic;
* **proxy**: the same N at once to that broker identity's port on one kproxy
  node (no fleet, a fresh process on its own loopback address, 127.0.0.35
  on), its address taken from the node's own Metadata answer. The node runs
  ``workers`` data-path processes (default: the node's own default, one per
  core; ``--workers``), which share its ports (SO_REUSEPORT);
* with ``backlog``, the same again through a node whose listeners have that
  accept queue (``limits.listen_backlog``; 100 was the old default).

Reported per N: time until every client was served (from the storm's start),
per-client p50/p99 (connect to last answer), failures by kind, the kernel's
listen overflows during the storm (every listener: the broker's too), the
node's CPU time over the storm per client (connect, three requests, close),
and the node's RSS per connection: its RSS while it holds every served
client, minus its RSS before the storm (after a small warm-up storm), over N. Each proxy arm gets a
fresh node so one storm's freed-but-kept memory does not hide the next one's,
and its own address so the last storm's upstream sockets in TIME_WAIT do not
eat the next one's ephemeral ports.

File descriptors: a worker holds two sockets per client and caps its clients at
what its own RLIMIT_NOFILE allows (proxy.listeners.client_capacity, per
process): a node of W workers holds W times as many. The bench raises its own
limit (the brokers and the node inherit it; root may raise the hard limit too)
and reports the workers' limit, how many clients the node allows, and the
refusals the node counted (``kproxy_connections_refused_total``, by reason).
The node's CPU and RSS are its whole process tree's (supervisor and workers).

Then, unless ``idle_window_s`` is 0, the idle cost: a 5-node fleet on the same
brokers, no clients, CPU of each node over the window (chaos.bench.idle):
``idle_cpu_fraction`` (of a core, mean per node), its max and per node.

Kafka's own accept queue (``socket.listen.backlog.size``, default 50) is left
as Kafka ships it: the direct arm, and the node's upstream connects, meet it.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psutil
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from chaos.bench.frames import decode_response
from chaos.bench.idle import DEFAULT_IDLE_WINDOW_S, IDLE_NODES, measure_idle_cpu
from chaos.bench.storm_load import (
    CLIENT_DEADLINE_S,
    DEFAULT_SOURCES,
    LightRequests,
    StormResult,
    light_requests,
    source_addresses,
    storm,
)
from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port
from chaos.testbed.proxies import NodeProcess, fleet_config
from proxy.config import DEFAULT_ACCEPTS_PER_SOURCE_PER_S, DEFAULT_LISTEN_BACKLOG, DEFAULT_MAX_CONNECTIONS
from proxy.listeners import RESERVED_DESCRIPTORS, somaxconn, worker_share

DEFAULT_CLIENTS = (1000, 4000, 10_000)
FIRST_NODE_IP = 35
NODE_IPS = 6  # 127.0.0.35 .. .40, one per proxy arm, round robin
WARM_UP_CLIENTS = 20
NOFILE_WANTED = 1 << 16  # at least; the node needs two descriptors per client (proxy.listeners.client_capacity)
KAFKA_DEFAULT_LISTEN_BACKLOG = 50  # socket.listen.backlog.size
SETTLED_CONNECTIONS = 200  # the leader holds at most this many client connections before the next storm
_LEN = struct.Struct(">i")


def raise_nofile(wanted: int) -> tuple[int, int]:
    """Raise this process' RLIMIT_NOFILE to ``wanted`` if it is lower (the hard limit too,
    which needs root); returns the (soft, hard) limits in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def leader_address(host: str, port: int, topic: str, timeout: float = 30.0) -> tuple[int, str, int]:
    """(broker id, host, port) of the leader of ``topic``'s partition 0, as the Kafka
    endpoint at ``host:port`` (a broker or a proxy node) answers Metadata."""
    requests = light_requests(topic, produce=False)
    deadline = time.monotonic() + timeout
    while True:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(requests.frames[1])
            (size,) = _LEN.unpack(s.recv(4, socket.MSG_WAITALL))
            _, body = decode_response(requests.response_types[1], s.recv(size, socket.MSG_WAITALL), framed=False)
        partitions = [p for t in body.topics if t.name == topic for p in t.partitions if p.partition_index == 0]
        brokers = {b.node_id: (b.host, b.port) for b in body.brokers}
        if partitions and partitions[0].leader_id in brokers:
            leader = partitions[0].leader_id
            return int(leader), brokers[leader][0], int(brokers[leader][1])
        if time.monotonic() > deadline:
            raise RuntimeError(f"no leader for {topic} at {host}:{port} within {timeout}s")
        time.sleep(0.2)


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because an accept queue was full
    (TcpExt ListenOverflows, this network namespace, every listener); None off Linux."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines, lines[1:]):
        if names.startswith("TcpExt:") and values.startswith("TcpExt:"):
            row = dict(zip(names.split()[1:], values.split()[1:]))
            return int(row["ListenOverflows"]) if "ListenOverflows" in row else None
    return None


def _established_to(port: int) -> int:
    """TCP connections established to local port ``port`` (the broker's side of them)."""
    return sum(1 for c in psutil.net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def _wait_settled(port: int, timeout: float = 60.0) -> None:
    """Until the last storm's connections to ``port`` are gone (the broker closed them)."""
    deadline = time.monotonic() + timeout
    while _established_to(port) > SETTLED_CONNECTIONS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{_established_to(port)} connections to port {port} still open after {timeout}s")
        time.sleep(0.2)


def default_workers() -> int:
    """The node's own default (``workers = "auto"``, proxy.config): one per core."""
    return max(1, os.cpu_count() or 1)


def node_processes(pid: int) -> list[psutil.Process]:
    """A node's process and its descendants (the data-path workers, proxy.supervisor)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_s(procs: list[psutil.Process]) -> float:
    return sum(tree_cpu_split_s(procs))


def tree_cpu_split_s(procs: list[psutil.Process]) -> tuple[float, float]:
    """(user, system) CPU seconds of the processes, added up."""
    user = system = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        user += times.user
        system += times.system
    return user, system


def tree_rss(procs: list[psutil.Process]) -> int:
    """Resident bytes of the processes, added up (pages they share counted once each: the
    workers are forked late, so the share is the interpreter's and is in "before" too)."""
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


class _StormBench:
    """One :func:`run`: its Kafka, the topic, the proxy nodes it starts one at a time."""

    def __init__(self, tmp: Path, *, deadline_s: float, sources: int, progress: Callable[[str], None],
                 workers: int = 1, share_upstream: bool = False, fair_accept: bool = True) -> None:
        self.tmp = tmp
        self.workers = workers
        self.share_upstream = share_upstream
        self.fair_accept = fair_accept
        self.deadline_s = deadline_s
        self.sources = source_addresses(sources)
        self.progress = progress
        self.cluster: KafkaCluster | None = None
        self.node: NodeProcess | None = None
        self.arms = 0
        self.topic = f"storm-{uuid.uuid4().hex[:8]}"
        self.requests: LightRequests = light_requests(self.topic)
        self.leader = (0, "", 0)
        self.node_nofile: tuple[int, int] | None = None  # a worker's (the one holding clients)
        self.refused: dict[str, float] = {}  # the node's refusals over the last proxied storm, by reason
        self.connect_waits = 0.0  # upstream connects that waited for a turn in the last proxied storm
        self.overflows: int | None = None  # listen overflows during the last storm (any listener)
        self.cpu_ms_per_connection = 0.0  # the node's CPU over the last proxied storm, per client
        self.system_cpu_ms_per_connection = 0.0  # the kernel's part of it (system time)

    def start_brokers(self) -> None:
        self.progress("starting a local 3-broker Kafka")
        self.cluster = KafkaCluster(self.tmp / "kafka", 3, base_port=free_base_port(3)).start()
        self.cluster.create_topic(self.topic, partitions=1)
        first = self.cluster.specs[0]
        self.leader = leader_address(first.host, first.port, self.topic)

    def _start_node(self, listen_backlog: int | None) -> tuple[NodeProcess, tuple[str, int]]:
        assert self.cluster is not None
        ip_last = FIRST_NODE_IP + self.arms % NODE_IPS
        self.arms += 1
        ip = f"127.0.0.{ip_last}"
        limits: dict[str, Any] = {"listen_backlog": listen_backlog} if listen_backlog is not None else {}
        if self.share_upstream:
            limits["share_upstream"] = True
        limits["fair_accept"] = self.fair_accept
        cfg = fleet_config(self.tmp / f"node-{self.arms}.toml", self.cluster.bootstrap, 1, first_ip=ip_last,
                           fleet=False, extra={"limits": limits} if limits else None, workers=self.workers)
        node = self.node = NodeProcess(cfg, "p1", ip, 9400, self.tmp / f"node-{self.arms}.log").start()
        node.wait_ready(60)
        assert node.pid is not None
        self.node_nofile = node_processes(node.pid)[-1].rlimit(psutil.RLIMIT_NOFILE)
        leader_id, host, port = leader_address(ip, 9092, self.topic)
        if leader_id != self.leader[0]:
            raise RuntimeError(f"the node names broker {leader_id} the leader, the brokers {self.leader[0]}")
        return node, (host, port)

    def _storm(self, host: str, port: int, clients: int, hold: Any = None) -> StormResult:
        before = listen_overflows()
        result = uvloop.run(storm(host, port, clients, self.requests, sources=self.sources,
                                  deadline_s=self.deadline_s, hold=hold))
        after = listen_overflows()
        self.overflows = after - before if after is not None and before is not None else None
        return result

    def direct(self, clients: int) -> StormResult:
        _, host, port = self.leader
        _wait_settled(port)
        self.progress(f"{clients} clients at once, directly to broker {self.leader[0]}")
        return self._storm(host, port, clients)  # self.overflows: this storm's

    def proxy(self, clients: int, listen_backlog: int | None = None) -> tuple[StormResult, float, int]:
        """The storm through a fresh node: its result, the node's RSS bytes per connection
        and the client connections it held at the peak."""
        _wait_settled(self.leader[2])
        node, (host, port) = self._start_node(listen_backlog)
        try:
            self._storm(host, port, WARM_UP_CLIENTS)  # one-time allocations (caches, imports) before "before"
            assert node.pid is not None
            procs = node_processes(node.pid)
            rss_before = tree_rss(procs)
            refused_before = _refused(node)
            waits_before = _connect_waits(node)
            held: dict[str, float] = {}

            async def hold() -> None:
                held["rss"] = tree_rss(procs)
                held["connections"] = _active_connections(node)

            label = f" (listen_backlog {listen_backlog})" if listen_backlog is not None else ""
            self.progress(f"{clients} clients at once, through kproxy{label} (W = {self.workers})")
            user_before, system_before = tree_cpu_split_s(procs)
            result = self._storm(host, port, clients, hold)
            user_after, system_after = tree_cpu_split_s(procs)
            self.cpu_ms_per_connection = (user_after + system_after - user_before - system_before) * 1000 / clients
            self.system_cpu_ms_per_connection = (system_after - system_before) * 1000 / clients
            self.refused = {reason: n - refused_before.get(reason, 0.0) for reason, n in _refused(node).items()}
            self.connect_waits = _connect_waits(node) - waits_before
            rss_per_connection = (held["rss"] - rss_before) / clients
            return result, rss_per_connection, int(held["connections"])
        finally:
            node.stop()
            self.node = None

    def stop(self) -> None:
        if self.node is not None and self.node.alive():
            self.node.stop()
        if self.cluster is not None:
            self.cluster.stop()


def _active_connections(node: NodeProcess) -> float:
    for line in node.get("/metrics").text.splitlines():
        if line.startswith("kproxy_connections_active{"):
            return float(line.rsplit(" ", 1)[1])
    return -1.0


def _refused(node: NodeProcess) -> dict[str, float]:
    """The node's ``kproxy_connections_refused_total`` by reason (every worker's, added up by
    the supervisor)."""
    return parse_refused(node.get("/metrics").text)


def _connect_waits(node: NodeProcess) -> float:
    """Upstream connects that waited for a turn (proxy.connect_pacing), every worker's."""
    return sum(sample.value for family in text_string_to_metric_families(node.get("/metrics").text)
               for sample in family.samples if sample.name == "kproxy_upstream_connect_waits_total")


def parse_refused(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "kproxy_connections_refused_total":
                reason = sample.labels.get("reason", "?")
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


def _row(clients: int, direct: StormResult, proxied: StormResult, rss_per_connection: float,
         held: int) -> dict[str, Any]:
    return {
        "clients": clients,
        "direct_all_served_s": direct.all_served_s, "proxy_all_served_s": proxied.all_served_s,
        "direct_failed": direct.failed, "proxy_failed": proxied.failed,
        "direct_p50_s": direct.p50_s, "direct_p99_s": direct.p99_s,
        "proxy_p50_s": proxied.p50_s, "proxy_p99_s": proxied.p99_s,
        "rss_bytes_per_connection": round(rss_per_connection),
        "proxy_connections_held": held,
        "direct_errors": direct.errors, "proxy_errors": proxied.errors,
        "direct_connect_p99_s": direct.connect_p99_s, "proxy_connect_p99_s": proxied.connect_p99_s,
        "direct_slow_connects": direct.slow_connects, "proxy_slow_connects": proxied.slow_connects,
    }


def run(clients: tuple[int, ...] = DEFAULT_CLIENTS, *, backlog: int | None = None,
        deadline_s: float = CLIENT_DEADLINE_S, sources: int = DEFAULT_SOURCES,
        idle_window_s: float = DEFAULT_IDLE_WINDOW_S, workers: int | None = None,
        share_upstream: bool = False, fair_accept: bool = True,
        progress: Callable[[str], None] = print) -> dict[str, Any]:
    """``idle_window_s``: also measure the idle cost of a 5-node fleet on the same
    brokers over that many seconds (chaos.bench.idle); 0: do not. ``workers``: the
    node's data-path processes (default: :func:`default_workers`). ``share_upstream``:
    the node runs with ``limits.share_upstream`` on; ``fair_accept``: its ``limits.fair_accept``."""
    workers = default_workers() if workers is None else workers
    nofile = raise_nofile(max(NOFILE_WANTED, 2 * max(clients) + 4 * RESERVED_DESCRIPTORS))
    results: dict[str, Any] = {"storm": [], "listen_backlog": DEFAULT_LISTEN_BACKLOG, "somaxconn": somaxconn(),
                               "sources": sources, "accepts_per_source_per_s": DEFAULT_ACCEPTS_PER_SOURCE_PER_S,
                               "client_deadline_s": deadline_s, "kafka_listen_backlog": KAFKA_DEFAULT_LISTEN_BACKLOG,
                               "workers": workers, "share_upstream": share_upstream, "fair_accept": fair_accept,
                               "load_average_before": [round(x, 2) for x in psutil.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="kproxy-storm-") as tmp:
        bench = _StormBench(Path(tmp), deadline_s=deadline_s, sources=sources, progress=progress, workers=workers,
                            share_upstream=share_upstream, fair_accept=fair_accept)
        try:
            bench.start_brokers()
            results["topic_leader"] = {"broker": bench.leader[0], "address": f"{bench.leader[1]}:{bench.leader[2]}"}
            for n in clients:
                direct = bench.direct(n)
                direct_overflows = bench.overflows
                proxied, rss, held = bench.proxy(n)
                row = _row(n, direct, proxied, rss, held)
                row["direct_listen_overflows"], row["proxy_listen_overflows"] = direct_overflows, bench.overflows
                row["proxy_cpu_ms_per_connection"] = round(bench.cpu_ms_per_connection, 3)
                row["proxy_system_cpu_ms_per_connection"] = round(bench.system_cpu_ms_per_connection, 3)
                row["proxy_refused"] = bench.refused
                row["proxy_upstream_connect_waits"] = bench.connect_waits
                if backlog is not None:
                    other, other_rss, _ = bench.proxy(n, backlog)
                    row[f"backlog_{backlog}"] = {"all_served_s": other.all_served_s, "failed": other.failed,
                                                 "p50_s": other.p50_s, "p99_s": other.p99_s, "errors": other.errors,
                                                 "rss_bytes_per_connection": round(other_rss),
                                                 "listen_overflows": bench.overflows,
                                                 "connect_p99_s": other.connect_p99_s,
                                                 "slow_connects": other.slow_connects, "refused": bench.refused}
                results["storm"].append(row)
                progress(f"{n}: direct {direct.all_served_s} s ({direct.failed} failed), "
                         f"kproxy {proxied.all_served_s} s ({proxied.failed} failed)")
            if idle_window_s > 0:
                assert bench.cluster is not None
                progress(f"idle CPU of a {IDLE_NODES}-node fleet over {idle_window_s:g} s")
                results.update(measure_idle_cpu(bench.cluster.bootstrap, Path(tmp) / "idle-fleet",
                                                window_s=idle_window_s).to_json())
        finally:
            bench.stop()
    node_soft = bench.node_nofile[0] if bench.node_nofile else None
    results["nofile"] = {"generator": list(nofile), "proxy_worker": list(bench.node_nofile or ()),
                         "proxy_node_max_clients": node_max_clients(node_soft, workers) if node_soft else None}
    results["targets"] = _targets(results["storm"])
    if "idle_cpu_fraction" in results:
        results["targets"]["idle_cpu_fraction<=0.005"] = results["idle_cpu_fraction"] <= 0.005
    return results


def node_max_clients(worker_nofile: int, workers: int, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """The clients a node of ``workers`` processes holds at most when each has the soft
    descriptor limit ``worker_nofile``: each its share of ``max_connections``, within its own
    descriptors (proxy.listeners.client_capacity, per process)."""
    per_worker = min(worker_share(max_connections, workers), max(1, (worker_nofile - RESERVED_DESCRIPTORS) // 2))
    return workers * per_worker


def _targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Issue 12: the largest storm all served within 2x the direct time, none failed."""
    if not rows:
        return {}
    top = max(rows, key=lambda r: r["clients"])
    within = (top["proxy_all_served_s"] is not None and top["direct_all_served_s"] is not None
              and top["proxy_all_served_s"] <= 2 * top["direct_all_served_s"])
    return {f"{top['clients']}_all_served_within_2x_direct": within,
            f"{top['clients']}_none_failed": top["proxy_failed"] == 0}
