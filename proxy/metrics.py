"""Per-node data path counters (Prometheus), served by the admin endpoint.

Each node owns its own ``CollectorRegistry`` so several nodes can live in one
process (tests). Label children are cached: the hot path does one dict lookup
and one locked add per request, never a label resolution.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class ProxyMetrics:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["node"]
        self.connections = Counter("kproxy_connections", "Client connections accepted", labels + ["listener"],
                                   registry=self.registry)
        self.connections_active = Gauge("kproxy_connections_active", "Open client connections", labels,
                                        registry=self.registry)
        self.requests = Counter("kproxy_requests", "Requests forwarded by api_key", labels + ["api_key"],
                                registry=self.registry)
        self.bytes = Counter("kproxy_bytes", "Bytes forwarded", labels + ["direction"], registry=self.registry)
        self.protocol_errors = Counter("kproxy_protocol_errors", "Connections closed for a protocol error",
                                       labels + ["side"], registry=self.registry)
        self.upstream_errors = Counter("kproxy_upstream_errors", "Upstream connects or connections that failed",
                                       labels, registry=self.registry)
        self.drained = Counter("kproxy_connections_drained", "Client connections closed to move them", labels,
                               registry=self.registry)
        self._requests: dict[int, object] = {}
        self.bytes_up = self.bytes.labels(node_id, "client_to_broker")
        self.bytes_down = self.bytes.labels(node_id, "broker_to_client")
        self.active = self.connections_active.labels(node_id)

    def request(self, api_key: int) -> None:
        child = self._requests.get(api_key)
        if child is None:
            child = self._requests[api_key] = self.requests.labels(self.node_id, str(api_key))
        child.inc()  # type: ignore[attr-defined]

    def watch_rewrites(self, counts: Tally[int]) -> None:
        """Export the rewriter's own per-api_key tally (no cost on the hot path)."""
        self.registry.register(_TallyCollector("kproxy_rewrites", "Responses rewritten by api_key",
                                               self.node_id, counts))

    def accepted(self, listener: str) -> None:
        self.connections.labels(self.node_id, listener).inc()

    def protocol_error(self, side: str) -> None:
        self.protocol_errors.labels(self.node_id, side).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _TallyCollector(Collector):
    def __init__(self, name: str, doc: str, node_id: str, counts: Tally[int]) -> None:
        self.name, self.doc, self.node_id, self.counts = name, doc, node_id, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=["node", "api_key"])
        for api_key, n in sorted(self.counts.items()):
            family.add_metric([self.node_id, str(api_key)], n)
        yield family
