"""The supervisor's decisions about its data-path workers, without I/O (proxy.supervisor runs them).

* :class:`AckBook`: which serving map every ready worker has acknowledged: the
  node reports a map as applied only then.
* :class:`RestartPolicy`: how long to wait before restarting a worker that
  exited (bounded exponential backoff, reset once a worker has run a while).
* :func:`merge_datapath_status` and :func:`merge_metric_families`: one node's
  status and Prometheus counters from its workers' (sums: an operator sees the
  node's totals, whatever W is); :class:`RetiredCounters` keeps the totals
  from going down when a worker exits (its counts would vanish with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from membership.serving import ServingMap
from proxy.datapath import DataPathStatus


class AckBook:
    """Maps pushed to the workers and the newest version each ready worker acknowledged.

    A worker counts from the moment it is ready (listeners bound and the map it
    was started with applied) until it exits; one that is starting does not
    serve yet, so it does not hold the node's applied map back."""

    def __init__(self) -> None:
        self.latest: ServingMap | None = None
        self._maps: dict[int, ServingMap] = {}  # version -> map, the ones some ready worker may still be on
        self._acked: dict[int, int] = {}  # ready worker -> newest version it applied (-1: none)

    def pushed(self, serving: ServingMap) -> bool:
        """A new map to push; False (ignore it) when it is older than the latest."""
        if self.latest is not None and serving.version < self.latest.version:
            return False
        self.latest = serving
        self._maps[serving.version] = serving
        return True

    def ready(self, worker: int, version: int) -> None:
        self._acked[worker] = version
        self._forget()

    def acked(self, worker: int, version: int) -> None:
        if worker in self._acked and version > self._acked[worker]:
            self._acked[worker] = version
            self._forget()

    def left(self, worker: int) -> None:
        self._acked.pop(worker, None)
        self._forget()

    def version_of(self, worker: int) -> int | None:
        return self._acked.get(worker)

    def behind(self) -> list[int]:
        """Ready workers that have not acknowledged the latest map (push it to them)."""
        if self.latest is None:
            return []
        return sorted(w for w, v in self._acked.items() if v < self.latest.version)

    def applied(self) -> ServingMap | None:
        """The newest map every ready worker has applied; None before the first."""
        if not self._acked:
            return None
        floor = min(self._acked.values())
        versions = [v for v in self._maps if v <= floor]
        return self._maps[max(versions)] if versions else None

    def _forget(self) -> None:
        """Keep the maps from the applied one on (older ones can no longer be reported)."""
        if not self._acked:
            return
        floor = min(self._acked.values())
        keep = max((v for v in self._maps if v <= floor), default=None)
        for v in [v for v in self._maps if keep is not None and v < keep]:
            del self._maps[v]


@attrs.define
class _Runs:
    started_at: float
    failures: int = 0


class RestartPolicy:
    """Delay before restarting a worker that exited.

    ``first_s`` after the first exit, doubling for each exit of a worker that
    had run less than ``stable_s``, at most ``max_s``; a worker that ran
    ``stable_s`` or longer starts again from ``first_s``. A crash loop thus
    costs a few restarts a minute, a rare crash is repaired at once."""

    def __init__(self, *, first_s: float = 0.1, max_s: float = 10.0, stable_s: float = 30.0) -> None:
        self.first_s, self.max_s, self.stable_s = first_s, max_s, stable_s
        self._runs: dict[int, _Runs] = {}
        self.restarts: dict[int, int] = {}

    def started(self, worker: int, now: float) -> None:
        runs = self._runs.setdefault(worker, _Runs(now))
        runs.started_at = now

    def exited(self, worker: int, now: float) -> float:
        """Seconds to wait before starting ``worker`` again."""
        runs = self._runs.setdefault(worker, _Runs(now))
        runs.failures = 1 if now - runs.started_at >= self.stable_s else runs.failures + 1
        self.restarts[worker] = self.restarts.get(worker, 0) + 1
        return min(self.max_s, self.first_s * 2 ** (runs.failures - 1))


def merge_datapath_status(parts: Sequence[DataPathStatus]) -> DataPathStatus:
    """The node's data path from its workers': connections (and those moving) summed; an identity is
    bound when every worker has it, unbound when any worker lacks it; draining
    when any worker drains; brokers from the worker that knows most; the floating
    addresses' view from the first worker that has one."""
    if not parts:
        raise ValueError("no worker status to merge")
    first = parts[0]
    bound = set(first.listeners).intersection(*(p.listeners for p in parts[1:]))
    return DataPathStatus(
        node=first.node, bootstrap=first.bootstrap, listeners=tuple(sorted(bound)),
        unbound=tuple(sorted(set().union(*(p.unbound for p in parts)))),
        standing_in=tuple(sorted(set().union(*(p.standing_in for p in parts)))),
        connections=sum(p.connections for p in parts), moving=sum(p.moving for p in parts),
        draining=any(p.draining for p in parts),
        brokers=max((p.brokers for p in parts), key=len),
        floating=next((p.floating for p in parts if p.floating is not None), None))


def merge_metric_families(workers: Iterable[Iterable[Metric]]) -> list[Metric]:
    """One node's metric families from each worker's: samples with the same name
    and labels are added up (counters and the active-connections gauge are
    per-process amounts of the same thing); ``_created`` samples keep the earliest."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for worker in workers:
        for family in worker:
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            merged = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in merged:
                    merged[key] = s.value
                elif s.name.endswith("_created"):
                    merged[key] = min(merged[key], s.value)
                else:
                    merged[key] += s.value
    out = []
    for name, family in families.items():
        family.samples = [Sample(n, dict(labels), v) for (n, labels), v in values[name].items()]
        out.append(family)
    return out


def counters_only(families: Iterable[Metric]) -> list[Metric]:
    """The counter samples of ``families`` (no gauges, no ``_created``)."""
    out = []
    for family in families:
        if family.type != "counter":
            continue
        kept = Metric(family.name, family.documentation, family.type, family.unit)
        kept.samples = [s for s in family.samples if not s.name.endswith("_created")]
        out.append(kept)
    return out


class RetiredCounters:
    """The counters of workers that exited, as last seen, added to the node's totals.

    Each scrape remembers every worker's counters; when a worker exits, the
    last ones seen are kept. A scrape after a crash thus never shows a node
    total below the one before it (Prometheus would read a counter reset);
    what the worker counted after the last scrape is lost with it."""

    def __init__(self) -> None:
        self._last: dict[int, list[Metric]] = {}
        self._retired: list[Metric] = []

    def seen(self, worker: int, families: list[Metric]) -> None:
        self._last[worker] = families

    def exited(self, worker: int) -> None:
        last = self._last.pop(worker, None)
        if last:
            self._retired = merge_metric_families([self._retired, counters_only(last)])

    def totals(self, live: Iterable[list[Metric]]) -> list[Metric]:
        """The node's families: the live workers' and the retired counters, added up."""
        return merge_metric_families([*live, self._retired])
