"""deploy/: the Prometheus alerting rules and the Grafana dashboard watch metrics a node exports,
and the rules do what their promtool unit tests say (skipped, with the reason, without promtool)."""

from __future__ import annotations

import json
import re
from collections import Counter
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from membership.serving import ServingMap
from proxy.fleet_metrics import FleetCollector, FleetSample
from proxy.metrics import ProxyMetrics
from topology import PortScheme, ProxyNode

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "kproxy-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "kproxy-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "kproxy-dashboard.json"
METRIC = re.compile(r"\b(kproxy_[a-z_]+)\b")


def _nodes() -> tuple[ProxyNode, ...]:
    return tuple(ProxyNode(p, f"127.0.0.1{i}", 9092, ports=PortScheme(base=9100)) for i, p in enumerate(("p1", "p2", "p3"), 1))


def _node_metrics(sample: FleetSample) -> ProxyMetrics:
    metrics = ProxyMetrics("p1")
    metrics.registry.register(FleetCollector("p1", lambda: sample))
    return metrics


def _samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in family.samples}


def test_fleet_gauges_from_the_serving_map():
    """p3 down, p2 draining, p1 owns brokers 1-2; broker 3 known upstream has no owner; 2 has no listener."""
    serving = ServingMap(epoch=7, owners={1: "p1", 2: "p1"}, nodes=_nodes(), vacant=frozenset({"p2", "p3"}),
                         draining=frozenset({"p2"}), degraded=True)
    got = _samples(_node_metrics(FleetSample(serving, known_brokers=(1, 2, 3), unbound=(2,), draining=False)))
    node = (("node", "p1"),)
    assert got[("kproxy_fleet_epoch", node)] == 7
    assert got[("kproxy_fleet_degraded", node)] == 1
    assert {m: got[("kproxy_fleet_member_up", (("member", m), *node))] for m in ("p1", "p2", "p3")} == {
        "p1": 1, "p2": 1, "p3": 0}
    assert {m: got[("kproxy_fleet_member_draining", (("member", m), *node))] for m in ("p1", "p2", "p3")} == {
        "p1": 0, "p2": 1, "p3": 0}
    assert (got[("kproxy_identities", node)], got[("kproxy_identities_unassigned", node)],
            got[("kproxy_identities_unbound", node)], got[("kproxy_draining", node)]) == (2, 1, 1, 0)


def _exported_names() -> set[str]:
    metrics = _node_metrics(FleetSample(ServingMap(nodes=_nodes()), (), (), False))
    metrics.accepted("bootstrap")
    metrics.refused("rate")
    metrics.protocol_error("client")
    metrics.upstream_errors.labels("p1").inc()
    metrics.drained.labels("p1").inc()
    metrics.request_counts[3] = 1
    metrics.watch_rewrites(Counter({3: 1}))
    return {name for name, _ in _samples(metrics)}


@pytest.mark.parametrize("path", [RULES, DASHBOARD], ids=["alert rules", "dashboard"])
def test_every_metric_watched_is_one_a_node_exports(path):
    if path == DASHBOARD:
        text = " ".join(t["expr"] for p in json.loads(path.read_text())["panels"] for t in p["targets"])
    else:
        text = path.read_text()
    watched = set(METRIC.findall(text))
    assert watched, f"no kproxy metric in {path}"
    assert watched <= _exported_names(), f"{path.name} watches metrics no node exports: {watched - _exported_names()}"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    return path


def test_promtool_checks_the_rules():
    result = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 6 rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass():
    result = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
