"""The fleet as one node sees it, as Prometheus gauges (read at scrape time, nothing on the hot path).

What the alerting rules in ``deploy/prometheus/`` and the dashboard in ``deploy/grafana/`` watch:

* ``kproxy_fleet_epoch`` — the committed epoch this node serves;
* ``kproxy_fleet_degraded`` — 1 while this node has no quorum and serves on its lease (DESIGN §2.5);
* ``kproxy_fleet_member_up`` / ``kproxy_fleet_member_draining`` {member} — the committed view of
  every member (up: not down; a draining member is up);
* ``kproxy_identities`` — broker identities this node advertises;
* ``kproxy_identities_unassigned`` — brokers this node knows upstream that the map gives no owner;
* ``kproxy_identities_unbound`` — brokers without a listener here (a port taken: never advertised);
* ``kproxy_draining`` — 1 while this node drains its clients.

Every sample has the ``node`` label of the node reporting it, like ``proxy.metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import attrs
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from membership.serving import ServingMap


@attrs.frozen
class FleetSample:
    """What the collector needs of a node's data path, taken at once."""

    serving: ServingMap
    known_brokers: tuple[int, ...]
    unbound: tuple[int, ...]
    draining: bool


class FleetCollector(Collector):
    def __init__(self, node_id: str, sample: Callable[[], FleetSample]) -> None:
        self.node_id = node_id
        self.sample = sample

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.sample()
        node = self.node_id
        serving = s.serving

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["node"])
            g.add_metric([node], value)
            return g

        yield gauge("kproxy_fleet_epoch", "Committed epoch of the map this node serves", serving.epoch)
        yield gauge("kproxy_fleet_degraded", "1 while this node has no Raft quorum and serves on its lease",
                    1 if serving.degraded else 0)
        up = GaugeMetricFamily("kproxy_fleet_member_up", "Each member in the committed view: 1 up, 0 down",
                               labels=["node", "member"])
        draining = GaugeMetricFamily("kproxy_fleet_member_draining", "Each member in the committed view: 1 draining",
                                     labels=["node", "member"])
        for member in sorted(n.id for n in serving.nodes):
            up.add_metric([node, member], 0 if member in serving.vacant - serving.draining else 1)
            draining.add_metric([node, member], 1 if member in serving.draining else 0)
        yield up
        yield draining
        owners = serving.owner_map()
        yield gauge("kproxy_identities", "Broker identities this node advertises",
                    sum(1 for p in owners.values() if p == node))
        yield gauge("kproxy_identities_unassigned", "Upstream brokers known here that the map gives no owner",
                    sum(1 for b in s.known_brokers if b not in owners))
        yield gauge("kproxy_identities_unbound", "Upstream brokers without a listener on this node",
                    len(s.unbound))
        yield gauge("kproxy_draining", "1 while this node drains its client connections", 1 if s.draining else 0)
