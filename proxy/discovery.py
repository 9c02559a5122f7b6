"""Which upstream brokers exist, and where a client connection goes upstream.

Brokers are learnt from the bootstrap servers at start, from a periodic
refresh, and from any response passing through that names a broker we do not
know. A broker's listener is bound *before* anything advertises it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from membership.serving import BOOTSTRAP
from proxy.config import Config, HostPort
from proxy.listeners import Listeners
from proxy.registry import ConnectionRegistry
from proxy.rewrite import BrokerAddress
from proxy.upstream import PLAINTEXT, DiscoveryError, UpstreamBroker, UpstreamSecurity, discover

log = logging.getLogger("kproxy.proxy")


class BrokerDiscovery:
    def __init__(self, config: Config, source_host: str, listeners: Listeners, registry: ConnectionRegistry,
                 security: UpstreamSecurity = PLAINTEXT) -> None:
        self.config = config
        self.security = security
        self.source_host = source_host  # discovery leaves from this node's own address
        self.listeners = listeners
        self.registry = registry
        self.brokers: dict[int, UpstreamBroker] = {}
        self._rr = itertools.count()
        self._changed: list[Callable[[list[UpstreamBroker]], None]] = []

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
        await self.learn(brokers)

    async def learn(self, brokers: list[UpstreamBroker]) -> None:
        """Bind a listener for every new broker *before* anything advertises it."""
        async with self.listeners.lock:
            changed = False
            for b in brokers:
                if self.brokers.get(b.node_id) != b:
                    self.brokers[b.node_id] = b
                    changed = True
            await self.listeners.bind_identities([b.node_id for b in brokers])
            if changed:
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
                await self.learn(await discover(candidates, self.config.limits.connect_timeout_s,
                                                source=self.source_host, security=self.security))
            except DiscoveryError as exc:
                log.warning("upstream refresh failed", extra={"reason": str(exc)})
            except Exception:  # a bug must not end discovery for the node's lifetime
                log.exception("upstream refresh failed unexpectedly")

    def upstream_for(self, listener: int) -> list[HostPort]:
        """Where a connection on ``listener`` goes: its broker, or (bootstrap) every live one, round robin."""
        if listener != BOOTSTRAP:
            b = self.brokers.get(listener)
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
