"""`kproxy bench handshakes`: the TLS handshake rate of one node, with W = 1 and W = 2 data-path
workers (proxy.supervisor).

One plaintext broker upstream (a handshake never reaches it) and, per W, one node whose
listeners speak TLS with a certificate from a test-bed CA (``chaos.testbed.security``:
ECDSA P-256; TLS 1.3 unless ``--tls-version 1.2``). The load is ``clients`` processes, each
in a loop: connect to the node's bootstrap port, a full handshake (no session resumption:
every connection starts without a session), close. Arms alternate, ``rounds`` times, after
an untimed warm-up of each.

Per arm: handshakes per second end to end (the clients share this machine's cores with the
node and are the bound on a small host), and the node's CPU seconds over the same window (its
supervisor and every worker, psutil), hence ``handshakes_per_core_s``: handshakes per CPU
second of the node, what one core of it sustains.
"""

from __future__ import annotations

import multiprocessing
import socket
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from chaos.bench.workers import tree_cpu_s
from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port
from chaos.testbed.proxies import BOOTSTRAP_PORT, NodeProcess, fleet_config
from chaos.testbed.security import Protocol, TestbedSecurity

NODE_IPS = {1: 94, 2: 95}  # W -> 127.0.0.<last>
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
CONNECT_TIMEOUT_S = 5.0


def handshake_loop(host: str, port: int, ca: str, tls_version: str, duration_s: float) -> tuple[int, int]:
    """One client process: full handshakes in a row for ``duration_s``; (done, failed)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ctx.maximum_version = TLS_VERSIONS[tls_version]
    done = failed = 0
    until = time.monotonic() + duration_s
    while time.monotonic() < until:
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as raw:
                with ctx.wrap_socket(raw, server_hostname=host):
                    done += 1
        except (OSError, ssl.SSLError):
            failed += 1
    return done, failed


def _load(pool: ProcessPoolExecutor, clients: int, host: str, ca: str, tls_version: str,
          duration_s: float) -> tuple[int, int, float]:
    start = time.monotonic()
    futures = [pool.submit(handshake_loop, host, BOOTSTRAP_PORT, ca, tls_version, duration_s) for _ in range(clients)]
    results = [f.result(timeout=duration_s + 60) for f in futures]
    return sum(d for d, _ in results), sum(f for _, f in results), time.monotonic() - start


class _Bench:
    def __init__(self, tmp: Path, progress: Callable[[str], None]) -> None:
        self.tmp = tmp
        self.progress = progress
        self.cluster: KafkaCluster | None = None
        self.nodes: dict[int, NodeProcess] = {}
        self.testbed = TestbedSecurity.create(tmp / "security", Protocol.PLAINTEXT,
                                              proxy_hosts=tuple(f"127.0.0.{ip}" for ip in NODE_IPS.values()))

    def start(self, workers: tuple[int, ...]) -> None:
        self.progress("starting a local 1-broker Kafka (plaintext)")
        self.cluster = KafkaCluster(self.tmp / "kafka", 1, base_port=free_base_port(1)).start()
        listeners = self.testbed.proxy_config()  # TLS toward clients only: the broker is plaintext
        for w in workers:
            ip_last = NODE_IPS[w]
            cfg = fleet_config(self.tmp / f"node-w{w}.toml", self.cluster.bootstrap, 1, first_ip=ip_last,
                               fleet=False, workers=w, extra={"security": listeners})
            self.progress(f"starting a TLS node with {w} worker(s) on 127.0.0.{ip_last}")
            self.nodes[w] = NodeProcess(cfg, "p1", f"127.0.0.{ip_last}", 9400, self.tmp / f"node-w{w}.log").start()
        for node in self.nodes.values():
            node.wait_ready(120)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        if self.cluster is not None:
            self.cluster.stop()


def run(workers: tuple[int, ...] = (1, 2), *, rounds: int = 3, duration_s: float = 10.0, clients: int = 4,
        tls_version: str = "1.3", progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Alternating arms (each W), ``rounds`` times, after an untimed warm-up of each (see the module doc)."""
    if tls_version not in TLS_VERSIONS:
        raise ValueError(f"tls_version: one of {sorted(TLS_VERSIONS)}")
    arms: dict[int, list[tuple[int, int, float, float]]] = {w: [] for w in workers}
    with tempfile.TemporaryDirectory(prefix="kproxy-bench-handshakes-") as tmp:
        bench = _Bench(Path(tmp), progress)
        ca = str(bench.testbed.ca)
        try:
            bench.start(workers)
            with ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn")) as pool:
                progress("warming up")
                for node in bench.nodes.values():
                    _load(pool, clients, node.host, ca, tls_version, min(duration_s, 2.0))
                for r in range(rounds):
                    for w, node in bench.nodes.items():
                        assert node.pid is not None
                        cpu0 = tree_cpu_s(node.pid)
                        done, failed, wall = _load(pool, clients, node.host, ca, tls_version, duration_s)
                        arms[w].append((done, failed, wall, tree_cpu_s(node.pid) - cpu0))
                        progress(f"round {r + 1} W={w}: {done / wall:.0f} handshakes/s, {failed} failed")
        finally:
            bench.stop()
    return figures(arms, clients=clients, duration_s=duration_s, tls_version=tls_version)


def figures(arms: dict[int, list[tuple[int, int, float, float]]], **load: Any) -> dict[str, Any]:
    """Per W: median handshakes/s of the rounds, the node's CPU over all of them, handshakes per
    node CPU second (per core)."""
    out: dict[str, Any] = {"load": dict(load), "arms": {}}
    for w, runs in arms.items():
        rates = [d / wall for d, _, wall, _ in runs]
        done = sum(d for d, _, _, _ in runs)
        cpu = sum(c for _, _, _, c in runs)
        wall = sum(x for _, _, x, _ in runs)
        out["arms"][f"w{w}"] = {
            "handshakes_per_s": round(statistics.median(rates)) if rates else None,
            "handshakes_per_s_runs": [round(x) for x in rates],
            "failed": sum(f for _, f, _, _ in runs),
            "node_cpu_ms_per_handshake": round(cpu * 1000 / done, 3) if done else None,
            "handshakes_per_core_s": round(done / cpu) if cpu > 0 else None,
            "node_cores_busy": round(cpu / wall, 2) if wall > 0 else None,
        }
    return out
