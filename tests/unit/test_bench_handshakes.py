"""The figures of `kproxy bench handshakes` (chaos.bench.handshakes), from hand-made rounds."""

from __future__ import annotations

import pytest

from chaos.bench.handshakes import figures

pytestmark = pytest.mark.unit


def test_figures_per_worker_count():
    # (done, failed, wall s, node CPU s) per round
    out = figures({1: [(1000, 0, 10.0, 2.0), (1200, 1, 10.0, 2.0)], 2: [(1500, 0, 10.0, 5.0)]}, clients=4)
    w1, w2 = out["arms"]["w1"], out["arms"]["w2"]
    assert w1["handshakes_per_s"] == 110 and w1["handshakes_per_s_runs"] == [100, 120]
    assert w1["handshakes_per_core_s"] == 550 and w1["node_cpu_ms_per_handshake"] == 1.818
    assert w1["failed"] == 1 and w1["node_cores_busy"] == 0.2
    assert w2["handshakes_per_core_s"] == 300 and w2["node_cores_busy"] == 0.5
    assert out["load"] == {"clients": 4}


def test_no_handshake_gives_no_rate():
    row = figures({1: [(0, 3, 10.0, 0.0)]})["arms"]["w1"]
    assert row["handshakes_per_core_s"] is None and row["node_cpu_ms_per_handshake"] is None and row["failed"] == 3
