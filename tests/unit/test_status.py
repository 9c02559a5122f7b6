"""proxy.status: the typed /status and fleet view (JSON in and out in one place)."""

from __future__ import annotations

import pytest

from proxy.status import BrokerRow, FleetView, MemberRow, NodeEndpoint, NodeStatus, StatusError

pytestmark = pytest.mark.unit


def node_json(node: str, *, role: str, term: int, epoch: int, assignment: dict[str, str],
              fleet: bool = True) -> dict:
    d = {
        "node": node, "pid": 4242, "ready": True, "bootstrap": f"{node}.example:9092",
        "listeners": [1, 2, 3], "unbound": [], "standing_in": [], "connections": 5, "draining": False,
        "brokers": [{"id": b, "host": "127.0.0.1", "port": 19091 + b, "rack": None,
                     "advertised": f"h:{9100 + b}"} for b in (1, 2, 3)],
        "epoch": epoch, "assignment": assignment, "role": role, "term": term, "leader": "p1",
        "has_quorum": True, "admin_endpoints": {"p1": "http://127.0.0.11:9400"},
    }
    if fleet:
        d.update({"degraded": False, "committed_epoch": epoch, "committed_assignment": assignment,
                  "members": {p: {"host": f"127.0.0.1{i}", "bootstrap_port": 9092, "rack": None, "up": p != "p3",
                                  "draining": p == "p2"} for i, p in enumerate(("p1", "p2", "p3"), 1)},
                  "draining_nodes": ["p2"], "peers": {"p2": {"live": True}}, "events": [{"t": 1.0, "event": "role"}],
                  "now": 12.5, "effective": {"epoch": epoch}})
    return d


def test_round_trip_keeps_every_field():
    d = node_json("p1", role="leader", term=3, epoch=7, assignment={"2": "p2", "1": "p1", "3": "p1"})
    s = NodeStatus.from_json(d)
    assert s.in_fleet and s.identities() == (1, 3)
    assert s.members["p2"] == MemberRow("127.0.0.12", 9092, None, True, True)
    assert s.brokers[0] == BrokerRow(1, "127.0.0.1", 19092, None, "h:9101")
    back = s.to_json()
    assert back["assignment"] == {"1": "p1", "2": "p2", "3": "p1"}  # sorted by broker id
    assert back["draining"] is False and back["draining_nodes"] == ["p2"]
    assert NodeStatus.from_json(back) == s
    assert s.floating is None and back["floating"] is None
    floating = {"held": {"p1": "198.18.0.11", "p3": "198.18.0.13"}, "fenced": False, "tickles_sent": 4}
    with_floating = NodeStatus.from_json({**d, "floating": floating})
    assert with_floating.floating == floating and NodeStatus.from_json(with_floating.to_json()) == with_floating


def test_a_node_without_a_fleet():
    s = NodeStatus.from_json(node_json("p1", role="standalone", term=0, epoch=0, assignment={"1": "p1"}, fleet=False))
    assert not s.in_fleet and s.members == {} and s.committed_assignment is None


def test_bad_shape_is_a_status_error():
    with pytest.raises(StatusError):
        NodeStatus.from_json({"node": "p1"})
    d = node_json("p1", role="leader", term=1, epoch=1, assignment={})
    d["brokers"] = [{"id": "x", "host": "h", "port": 1}]
    with pytest.raises(StatusError):
        NodeStatus.from_json(d)


def endpoints():
    return [NodeEndpoint("p1", "127.0.0.11", 100, True), NodeEndpoint("p2", "127.0.0.12", 101, True),
            NodeEndpoint("p3", "127.0.0.13", 102, False)]


def test_fleet_view_takes_the_leaders_table():
    a_old = {"1": "p1", "2": "p2", "3": "p3"}
    a_new = {"1": "p1", "2": "p1", "3": "p2"}
    statuses = {
        "p1": NodeStatus.from_json(node_json("p1", role="leader", term=4, epoch=9, assignment=a_new)),
        "p2": NodeStatus.from_json(node_json("p2", role="follower", term=4, epoch=10, assignment=a_old)),
        "p3": None,
    }
    view = FleetView.build(endpoints(), statuses, ["127.0.0.11:9092"])
    assert view.leader == "p1" and view.epoch == 9
    assert [n.identities for n in view.nodes] == [(1, 2), (3,), ()]
    assert [n.role for n in view.nodes] == ["leader", "follower", "unreachable"]
    assert view.node("p2").draining is True and view.node("p3").up is False
    assert view.loads() == {"p1": 2}  # p2 drains, p3 does not answer
    assert view.health_problems() == ["node p3 unreachable", "nodes disagree on the epoch: [9, 10]"]
    assert view.health_problems(allow_dead=True) == ["nodes disagree on the epoch: [9, 10]"]
    assert view.to_json()["nodes"][0]["identities"] == [1, 2]


def test_fleet_view_names_an_identity_on_a_dead_node_and_a_missing_leader():
    owners = {"1": "p3", "2": "p1"}
    s = node_json("p1", role="follower", term=2, epoch=3, assignment=owners)
    s["leader"] = None
    view = FleetView.build(endpoints(), {"p1": NodeStatus.from_json(s), "p2": None, "p3": None}, [])
    assert view.health_problems(allow_dead=True) == [
        "no Raft leader", "broker 1 assigned to unreachable node p3", "broker 3 unassigned"]
