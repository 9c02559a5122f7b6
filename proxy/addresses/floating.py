"""The I/O shell of one node's floating addresses: takes and releases what
``proxy.takeover`` decides, with the mover of ``[addresses]``, and runs the fence.

:class:`FloatingAddresses` is driven by the data path (``proxy.datapath``): ``sync(map)`` after
every map (and after a fence or an unfence) takes and releases addresses in the mover's own
thread (a take is two netlink requests and an ARP, milliseconds: never on the loop; one thread
of its own, not the loop's default executor, where a blocking call of another part could make a
take wait its turn, and where the netlink socket it keeps is used by one thread); once the data path
listens on the taken addresses' ports, ``tickle_taken()`` sends the tickle ACKs to the clients
of each down node whose address it took; ``watch()`` ticks the
:class:`proxy.takeover.Fence`. A failed take or release is logged and tried again at the next
sync (the reconciler only records what was done).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable

from membership.serving import ServingMap
from proxy.addresses.config import MoverConfig
from proxy.addresses.movers import AddressMover, MoverError, build_mover
from proxy.addresses.peers import PeerClients
from proxy.addresses.plan import AddressRefused, FloatingAddress
from proxy.addresses.tickle import ClientPair, send_segments, tickle_segments
from proxy.takeover import AddressReconciler, Fence, ReleaseAddress, TakeAddress, down_nodes, wanted_addresses

log = logging.getLogger("kproxy.addresses")

# The fence's tick. A stall is seen at once after the node thaws (the overdue timer fires
# first), so this bounds only how late the fence is lifted; it is an idle node's wake-up rate.
FENCE_TICK_S = 0.1
# Tickles go out twice, this far apart: the first may race the clients' ARP update.
TICKLE_AGAIN_S = 0.3
# The clients' group-coordinator connections are tickled this long after their other ones. Reset
# in one burst, a client's coordinator connection and its connection to the same address for the
# identity itself fail together, and librdkafka sends its coordinator lookup over its most recently
# used connection still marked up: often that one, a moment before it is seen to fail; the lookup
# fails and the next comes at the consumer's next main-thread wake-up, up to 1 s later (emulated
# hosts, librdkafka's own log: a confluent consumer's 1.16 s in a kill drill; a partition drill's
# 1.39 s before this, none over 0.8 s after, every lookup answered). A
# moment later, that connection is down or made again to the address's new holder, and the lookup
# goes over a live one. The drain does the same (proxy.drain.DRAIN_COORDINATOR_DELAY_S).
TICKLE_GROUP_DELAY_S = 0.05
# Up to this many clients the tickle ACKs are built in the loop's thread (~1 ms); more, in an executor.
INLINE_TICKLES = 32
# A taken address is announced again this long after the take (seconds from the take). Linux
# ignores an ARP update to a neighbour entry changed less than `locktime` ago (1 s by default),
# so the take's own gratuitous ARPs are lost where the previous holder's announcement or answer
# was that fresh (a node back from a partition takes its address while the survivor still
# holds it); the clients would then send to the previous holder until their entry went stale,
# ~30 s (seen after heals on emulated hosts).
ANNOUNCE_AGAIN_S = (1.5, 4.0)
# While quorate and unfenced, a node announces every address it holds this often (keepalived's
# garp refresh): whatever left a client's ARP cache naming another host (a peer without quorum
# that claimed this address and gave it back, an announcement lost to `locktime`), it is put
# right within this, not after the entry fails (~10 s, then the clients' requests time out).
REFRESH_S = 2.0
# A survivor gives a node that came back its address only once the node holds it itself (its
# answer to the survivor's long poll of its clients says so, proxy.addresses.peers), at the
# latest after HANDOVER_MAX_S; without that poll (tickles off) after HANDOVER_WAIT_S. Released
# at the map that marks the node up, the address was on no host until the node took it (it
# takes it once it serves, up to 1.7 s later after a restart, session 28): the clients'
# reconnects (the survivor resets them as it gives the address back) got no answer, and a SYN
# without an answer is sent again only after 1 s. The node's gratuitous ARP comes first now.
HANDOVER_WAIT_S = 0.25
HANDOVER_MAX_S = 3.0
HANDOVER_POLL_S = 0.02


def floating_address(config: MoverConfig, node: str, host: str) -> FloatingAddress:
    """``host`` with the prefix of the configured network that holds it (the link's network)."""
    ip = ipaddress.IPv4Address(host)
    net = next((n for n in config.networks if ip in n), None)
    if net is None:
        raise AddressRefused(f"{ip} is outside the networks of the {config.kind} mover")
    return FloatingAddress(ip, net.prefixlen, node)


class FloatingAddresses:
    def __init__(self, config: MoverConfig, node_id: str, own_host: str, *, fleet: bool, stall_s: float,
                 confirm_s: float, mover: AddressMover | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.node_id = node_id
        self.own_host = own_host
        self.fleet = fleet
        self.mover = mover or build_mover(config)
        self._mover_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kproxy-mover")
        self.reconciler = AddressReconciler()
        self.clock = clock
        self.fence = Fence(stall_s, confirm_s, clock())
        self.has_quorum: Callable[[], bool] = lambda: True  # the runtime's member view, when there is one
        self.peer_clients: PeerClients | None = None  # the runtime's poller, when there is one
        self.tickles_sent = 0
        self._to_tickle: list[TakeAddress] = []  # taken by sync, tickled by tickle_taken
        # Before another node's address is given back: stop listening there and reset the
        # clients connected to it here (the data path's; see :meth:`sync`).
        self.before_release: Callable[[str, str], Awaitable[None]] | None = None
        self._lock = asyncio.Lock()
        self._unreachable: frozenset[str] = frozenset()  # of the last map seen
        # Called when this host takes or gives back its own address (the runtime bumps its
        # client list's version: the peers' long polls answer at once, see HANDOVER_MAX_S).
        self.on_own_change: Callable[[], None] | None = None
        self._last: tuple[ServingMap, bool] | None = None  # the newest (map, draining) sync saw
        self._handovers: set[str] = set()  # nodes whose address waits for them to hold it
        self._leftovers_adopted = False  # peers' addresses found on the host at start: see _adopt_leftovers

    def warm_up(self) -> None:
        """Open what a take uses now, in the mover's thread (:meth:`AddressMover.prepare`), so that
        this node's first take, when its address comes back to it, costs milliseconds."""
        def prepare() -> None:
            try:
                self.mover.prepare()
            except (MoverError, OSError) as exc:
                log.warning("floating-address mover not prepared (its first take opens it)",
                            extra={"reason": str(exc)})
        self._mover_thread.submit(prepare)

    @property
    def held(self) -> frozenset[str]:
        """The nodes whose address this host holds now."""
        return frozenset(self.reconciler.held)

    def holds(self, node: str) -> bool:
        """Does this host hold ``node``'s address now (one dict lookup: safe from another thread)?"""
        return node in self.reconciler.held

    async def sync(self, serving: ServingMap, *, draining: bool) -> frozenset[str]:
        """Take and release until the host holds what ``serving`` asks; returns what it holds."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            self._last = (serving, draining)
            if not self._leftovers_adopted:
                await self._adopt_leftovers(serving)
            for action in self.reconciler.plan(self._wanted(), serving, (self.node_id, self.own_host)):
                address = floating_address(self.config, action.node, action.host)
                if isinstance(action, ReleaseAddress):
                    if self.handing_over(action.node, serving):
                        self._hand_over_later(action)  # once its node holds it (HANDOVER_MAX_S)
                    else:
                        await self._release(action, address)
                    continue
                started = self.clock()
                try:
                    await loop.run_in_executor(self._mover_thread, self.mover.take, address)
                except (MoverError, AddressRefused, OSError) as exc:
                    log.warning("floating address not moved", extra={
                        "action": type(action).__name__, "node": action.node, "address": action.host,
                        "reason": str(exc)})
                    continue
                self.reconciler.taken(action)
                if action.node == self.node_id and self.on_own_change is not None:
                    self.on_own_change()
                log.info("holding a floating address", extra={
                    "node": action.node, "address": action.host, "ms": round((self.clock() - started) * 1e3, 1)})
                loop.create_task(self._announce_again(action, address))
                if action.node != self.node_id:
                    self._to_tickle.append(action)
            return self.held

    async def _adopt_leftovers(self, serving: ServingMap) -> None:
        """Count as held the peers' addresses this host's link still holds from before this
        process (the caller holds the lock), so that the plan gives back those it does not
        want. A node killed while it stood in for a peer leaves that address on its host: the
        peer's and this host then both answered it, each resetting the other's connections
        (kill-two drills on emulated hosts, once the drill waited for every address back on its
        own node). Only the addresses of the map's nodes: another address in the networks is
        not ours to remove. Done at the first map that names a peer."""
        peers = {n.host: n.id for n in serving.nodes if n.id != self.node_id}
        if not peers:
            return
        self._leftovers_adopted = True
        try:
            found = await asyncio.get_running_loop().run_in_executor(self._mover_thread, self.mover.held_floating)
        except (MoverError, OSError) as exc:
            log.warning("could not read which floating addresses this host holds",
                        extra={"reason": str(exc)})
            return
        for ip in found:
            node = peers.get(str(ip))
            if node is not None and node not in self.reconciler.held:
                self.reconciler.taken(TakeAddress(node, str(ip)))
                log.info("a peer's floating address is on this host from before this process",
                         extra={"node": node, "address": str(ip)})

    def _wanted(self) -> frozenset[str]:
        assert self._last is not None
        serving, draining = self._last
        return wanted_addresses(serving, self.node_id, fleet=self.fleet, fenced=self.fence.fenced, draining=draining)

    async def _release(self, action: ReleaseAddress, address: FloatingAddress) -> None:
        """Give ``address`` back (the caller holds the lock); logged and kept if the mover fails."""
        if action.node != self.node_id and self.before_release is not None:
            # While the address is still ours: once it is gone this host can send its
            # clients nothing (no RST, no answer), and a client waiting for a response
            # would wait out its request timeout (seen: 10-60 s stalls after heals).
            await self.before_release(action.node, action.host)
        try:
            await asyncio.get_running_loop().run_in_executor(self._mover_thread, self.mover.release, address)
        except (MoverError, AddressRefused, OSError) as exc:
            log.warning("floating address not moved", extra={
                "action": type(action).__name__, "node": action.node, "address": action.host, "reason": str(exc)})
            return
        self.reconciler.released(action)
        if action.node == self.node_id and self.on_own_change is not None:
            self.on_own_change()

    def _hand_over_later(self, action: ReleaseAddress) -> None:
        if action.node in self._handovers:
            return
        self._handovers.add(action.node)
        asyncio.get_running_loop().create_task(self._hand_over(action))

    async def _hand_over(self, action: ReleaseAddress) -> None:
        """Give ``action``'s address back to its node once it holds the address itself (or after
        the longest wait), if this host still holds it and the newest map still gives it back."""
        try:
            waited = await self._until_held_by_its_node(action.node)
            async with self._lock:
                if self.reconciler.held.get(action.node) != action.host or action.node in self._wanted():
                    return  # given back meanwhile (fenced), or wanted here again (its node went down)
                log.info("handing a floating address back to its node", extra={
                    "node": action.node, "address": action.host, "waited_ms": round(waited * 1e3, 1)})
                await self._release(action, floating_address(self.config, action.node, action.host))
        finally:
            self._handovers.discard(action.node)

    async def _until_held_by_its_node(self, node: str) -> float:
        """Wait until ``node`` says it holds its own address (the peers' long poll), at most
        HANDOVER_MAX_S; HANDOVER_WAIT_S without a poll of that node. Returns the time waited."""
        started = self.clock()
        peers = self.peer_clients
        if peers is None or node not in peers.peers:
            await asyncio.sleep(HANDOVER_WAIT_S)
            return self.clock() - started
        while not peers.holds_own(node):
            if self.clock() - started >= HANDOVER_MAX_S:
                log.warning("handing a floating address back to its node, which has not said it holds it",
                            extra={"node": node, "waited_s": HANDOVER_MAX_S})
                break
            await asyncio.sleep(HANDOVER_POLL_S)
        return self.clock() - started

    def handing_over(self, node: str, serving: ServingMap) -> bool:
        """Is another node's address, held here, going back to that node itself (it is up in
        ``serving`` and not down: it takes it at this map)? Not when this node is fenced (it
        gives everything back at once) or when the address goes on to another survivor."""
        return (node != self.node_id and not self.fence.fenced and serving.node(node) is not None
                and node not in down_nodes(serving) and not serving.degraded)

    def status(self) -> dict[str, object]:
        """For ``/status``: the floating addresses this host holds (by the node they belong to),
        whether it is fenced, and how many tickle ACKs it has sent."""
        return {"held": dict(sorted(self.reconciler.held.items())), "fenced": self.fence.fenced,
                "tickles_sent": self.tickles_sent}

    def tickle_taken(self) -> None:
        """Send the tickle ACKs of the addresses :meth:`sync` took, once the data path listens
        on their ports: a client reset earlier reconnected into "connection refused" (a stand-in
        listener not bound yet), which librdkafka answers with a growing reconnect backoff."""
        taken, self._to_tickle = self._to_tickle, []
        for action in taken:
            asyncio.get_running_loop().create_task(self._tickle(action))

    async def _announce_again(self, action: TakeAddress, address: FloatingAddress,
                              at_times: tuple[float, ...] = ANNOUNCE_AGAIN_S) -> None:
        """Announce a held address again at ``at_times`` (seconds from now) while this host holds it."""
        waited = 0.0
        for at in at_times:
            await asyncio.sleep(at - waited)
            waited = at
            async with self._lock:  # not while a sync takes or releases it
                if self.reconciler.held.get(action.node) != action.host or action.node in self._handovers:
                    return  # given back meanwhile, or going back to its node (which announces it)
                if not await self._announce(address):
                    return

    async def _announce(self, address: FloatingAddress) -> bool:
        """One gratuitous ARP round for a held ``address`` (the caller holds the lock);
        False, logged, when the mover failed."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._mover_thread, self.mover.announce, address)
        except (MoverError, AddressRefused, OSError) as exc:
            log.warning("floating address not announced", extra={
                "node": address.node, "address": str(address.ip), "reason": str(exc)})
            return False
        return True

    async def _tickle(self, action: TakeAddress) -> None:
        """Reset the silent clients of the node whose address was just taken (tickle ACKs)."""
        pairs = self.peer_clients.at(action.host, action.node) if self.peer_clients is not None else ()
        if not pairs:
            if self.peer_clients is not None:  # a client waiting silently on it now waits out its timeout
                log.info("no clients known to tickle", extra={
                    "node": action.node, "address": action.host, **self.peer_clients.state(action.node)})
            return
        # The group-coordinator connections a moment after the rest (TICKLE_GROUP_DELAY_S), each
        # of them twice (TICKLE_AGAIN_S apart).
        others, group = [p for p in pairs if not p.group], [p for p in pairs if p.group]
        lag = TICKLE_GROUP_DELAY_S if others and group else 0.0
        waves = sorted(((at, wave) for at, wave in ((0.0, others), (lag, group), (TICKLE_AGAIN_S, others),
                                                    (TICKLE_AGAIN_S + lag, group)) if wave), key=lambda w: w[0])
        loop = asyncio.get_running_loop()
        started = loop.time()
        for at, wave in waves:
            delay = started + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not await self._send_tickles(action, wave):
                return

    async def _send_tickles(self, action: TakeAddress, pairs: list[ClientPair]) -> bool:
        """One burst of tickle ACKs to ``pairs``; False when the address was given back meanwhile
        or the burst could not be sent."""
        if self.reconciler.held.get(action.node) != action.host:
            return False  # given back meanwhile
        try:
            # Built apart (~30 us a client), then sent from the loop's thread in one burst
            # (proxy.addresses.tickle.send_segments).
            segments = tickle_segments(action.host, pairs) if len(pairs) <= INLINE_TICKLES \
                else await asyncio.get_running_loop().run_in_executor(None, tickle_segments, action.host, pairs)
            sent = send_segments(action.host, segments)
        except OSError as exc:
            log.warning("tickle ACKs not sent", extra={"node": action.node, "reason": str(exc)})
            return False
        self.tickles_sent += sent
        log.info("tickle ACKs sent", extra={"node": action.node, "address": action.host, "clients": sent,
                                            "group": bool(pairs[0].group)})
        return True

    async def watch(self, serving: Callable[[], ServingMap], fenced: Callable[[], None],
                    resync: Callable[[], Awaitable[None]]) -> None:
        """Tick the fence: on a stall, ``fenced()`` (drop the connections) and give every address
        back; once unfenced, ``resync()`` (take back what the map says)."""
        self.fence.start_ticking(self.clock())
        next_refresh = self.clock() + REFRESH_S
        while True:
            await asyncio.sleep(FENCE_TICK_S)
            now = self.clock()
            current = serving()
            epoch = current.epoch
            if now >= next_refresh:
                next_refresh = now + REFRESH_S
                if not self.fence.fenced and not current.degraded and self.has_quorum():
                    await self.refresh()
            if self.fence.tick(now, epoch):
                log.warning("this node stalled: fencing (addresses given back until the committed map is known)",
                            extra={"node": self.node_id})
                fenced()
                await resync()
            elif self.fence.fenced and self.fence.may_unfence(now, self.has_quorum(), epoch):
                log.info("fence lifted: the committed map is known", extra={"node": self.node_id})
                await resync()

    async def refresh(self) -> int:
        """Announce every address this host holds (``REFRESH_S``); returns how many."""
        sent = 0
        async with self._lock:
            for node, host in sorted(self.reconciler.held.items()):
                if node not in self._handovers:  # its node announces it now
                    sent += await self._announce(floating_address(self.config, node, host))
        return sent

    def map_seen(self, serving: ServingMap) -> bool:
        """A new map: True when it fences the node (isolated, or quorum back after a degraded spell).

        Isolated (membership.liveness: this host hears no peer, all fell silent at once): the
        host is most likely the one cut off, and its peers are declaring it down and taking its
        address. It gives every address up at once (Fence.map_seen says why not at the heal) and
        takes its own again, announcing it, once the committed map says it is up."""
        regained, self._unreachable = self._unreachable - serving.unreachable, serving.unreachable
        if self.fence.map_seen(self.clock(), serving.degraded, serving.epoch, isolated=serving.isolated):
            log.warning("isolated, or quorum back after a degraded spell: fencing",
                        extra={"node": self.node_id, "isolated": serving.isolated})
            return True
        if regained:
            self._announce_own(regained)
        return False

    def _announce_own(self, regained: frozenset[str]) -> None:
        """Peers this node could not reach are back: announce its own address (if it holds it
        and is not fenced) now and at ``ANNOUNCE_AGAIN_S``. Without quorum each side of a cut
        may claim the other's address; the peer that announced this node's gives it back as
        soon as it hears this node again, and this node, which kept its address, is the one to
        point the clients back at itself: else their ARP caches name the peer's host until the
        entries fail (~10 s)."""
        own = self.reconciler.held.get(self.node_id)
        if own is None or self.fence.fenced:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: nothing announces (unit tests of the pure parts)
        log.info("peers back in reach: announcing this node's address again",
                 extra={"node": self.node_id, "peers": sorted(regained)})
        loop.create_task(self._announce_again(TakeAddress(self.node_id, own),
                                              floating_address(self.config, self.node_id, own),
                                              (0.0, *ANNOUNCE_AGAIN_S)))

    async def release_all(self) -> None:
        """Give back the addresses of other nodes (stopping); the node's own stays: its kernel
        refuses connections while nobody else holds the address."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            for node, host in sorted(self.reconciler.held.items()):
                if node == self.node_id:
                    continue
                try:
                    await loop.run_in_executor(self._mover_thread, self.mover.release,
                                               floating_address(self.config, node, host))
                except (MoverError, AddressRefused, OSError) as exc:
                    log.warning("floating address not released", extra={"node": node, "reason": str(exc)})
                self.reconciler.released(ReleaseAddress(node, host))
