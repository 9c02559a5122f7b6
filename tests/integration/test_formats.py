"""Node-by-node upgrades (issue 15, item 3) with real processes in front of the session's Kafka.

One commit plays two releases through ``KPROXY_FORMATS`` (membership.formats): the fleet of three
runs this release (state format 1); a node of the "next release" (formats 1..2) replaces one of
them and serves; a node that reads only format 2 is refused with a message naming what it
supports; once every node is on the next release the leader commits format 2, and a node of the
old release is then refused in turn."""

from __future__ import annotations

import pytest

from chaos.clients import batch as clients
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

FIRST_IP = 101  # nodes on 127.0.0.101-103


@pytest.fixture(scope="module")
def fleet(kafka_cluster, tmp_path_factory):
    from chaos.testbed.fleet import LocalFleet

    f = LocalFleet.up(tmp_path_factory.mktemp("formats-fleet"), kafka_bootstrap=kafka_cluster.bootstrap,
                      timeout=120, first_ip=FIRST_IP)
    try:
        yield f
    finally:
        f.down()



def _restart(fleet, node_id: str, formats: str | None, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Stop the node (graceful) and start it again claiming ``formats`` (None: this release's)."""
    node = fleet.nodes[node_id]
    node.stop()
    if formats is None:
        monkeypatch.delenv("KPROXY_FORMATS", raising=False)
    else:
        monkeypatch.setenv("KPROXY_FORMATS", formats)
    node.start()


def _refused(fleet, node_id: str, fleet_format: int, supported: str) -> None:  # type: ignore[no-untyped-def]
    node = fleet.nodes[node_id]
    assert node.wait_gone(30.0), f"{node_id} kept running:\n{node.log_tail()}"
    assert node._proc is not None and node._proc.returncode == 2
    log = node.log_tail(200)
    assert f"node {node_id} supports state formats {supported}, the fleet's committed format is {fleet_format}" in log
    assert "Traceback" not in log


def test_a_next_release_node_joins_and_serves_an_incompatible_one_is_refused(fleet, kafka_cluster, topic_name,
                                                                             monkeypatch):
    status = fleet.status("p1")
    assert status.state_format == 1
    assert status.member_formats == {"p1": "1", "p2": "1", "p3": "1"}

    # A node that reads format 2 only cannot read the fleet's state: refused, exit 2, one line.
    _restart(fleet, "p3", "2", monkeypatch)
    _refused(fleet, "p3", 1, "2")

    # The next release (1..2) joins the fleet of the current one, which stays at format 1, and serves.
    _restart(fleet, "p3", "1-2", monkeypatch)
    fleet.nodes["p3"].wait_ready(60)
    fleet.wait_balanced(60)
    status = fleet.status("p3")
    assert status.supported_formats == "1..2" and status.state_format == 1
    assert status.member_formats["p3"] == "1..2"
    assert status.identities(), "the next-release node advertises no identity"
    kafka_cluster.create_topic(topic_name, partitions=3)
    acks = clients.produce("aiokafka", f"{fleet.node_address('p3')}:9092", topic_name, 20, prefix=0)
    assert sorted(a.value for a in acks) == sorted(clients.values(0, 20))
    assert fleet.status("p1").state_format == 1  # p1 and p2 still read format 1 only

    # The rest of the rolling upgrade: once every node reads 2, the leader commits format 2.
    for node_id in ("p1", "p2"):
        _restart(fleet, node_id, "1-2", monkeypatch)
        fleet.nodes[node_id].wait_ready(60)
        fleet.wait_healthy(60)
    wait_for(lambda: all(s is not None and s.state_format == 2 for s in fleet.statuses().values()),
              "format 2 committed on every node")
    view = fleet.fleet_view().to_json()  # what `kproxy cluster status --json` prints
    assert view["state_format"] == 2 and view["member_formats"] == {"p1": "1..2", "p2": "1..2", "p3": "1..2"}

    # Now a node of the old release cannot read the fleet's state: refused in turn.
    _restart(fleet, "p2", None, monkeypatch)
    _refused(fleet, "p2", 2, "1")
    _restart(fleet, "p2", "1-2", monkeypatch)
    fleet.nodes["p2"].wait_ready(60)
    fleet.wait_balanced(60)
