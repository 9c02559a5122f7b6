"""chaos.bench.storm_turns: the connect pacing's per-turn trace summed up by client source."""

from __future__ import annotations

import json

import pytest

from chaos.bench.storm_turns import light_or_other, turn_stats

pytestmark = [pytest.mark.unit]


def _line(source: str, waited: float, connect: float | None, held: float | None, how: str) -> str:
    return json.dumps({"ts": "2026-11-24T13:00:00.000Z", "level": "DEBUG", "msg": "upstream connect turn",
                       "source": source, "broker": "127.0.0.1:19092", "how": how, "limit": 20,
                       "waited_ms": waited, "connect_ms": connect, "held_ms": held})


def test_turns_are_summed_up_per_class_of_source_and_other_lines_are_skipped() -> None:
    lines = [
        _line("127.0.0.100", 0.0, 2.0, 10.0, "answered"),
        _line("127.0.0.119", 300.0, 4.0, 250.0, "held"),
        json.dumps({"msg": "closing connection", "peer": "127.0.0.1:5"}),
        _line("127.0.0.1", 0.0, 1.0, 5.0, "answered"),
        _line("127.0.0.1", 80.0, None, None, "abandoned"),
        "not json, and no trace message either",
    ]
    stats = turn_stats(lines)
    assert set(stats) == {"light", "other"}
    light, other = stats["light"], stats["other"]
    assert (light.turns, light.waited, light.ended) == (2, 1, {"answered": 1, "held": 1})
    assert light.waited_ms["max"] == 300.0 and light.held_ms["p50"] == pytest.approx(130.0)
    assert (other.turns, other.waited, other.ended) == (2, 1, {"answered": 1, "abandoned": 1})
    assert other.connect_ms == {"p50": 1.0, "p99": 1.0, "max": 1.0}  # the abandoned turn never connected


def test_the_light_clients_sources_are_light_and_the_rest_other() -> None:
    assert [light_or_other(s) for s in ("127.0.0.100", "127.0.0.254", "127.0.0.1", "127.0.0.99", "::1")] == [
        "light", "light", "other", "other", "other"]
