"""proxy.upstream_pool: idle broker connections kept for the next bootstrap client, over real
loopback TCP connections (the peer is a plain listener here: the pool never reads or writes)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from proxy.upstream_pool import UpstreamPool
from tests.waiting import until

pytestmark = [pytest.mark.unit]


class _Peer:
    """A loopback listener standing for a broker: it holds what it accepted, to close or write."""

    def __init__(self) -> None:
        self.accepted: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> _Peer:
        async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted.append(writer)

        self.server = await asyncio.start_server(held, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def connect(self) -> asyncio.Transport:
        transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, "127.0.0.1", self.port)
        return transport

    def close(self) -> None:
        for writer in self.accepted:
            writer.close()
        assert self.server is not None
        self.server.close()


def test_kept_per_address_up_to_the_cap_and_taken_newest_first_in_candidate_order() -> None:
    async def scenario() -> None:
        a, b = await _Peer().start(), await _Peer().start()
        reused = []
        pool = UpstreamPool(2, on_reuse=lambda: reused.append(1))
        ta = [await a.connect() for _ in range(3)]
        tb = await b.connect()
        assert [pool.put("a", t) for t in ta] == [True, True, False]  # the third is the caller's to close
        assert pool.put("b", tb) and len(pool) == 3
        assert pool.take(["c"]) is None  # none kept for that broker
        assert pool.take(["b", "a"]) == (tb, "b")  # the first candidate that has one
        assert pool.take(["b", "a"]) == (ta[1], "a")  # newest first
        assert pool.take(["a"]) == (ta[0], "a")
        assert pool.take(["a", "b"]) is None and len(pool) == 0 and len(reused) == 3
        for t in [*ta, tb]:
            t.close()
        a.close()
        b.close()

    uvloop.run(scenario())


def test_none_is_kept_with_a_pool_of_zero_nor_a_closing_connection() -> None:
    async def scenario() -> None:
        peer = await _Peer().start()
        t = await peer.connect()
        assert not UpstreamPool(0).put("a", t)
        pool = UpstreamPool(4)
        t.close()
        assert not pool.put("a", t) and len(pool) == 0
        peer.close()

    uvloop.run(scenario())


def test_a_kept_connection_the_broker_closes_or_speaks_on_leaves_the_pool() -> None:
    async def scenario() -> None:
        peer = await _Peer().start()
        pool = UpstreamPool(4)
        closed_by_broker, spoken_to = await peer.connect(), await peer.connect()
        assert pool.put("a", closed_by_broker) and pool.put("a", spoken_to)
        await until(lambda: len(peer.accepted) == 2, "both accepted")
        first, second = peer.accepted
        first.close()  # accepted in connect order: the broker closes the first
        await until(lambda: len(pool) == 1, "the closed one forgotten")
        second.write(b"\x00\x00\x00\x01x")  # a broker never speaks unasked: whatever this is, drop it
        await until(lambda: len(pool) == 0 and spoken_to.is_closing(), "the spoken-to one closed")
        assert pool.take(["a"]) is None
        peer.close()

    uvloop.run(scenario())


def test_kept_connections_close_once_idle_for_idle_s_and_at_close_all() -> None:
    async def scenario() -> None:
        peer = await _Peer().start()
        pool = UpstreamPool(4, idle_s=0.5)
        old = await peer.connect()
        assert pool.put("a", old)
        await asyncio.sleep(0.3)  # the second is kept later: it outlives the first by 0.3 s
        young = await peer.connect()
        assert pool.put("b", young)
        await until(lambda: old.is_closing(), "the older one closed after 0.5 s idle")
        assert len(pool) == 1 and pool.take(["a"]) is None
        assert pool.put("b", await peer.connect()) and len(pool) == 2
        pool.close_all()
        assert len(pool) == 0 and young.is_closing()
        peer.close()

    uvloop.run(scenario())


def test_a_connection_let_go_goes_to_the_longest_waiting_one_that_would_take_its_broker() -> None:
    async def scenario() -> None:
        peer = await _Peer().start()
        reused = []
        handed: dict[str, list[tuple[object, str]]] = {}

        def taker(name: str, takes: bool = True):  # type: ignore[no-untyped-def]
            def on_handover(transport, address) -> bool:  # type: ignore[no-untyped-def]
                handed.setdefault(name, []).append((transport, address))
                return takes
            return on_handover

        pool = UpstreamPool(1, on_reuse=lambda: reused.append(1))
        only_b = pool.wait(["b"], taker("only_b"))
        closed = pool.wait(["a"], taker("closed", takes=False))  # its pair closed while it waited
        first, second = pool.wait(["a", "b"], taker("first")), pool.wait(["b", "a"], taker("second"))
        given_up = pool.wait(["a"], taker("given_up"))
        pool.stop_waiting(given_up)  # its pair got a turn: never handed one
        assert pool.waiting == 4 and given_up.future.cancelled()
        t1, t2, t3 = [await peer.connect() for _ in range(3)]
        # Handed over in the put itself: the one whose pair closed says no, the next takes it.
        assert pool.put("a", t1) and handed["closed"] == [(t1, "a")] and handed["first"] == [(t1, "a")]
        assert closed.future.result() is False and first.future.result() is True  # not only_b: no "a"
        assert pool.put("a", t2) and handed["second"] == [(t2, "a")] and second.future.result() is True
        assert pool.waiting == 1 and not only_b.future.done()
        assert pool.put("a", t3) and len(pool) == 1  # nobody waiting for "a": kept, up to the cap of 1
        t4 = await peer.connect()
        assert pool.put("b", t4) and handed["only_b"] == [(t4, "b")]  # handed over, cap or not
        assert pool.waiting == 0 and len(reused) == 3 and "given_up" not in handed
        pool.close_all()
        for t in (t1, t2, t4):
            t.close()
        peer.close()

    uvloop.run(scenario())


def test_close_all_cancels_the_waiting_ones() -> None:
    async def scenario() -> None:
        pool = UpstreamPool(1)
        waiter = pool.wait(["a"], lambda transport, address: True)
        pool.close_all()
        assert waiter.future.cancelled() and pool.waiting == 0

    uvloop.run(scenario())


def test_a_client_connection_borrows_per_request_only_where_the_brokers_do_not_authenticate_clients() -> None:
    """A SASL broker takes one ApiVersions per connection before the handshake (Kafka's
    SaslServerAuthenticator): where the node logs in to the brokers, nothing is borrowed."""
    from membership.serving import BOOTSTRAP
    from proxy.config import Limits
    from proxy.connection import Pair
    from proxy.drain import NodeDrain
    from proxy.metrics import ProxyMetrics
    from proxy.registry import ConnectionRegistry

    def registry(pool: int, log_in: bool, share: bool = True) -> ConnectionRegistry:
        r = ConnectionRegistry("t", Limits(bootstrap_pool=pool, share_upstream=share), ProxyMetrics("t"), None,
                               NodeDrain(takeover=False))
        r.clients_log_in = log_in
        return r

    plain, sasl, off = registry(8, False), registry(8, True), registry(0, False)
    assert Pair(plain, 1).shared and Pair(plain, BOOTSTRAP).shared and Pair(plain, 1).reusable
    assert not Pair(sasl, 1).shared and not Pair(sasl, 1).reusable and Pair(sasl, BOOTSTRAP).reusable  # as before
    assert not Pair(off, 1).shared and not Pair(off, 1).reusable
    default = registry(8, False, share=Limits().share_upstream)  # off unless asked
    assert not Pair(default, 1).shared and not Pair(default, 1).reusable and Pair(default, BOOTSTRAP).reusable


def test_a_broker_connection_let_go_past_the_cap_closes_without_closing_the_client_that_let_it_go() -> None:
    """ConnectionRegistry.release with the pool full: the broker connection is closed, and its
    close (connection_lost on the protocol it had) is not taken for the pair's broker leaving."""
    from proxy.config import HostPort, Limits
    from proxy.connection import Pair, UpstreamSide
    from proxy.drain import NodeDrain
    from proxy.metrics import ProxyMetrics
    from proxy.registry import ConnectionRegistry

    async def scenario() -> None:
        broker, client_host = await _Peer().start(), await _Peer().start()
        registry = ConnectionRegistry("t", Limits(bootstrap_pool=1, share_upstream=True), ProxyMetrics("t"), None,
                                      NodeDrain(takeover=False))
        address = HostPort("127.0.0.1", broker.port)
        assert registry.pool.put(address, await broker.connect())  # the pool's one place is taken
        pair = Pair(registry, 1)
        assert pair.shared
        registry.pairs.add(pair)
        pair.client = await client_host.connect()
        loop = asyncio.get_running_loop()
        upstream, _ = await loop.create_connection(lambda: UpstreamSide(pair), "127.0.0.1", broker.port)
        pair.upstream, pair.upstream_addr = upstream, address
        registry.release(pair)  # at a response boundary: nothing in flight
        assert pair.upstream is None

        def socket_closed() -> bool:  # after connection_lost: the transport let its socket go
            sock = upstream.get_extra_info("socket")
            return sock is None or sock.fileno() == -1

        await until(socket_closed, "the broker connection closed")
        assert not pair.closed and not pair.client.is_closing()
        pair.close("test over")
        registry.pool.close_all()
        broker.close()
        client_host.close()

    uvloop.run(scenario())
