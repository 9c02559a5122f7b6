"""Who waited for the connect pacing's turns: the nodes' per-turn trace, by client source.

With ``logging.level = "DEBUG"`` a node logs one ``upstream connect turn`` line per
upstream connect (proxy.datapath): the client's source address, how long the connect
waited in line for a turn (``waited_ms``), how long the connect took (``connect_ms``),
how long the turn was held after it (``held_ms``) and how the turn ended. This reads
those lines from the nodes' JSON logs and sums them up per class of source (the
failover bench's light clients bind 127.0.0.100 on; the real clients do not bind)::

    python -m chaos.bench.storm_turns STATE_DIR/logs/*.log
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from chaos.bench.storm_load import source_addresses
from chaos.measures import percentile

TRACE_MESSAGE = "upstream connect turn"


@attrs.frozen
class TurnStats:
    turns: int
    waited: int  # turns that waited in line at all
    waited_ms: dict[str, float | None]  # p50 / p99 / max over every turn
    connect_ms: dict[str, float | None]
    held_ms: dict[str, float | None]
    ended: dict[str, int]  # how the turns ended: answered, held, failed, ...


def light_or_other(source: str, light: frozenset[str] = frozenset(source_addresses(155))) -> str:
    """"light" for the light clients' bound loopback sources (127.0.0.100 on), else "other"."""
    return "light" if source in light else "other"


def _stats(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "max": max(values) if values else None}


def turn_stats(lines: Iterable[str], classify: Callable[[str], str] = light_or_other) -> dict[str, TurnStats]:
    """Per class of source, the turns traced in ``lines`` (JSON log lines; others skipped)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if TRACE_MESSAGE not in line:
            continue
        record = json.loads(line)
        if record.get("msg") != TRACE_MESSAGE:
            continue
        rows.setdefault(classify(str(record.get("source"))), []).append(record)
    out = {}
    for cls, records in sorted(rows.items()):
        ended: dict[str, int] = {}
        for r in records:
            ended[r["how"]] = ended.get(r["how"], 0) + 1
        out[cls] = TurnStats(
            turns=len(records), waited=sum(1 for r in records if r["waited_ms"] > 0),
            waited_ms=_stats([r["waited_ms"] for r in records]),
            connect_ms=_stats([r["connect_ms"] for r in records if r["connect_ms"] is not None]),
            held_ms=_stats([r["held_ms"] for r in records if r["held_ms"] is not None]), ended=ended)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="the nodes' JSON logs")
    args = parser.parse_args(argv)

    def lines() -> Iterable[str]:
        for path in args.logs:
            with path.open() as f:
                yield from f

    print(json.dumps({cls: attrs.asdict(s) for cls, s in turn_stats(lines()).items()}, indent=1))


if __name__ == "__main__":
    main()
