"""`kproxy cluster status` at 80 columns: one line per node, draining and down marked, ports shown."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from cli.fleet_cmd import render_status, stand_in_summary
from proxy.status import FleetView, NodeEndpoint, NodeStatus
from tests.unit.test_status import node_json

pytestmark = pytest.mark.unit


def _view() -> FleetView:
    """p1 leads and stands in for down p3's bootstrap and three identity ports; p2 drains."""
    owners = {"1": "p1", "2": "p1", "3": "p1"}
    p1 = node_json("p1", role="leader", term=4, epoch=9, assignment=owners)
    p1["standing_in"] = ["127.0.0.13:9092", "127.0.0.13:9101", "127.0.0.13:9102", "127.0.0.13:9103",
                         "127.0.0.12:9102"]
    p2 = node_json("p2", role="follower", term=4, epoch=9, assignment=owners)
    statuses = {"p1": NodeStatus.from_json(p1), "p2": NodeStatus.from_json(p2), "p3": None}
    endpoints = [NodeEndpoint("p1", "127.0.0.11", 100, True), NodeEndpoint("p2", "127.0.0.12", 101, True),
                 NodeEndpoint("p3", "127.0.0.13", 102, False)]
    return FleetView.build(endpoints, statuses, ["127.0.0.11:9092", "127.0.0.12:9092", "127.0.0.13:9092"])


def _render(view: FleetView, problems: list[str]) -> list[str]:
    buf = io.StringIO()
    render_status(view, problems, Console(file=buf, width=80, color_system=None))
    return buf.getvalue().splitlines()


def test_stand_ins_are_summarised_per_vacant_node():
    view = _view()
    assert stand_in_summary(view, view.node("p1")) == "p2 ×1, p3 ×4"
    assert stand_in_summary(view, view.node("p2")) == "—"


def test_status_fits_80_columns_one_line_per_node():
    view = _view()
    lines = _render(view, view.health_problems())
    assert max(len(line) for line in lines[:-1]) <= 80, "\n".join(lines)
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("p1", "p2", "p3")}
    assert set(rows) == {"p1", "p2", "p3"}  # each node's row is on one line, no wrapped continuation
    assert "127.0.0.11:9092" in rows["p1"] and "leader" in rows["p1"] and "p2 ×1, p3 ×4" in rows["p1"]
    assert "1,2,3" in rows["p1"]
    assert "127.0.0.12:9092" in rows["p2"] and "draining" in rows["p2"]
    assert "DOWN" in rows["p3"] and "127.0.0.13:9092" in rows["p3"]
    assert "term 4" in lines[0] + lines[1] and "leader p1" in lines[0] + lines[1]
    assert lines[-1].startswith("unhealthy:") and "node p3 unreachable" in lines[-1]
