"""Follow the brokers (issue 15 item 2), against a real KRaft cluster of its own.

A 3-node fleet (127.0.0.131-133) fronts two brokers (127.0.0.139) while an aiokafka producer
(acks=all, idempotent) and a consumer run through it. A third broker joins the running cluster
(`kproxy kafka add-broker`): every node binds its port, the map gives it an owner and Metadata
advertises it, with no restart; a partition led by the new broker is produced to and read
through the fleet. Then that broker is decommissioned (`kproxy kafka remove-broker`: controlled
shutdown, unregistered): every node releases it (listener closed, identity out of the map) once
``release_after_s`` has passed. A final read through the fleet finds every acknowledged record.

Not the session cluster of tests/conftest.py: other tests depend on its shape.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid

import pytest

from chaos.clients.aiokafka_client import stop_aiokafka

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KAFKA_HOST = "127.0.0.139"
FIRST_IP = 131
PROXIES = 3
PORT_BASE = 9100  # chaos.testbed.proxies: broker B on 9100 + B on every node
REFRESH_S = 0.5
RELEASE_AFTER_S = 3.0
DEADLINE_S = 45.0


def _wait(condition, timeout_s: float, what: str, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    assert condition(), f"timed out after {timeout_s} s waiting for {what}\n{detail()}"


class Load:
    """A producer (acks=all, idempotent) to ``topics`` and a consumer of the first, through the fleet,
    on an asyncio loop of their own. ``acked``: (topic, value) of every acknowledged record."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topics = [topic]
        self.acked: list[tuple[str, str]] = []
        self.failed = 0
        self.consumed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "Load":
        self._thread.start()
        return self

    def add_topic(self, topic: str) -> None:
        self.topics = [*self.topics, topic]

    def acked_in(self, topic: str) -> int:
        return sum(1 for t, _ in self.acked if t == topic)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "the load did not stop"
        if self.error is not None:
            raise self.error

    async def _run(self) -> None:
        try:
            await asyncio.gather(self._produce(), self._consume())
        except BaseException as exc:
            self.error = exc

    async def _produce(self) -> None:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True,
                                    request_timeout_ms=15000, retry_backoff_ms=100)
        await producer.start()
        seq = 0
        try:
            while not self._stop.is_set():
                sends = []
                for topic in self.topics:
                    value = f"{topic}:{seq}"
                    sends.append((topic, value, await producer.send(topic, value=value.encode())))
                    seq += 1
                for topic, value, future in sends:
                    try:
                        await future
                        self.acked.append((topic, value))
                    except Exception:  # not acknowledged: not counted as sent (the idempotent producer retried)
                        self.failed += 1
                await asyncio.sleep(0.02)
        finally:
            await producer.flush()
            await stop_aiokafka(producer)

    async def _consume(self) -> None:
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(self.topics[0], bootstrap_servers=self.bootstrap, group_id=f"load-{uuid.uuid4()}",
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            while not self._stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                self.consumed += sum(len(records) for records in batch.values())
        finally:
            await stop_aiokafka(consumer)


def read_all(bootstrap: str, topics: list[str], wanted: set[tuple[str, str]], timeout_s: float) -> set[tuple[str, str]]:
    """Read ``topics`` from the beginning through the fleet until ``wanted`` is seen or time is up."""
    from aiokafka import AIOKafkaConsumer

    async def run() -> set[tuple[str, str]]:
        consumer = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, group_id=f"final-{uuid.uuid4()}",
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        seen: set[tuple[str, str]] = set()
        deadline = time.monotonic() + timeout_s
        try:
            while not wanted <= seen and time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=500)
                for tp, records in batch.items():
                    seen.update((tp.topic, r.value.decode()) for r in records)
        finally:
            await stop_aiokafka(consumer)
        return seen

    return asyncio.run(run())


def refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True


@pytest.fixture
def small_kafka(tmp_path):
    from chaos.testbed.kafka_cluster import KafkaCluster, free_base_port

    cluster = KafkaCluster(tmp_path / "kafka", 2, host=KAFKA_HOST,
                           base_port=free_base_port(3, host=KAFKA_HOST, seed=os.getpid() + 15))
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        # The test adds a broker through `kproxy kafka add-broker`: the state file knows its PID.
        KafkaCluster.load(cluster.state_dir).stop()
        cluster.stop()


def kafka_cli(*args: str) -> str:
    from click.testing import CliRunner

    from cli.main import cli

    result = CliRunner().invoke(cli, ["kafka", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_broker_added_is_served_and_a_broker_removed_is_released_under_load(small_kafka, tmp_path):
    from confluent_kafka.admin import AdminClient, NewTopic

    from chaos.testbed.fleet import LocalFleet

    fleet = LocalFleet.up(tmp_path / "fleet", proxies=PROXIES, kafka_bootstrap=small_kafka.bootstrap,
                          first_ip=FIRST_IP, timeout=90,
                          extra_config={"upstream": {"refresh_interval_s": REFRESH_S,
                                                     "release_after_s": RELEASE_AFTER_S}})
    load = None
    statuses = fleet.statuses
    detail = lambda: "\n".join(f"{n}: {s.to_json() if s else None}" for n, s in statuses().items())  # noqa: E731
    try:
        assert {n: sorted(s.listeners) if s else None for n, s in statuses().items()} == {
            f"p{i}": [1, 2] for i in range(1, PROXIES + 1)}
        steady = f"steady-{uuid.uuid4().hex[:6]}"
        small_kafka.create_topic(steady, partitions=2, replication=2)
        load = Load(fleet.bootstrap_servers, steady).start()
        _wait(lambda: load.acked_in(steady) > 20 and load.consumed > 0, DEADLINE_S, "the load running")

        # ---- a broker joins the running cluster: bound, assigned and advertised by every node.
        from chaos.testbed.kafka_cluster import KafkaCluster

        state = str(small_kafka.state_dir)
        kafka_cli("add-broker", "--state-dir", state)
        new = KafkaCluster.load(state).spec(3)
        assert not new.controller

        def serves_new() -> bool:
            s = statuses()
            if any(x is None for x in s.values()):
                return False
            advertised = {next((b.advertised for b in x.brokers if b.id == new.id), None) for x in s.values()}
            return all(new.id in x.listeners and str(new.id) in x.assignment for x in s.values()) \
                and len(advertised) == 1 and None not in advertised

        _wait(serves_new, DEADLINE_S, "every node serving broker 3", detail)
        owner = next(iter(statuses().values())).assignment[str(new.id)]
        owner_host = fleet.node_address(owner)
        assert {next(b.advertised for b in x.brokers if b.id == new.id) for x in statuses().values()} == {
            f"{owner_host}:{PORT_BASE + new.id}"}

        # A partition led by the new broker, produced to and read through the fleet.
        led = f"led-by-3-{uuid.uuid4().hex[:6]}"
        admin = AdminClient(small_kafka.admin_config())
        admin.create_topics([NewTopic(led, num_partitions=1, replica_assignment=[[new.id, 1]],
                                      config={"min.insync.replicas": "1"})])[led].result(30)
        _wait(lambda: (p := admin.list_topics(led, timeout=5).topics[led].partitions.get(0)) is not None
              and p.leader == new.id, DEADLINE_S, "broker 3 leading the new partition")
        load.add_topic(led)
        _wait(lambda: load.acked_in(led) >= 20, DEADLINE_S, "records acknowledged by broker 3 through the fleet")
        on_new = {r for r in load.acked if r[0] == led}
        assert read_all(fleet.bootstrap_servers, [led], on_new, 30) >= on_new

        # ---- the broker is decommissioned: every node releases it.
        consumed_before = load.consumed
        removed = kafka_cli("remove-broker", str(new.id), "--state-dir", state)
        assert f"broker {new.id} stopped and unregistered" in removed
        assert [b.id for b in KafkaCluster.load(state).specs] == [1, 2]

        def released() -> bool:
            s = statuses()
            return all(x is not None and new.id not in x.listeners and str(new.id) not in x.assignment
                       and all(b.id != new.id for b in x.brokers) for x in s.values())

        _wait(released, DEADLINE_S, "every node releasing broker 3", detail)
        for node_id in fleet.node_ids:
            assert refused(fleet.node_address(node_id), PORT_BASE + new.id), node_id
        _wait(lambda: load.consumed > consumed_before + 20 and load.acked_in(led) > len(on_new) + 20,
              DEADLINE_S, "the load going on after the release")
        load.stop()

        # ---- 0 lost: every acknowledged record is read back through the fleet.
        wanted = set(load.acked)
        assert len(wanted) == len(load.acked)  # every value is unique: a count is a count of records
        seen = read_all(fleet.bootstrap_servers, [steady, led], wanted, 60)
        lost = wanted - seen
        assert not lost, f"{len(lost)} of {len(wanted)} acknowledged records lost: {sorted(lost)[:10]}"
    finally:
        try:
            if load is not None and load._thread.is_alive():
                load.stop()
        finally:
            fleet.down()
