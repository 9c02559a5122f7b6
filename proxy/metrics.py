"""Per-node data path counters (Prometheus), served by the admin endpoint.

Each node owns its own ``CollectorRegistry`` so several nodes can live in one
process (tests). The per-request and per-read counters (``kproxy_requests``,
``kproxy_bytes``) are plain ints and a dict on the hot path, read by a custom
collector at scrape time: a ``Counter.labels(...).inc()`` (a lock and a method
call or two) per request is a visible share of the proxy's CPU for small
requests. The rarer events (connections, errors, drains) stay ordinary
Prometheus counters.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class ProxyMetrics:
    """Hot-path tallies (written from the event loop thread, read at scrape time):

    * ``bytes_to_broker`` / ``bytes_to_client``: ints, ``+=`` per read;
    * ``spliced_bytes``: the part of ``bytes_to_client`` moved with splice(2)
      (proxy.splice), never read into the process;
    * ``request_counts``: api_key -> requests, see :meth:`count_requests`.
    """

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["node"]
        self.connections = Counter("kproxy_connections", "Client connections accepted", labels + ["listener"],
                                   registry=self.registry)
        self.connections_active = Gauge("kproxy_connections_active", "Open client connections", labels,
                                        registry=self.registry)
        self.connections_refused = Counter("kproxy_connections_refused",
                                           "Client connections refused at accept (proxy.admission), by limit",
                                           labels + ["reason"], registry=self.registry)
        self.protocol_errors = Counter("kproxy_protocol_errors", "Connections closed for a protocol error",
                                       labels + ["side"], registry=self.registry)
        self.upstream_errors = Counter("kproxy_upstream_errors", "Upstream connects or connections that failed",
                                       labels, registry=self.registry)
        self.upstream_connect_waits = Counter(
            "kproxy_upstream_connect_waits",
            "Upstream connects that waited for a turn (proxy.connect_pacing: a bounded number in flight per broker)",
            labels, registry=self.registry).labels(node_id)
        self.upstream_reused = Counter(
            "kproxy_upstream_reused",
            "Broker connections reused: a client connection (or one of its requests) given a kept or "
            "let-go broker connection instead of a new one (proxy.upstream_pool)", labels, registry=self.registry).labels(node_id)
        self.local_answers = Counter(
            "kproxy_local_answers",
            "ApiVersions requests the node answered itself from the broker's last answer, without a broker "
            "connection (limits.api_versions_answer_s; proxy.local_answers)", labels, registry=self.registry).labels(node_id)
        self.coalesced = Counter(
            "kproxy_coalesced_requests",
            "Metadata requests answered with a copy of an identical request's answer, asked at the same time "
            "on the same listener: no broker round trip of their own (limits.coalesce_metadata; "
            "proxy.single_flight)", labels, registry=self.registry).labels(node_id)
        self.accept_waiting = Gauge(
            "kproxy_accept_waiting",
            "Client connections accepted from the kernel but not opened yet (limits.fair_accept: in a line per "
            "client host, proxy.accept_lines); not yet in kproxy_connections_active", labels,
            registry=self.registry).labels(node_id)
        self.drained = Counter("kproxy_connections_drained", "Client connections closed to move them", labels,
                               registry=self.registry)
        self.drain_deferred = Counter("kproxy_drain_close_deferred",
                                      "Drain closes put off because a client request was still unread",
                                      labels, registry=self.registry).labels(node_id)
        self.coordinator_redirects = Counter(
            "kproxy_coordinator_redirects",
            "Client connections closed at their first group-coordinator request because another node serves that "
            "broker identity (the client had the address from an older map): the client looks its coordinator up "
            "again", labels, registry=self.registry).labels(node_id)
        self.coordinator_redirects_declined = Counter(
            "kproxy_coordinator_redirects_declined",
            "Group-coordinator requests forwarded although another node serves that broker identity: the "
            "client's host had come back too often (proxy.drain.RedirectBudget; the fleet's maps may disagree)",
            labels, registry=self.registry).labels(node_id)
        self.active = self.connections_active.labels(node_id)
        # Hot path: plain ints and a dict, exported by _HotCollector.
        self.created = time.time()
        self.bytes_to_broker = 0
        self.bytes_to_client = 0
        self.spliced_bytes = 0
        self.request_counts: dict[int, int] = {}
        self.request_created: dict[int, float] = {}
        self.registry.register(_HotCollector(self))

    def count_requests(self, headers) -> None:  # type: ignore[no-untyped-def]
        """Count requests from a list of :class:`proxy.codec.RequestHeader`."""
        counts = self.request_counts
        for h in headers:
            key = h.api_key
            try:
                counts[key] += 1
            except KeyError:
                self.request_created[key] = time.time()
                counts[key] = 1

    def watch_rewrites(self, counts: Tally[int]) -> None:
        """Export the rewriter's own per-api_key tally (no cost on the hot path)."""
        self.registry.register(_TallyCollector("kproxy_rewrites", "Responses rewritten by api_key",
                                               self.node_id, counts))

    def accepted(self, listener: str) -> None:
        self.connections.labels(self.node_id, listener).inc()

    def refused(self, reason: str) -> None:
        self.connections_refused.labels(self.node_id, reason).inc()

    def protocol_error(self, side: str) -> None:
        self.protocol_errors.labels(self.node_id, side).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HotCollector(Collector):
    """``kproxy_requests``, ``kproxy_bytes`` and ``kproxy_spliced_bytes``, from the node's plain counters
    (same names, labels and ``_created`` samples as prometheus_client Counters)."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        m = self.metrics
        node = m.node_id
        requests = CounterMetricFamily("kproxy_requests", "Requests forwarded by api_key", labels=["node", "api_key"])
        counts = m.request_counts.copy()  # the loop thread may add a key meanwhile
        created = m.request_created.copy()
        for api_key, n in sorted(counts.items()):
            requests.add_metric([node, str(api_key)], n, created=created.get(api_key, m.created))
        yield requests
        forwarded = CounterMetricFamily("kproxy_bytes", "Bytes forwarded", labels=["node", "direction"])
        forwarded.add_metric([node, "client_to_broker"], m.bytes_to_broker, created=m.created)
        forwarded.add_metric([node, "broker_to_client"], m.bytes_to_client, created=m.created)
        yield forwarded
        spliced = CounterMetricFamily("kproxy_spliced_bytes", "Bytes to clients moved with splice(2), a part of"
                                      " kproxy_bytes{direction=broker_to_client}", labels=["node"])
        spliced.add_metric([node], m.spliced_bytes, created=m.created)
        yield spliced


class _TallyCollector(Collector):
    def __init__(self, name: str, doc: str, node_id: str, counts: Tally[int]) -> None:
        self.name, self.doc, self.node_id, self.counts = name, doc, node_id, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["node", "api_key"])
        for api_key, n in sorted(self.counts.items()):
            family.add_metric([self.node_id, str(api_key)], n)
        yield family


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def render_families(families: list[Metric]) -> bytes:
    """Prometheus text of metric families gathered elsewhere (a node's workers, proxy.supervisor)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)


def worker_restarts_family(node_id: str, restarts: dict[int, int]) -> Metric:
    family = CounterMetricFamily("kproxy_worker_restarts", "Data-path worker processes restarted after they exited",
                                 labels=["node", "worker"])
    for worker, n in sorted(restarts.items()):
        family.add_metric([node_id, str(worker)], n)
    return family
