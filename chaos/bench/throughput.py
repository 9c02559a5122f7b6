"""`kproxy bench proxy`: proxy overhead measured side by side in one run.

Against the same brokers, alternating direct and proxied runs (this machine is
shared and noisy, so only ratios measured in one run mean anything):

* produce throughput with Kafka's own ProducerPerformance: 1 KiB records with
  default batching, and with ~1 MiB batches (batch.size=1 MiB, linger 20 ms),
  acks=all, idempotent, RF=3;
* fetch throughput with Kafka's ConsumerPerformance over what was produced:
  each run, direct or proxied, reads both topics of that batching (the direct
  and the proxied one, ``--include``), so every run fetches the same
  2 x records x rounds records (~1.2 GB at the defaults: a run lasts seconds,
  not the ~1 s where JVM start-up and the group join dominate), and fetch runs
  ``fetch_rounds`` times each way (default 2 x rounds);
* proxy CPU seconds per GB forwarded (the proxy process' CPU time over the
  bytes its metrics counted, both directions), per phase (produce small,
  produce 1 MiB, fetch small, fetch 1 MiB: sampled around each proxied run
  only) and overall (the sum of the phases); the proxy's CPU while the direct
  runs went on (idle: timers, metadata refresh) is reported apart;
* added produce latency (p50/p99 of ProducerPerformance at a fixed, modest
  rate, proxied minus direct);
* the cost of rewriting a Metadata response at 100 … 50,000 partitions.

With ``relay`` (the default when the bench starts its own Kafka), the fetch
phases get a baseline arm: the same consumer through ``chaos.bench.relay``, a
Kafka-unaware splice(2) relay (blocking threads, 1 MiB pipes: the cheapest hop a
user-space proxy can be; the brokers advertise it on a second listener). Its
ratio to direct is the most any proxy with a TCP hop can reach on this machine;
``fetch_vs_relay`` is what kproxy keeps of it.

With ``compare_splice``, a second proxy process with splice(2) off
(``limits.splice_min_bytes = 0``; same address, other ports) joins the fetch
phases as a third arm, alternating with the first (proxy.splice): fetch
throughput and CPU per GB with and without splice, from one run.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import psutil

from chaos.clients.batch import kafka_tool
from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port, port_free
from chaos.testbed.proxies import NodeProcess, fleet_config
from chaos.testbed.security import ClientSecurity, Protocol

_PRODUCER_SUMMARY = re.compile(
    r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\), ([\d.]+) ms avg latency, ([\d.]+) ms max latency,"
    r" (\d+) ms 50th, (\d+) ms 95th, (\d+) ms 99th")


def producer_perf(bootstrap: str, topic: str, records: int, size: int, throughput: int = -1,
                  props: dict[str, Any] | None = None, config: Path | None = None) -> dict[str, float]:
    """``config``: a properties file (the client's security: a JAAS line does not fit ``--producer-props``)."""
    base = {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": "true", "linger.ms": 5}
    base.update(props or {})
    extra = ["--producer.config", str(config)] if config is not None else []
    out = kafka_tool("org.apache.kafka.tools.ProducerPerformance", "--topic", topic, "--num-records", str(records),
                     "--record-size", str(size), "--throughput", str(throughput), *extra, "--producer-props",
                     *[f"{k}={v}" for k, v in base.items()], timeout=600).stdout
    m = None
    for m in _PRODUCER_SUMMARY.finditer(out):
        pass
    if m is None:
        raise RuntimeError(f"no ProducerPerformance summary in:\n{out[-2000:]}")
    return {"records": int(m.group(1)), "records_per_s": float(m.group(2)), "mb_per_s": float(m.group(3)),
            "p50_ms": float(m.group(6)), "p99_ms": float(m.group(8))}


def consumer_perf(bootstrap: str, topic: str, records: int, *, include: str | None = None,
                  command_config: Path | None = None) -> dict[str, float]:
    """Consume ``records`` from ``topic`` (or every topic matching the regex ``include``);
    ``command_config``: the client's security properties (chaos.testbed.security)."""
    which = ["--include", include] if include is not None else ["--topic", topic]
    config = ["--command-config", str(command_config)] if command_config is not None else []
    out = kafka_tool("org.apache.kafka.tools.ConsumerPerformance", "--bootstrap-server", bootstrap, *which,
                     "--num-records", str(records), "--timeout", "60000", "--group", f"bench-{uuid.uuid4().hex[:8]}",
                     "--command-property", "auto.offset.reset=earliest", *config, timeout=600).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    header_idx = next(i for i, line in enumerate(lines) if line.startswith("start.time"))
    names = [c.strip() for c in lines[header_idx].split(",")]
    values = [c.strip() for c in lines[header_idx + 1].split(",")]
    row = dict(zip(names, values))
    records_got = int(row["data.consumed.in.nMsg"])
    if records_got < records:
        raise RuntimeError(f"ConsumerPerformance read {records_got} of {records} records:\n{out[-2000:]}")
    return {"mb_per_s": float(row["fetch.MB.sec"]), "records": records_got}


class _ProxyMeter:
    """CPU seconds of the proxy process and bytes it forwarded, between two points."""

    def __init__(self, node: NodeProcess) -> None:
        self.node = node
        assert node.pid is not None
        self.proc = psutil.Process(node.pid)

    def sample(self) -> tuple[float, float]:
        t = self.proc.cpu_times()
        text = self.node.get("/metrics").text
        forwarded = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("kproxy_bytes_total"))
        return t.user + t.system, forwarded


def _spliced_bytes(node: NodeProcess) -> float:
    text = node.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kproxy_spliced_bytes_total"))


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every process, the kernel), since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _children_cpu_s() -> float:
    """CPU seconds of this process' children that ended and were waited for (the client tools' JVMs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # gone: counts nothing from here on
            continue
        total += t.user + t.system
    return total


class _Machine:
    """Per phase and arm (direct, proxied, relay …): the whole machine's busy CPU and wall time over
    the runs, the records they moved, and who spent the CPU: the client tool's JVM, the brokers,
    the hop (the proxy or the relay process; none for direct). How saturated the machine was, and
    what each arm costs it per GB: a hop adds its own CPU and the second TCP hop's kernel work to
    the same two cores the brokers and the client use."""

    FIELDS = ("busy", "wall", "records", "client", "brokers", "hop")

    def __init__(self, broker_pids: list[int]) -> None:
        self.brokers = [psutil.Process(pid) for pid in broker_pids]
        self.acc: dict[tuple[str, str], list[float]] = {}

    def run(self, phase: str | None, arm: str, fn: Callable[[], dict], hop: psutil.Process | None = None) -> dict:
        if phase is None:
            return fn()
        before = (_machine_busy_s(), time.monotonic(), _children_cpu_s(), _cpu_s(self.brokers),
                  _cpu_s([hop]) if hop else 0.0)
        result = fn()
        after = (_machine_busy_s(), time.monotonic(), _children_cpu_s(), _cpu_s(self.brokers),
                 _cpu_s([hop]) if hop else 0.0)
        acc = self.acc.setdefault((phase, arm), [0.0] * len(self.FIELDS))
        busy, wall, client, brokers, hop_cpu = (a - b for a, b in zip(after, before))
        for i, v in enumerate((busy, wall, float(result.get("records", 0)), client, brokers, hop_cpu)):
            acc[i] += v
        return result

    def report(self, record_bytes: int) -> dict[str, Any]:
        """Per phase and arm: the machine's busy fraction (of every core), busy CPU-s per payload GB,
        and the client's, brokers' and hop's CPU-s per payload GB."""
        cores = psutil.cpu_count() or 1
        out: dict[str, Any] = {}
        for (phase, arm), (busy, wall, records, client, brokers, hop) in sorted(self.acc.items()):
            gb = max(records * record_bytes / 1e9, 1e-9)
            row = {"busy_fraction": round(busy / max(wall * cores, 1e-9), 3), "cpu_s_per_gb": round(busy / gb, 3),
                   "client_cpu_s_per_gb": round(client / gb, 3)}
            if self.brokers:
                row["brokers_cpu_s_per_gb"] = round(brokers / gb, 3)
            if arm != "direct":
                row["hop_cpu_s_per_gb"] = round(hop / gb, 3)
            out.setdefault(phase, {})[arm] = row
        return out


class _Phases:
    """Proxy CPU and bytes forwarded, summed per phase over the proxied runs;
    what the proxy spent while direct runs went on is kept apart (idle).
    Every run is also measured by the shared :class:`_Machine` (under ``arm``, or "direct")."""

    def __init__(self, meter: _ProxyMeter, machine: _Machine, arm: str = "proxied") -> None:
        self.meter = meter
        self.machine = machine
        self.arm = arm
        self.cpu: dict[str, float] = {}
        self.bytes: dict[str, float] = {}
        self.idle_cpu = 0.0
        self.idle_s = 0.0

    def proxied(self, phase: str, fn: Callable[[], dict]) -> dict:
        cpu0, bytes0 = self.meter.sample()
        result = self.machine.run(phase, self.arm, fn, hop=self.meter.proc)
        cpu1, bytes1 = self.meter.sample()
        self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu1 - cpu0
        self.bytes[phase] = self.bytes.get(phase, 0.0) + bytes1 - bytes0
        return result

    def direct(self, fn: Callable[[], dict], phase: str | None = None) -> dict:
        cpu0, _ = self.meter.sample()
        t0 = time.monotonic()
        result = self.machine.run(phase, "direct", fn)
        self.idle_s += time.monotonic() - t0
        self.idle_cpu += self.meter.sample()[0] - cpu0
        return result

    def report(self) -> dict[str, Any]:
        def per_gb(cpu: float, forwarded: float) -> float:
            return round(cpu / max(forwarded / 1e9, 1e-9), 3)

        cpu, forwarded = sum(self.cpu.values()), sum(self.bytes.values())
        return {
            "proxy_cpu_s": round(cpu, 3),
            "proxy_gb_forwarded": round(forwarded / 1e9, 3),
            "proxy_cpu_s_per_gb": per_gb(cpu, forwarded),
            "proxy_cpu_s_per_gb_by_phase": {k: per_gb(self.cpu[k], self.bytes[k]) for k in self.cpu},
            "proxy_cpu_by_phase": {k: {"cpu_s": round(self.cpu[k], 3), "gb": round(self.bytes[k] / 1e9, 3)}
                                   for k in self.cpu},
            "proxy_idle_cpu_s": {"cpu_s": round(self.idle_cpu, 3), "during_direct_runs_s": round(self.idle_s, 1)},
        }


def _alternate(rounds: int, direct: Callable[[], dict], proxied: Callable[[], dict]) -> tuple[list, list]:
    d, p = [], []
    for _ in range(rounds):
        d.append(direct())
        p.append(proxied())
    return d, p


def _alternate_arms(rounds: int, direct: Callable[[], dict], others: dict[str, Callable[[], dict]]
                    ) -> tuple[list, dict[str, list]]:
    """Each round: direct, then the other arms in turn, their order rotated by one every round
    (with two, which goes first swaps), so no arm always follows the same one."""
    d: list = []
    out: dict[str, list] = {name: [] for name in others}
    names = list(others)
    for i in range(rounds):
        d.append(direct())
        k = i % len(names) if names else 0
        for name in names[k:] + names[:k]:
            out[name].append(others[name]())
    return d, out


class RelayProcess:
    """``python -m chaos.bench.relay`` in front of the brokers' RELAY listeners; stopped by its PID."""

    def __init__(self, cluster: KafkaCluster, log_path: Path) -> None:
        assert cluster.relay_host is not None
        self.host = cluster.relay_host
        self.routes = [(f"{self.host}:{s.relay_port}", f"{s.host}:{s.relay_port}") for s in cluster.specs]
        self.bootstrap = ",".join(listen for listen, _ in self.routes)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> "RelayProcess":
        for listen, _ in self.routes:
            if not port_free(*_split(listen)):
                raise RuntimeError(f"relay address {listen} is taken")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "chaos.bench.relay", "--max-seconds", "14400",
                                          *[f"{a}={b}" for a, b in self.routes]],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while any(port_free(*_split(listen)) for listen, _ in self.routes):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the relay did not start: {self.log_path.read_text()[-1000:]}")
            time.sleep(0.05)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


_BATCHINGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("small_batches", "small", {}),
    ("1mb_batches", "1mb", {"batch.size": 1 << 20, "linger.ms": 20, "max.request.size": 2 << 20}),
)


class _Bench:
    """One :func:`run`: the processes it starts (the brokers unless given a bootstrap, the relay,
    the proxy, the proxy without splice), what measures them, the results, one method per phase.
    :meth:`stop` stops what is still running, each by its handle."""

    def __init__(self, tmp: Path, *, records: int, rounds: int, fetch_rounds: int, proxy_ip: str,
                 progress: Callable[[str], None]) -> None:
        self.tmp = tmp
        self.records = records
        self.rounds = rounds
        self.fetch_rounds = fetch_rounds
        self.proxy_ip = proxy_ip
        self.proxied_bs = f"{proxy_ip}:9092"
        self.progress = progress
        self.bootstrap = ""
        self.cluster: KafkaCluster | None = None
        self.relay: RelayProcess | None = None
        self.relay_ps: psutil.Process | None = None
        self.node: NodeProcess | None = None
        self.nosplice: NodeProcess | None = None
        self.machine = _Machine([])
        self.phases: _Phases | None = None
        self.nosplice_phases: _Phases | None = None
        self.results: dict[str, Any] = {}
        # Per arm: the Java client properties file of its security (None: plaintext).
        self.configs: dict[str, Path | None] = {"direct": None, "proxy": None}

    def _secure(self, arm: str, client: ClientSecurity) -> None:
        self.configs[arm] = client.java_properties(self.tmp / f"{arm}-client.properties")

    def _topic(self, name: str) -> None:
        config = ["--command-config", str(self.configs["direct"])] if self.configs["direct"] else []
        kafka_tool("org.apache.kafka.tools.TopicCommand", "--bootstrap-server", self.bootstrap, "--create",
                   "--topic", name, "--partitions", "6", "--replication-factor", "3", *config)

    def start_brokers(self, bootstrap: str | None, relay: bool, security: Protocol = Protocol.PLAINTEXT) -> bool:
        """A local 3-broker Kafka unless given ``bootstrap``; returns whether the relay arm runs.
        ``security``: the brokers' listener (its own CA and users); the proxy then speaks TLS to
        its clients and the brokers' protocol upstream, and the relay arm (plaintext) is left out."""
        relay_ip = ".".join(self.proxy_ip.split(".")[:3] + [str(int(self.proxy_ip.split(".")[-1]) + 2)])
        if security is not Protocol.PLAINTEXT:
            if bootstrap is not None:
                raise ValueError("--security needs the bench's own Kafka (not --bootstrap)")
            relay = False
        if bootstrap is None:
            base = free_base_port(3)
            self.progress(f"starting a local 3-broker Kafka ({security.value})")
            self.cluster = KafkaCluster(self.tmp / "kafka", 3, base_port=base, security=security,
                                        relay_host=relay_ip if relay else None).start()
            bootstrap = self.cluster.bootstrap_servers
            if self.cluster.security is not None:
                self._secure("direct", self.cluster.client_security)
                self._secure("proxy", self.cluster.security.proxy_client())
                os.environ.update(self.cluster.security.proxy_env())  # the proxy's own login upstream
        elif relay:
            self.progress("no relay baseline with --bootstrap (it needs brokers that advertise the relay)")
            relay = False
        self.bootstrap = bootstrap
        self.machine = _Machine(list(self.cluster.pids.values()) if self.cluster is not None else [])
        return relay

    def start_arms(self, relay: bool, limits: dict[str, int], compare_splice: bool) -> None:
        """The relay (``relay``), the proxy, and the proxy without splice (``compare_splice``)."""
        if relay:
            assert self.cluster is not None
            self.relay = RelayProcess(self.cluster, self.tmp / "relay.log").start()
            self.relay_ps = psutil.Process(self.relay.pid)
        first_ip = int(self.proxy_ip.split(".")[-1])
        brokers = self.bootstrap.split(",")
        extra: dict[str, Any] = {"limits": limits} if limits else {}
        if self.cluster is not None and self.cluster.security is not None:
            extra["security"] = self.cluster.security.proxy_config()
        cfg = fleet_config(self.tmp / "fleet.toml", brokers, 1, first_ip=first_ip,
                           fleet=False, log_format="json", extra=extra or None)
        self.node = NodeProcess(cfg, "p1", self.proxy_ip, 9400, self.tmp / "p1.log").start()
        self.node.wait_ready(60)
        self.phases = _Phases(_ProxyMeter(self.node), self.machine)
        if compare_splice:  # the same proxy without splice, on other ports of the same address
            cfg2 = fleet_config(self.tmp / "nosplice.toml", brokers, 1, first_ip=first_ip,
                                fleet=False, log_format="json", bootstrap_port=9093, port_base=9600,
                                admin_port=9401, extra={"limits": {**limits, "splice_min_bytes": 0}})
            self.nosplice = NodeProcess(cfg2, "p1", self.proxy_ip, 9401, self.tmp / "p1-nosplice.log").start()
            self.nosplice.wait_ready(60)
            self.nosplice_phases = _Phases(_ProxyMeter(self.nosplice), self.machine, arm="nosplice")

    def batching(self, name: str, short: str, props: dict[str, Any]) -> None:
        """Produce throughput, then fetch throughput, with one batching: alternating direct and
        proxied runs, each to its own topic."""
        assert self.phases is not None
        phases, bootstrap, records = self.phases, self.bootstrap, self.records
        suffix = uuid.uuid4().hex[:6]
        topics = {"direct": f"bench-{name}-direct-{suffix}", "proxy": f"bench-{name}-proxy-{suffix}"}
        for t in topics.values():
            self._topic(t)
        self.progress(f"produce throughput, {name}")
        configs = self.configs
        d, p = _alternate(
            self.rounds,
            lambda: phases.direct(lambda: producer_perf(bootstrap, topics["direct"], records, 1024, props=props,
                                                        config=configs["direct"])),
            lambda: phases.proxied(f"produce_{short}", lambda: producer_perf(
                self.proxied_bs, topics["proxy"], records, 1024, props=props, config=configs["proxy"])))
        self.results[f"produce_{name}"] = {"direct_mb_s": [r["mb_per_s"] for r in d],
                                           "proxy_mb_s": [r["mb_per_s"] for r in p]}
        self._fetch(name, short, suffix)

    def _fetch(self, name: str, short: str, suffix: str) -> None:
        assert self.phases is not None
        phases, phase = self.phases, f"fetch_{short}"
        self.progress(f"fetch throughput, {name}")
        # Both ways read both topics: the same bytes, twice the data of one topic per run.
        include = f"bench-{name}-(direct|proxy)-{suffix}"
        total = 2 * self.records * self.rounds

        def read_via(bootstrap: str, arm: str = "proxy") -> Callable[[], dict]:
            return lambda: consumer_perf(bootstrap, "", total, include=include, command_config=self.configs[arm])

        others: dict[str, Callable[[], dict]] = {"proxy": lambda: phases.proxied(phase, read_via(self.proxied_bs))}
        nosplice_phases, relay, relay_ps = self.nosplice_phases, self.relay, self.relay_ps
        if nosplice_phases is not None:
            others["nosplice"] = lambda: nosplice_phases.proxied(phase, read_via(f"{self.proxy_ip}:9093"))
        if relay is not None:
            others["relay"] = lambda: self.machine.run(phase, "relay", read_via(relay.bootstrap), hop=relay_ps)
        d, arms = _alternate_arms(self.fetch_rounds,
                                  lambda: phases.direct(read_via(self.bootstrap, "direct"), phase=phase),
                                  others)
        if nosplice_phases is not None:
            self.results[f"fetch_{name}_nosplice"] = {"proxy_mb_s": [r["mb_per_s"] for r in arms["nosplice"]]}
        if relay is not None:
            self.results[f"fetch_{name}_relay"] = {"relay_mb_s": [r["mb_per_s"] for r in arms["relay"]]}
        self.results[f"fetch_{name}"] = {"direct_mb_s": [r["mb_per_s"] for r in d],
                                         "proxy_mb_s": [r["mb_per_s"] for r in arms["proxy"]]}

    def produce_latency(self) -> tuple[list, list]:
        """Produce runs at a fixed, modest rate, direct and proxied: their latency summaries."""
        self.progress("produce latency at 2,000 records/s")
        lat_topic = f"bench-latency-{uuid.uuid4().hex[:6]}"
        self._topic(lat_topic)
        return _alternate(self.rounds,
                          lambda: producer_perf(self.bootstrap, lat_topic, 20_000, 1024, throughput=2000,
                                                config=self.configs["direct"]),
                          lambda: producer_perf(self.proxied_bs, lat_topic, 20_000, 1024, throughput=2000,
                                                config=self.configs["proxy"]))

    def stop_proxies(self) -> None:
        """After the last run: what the proxy spliced, then both proxies stopped."""
        assert self.node is not None
        self.results["spliced_gb"] = round(_spliced_bytes(self.node) / 1e9, 3)
        self.node.stop()
        if self.nosplice is not None:
            self.nosplice.stop()

    def stop(self) -> None:
        """Whatever still runs (after a failure), each by its handle: the relay, the proxies,
        the brokers."""
        if self.relay is not None:
            self.relay.stop()
        for node in (self.node, self.nosplice):
            if node is not None and node.alive():
                node.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def figures(self, latency: tuple[list, list], rewrite_us: dict[int, float], load_before: list[float],
                relay: bool) -> dict[str, Any]:
        """The results with the figures computed from them: ratios, CPU per GB, latency, targets."""
        assert self.phases is not None
        results, (d, p) = self.results, latency

        def ratio(key: str) -> float:
            r = results[key]
            return round(statistics.median(r["proxy_mb_s"]) / statistics.median(r["direct_mb_s"]), 3)

        results.update({
            "produce_ratio": min(ratio("produce_small_batches"), ratio("produce_1mb_batches")),
            "fetch_ratio": min(ratio("fetch_small_batches"), ratio("fetch_1mb_batches")),
            "produce_ratio_by_batching": {k: ratio(f"produce_{k}") for k in ("small_batches", "1mb_batches")},
            "fetch_ratio_by_batching": {k: ratio(f"fetch_{k}") for k in ("small_batches", "1mb_batches")},
            **self.phases.report(),
            "machine_by_phase": self.machine.report(results["record_bytes"]),
            "latency_direct_ms": {"p50": statistics.median(r["p50_ms"] for r in d),
                                  "p99": statistics.median(r["p99_ms"] for r in d)},
            "latency_proxy_ms": {"p50": statistics.median(r["p50_ms"] for r in p),
                                 "p99": statistics.median(r["p99_ms"] for r in p)},
            "metadata_rewrite_us": {str(k): round(v, 1) for k, v in rewrite_us.items()},
            "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        })
        if self.nosplice_phases is not None:
            results["nosplice"] = _nosplice_figures(results, self.phases, self.nosplice_phases)
        if relay:
            results.update(_relay_figures(results))
        results["latency_added_ms"] = {q: round(results["latency_proxy_ms"][q] - results["latency_direct_ms"][q], 2)
                                       for q in ("p50", "p99")}
        results["targets"] = {
            "produce_ratio>=0.90": results["produce_ratio"] >= 0.90,
            "fetch_ratio>=0.90": results["fetch_ratio"] >= 0.90,
            "proxy_cpu_s_per_gb<=1": results["proxy_cpu_s_per_gb"] <= 1.0,
            "metadata_rewrite_10k_us<=1000": rewrite_us.get(10_000, 0.0) <= 1000,
        }
        return results


def run(bootstrap: str | None = None, *, records: int = 200_000, rounds: int = 2, fetch_rounds: int | None = None,
        partitions: tuple[int, ...] = (100, 1000, 10_000, 50_000), progress: Callable[[str], None] = print,
        proxy_ip: str = "127.0.0.31", fetch_max_version: int | None = None, splice_min_bytes: int | None = None,
        compare_splice: bool = False, relay: bool = True, security: Protocol = Protocol.PLAINTEXT) -> dict[str, Any]:
    from chaos.bench.rewrite import bench_metadata_rewrite

    fetch_rounds = fetch_rounds or 2 * rounds
    load_before = [round(x, 2) for x in os.getloadavg()]
    limits: dict[str, int] = {}
    if fetch_max_version:
        limits["fetch_max_version"] = fetch_max_version
    if splice_min_bytes is not None:
        limits["splice_min_bytes"] = splice_min_bytes

    with tempfile.TemporaryDirectory(prefix="kproxy-bench-") as tmp:
        bench = _Bench(Path(tmp), records=records, rounds=rounds, fetch_rounds=fetch_rounds, proxy_ip=proxy_ip,
                       progress=progress)
        relay = bench.start_brokers(bootstrap, relay, security)
        try:
            bench.start_arms(relay, limits, compare_splice)
            bench.results.update({"records": records, "record_bytes": 1024, "rounds": rounds,
                                  "fetch_rounds": fetch_rounds, "fetch_records_per_run": 2 * records * rounds,
                                  "fetch_max_version": fetch_max_version or "default",
                                  "security": security.value,
                                  "splice_min_bytes": "default" if splice_min_bytes is None else splice_min_bytes})
            for name, short, props in _BATCHINGS:
                bench.batching(name, short, props)
            latency = bench.produce_latency()
            bench.stop_proxies()
        finally:
            bench.stop()

    progress("metadata rewrite cost")
    rewrite_us = bench_metadata_rewrite(partitions)
    return bench.figures(latency, rewrite_us, load_before, relay)


def _nosplice_figures(results: dict[str, Any], phases: _Phases, nosplice_phases: _Phases) -> dict[str, Any]:
    """The figures of the proxy without splice (``compare_splice``). Produce is never spliced
    (requests are copied; its responses are small): the overall figure without splice takes the
    produce phases of the main proxy and the fetch phases of the other."""
    without = nosplice_phases.report()
    fetch_cpu = {k: v for k, v in phases.cpu.items() if k.startswith("fetch_")}
    fetch_gb = {k: v for k, v in phases.bytes.items() if k.startswith("fetch_")}
    cpu_no = sum(v for k, v in phases.cpu.items() if not k.startswith("fetch_")) + sum(nosplice_phases.cpu.values())
    gb_no = sum(v for k, v in phases.bytes.items() if not k.startswith("fetch_")) + \
        sum(nosplice_phases.bytes.values())
    return {
        "fetch_ratio_by_batching": {
            k: round(statistics.median(results[f"fetch_{k}_nosplice"]["proxy_mb_s"])
                     / statistics.median(results[f"fetch_{k}"]["direct_mb_s"]), 3)
            for k in ("small_batches", "1mb_batches")},
        "proxy_cpu_s_per_gb_by_phase": without["proxy_cpu_s_per_gb_by_phase"],
        "proxy_cpu_by_phase": without["proxy_cpu_by_phase"],
        "proxy_cpu_s_per_gb": round(cpu_no / max(gb_no / 1e9, 1e-9), 3),
        "splice_fetch_cpu_s_per_gb": round(sum(fetch_cpu.values()) / max(sum(fetch_gb.values()) / 1e9, 1e-9), 3),
        "nosplice_fetch_cpu_s_per_gb": without["proxy_cpu_s_per_gb"],
    }


def _relay_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The baseline hop: the relay's throughput ratio is the most a proxy can reach here;
    fetch_vs_relay is kproxy's throughput over the relay's (medians, same runs)."""
    med = statistics.median
    relay = {
        "fetch_ratio_by_batching": {
            k: round(med(results[f"fetch_{k}_relay"]["relay_mb_s"]) / med(results[f"fetch_{k}"]["direct_mb_s"]), 3)
            for k in ("small_batches", "1mb_batches")},
        "fetch_vs_relay_by_batching": {
            k: round(med(results[f"fetch_{k}"]["proxy_mb_s"]) / med(results[f"fetch_{k}_relay"]["relay_mb_s"]), 3)
            for k in ("small_batches", "1mb_batches")},
        # From machine_by_phase: CPU-s per GB of payload fetched, the same records for both.
        "hop_cpu_s_per_gb_by_phase": {
            phase: {arm: results["machine_by_phase"][phase][arm]["hop_cpu_s_per_gb"] for arm in ("proxied", "relay")}
            for phase in ("fetch_small", "fetch_1mb")},
    }
    return {"relay": relay,
            "fetch_ratio_relay": min(relay["fetch_ratio_by_batching"].values()),
            "fetch_vs_relay": min(relay["fetch_vs_relay_by_batching"].values())}
