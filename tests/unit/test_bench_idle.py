"""The idle bench's arithmetic: CPU seconds over wall seconds, per node, mean and max."""

from __future__ import annotations

import pytest

from chaos.bench.idle import IdleCpu, cpu_fractions

pytestmark = pytest.mark.unit


def test_cpu_fraction_is_cpu_seconds_over_the_window():
    before = {"p1": 10.0, "p2": 3.0, "p3": 7.5}
    after = {"p1": 10.6, "p2": 3.12, "p3": 7.5}
    fractions = cpu_fractions(before, after, 60.0)
    assert fractions == pytest.approx({"p1": 0.01, "p2": 0.002, "p3": 0.0})
    assert cpu_fractions({"p1": 1.0, "gone": 1.0}, {"p1": 1.3}, 30.0) == pytest.approx({"p1": 0.01})
    with pytest.raises(ValueError):
        cpu_fractions(before, after, 0.0)


def test_idle_json_has_the_issue_keys():
    idle = IdleCpu(60.0, {"p1": 0.01, "p2": 0.002, "p3": 0.003}, "p1")
    out = idle.to_json()
    assert out["idle_cpu_fraction"] == pytest.approx(0.005)
    assert out["idle_cpu_fraction_max"] == 0.01
    assert out["idle_cpu_fraction_per_node"] == {"p1": 0.01, "p2": 0.002, "p3": 0.003}
    assert (out["idle_leader"], out["idle_window_s"], out["idle_nodes"]) == ("p1", 60.0, 3)
