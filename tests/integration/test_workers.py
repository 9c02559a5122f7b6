"""A fleet whose nodes run two data-path worker processes each (issue 12, workers), in front of
the session's real Kafka: clients are served by both workers of a node, a killed worker is
restarted without moving the node's identities or losing an acknowledged record, and a node
reports a map as applied only once every worker has it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import pytest

from chaos.clients import batch as clients
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

WORKERS = 2
FIRST_IP = 74  # nodes on 127.0.0.74-76 (the secure session fleet has .61-63)


@pytest.fixture(scope="module")
def fleet(kafka_cluster, tmp_path_factory):
    from chaos.testbed.fleet import LocalFleet

    f = LocalFleet.up(tmp_path_factory.mktemp("workers-fleet"), kafka_bootstrap=kafka_cluster.bootstrap,
                      timeout=120, first_ip=FIRST_IP, workers=WORKERS)
    try:
        yield f
    finally:
        f.down()



def _bootstrap(fleet, node: str) -> str:  # type: ignore[no-untyped-def]
    return f"{fleet.node_address(node)}:9092"


def test_both_workers_serve_clients_of_every_family_tried(fleet, kafka_cluster, topic_name):
    status = fleet.status("p1")
    assert [w.index for w in status.workers] == [0, 1]
    assert all(w.ready and w.pid and w.pid != status.pid for w in status.workers)
    kafka_cluster.create_topic(topic_name, partitions=3)
    bs = _bootstrap(fleet, "p1")
    for prefix, family in enumerate(("aiokafka", "java")):
        acks = clients.produce(family, bs, f"{topic_name}", 30, prefix=prefix)
        assert sorted(a.value for a in acks) == sorted(clients.values(prefix, 30))
    got = clients.consume("aiokafka", bs, topic_name, f"g-{topic_name}", 60)
    assert sorted(c.value for c in got) == sorted(clients.values(0, 30) + clients.values(1, 30))
    # Connections are spread over the workers by the kernel (SO_REUSEPORT): hold 24 and look.
    host = fleet.node_address("p1")
    held = [socket.create_connection((host, 9092), timeout=5) for _ in range(24)]
    try:
        def counted():  # type: ignore[no-untyped-def]
            rows = fleet.status("p1").workers
            return rows if sum(w.connections or 0 for w in rows) >= 24 else None

        rows = wait_for(counted, "the held connections counted")
        assert all((w.connections or 0) > 0 for w in rows), rows
        assert fleet.status("p1").connections == sum(w.connections or 0 for w in rows)
    finally:
        for s in held:
            s.close()
    lines = [json.loads(x) for x in fleet.nodes["p1"].log_path.read_text().splitlines() if x.startswith("{")]
    assert {x.get("kproxy_worker") for x in lines} >= {None, 0, 1}  # the supervisor's lines, and each worker's
    metrics = fleet.nodes["p1"].get("/metrics").text
    accepted = sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines()
                   if x.startswith("kproxy_connections_total{"))
    assert accepted >= 24 + 2  # the node's totals, over both workers


def _requests_total(node) -> float:  # type: ignore[no-untyped-def]
    return sum(float(x.rsplit(" ", 1)[1]) for x in node.get("/metrics").text.splitlines()
               if x.startswith("kproxy_requests_total{"))


async def _produce_paced(bs: str, topic: str, prefix: int, stop: threading.Event, acked: list[tuple[str, float]],
                         failed: list[str]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bs, acks="all", enable_idempotence=True, request_timeout_ms=20000,
                                retry_backoff_ms=50)
    await producer.start()
    try:
        seq = 0
        while not stop.is_set():
            value = f"{prefix}.{seq}"
            seq += 1
            try:
                await producer.send_and_wait(topic, value.encode(), key=str(seq % 7).encode())
                acked.append((value, time.monotonic()))
            except Exception:  # not acknowledged: not counted as lost if missing
                failed.append(value)
            await asyncio.sleep(0.01)
    finally:
        await producer.stop()


async def _read_all(bootstrap: list[str], topic: str, partitions: int) -> list[str]:
    """Every record of ``topic``, read directly from the brokers (the final read)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=",".join(bootstrap), enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        out: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            positions = [await consumer.position(p) for p in parts]
            if all(pos >= ends[p] for pos, p in zip(positions, parts)):
                break
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(r.value.decode() for r in records)
        return out
    finally:
        await consumer.stop()


def test_a_killed_worker_is_restarted_and_its_clients_come_back_without_loss(fleet, kafka_cluster, topic_name):
    kafka_cluster.create_topic(topic_name, partitions=3)
    before = fleet.wait_healthy(30)
    bs = ",".join(fleet.bootstrap)
    stop = threading.Event()
    acked: list[list[tuple[str, float]]] = [[] for _ in range(6)]
    failed: list[str] = []

    async def load() -> None:
        await asyncio.gather(*(_produce_paced(bs, topic_name, i, stop, acked[i], failed) for i in range(6)))

    thread = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
    thread.start()
    try:
        def producing(after: float, n: int) -> bool:
            assert thread.is_alive(), "the load ended early"
            return all(sum(t > after for _, t in a) >= n for a in acked)

        wait_for(lambda: producing(0.0, 20), "every producer acknowledged", 60)
        # The busiest worker of the fleet carries producers: kill it.
        node, worker = max(((n, w) for n in fleet.node_ids for w in fleet.status(n).workers),
                           key=lambda nw: nw[1].connections or 0)
        assert worker.connections and worker.pid
        requests_before = _requests_total(fleet.nodes[node])
        killed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        restarted = wait_for(lambda: next((w for w in fleet.status(node).workers if w.index == worker.index
                                            and w.ready and w.pid != worker.pid), None), "the worker restarted")
        assert restarted.restarts == 1
        assert _requests_total(fleet.nodes[node]) >= requests_before  # the node's counter did not go back
        # Every producer acknowledges records after the kill: the killed worker's clients reconnected.
        wait_for(lambda: producing(killed_at + 0.5, 10), "every producer acknowledging again", 60)
    finally:
        stop.set()
        thread.join(60)
    after = fleet.fleet_view()
    assert (after.epoch, after.assignment) == (before.epoch, before.assignment)  # no identity moved
    assert fleet.status(node).pid == fleet.nodes[node].pid  # the node itself did not restart
    written = set(asyncio.run(_read_all(kafka_cluster.bootstrap, topic_name, 3)))
    lost = [v for a in acked for v, _ in a if v not in written]
    assert not lost, f"{len(lost)} acknowledged records missing, e.g. {lost[:5]}"
    restarts = [x for x in fleet.nodes[node].get("/metrics").text.splitlines()
                if x.startswith("kproxy_worker_restarts_total{") and f'worker="{worker.index}"' in x]
    assert restarts and float(restarts[0].rsplit(" ", 1)[1]) == 1.0


def test_a_map_is_reported_applied_only_once_every_worker_has_it(fleet):
    fleet.wait_healthy(30)
    seen: list[tuple[int, list[int | None]]] = []
    done = threading.Event()

    def watch() -> None:  # every /status of p2 during the moves: no worker behind the node's epoch
        while not done.is_set():
            try:
                s = fleet.status("p2")
            except Exception:
                continue
            seen.append((s.epoch, [w.epoch for w in s.workers if w.ready]))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        drained_at = fleet.drain("p2")["epoch"]
        def applied_drain():  # type: ignore[no-untyped-def]
            s = fleet.status("p2")
            return s if s.epoch >= drained_at else None

        view = wait_for(applied_drain, "p2 applied the drain")
        assert view.draining and not view.identities()
        assert all(w.epoch is not None and w.epoch >= drained_at for w in view.workers)
        undrained_at = fleet.undrain("p2")["epoch"]
        wait_for(lambda: fleet.status("p2").epoch >= undrained_at, "p2 applied the undrain")
        fleet.wait_balanced(60)
    finally:
        done.set()
        watcher.join(10)
    assert len(seen) > 5
    behind = [(epoch, workers) for epoch, workers in seen if any(w is None or w < epoch for w in workers)]
    assert not behind, behind[:5]
    assert {epoch for epoch, _ in seen} >= {drained_at}


def test_the_member_runs_real_time_and_the_data_path_does_not(fleet):
    """fleet.member_priority (10 by default; the tests run as root): the supervisor's threads and
    the member's (Raft, heartbeats) are SCHED_RR, so a data path keeping every core busy cannot
    delay detection, commits or map pushes; the workers it spawned are not (SCHED_RESET_ON_FORK)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (or CAP_SYS_NICE) to run threads at a real-time priority")
    node = fleet.nodes["p1"]
    assert node.pid is not None
    def policy(tid: int) -> int:  # SCHED_RESET_ON_FORK reads as a flag on the policy
        return os.sched_getscheduler(tid) & ~getattr(os, "SCHED_RESET_ON_FORK", 0)

    policies = {int(t): policy(int(t)) for t in os.listdir(f"/proc/{node.pid}/task")}
    assert policies[node.pid] == os.SCHED_RR and os.sched_getparam(node.pid).sched_priority == 10
    # The member's thread and pysyncobj's tick thread it started (Python names no OS thread).
    assert sum(policies[t] == os.SCHED_RR for t in policies if t != node.pid) >= 2, policies
    workers = [w.pid for w in fleet.status("p1").workers]
    assert len(workers) == WORKERS
    for pid in workers:
        assert all(policy(int(t)) == os.SCHED_OTHER for t in os.listdir(f"/proc/{pid}/task"))


def test_a_node_freezes_and_dies_whole(fleet):
    import psutil

    node = fleet.nodes["p3"]
    assert node.pid is not None
    workers = [w.pid for w in fleet.status("p3").workers]
    assert len(workers) == WORKERS and all(workers)

    def state(pid: int) -> str:
        try:
            return psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            return "gone"

    from proxy.admin_client import NodeAdmin

    # The drill's freeze (the launcher signals the node's process group), then the admin action's.
    for freeze in (lambda: fleet.signal_node("p3", "STOP"), lambda: NodeAdmin.signal(node, "STOP")):
        freeze()
        try:
            wait_for(lambda: all(state(p) == psutil.STATUS_STOPPED for p in [node.pid, *workers]),
                      "p3 frozen whole", 10)
        finally:
            fleet.signal_node("p3", "CONT")
        wait_for(lambda: fleet.status("p3").ready, "p3 serving again", 30)
    os.kill(node.pid, signal.SIGKILL)  # the supervisor alone: its workers go with it at once
    wait_for(lambda: all(state(p) in ("gone", psutil.STATUS_ZOMBIE) for p in workers), "p3's workers gone", 5)
    fleet.restart_node("p3")
    fleet.wait_healthy(60)
    fleet.wait_balanced(60)
