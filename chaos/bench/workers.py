"""`kproxy bench workers`: a request-heavy produce load through nodes of W = 1 and W = 2 data-path
workers (proxy.supervisor), and directly to the brokers, side by side in one run.

The load is many connections, each keeping a few small Produce requests in
flight (one 100-byte record, acks=all: each answer waits for the replicas), so
requests, not bytes, are what the proxy spends its CPU on. It comes from raw
asyncio protocols that count answers without decoding them (precomputed
frames, the correlation id patched in), far cheaper per request than a client
library, so that the proxy can be the bottleneck. The connections spread over
single-partition topics whose leaders are on different brokers, each to its
leader's address (the node's identity port, or the broker).

Per arm and round (alternating, this machine is shared): requests per second,
and the node's CPU-µs per request (its supervisor and every worker, psutil).
On a host with fewer cores than brokers + proxy + load, W = 2 cannot show its
full gain; the figures say what this machine gives.
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import struct
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import uvloop
from kafka.record.default_records import DefaultRecordBatchBuilder
from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData
from kio.static.primitive import Records, i32Timedelta

from chaos.bench.frames import make, request_frame
from chaos.bench.storm import leader_address
from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port
from chaos.testbed.proxies import NodeProcess, fleet_config

RECORD_BYTES = 100
TOPICS = 3  # one partition each: leaders on different brokers
NODE_IPS = {1: 71, 2: 72}  # W -> 127.0.0.<last>
_LEN = struct.Struct(">i")
_CORRELATION = struct.Struct(">i")
CORRELATION_OFFSET = 8  # length (4), api_key (2), api_version (2)


def produce_frame(topic: str, acks: int = -1) -> bytes:
    """A Produce v9 of one 100-byte record to ``topic``/0 (acks -1: all; correlation id 0)."""
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    builder.append(0, timestamp=None, key=None, value=b"w" * RECORD_BYTES, headers=[])
    data = make(TopicProduceData, name=topic, partition_data=(
        make(PartitionProduceData, index=0, records=Records(bytes(builder.build()))),))
    if acks not in (-1, 1):
        raise ValueError("acks must be -1 (all) or 1: every request needs an answer to count")
    return request_frame(make(ProduceRequest, transactional_id=None, acks=acks,
                              timeout=i32Timedelta.parse(datetime.timedelta(seconds=10)), topic_data=(data,)),
                         0, "kproxy-bench-workers")


class _Pipelined(asyncio.Protocol):
    """One connection keeping ``depth`` requests in flight until ``until`` (loop time); counts answers."""

    def __init__(self, frame: bytes, depth: int, until: float, done: asyncio.Future[None]) -> None:
        self.frame = bytearray(frame)
        self.depth, self.until, self.done = depth, until, done
        self.buffer = bytearray()
        self.answered = 0
        self.in_flight = 0
        self.correlation = 0
        self.transport: asyncio.Transport | None = None

    def _send(self, n: int) -> None:
        assert self.transport is not None
        out = []
        for _ in range(n):
            self.correlation += 1
            _CORRELATION.pack_into(self.frame, CORRELATION_OFFSET, self.correlation)
            out.append(bytes(self.frame))
        self.in_flight += n
        self.transport.write(b"".join(out))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send(self.depth)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        answers = 0
        while len(self.buffer) >= 4:
            (size,) = _LEN.unpack_from(self.buffer)
            if len(self.buffer) < 4 + size:
                break
            del self.buffer[:4 + size]
            answers += 1
        self.answered += answers
        self.in_flight -= answers
        if asyncio.get_running_loop().time() < self.until:
            self._send(answers)
        elif self.in_flight == 0 and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def request_load(targets: list[tuple[str, int, bytes]], connections: int, depth: int,
                       duration_s: float) -> tuple[int, float]:
    """``connections`` over ``targets`` (host, port, frame), ``depth`` in flight each, for
    ``duration_s``: (answers, seconds until the last connection finished)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    until = start + duration_s
    protocols = []
    for i in range(connections):
        host, port, frame = targets[i % len(targets)]
        done: asyncio.Future[None] = loop.create_future()
        _, protocol = await loop.create_connection(lambda f=frame, d=done: _Pipelined(f, depth, until, d), host, port)
        protocols.append(protocol)
    await asyncio.wait([p.done for p in protocols], timeout=duration_s + 30)
    for p in protocols:
        if p.transport is not None:
            p.transport.abort()
    return sum(p.answered for p in protocols), loop.time() - start


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a node: its process and every descendant (the workers)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class _Bench:
    def __init__(self, tmp: Path, progress: Callable[[str], None], acks: int) -> None:
        self.tmp = tmp
        self.acks = acks
        self.progress = progress
        self.cluster: KafkaCluster | None = None
        self.nodes: dict[int, NodeProcess] = {}
        self.topics = [f"bench-workers-{i}-{uuid.uuid4().hex[:6]}" for i in range(TOPICS)]

    def start(self, workers: tuple[int, ...]) -> None:
        self.progress("starting a local 3-broker Kafka")
        self.cluster = KafkaCluster(self.tmp / "kafka", 3, base_port=free_base_port(3)).start()
        for topic in self.topics:
            self.cluster.create_topic(topic, partitions=1, config={"min.insync.replicas": "2"})
        for w in workers:
            ip_last = NODE_IPS[w]
            cfg = fleet_config(self.tmp / f"node-w{w}.toml", self.cluster.bootstrap, 1, first_ip=ip_last,
                               fleet=False, workers=w)
            self.progress(f"starting a node with {w} worker(s) on 127.0.0.{ip_last}")
            self.nodes[w] = NodeProcess(cfg, "p1", f"127.0.0.{ip_last}", 9400, self.tmp / f"node-w{w}.log").start()
        for node in self.nodes.values():
            node.wait_ready(120)

    def targets(self, host: str, port: int) -> list[tuple[str, int, bytes]]:
        out = []
        for topic in self.topics:
            _, leader_host, leader_port = leader_address(host, port, topic)
            out.append((leader_host, leader_port, produce_frame(topic, self.acks)))
        return out

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        if self.cluster is not None:
            self.cluster.stop()


def run(workers: tuple[int, ...] = (1, 2), *, rounds: int = 3, duration_s: float = 10.0, connections: int = 64,
        depth: int = 4, acks: int = -1, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Alternating arms (direct, then each W), ``rounds`` times, after one untimed warm-up of
    every arm (the brokers' JIT); figures per arm (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="kproxy-bench-workers-") as tmp:
        bench = _Bench(Path(tmp), progress, acks)
        try:
            bench.start(workers)
            assert bench.cluster is not None
            first = bench.cluster.specs[0]
            arms: dict[str, list[tuple[int, float, float]]] = {"direct": []}
            arm_targets = {"direct": bench.targets(first.host, first.port)}
            for w, node in bench.nodes.items():
                arms[f"w{w}"] = []
                arm_targets[f"w{w}"] = bench.targets(node.host, 9092)
            progress("warming up")
            for targets in arm_targets.values():
                uvloop.run(request_load(targets, connections, depth, min(duration_s, 3.0)))
            for r in range(rounds):
                for arm, targets in arm_targets.items():
                    node = bench.nodes.get(int(arm[1:])) if arm != "direct" else None
                    cpu0 = tree_cpu_s(node.pid) if node and node.pid else 0.0
                    answers, wall = uvloop.run(request_load(targets, connections, depth, duration_s))
                    cpu = (tree_cpu_s(node.pid) - cpu0) if node and node.pid else 0.0
                    arms[arm].append((answers, wall, cpu))
                    progress(f"round {r + 1} {arm}: {answers / wall:.0f} requests/s")
        finally:
            bench.stop()
    return _figures(arms, connections=connections, depth=depth, duration_s=duration_s,
                    acks="all" if acks == -1 else acks)


def _figures(arms: dict[str, list[tuple[int, float, float]]], **load: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"load": {**load, "record_bytes": RECORD_BYTES, "topics": TOPICS},
                           "arms": {}}
    for arm, runs in arms.items():
        rates = [a / w for a, w, _ in runs]
        row: dict[str, Any] = {"requests_per_s": round(statistics.median(rates)),
                               "requests_per_s_runs": [round(x) for x in rates]}
        answers = sum(a for a, _, _ in runs)
        if arm != "direct":
            row["cpu_us_per_request"] = round(sum(c for _, _, c in runs) * 1e6 / max(answers, 1), 1)
            row["cpu_cores_busy"] = round(sum(c for _, _, c in runs) / max(sum(w for _, w, _ in runs), 1e-9), 2)
        out["arms"][arm] = row
    direct = out["arms"]["direct"]["requests_per_s"]
    for arm, row in out["arms"].items():
        if arm != "direct":
            row["ratio_to_direct"] = round(row["requests_per_s"] / max(direct, 1), 3)
    return out


if __name__ == "__main__":  # pragma: no cover
    import json

    print(json.dumps(run(progress=print), indent=2))
