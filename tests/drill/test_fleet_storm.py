"""A connection storm against one node of a real fleet (issue 12): every client is served
and the fleet's membership does not notice — no node suspected, no leader change, no
lost quorum, while the node answers thousands of new connections at once.

Loopback only, bounded: 3,000 light clients (connect, ApiVersions, Metadata, one small
Produce), each with a 30 s deadline, against a 3-node fleet on 127.0.0.31-33."""

from __future__ import annotations

import threading
import time

import attrs
import pytest
import uvloop

from chaos.bench.storm import leader_address, raise_nofile
from chaos.bench.storm_load import light_requests, source_addresses, storm
from chaos.testbed.fleet import LocalFleet
from proxy.status import NodeStatus

pytestmark = [pytest.mark.drill, pytest.mark.integration, pytest.mark.timeout(240)]

STORM_CLIENTS = 3000
FIRST_IP = 31
SAMPLE_EVERY_S = 0.1


@pytest.fixture(scope="module")
def fleet(kafka_cluster, tmp_path_factory):
    raise_nofile(4 * STORM_CLIENTS)  # the nodes inherit it: two descriptors per client
    f = LocalFleet.up(tmp_path_factory.mktemp("storm-fleet"), kafka_bootstrap=kafka_cluster.bootstrap,
                      first_ip=FIRST_IP, timeout=90)
    try:
        yield f
    finally:
        f.down()


@attrs.frozen
class MembershipSample:
    """What one node said about the fleet at one instant of the storm."""

    node: str
    answered: bool
    role: str | None = None
    leader: str | None = None
    term: int | None = None
    has_quorum: bool = False
    degraded: bool = False
    suspected: tuple[str, ...] = ()  # peers its heartbeat does not see live

    @classmethod
    def of(cls, node: str, status: NodeStatus | None) -> MembershipSample:
        if status is None:
            return cls(node, answered=False)
        suspected = tuple(sorted(p for p, view in status.peers.items() if not view.get("live")))
        return cls(node, True, status.role, status.leader, status.term, status.has_quorum, status.degraded,
                   suspected)


class MembershipSampler:
    """Samples every node's /status on a thread until stopped."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.samples: list[MembershipSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="membership-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for node, status in self.fleet.statuses(timeout=2.0).items():
                self.samples.append(MembershipSample.of(node, status))
            self._stop.wait(SAMPLE_EVERY_S)

    def __enter__(self) -> MembershipSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _membership_events(fleet: LocalFleet, since_ns: int) -> list[dict]:
    """Every node's peer_down / role / degraded events stamped after ``since_ns`` (wall clock)."""
    out = []
    for node, status in fleet.statuses(timeout=2.0).items():
        assert status is not None, f"{node} does not answer /status"
        out += [{"node": node, **e} for e in status.events
                if e.get("ts_ns", 0) >= since_ns and e.get("event") in ("peer_down", "role", "degraded")]
    return out


def test_a_storm_against_one_node_leaves_the_fleet_membership_untouched(fleet, kafka_cluster, topic_name):
    kafka_cluster.create_topic(topic_name, partitions=1)
    before = fleet.wait_healthy(30)
    first = fleet.nodes["p1"]
    leader_broker, host, port = leader_address(first.host, 9092, topic_name)
    target = before.assignment[str(leader_broker)]
    assert host == fleet.node_address(target)  # the storm hits the node that owns the partition leader
    statuses = fleet.statuses()
    raft_leader = {s.leader for s in statuses.values() if s is not None}
    assert len(raft_leader) == 1 and None not in raft_leader, statuses
    terms = {s.term for s in statuses.values() if s is not None}

    started_ns = time.time_ns()
    with MembershipSampler(fleet) as sampler:
        result = uvloop.run(storm(host, port, STORM_CLIENTS, light_requests(topic_name),
                                  sources=source_addresses(), deadline_s=30))
    assert (result.served, result.failed, result.errors) == (STORM_CLIENTS, 0, {})

    # A node busy with the storm may answer /status late (the sampler gives up after 2 s):
    # such a sample says nothing; every node must have answered during the storm, and
    # the events below cover the gaps.
    samples = [s for s in sampler.samples if s.answered]
    assert {s.node for s in samples} == set(fleet.nodes), sampler.samples[-10:]
    unhealthy = [s for s in samples if not (s.has_quorum and not s.degraded and not s.suspected
                                            and s.leader in raft_leader and s.term in terms)]
    assert unhealthy == [], unhealthy[:10]
    assert _membership_events(fleet, started_ns) == []
    assert fleet.wait_healthy(10).assignment == before.assignment  # no identity moved
