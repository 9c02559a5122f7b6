"""The supervisor's broker set (proxy.supervisor, W workers): what any ready worker knows. New
brokers go to the other workers and to the member; a broker is forgotten, and the member told,
only once every worker has forgotten it (each worker's roster waits out the grace period)."""

from __future__ import annotations

import pytest

from proxy.config import parse
from proxy.supervisor import Supervisor, WorkerHandle
from proxy.upstream import UpstreamBroker
from proxy.worker_wire import LearnBrokers
from topology import Broker

pytestmark = pytest.mark.unit

B = {i: UpstreamBroker(i, "127.0.0.1", 19090 + i, None) for i in range(1, 5)}


class Recorder:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)


class FakeMember:
    def __init__(self) -> None:
        self.reports: list[list[int]] = []

    def set_brokers(self, brokers: list[Broker]) -> None:
        self.reports.append([b.id for b in brokers])


def supervisor(workers: int = 2) -> tuple[Supervisor, dict[int, Recorder], FakeMember]:
    config = parse({"upstream": {"bootstrap": ["127.0.0.1:19091"]}, "ports": {"base": 9100},
                    "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092, "workers": workers}]})
    sup = Supervisor(config, "p1")
    channels = {i: Recorder() for i in range(workers)}
    sup.handles = {i: WorkerHandle(i, None, channels[i], ready=True) for i in range(workers)}  # type: ignore[arg-type]
    sup.member = FakeMember()
    return sup, channels, sup.member


def test_a_new_broker_reaches_the_other_workers_and_the_member():
    sup, channels, member = supervisor()
    sup._learn(0, (B[1], B[2]))
    sup._learn(1, (B[1], B[2]))
    assert member.reports == [[1, 2]]  # the second worker told nothing new
    sup._learn(1, (B[1], B[2], B[3]))
    assert member.reports[-1] == [1, 2, 3]
    assert LearnBrokers((B[3],)) in channels[0].sent


def test_a_broker_is_forgotten_only_when_every_worker_forgot_it():
    sup, channels, member = supervisor()
    for w in (0, 1):
        sup._learn(w, (B[1], B[2], B[3]))
    for c in channels.values():
        c.sent.clear()
    sup._learn(0, (B[1], B[2]))
    assert sorted(sup.brokers) == [1, 2, 3] and member.reports[-1] == [1, 2, 3]
    sup._learn(1, (B[1], B[2]))
    assert sorted(sup.brokers) == [1, 2] and member.reports[-1] == [1, 2]
    assert len(member.reports) == 2
    # Only what is new travels to the workers: the forgetting alone sends them nothing.
    assert [m for c in channels.values() for m in c.sent] == []


def test_a_broker_at_a_new_address_is_passed_on():
    sup, channels, member = supervisor()
    sup._learn(0, (B[1],))
    moved = UpstreamBroker(1, "127.0.0.9", 19999, None)
    sup._learn(0, (moved,))
    assert sup.brokers[1] == moved and LearnBrokers((moved,)) in channels[1].sent
