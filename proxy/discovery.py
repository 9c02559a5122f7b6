"""Which upstream brokers exist, and where a client connection goes upstream.

Brokers are learnt from the bootstrap servers at start, from a periodic
refresh, and from any response passing through that names a broker we do not
know. A broker's listener is bound *before* anything advertises it.

Brokers also leave: one missing from the refresh's Metadata for
``upstream.release_after_s`` (and two refreshes at least:
:class:`proxy.broker_roster.BrokerRoster`) is forgotten, and reported so. Its
listener is released once nothing still lists it: at once on a node without a
fleet; in a fleet once the map in effect (``held``) no longer does, that is
once the Raft leader has committed the smaller broker set. Clients still
connected on a released listener are drained (closed at an idle moment).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable

from membership.serving import BOOTSTRAP
from proxy.broker_roster import BrokerRoster, RosterChange
from proxy.config import Config, HostPort
from proxy.listeners import Listeners
from proxy.registry import ConnectionRegistry
from proxy.rewrite import BrokerAddress
from proxy.upstream import PLAINTEXT, DiscoveryError, UpstreamBroker, UpstreamSecurity, discover

log = logging.getLogger("kproxy.proxy")


class BrokerDiscovery:
    def __init__(self, config: Config, source_host: str, listeners: Listeners, registry: ConnectionRegistry,
                 security: UpstreamSecurity = PLAINTEXT, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.security = security
        self.source_host = source_host  # discovery leaves from this node's own address
        self.listeners = listeners
        self.registry = registry
        self.roster = BrokerRoster(config.release_after_s)
        self.clock = clock
        # Identities the map in effect still lists (the data path sets it for a fleet): their
        # listeners stay until the map lets them go.
        self.held: Callable[[], Iterable[int]] = lambda: ()
        # Forgotten brokers whose listener is still held: their connections still go to them.
        self._forgotten: dict[int, UpstreamBroker] = {}
        self._rr = itertools.count()
        self._changed: list[Callable[[list[UpstreamBroker]], None]] = []

    @property
    def brokers(self) -> dict[int, UpstreamBroker]:
        """The brokers this node knows (the roster's; read-only for callers)."""
        return self.roster.brokers

    def on_changed(self, callback: Callable[[list[UpstreamBroker]], None]) -> None:
        self._changed.append(callback)

    async def first(self, timeout: float) -> None:
        """Discover the brokers from the bootstrap servers, retrying until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                brokers = await discover(self.config.upstream, self.config.limits.connect_timeout_s,
                                         source=self.source_host, security=self.security)
                break
            except DiscoveryError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("upstream not reachable yet", extra={"reason": str(exc)})
                await asyncio.sleep(0.5)
        await self.polled(brokers)

    async def learn(self, brokers: list[UpstreamBroker]) -> None:
        """Brokers seen in passing: bind a listener for every new one *before* anything advertises it."""
        async with self.listeners.lock:
            change = self.roster.sighted(brokers)
            await self.listeners.bind_identities([b.node_id for b in brokers])
            self._report(change)

    async def polled(self, brokers: list[UpstreamBroker]) -> None:
        """Kafka's complete broker list: learn the new ones (listener first), forget those gone long enough."""
        async with self.listeners.lock:
            last = {bid: self.brokers[bid] for bid in self.brokers}
            change = self.roster.polled(brokers, self.clock())
            await self.listeners.bind_identities([b.node_id for b in brokers])
            for bid in change.released:
                self._forgotten[bid] = last[bid]
                log.warning("broker gone from the cluster: forgotten", extra={
                    "broker": bid, "missing_s": self.config.release_after_s})
            self._release_unheld()
            self._report(change)

    async def release_unheld(self) -> None:
        """Release the listeners nothing lists any more (call when the map in effect changed)."""
        async with self.listeners.lock:
            self._release_unheld()

    def _release_unheld(self) -> None:
        gone = self.listeners.bound - self.brokers.keys() - frozenset(self.held())
        if gone:
            self.listeners.release_identities(gone)
            drained = self.registry.drain(set(gone))
            log.info("broker identities released", extra={"brokers": sorted(gone), "connections_drained": drained})
        # Kept: forgotten, not learnt again, listener still held.
        self._forgotten = {b: v for b, v in self._forgotten.items()
                           if b not in self.brokers and b in self.listeners.bound}

    def _report(self, change: RosterChange) -> None:
        if change:
            for cb in self._changed:
                cb(sorted(self.brokers.values()))

    def brokers_seen(self, api_key: int, brokers: tuple[BrokerAddress, ...], complete: bool) -> None:
        """A response passing through named brokers: learn any we do not know (listener first)."""
        new = [UpstreamBroker(b.node_id, b.host, b.port, b.rack) for b in brokers
               if (old := self.brokers.get(b.node_id)) is None or (old.host, old.port) != (b.host, b.port)]
        if new:
            self.registry.spawn(self.learn(new))

    async def refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval_s)
            try:
                candidates = [b.address for b in self.brokers.values()] + list(self.config.upstream)
                await self.polled(await discover(candidates, self.config.limits.connect_timeout_s,
                                                source=self.source_host, security=self.security))
            except DiscoveryError as exc:
                log.warning("upstream refresh failed", extra={"reason": str(exc)})
            except Exception:  # a bug must not end discovery for the node's lifetime
                log.exception("upstream refresh failed unexpectedly")

    def upstream_for(self, listener: int) -> list[HostPort]:
        """Where a connection on ``listener`` goes: its broker, or (bootstrap) every live one, round robin."""
        if listener != BOOTSTRAP:
            b = self.brokers.get(listener) or self._forgotten.get(listener)
            return [b.address] if b else []
        live = sorted(self.brokers.values())
        if not live:
            return list(self.config.upstream)
        start = next(self._rr) % len(live)
        return [b.address for b in live[start:] + live[:start]]

    @property
    def unbound(self) -> list[int]:
        """Known brokers whose listener could not be bound yet (never advertised meanwhile;
        every refresh tries again). A node with any is not ready."""
        return sorted(set(self.brokers) - self.listeners.bound)
