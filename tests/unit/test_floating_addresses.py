"""Floating addresses without root: who holds a down node's address (proxy.takeover), the
fence, the tickle ACK segment (proxy.addresses.tickle), the peers' client lists and the shell's
take/release order with a fake mover (proxy.addresses.floating), and the config keys."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import struct
import threading
import time

import attrs

import pytest

from membership.serving import BOOTSTRAP, ServingMap, stand_in_duties
from proxy.addresses import floating
from proxy.addresses.config import parse_mover_config
from proxy.addresses.floating import FloatingAddresses
from proxy.addresses.movers import AddressMover
from proxy.addresses.peers import (CLIENTS_POLL_S, POLL_TIMEOUT_S, SETTLE_S, SMALL_LIST, SMALL_LIST_GAP_S,
                                   TIMEOUT_RETRY_S, ChangeCounter, PeerClients, listing)
from proxy.admin import MAX_CLIENTS_WAIT_S, clients_query
from proxy.addresses.tickle import TCP_ACK, ClientPair, checksum, pseudo_header, tickle_segment, tickle_segments
from proxy.config import ConfigError, parse
from proxy.takeover import (AddressReconciler, Fence, ReleaseAddress, TakeAddress, address_holder, down_nodes,
                            floating_stand_ins, wanted_addresses)
from topology import PortScheme, ProxyNode

pytestmark = pytest.mark.unit

NODES = tuple(ProxyNode(id=f"p{i}", host=f"198.18.0.1{i}", bootstrap_port=9092, ports=PortScheme(base=9100))
              for i in (1, 2, 3))


def fleet_map(owners: dict[int, str], vacant: set[str] = frozenset(), draining: set[str] = frozenset(),
              epoch: int = 5) -> ServingMap:
    return ServingMap(epoch=epoch, owners=owners, nodes=NODES, vacant=frozenset(vacant),
                      draining=frozenset(draining), stand_ins=stand_in_duties(owners, NODES, vacant, draining))


# ------------------------------------------------------------------ who holds what
def test_exactly_one_survivor_holds_a_down_nodes_address():
    m = fleet_map({1: "p1", 2: "p2", 3: "p2"}, vacant={"p3"})
    holder = address_holder(m, "p3")
    assert holder in {"p1", "p2"}
    held = {n: wanted_addresses(m, n, fleet=True, fenced=False, draining=False) for n in ("p1", "p2")}
    assert [n for n in ("p1", "p2") if "p3" in held[n]] == [holder]
    assert held["p1"] >= {"p1"} and held["p2"] >= {"p2"}  # each keeps its own


def test_the_holder_of_two_down_nodes_is_the_one_survivor_and_a_down_node_holds_nothing():
    m = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2", "p3"})
    assert address_holder(m, "p2") == address_holder(m, "p3") == "p1"
    assert wanted_addresses(m, "p1", fleet=True, fenced=False, draining=False) == {"p1", "p2", "p3"}
    # p2 is alive again but still down in the committed map: it holds nothing, not even its own.
    assert wanted_addresses(m, "p2", fleet=True, fenced=False, draining=False) == frozenset()


def test_a_draining_node_keeps_its_address_and_nobody_takes_it():
    m = fleet_map({1: "p1", 2: "p1", 3: "p3"}, vacant={"p2"}, draining={"p2"})
    assert address_holder(m, "p2") is None
    assert wanted_addresses(m, "p2", fleet=True, fenced=False, draining=True) == {"p2"}
    assert wanted_addresses(m, "p1", fleet=True, fenced=False, draining=False) == {"p1"}


def test_own_address_waits_for_a_committed_map_and_a_fence_gives_everything_back():
    assert wanted_addresses(ServingMap(), "p1", fleet=True, fenced=False, draining=False) == frozenset()
    assert wanted_addresses(ServingMap(), "p1", fleet=False, fenced=False, draining=False) == {"p1"}
    m = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2", "p3"})
    assert wanted_addresses(m, "p1", fleet=True, fenced=True, draining=False) == frozenset()


NODES5 = tuple(ProxyNode(id=f"p{i}", host=f"198.18.0.1{i}", bootstrap_port=9092, ports=PortScheme(base=9100))
               for i in range(1, 6))


@pytest.mark.parametrize("victim", ["p1", "p2", "p3", "p4", "p5"])
def test_a_refused_node_s_address_floats_before_the_commit_to_the_holder_the_commit_keeps(victim):
    """Its host refused a heartbeat (its process is gone): one survivor takes its address now,
    and it is the one that holds it once the commit marks the node down (no second move)."""
    up = {1: "p1", 2: "p2", 3: "p3", 4: "p4", 5: "p5"}
    before = ServingMap(epoch=5, owners=up, nodes=NODES5, refused=frozenset({victim}))
    moved = {b: ("p1" if p == victim and victim != "p1" else "p2" if p == victim else p) for b, p in up.items()}
    after = ServingMap(epoch=6, owners=moved, nodes=NODES5, vacant=frozenset({victim}), refused=frozenset({victim}),
                       stand_ins=stand_in_duties(moved, NODES5, {victim}, frozenset()))
    survivors = [n.id for n in NODES5 if n.id != victim]
    assert down_nodes(before) == {victim}
    holder = address_holder(before, victim)
    assert holder in survivors and holder == address_holder(after, victim)
    for m in (before, after):
        takers = [n for n in survivors if victim in wanted_addresses(m, n, fleet=True, fenced=False, draining=False)]
        assert takers == [holder]
    # The refused node itself (restarting) holds nothing of the others', and a fenced holder nothing.
    assert wanted_addresses(before, holder, fleet=True, fenced=True, draining=False) == frozenset()


def test_a_refused_node_that_drains_keeps_its_address_and_a_map_without_refusals_moves_nothing():
    drained = ServingMap(epoch=5, owners={1: "p1", 2: "p1", 3: "p3"}, nodes=NODES, vacant=frozenset({"p2"}),
                         draining=frozenset({"p2"}), refused=frozenset({"p2"}),
                         stand_ins=stand_in_duties({1: "p1", 2: "p1", 3: "p3"}, NODES, {"p2"}, {"p2"}))
    assert down_nodes(drained) == frozenset() and address_holder(drained, "p2") is None
    plain = ServingMap(epoch=5, owners={1: "p1", 2: "p2", 3: "p3"}, nodes=NODES)
    assert down_nodes(plain) == frozenset() and address_holder(plain, "p2") is None
    assert wanted_addresses(plain, "p1", fleet=True, fenced=False, draining=False) == {"p1"}


def test_the_holder_listens_on_every_port_of_the_down_nodes_address():
    m = fleet_map({1: "p1", 2: "p2", 3: "p1"}, vacant={"p3"})
    got = floating_stand_ins(m, "p1", {1, 2, 3}, {"p1", "p3"})
    assert [(s.vacant, s.listener, s.host, s.port) for s in got] == [
        ("p3", BOOTSTRAP, "198.18.0.13", 9092), ("p3", 1, "198.18.0.13", 9101), ("p3", 2, "198.18.0.13", 9102),
        ("p3", 3, "198.18.0.13", 9103)]
    assert floating_stand_ins(m, "p1", {1, 2, 3}, {"p1"}) == ()


def test_reconciler_releases_before_it_takes_and_records_only_what_was_done():
    r = AddressReconciler()
    m = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p3"})
    first = r.plan({"p1", "p3"}, m, ("p1", "198.18.0.11"))
    assert first == [TakeAddress("p1", "198.18.0.11"), TakeAddress("p3", "198.18.0.13")]
    r.taken(first[0])  # the take of p3's address failed: planned again next time
    assert r.plan({"p1", "p3"}, m, ("p1", "198.18.0.11")) == [TakeAddress("p3", "198.18.0.13")]
    r.taken(TakeAddress("p3", "198.18.0.13"))
    assert r.plan({"p1"}, m, ("p1", "198.18.0.11")) == [ReleaseAddress("p3", "198.18.0.13")]
    assert r.plan(set(), m, ("p1", "198.18.0.11")) == [ReleaseAddress("p1", "198.18.0.11"),
                                                         ReleaseAddress("p3", "198.18.0.13")]


# ------------------------------------------------------------------------ the fence
def test_a_stall_as_long_as_dead_after_fences_until_quorum_held_for_the_confirm_time():
    f = Fence(stall_s=1.0, confirm_s=0.6, now=0.0)
    assert f.tick(0.05, 5) is False and f.tick(0.9, 5) is False  # 0.85 s late: not a stall yet
    assert f.tick(2.0, 5) is True and f.fenced  # frozen 1.1 s
    assert f.may_unfence(2.1, True, 5) is False
    assert f.may_unfence(2.5, False, 5) is False  # quorum lost: the wait starts over
    assert f.may_unfence(2.6, True, 5) is False
    assert f.may_unfence(3.1, True, 5) is False
    assert f.may_unfence(3.3, True, 5) is True and not f.fenced


def test_a_newer_committed_epoch_with_quorum_lifts_the_fence_at_once():
    f = Fence(stall_s=1.0, confirm_s=0.6, now=0.0)
    f.start_ticking(10.0)
    assert f.tick(10.5, 5) is False  # the gap before start_ticking is no stall
    assert f.tick(12.0, 5) is True
    assert f.may_unfence(12.05, False, 6) is False  # no quorum: the epoch may be a stale leader's
    assert f.may_unfence(12.1, True, 6) is True  # the fleet declared it down: epoch 6 is news


def test_quorum_back_after_a_degraded_spell_fences():
    f = Fence(stall_s=1.0, confirm_s=0.6, now=0.0)
    assert f.map_seen(1.0, False, 5) is False
    assert f.map_seen(2.0, True, 5) is False and not f.fenced  # cut off: keeps serving (no quorum rules)
    assert f.map_seen(5.0, False, 5) is True and f.fenced  # healed: a survivor may hold its address
    assert f.may_unfence(5.0, True, 5) is False
    assert f.may_unfence(5.7, True, 5) is True


# -------------------------------------------------------------------- tickle ACKs
def test_tickle_segment_is_a_bare_ack_with_a_valid_checksum():
    seg = tickle_segment("198.18.0.11", 9092, "198.18.0.3", 40000, seq=0x01020304, ack=0xFFFFFFFF)
    assert len(seg) == 20
    sport, dport, seq, ack, offset, flags, window, _csum, urgent = struct.unpack("!HHIIBBHHH", seg)
    assert (sport, dport, seq, ack) == (9092, 40000, 0x01020304, 0xFFFFFFFF)
    assert offset >> 4 == 5 and flags == TCP_ACK == 0x10 and urgent == 0 and window > 0
    # The receiver's check (RFC 1071): the sum over pseudo-header and segment, checksum included, is 0xFFFF.
    pseudo = pseudo_header(ipaddress.IPv4Address("198.18.0.11"), ipaddress.IPv4Address("198.18.0.3"), 20)
    assert checksum(pseudo + seg) == 0
    other = tickle_segment("198.18.0.12", 9092, "198.18.0.3", 40000, seq=0x01020304, ack=0xFFFFFFFF)
    assert checksum(pseudo + other) != 0  # the checksum covers the source address


def test_tickles_of_one_client_host_go_out_back_to_back_once_each():
    """Sorted by client address and port (one host's connections in one run of the burst), a
    connection listed twice tickled once, each segment addressed to its own client."""
    pairs = [ClientPair(9101, "198.18.0.9", 40001), ClientPair(9102, "198.18.0.3", 40007),
             ClientPair(9101, "198.18.0.10", 40000), ClientPair(9101, "198.18.0.3", 40002),
             ClientPair(9102, "198.18.0.3", 40007)]
    segments = tickle_segments("198.18.0.11", pairs, random.Random(1))
    assert [ip for _, ip in segments] == ["198.18.0.3", "198.18.0.3", "198.18.0.9", "198.18.0.10"]
    ports = [struct.unpack("!HH", seg[:4]) for seg, _ in segments]
    assert ports == [(9101, 40002), (9102, 40007), (9101, 40001), (9101, 40000)]
    pseudo = pseudo_header(ipaddress.IPv4Address("198.18.0.11"), ipaddress.IPv4Address("198.18.0.3"), 20)
    assert checksum(pseudo + segments[0][0]) == 0


def test_checksum_matches_rfc1071_worked_example():
    # RFC 1071 §3: the words 0001 f203 f4f5 f6f7 sum to ddf2 (with end-around carry); checksum = ~ddf2.
    assert checksum(bytes.fromhex("0001f203f4f5f6f7")) == 0xFFFF - 0xDDF2


def test_client_pairs_parse_only_valid_entries():
    assert ClientPair.from_json([9092, "198.18.0.3", 40000]) == ClientPair(9092, "198.18.0.3", 40000)
    on_stand_in = ClientPair(9102, "198.18.0.3", 40001, "198.18.0.12")
    assert ClientPair.from_json(on_stand_in.to_json()) == on_stand_in
    for bad in ([9092, "198.18.0.3"], [0, "198.18.0.3", 1], [9092, "not-an-ip", 1], "x",
                [9092, "198.18.0.3", 1, "nope"], [9092, "198.18.0.3", 1, "198.18.0.12", 5]):
        with pytest.raises(ValueError):
            ClientPair.from_json(bad)


def test_peer_clients_keep_the_last_list_of_a_peer_that_stopped_answering():
    import httpx

    answers = {"p2": {"clients": [[9092, "198.18.0.3", 40000]], "version": 7}}
    asked: list[tuple[str, float]] = []

    def fetch(url: str, token: str, timeout_s: float) -> dict:
        assert token == "t"
        asked.append((url, timeout_s))
        node = "p2" if "112" in url else "p3"
        if node not in answers:
            raise httpx.ConnectError("frozen")
        return answers[node]

    peers = PeerClients({"p2": "http://198.18.0.112:9400", "p3": "http://198.18.0.113:9400"}, "t", fetch=fetch,
                        long_poll_s=20.0)
    assert peers.poll("p2") == SMALL_LIST_GAP_S  # a small list: ask again (a long poll) at once
    assert peers.poll("p3") == CLIENTS_POLL_S  # not answering: ask again later
    assert peers.of("p2") == (ClientPair(9092, "198.18.0.3", 40000),) and peers.of("p3") == ()
    del answers["p2"]
    assert peers.poll("p2") == CLIENTS_POLL_S
    assert peers.of("p2") == (ClientPair(9092, "198.18.0.3", 40000),)
    # what a take that finds nobody to tickle logs: the list kept, its age, why polls fail
    state = peers.state("p2")
    assert state["pairs"] == 1 and state["version"] is None and "frozen" in state["failing"]
    assert 0 <= state["answer_age_s"] < 5
    assert peers.state("p3") == {"pairs": 0, "answer_age_s": None, "version": None,
                                 "failing": "ConnectError: frozen"}
    # the first ask is plain, the next a long poll from the version it got, with a longer timeout;
    # after a failure it asks plainly again (the peer may have restarted)
    p2_asks = [a for a in asked if "112" in a[0]]
    assert p2_asks[0] == ("http://198.18.0.112:9400/clients", POLL_TIMEOUT_S)
    assert p2_asks[1] == ("http://198.18.0.112:9400/clients?after=7&wait=20", POLL_TIMEOUT_S + 20.0)
    answers["p2"] = {"clients": [[9101, "198.18.0.3", 40002]], "version": 9}
    peers.poll("p2")
    assert asked[-1][0] == "http://198.18.0.112:9400/clients"
    assert peers.of("p2") == (ClientPair(9101, "198.18.0.3", 40002),)
    assert peers.state("p2")["failing"] is None and peers.state("p2")["version"] == 9


def test_a_peers_list_names_its_group_coordinator_connections_and_a_list_without_them_has_none():
    answers = {"clients": [[9101, "198.18.0.3", 40000], [9102, "198.18.0.3", 40001], [9102, "198.18.0.4", 1]],
               "group": [1, "x", 7], "version": 3}  # junk and indices past the list are ignored
    peers = PeerClients({"p2": "http://198.18.0.112:9400"}, "t", fetch=lambda url, token, timeout_s: answers)
    peers.poll("p2")
    assert [p.group for p in peers.of("p2")] == [False, True, False]
    del answers["group"]  # a node from before the flag
    peers.poll("p2")
    assert [p.group for p in peers.of("p2")] == [False, False, False]


def test_group_coordinator_connections_are_tickled_a_moment_after_the_others(monkeypatch):
    sent: list[tuple[float, tuple[int, ...]]] = []
    monkeypatch.setattr(floating, "send_segments", lambda host, segments: sent.append(
        (time.monotonic(), tuple(seg[1] for seg in segments))) or len(segments))
    monkeypatch.setattr(floating, "tickle_segments", lambda host, pairs: [(p, p.client_port) for p in pairs])
    monkeypatch.setattr(floating, "TICKLE_AGAIN_S", 0.2)
    monkeypatch.setattr(floating, "TICKLE_GROUP_DELAY_S", 0.05)
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=FakeMover())  # type: ignore[arg-type]
    pairs = (ClientPair(9102, "198.18.0.3", 1), ClientPair(9102, "198.18.0.3", 2, group=True),
             ClientPair(9101, "198.18.0.3", 3))

    async def run() -> None:
        sent.clear()
        shell.reconciler.taken(TakeAddress("p2", "198.18.0.12"))
        await shell._tickle(TakeAddress("p2", "198.18.0.12"))

    shell.peer_clients = type("Known", (), {"at": lambda self, a, o: pairs})()  # type: ignore[assignment]
    asyncio.run(run())
    assert [ports for _, ports in sent] == [(1, 3), (2,), (1, 3), (2,)]
    t = [at - sent[0][0] for at, _ in sent]
    assert 0.04 <= t[1] < 0.15 and 0.19 <= t[2] < 0.3 and 0.24 <= t[3] < 0.35
    # only group connections: no lag before the first wave
    shell.peer_clients = type("Known", (), {"at": lambda self, a, o: (pairs[1],)})()  # type: ignore[assignment]
    started = time.monotonic()
    asyncio.run(run())
    assert [ports for _, ports in sent] == [(2,), (2,)] and sent[0][0] - started < 0.04


def test_a_peer_that_times_out_is_asked_again_at_once_from_the_same_version():
    """A frozen peer answers when it thaws: a timed-out long poll is asked again at once and
    from the version it had (no plain re-ask after poll_s: in that gap a peer that froze again
    moments after thawing could have its clients unknown); a refusal still waits poll_s."""
    import httpx

    script: list[object] = [{"clients": [[9101, "198.18.0.3", 40000]], "version": 4},
                            httpx.ReadTimeout("frozen"), httpx.ConnectTimeout("frozen"),
                            {"clients": [[9101, "198.18.0.3", 40001]], "version": 6},
                            httpx.ConnectError("refused")]
    asked: list[tuple[str, float]] = []

    def fetch(url: str, token: str, timeout_s: float) -> dict:
        asked.append((url, timeout_s))
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    peers = PeerClients({"p3": "http://198.18.0.113:9400"}, "t", fetch=fetch, long_poll_s=20.0)
    assert peers.poll("p3") == SMALL_LIST_GAP_S
    assert peers.poll("p3") == TIMEOUT_RETRY_S < CLIENTS_POLL_S
    assert peers.poll("p3") == TIMEOUT_RETRY_S
    assert peers.of("p3") == (ClientPair(9101, "198.18.0.3", 40000),)  # the last list kept meanwhile
    assert peers.poll("p3") == SMALL_LIST_GAP_S
    assert peers.poll("p3") == CLIENTS_POLL_S
    long_ask = ("http://198.18.0.113:9400/clients?after=4&wait=20", POLL_TIMEOUT_S + 20.0)
    assert asked[1:4] == [long_ask] * 3
    assert asked[4][0].endswith("after=6&wait=20")
    assert peers.of("p3") == (ClientPair(9101, "198.18.0.3", 40001),) and peers.state("p3")["version"] is None


def test_the_clients_of_an_address_include_those_a_peer_took_standing_in_there():
    """p2 froze, p1 stood in on p2's address and took clients there, then p1 froze too: p3,
    taking p2's address, must reset p2's own clients and p1's on that address, not p1's own."""
    lists = {
        "http://p1": {"clients": [[9101, "198.18.0.3", 41000], [9102, "198.18.0.3", 41001, "198.18.0.12"]],
                      "version": 1},
        "http://p2": {"clients": [[9102, "198.18.0.3", 40000], [9102, "198.18.0.3", 41001]], "version": 1},
    }
    peers = PeerClients({"p1": "http://p1", "p2": "http://p2"}, "t",
                        fetch=lambda url, token, timeout: lists[url.split("/clients")[0]])
    peers.poll("p1")
    peers.poll("p2")
    at_p2 = sorted((p.local_port, p.client_port) for p in peers.at("198.18.0.12", "p2"))
    assert at_p2 == [(9102, 40000), (9102, 41001)]  # p2's own, and p1's there (once)
    assert [(p.local_port, p.client_port) for p in peers.at("198.18.0.11", "p1")] == [(9101, 41000)]


def test_a_peers_answer_says_whether_it_holds_its_own_address_and_a_failed_poll_forgets_it():
    import httpx

    script: list = [{"clients": [], "version": 1, "holds_own": False}, {"clients": [], "version": 2, "holds_own": True},
                    httpx.ConnectError("refused"), {"clients": [], "version": 1}]

    def fetch(url: str, token: str, timeout_s: float) -> dict:
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    peers = PeerClients({"p2": "http://198.18.0.112:9400"}, "t", fetch=fetch)
    assert peers.holds_own("p2") is None  # never answered
    peers.poll("p2")
    assert peers.holds_own("p2") is False
    peers.poll("p2")
    assert peers.holds_own("p2") is True
    peers.poll("p2")
    assert peers.holds_own("p2") is None  # restarting, frozen, cut off: unknown, not its last word
    peers.poll("p2")
    assert peers.holds_own("p2") is None  # a node that does not say


def test_a_peer_without_versions_is_polled_every_poll_s_and_a_long_list_waits_too():
    body = {"clients": [[9092, "198.18.0.3", 40000 + i] for i in range(SMALL_LIST + 1)]}
    peers = PeerClients({"p2": "http://198.18.0.112:9400"}, "t", fetch=lambda u, t, s: body)
    assert peers.poll("p2") == CLIENTS_POLL_S  # no version: an old node, plain polls
    body["version"] = 1
    assert peers.poll("p2") == CLIENTS_POLL_S  # versioned, but a long list: not one per change
    assert len(peers.of("p2")) == SMALL_LIST + 1


def test_the_long_poll_answers_at_a_change_after_settling_or_at_the_wait():
    counter = ChangeCounter()
    slept: list[float] = []
    pairs = [ClientPair(9092, "198.18.0.3", 40000)]
    assert listing(lambda: pairs, counter, None, 0.0, sleep=slept.append) == (0, pairs)  # plain: at once
    t0 = time.monotonic()
    assert listing(lambda: pairs, counter, 0, 0.05, sleep=slept.append) == (0, pairs)  # unchanged: the wait
    assert time.monotonic() - t0 >= 0.05 and slept == []
    threading.Timer(0.05, counter.bump).start()
    t0 = time.monotonic()
    assert listing(lambda: pairs, counter, 0, 5.0, sleep=slept.append)[0] == 1
    assert time.monotonic() - t0 < 4.0 and slept == [SETTLE_S]  # answered at the change, settled
    assert counter.wait_past(5, 0.0) == 1  # a version from another process: differs, at once


def test_clients_query_parses_and_caps_and_names_the_bad_parameter():
    assert clients_query("/clients") == (None, 0.0)
    assert clients_query("/clients?after=3&wait=20") == (3, 20.0)
    assert clients_query("/clients?after=3&wait=999") == (3, MAX_CLIENTS_WAIT_S)
    for bad, name in (("/clients?after=x", "after"), ("/clients?after=1&wait=y", "wait"),
                      ("/clients?after=1&wait=-1", "wait"), ("/clients?after=1&wait=nan", "wait")):
        with pytest.raises(ValueError, match=name):
            clients_query(bad)


# ------------------------------------------------------------ the shell, fake mover
class FakeMover:
    def __init__(self, fail: set[str] = frozenset(), found: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self.found = found  # the floating addresses on the host's link when the process starts
        self.reads = 0

    def held_floating(self) -> list[ipaddress.IPv4Address]:
        self.reads += 1
        return [ipaddress.IPv4Address(ip) for ip in self.found]

    def take(self, address) -> None:
        if str(address.ip) in self.fail:
            from proxy.addresses.movers import MoverError

            raise MoverError("ip addr replace exited 2")
        self.calls.append(f"take {address.cidr}")

    def release(self, address) -> None:
        self.calls.append(f"release {address.cidr}")

    def announce(self, address) -> None:
        self.calls.append(f"announce {address.cidr}")


def test_shell_takes_own_and_a_down_nodes_address_and_gives_them_back_when_fenced():
    mover = FakeMover()
    now = [0.0]
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover, clock=lambda: now[0])  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2", "p3"})

    async def run() -> None:
        assert shell.status() == {"held": {}, "fenced": False, "tickles_sent": 0}
        assert await shell.sync(m, draining=False) == {"p1", "p2", "p3"}
        assert shell.status() == {"held": {"p1": "198.18.0.11", "p2": "198.18.0.12", "p3": "198.18.0.13"},
                                  "fenced": False, "tickles_sent": 0}
        now[0] = 2.0
        assert shell.fence.tick(now[0], m.epoch) is True
        assert await shell.sync(m, draining=False) == frozenset()
        assert shell.status() == {"held": {}, "fenced": True, "tickles_sent": 0}

    asyncio.run(run())
    assert mover.calls == ["take 198.18.0.11/24", "take 198.18.0.12/24", "take 198.18.0.13/24",
                           "release 198.18.0.11/24", "release 198.18.0.12/24", "release 198.18.0.13/24"]


def test_shell_keeps_going_when_a_take_fails_and_retries_it_next_time():
    mover = FakeMover(fail={"198.18.0.13"})
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover)  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2", "p3"})

    async def run() -> frozenset[str]:
        assert await shell.sync(m, draining=False) == {"p1", "p2"}
        mover.fail = set()
        return await shell.sync(m, draining=False)

    assert asyncio.run(run()) == {"p1", "p2", "p3"}
    assert mover.calls == ["take 198.18.0.11/24", "take 198.18.0.12/24", "take 198.18.0.13/24"]


def test_a_peers_address_left_on_the_host_by_a_killed_process_is_given_back_at_the_first_map(monkeypatch):
    # p1 was killed while it stood in for p2 and p3 (their addresses stayed on p1's link); now p1
    # and p3 are up again and p2 is down, p1 its holder: p3's address goes back (once p3 holds it:
    # here the fixed wait), p2's stays held (no second take), and an address in the networks that
    # is no node's is not touched.
    monkeypatch.setattr(floating, "HANDOVER_WAIT_S", 0.01)
    mover = FakeMover(found=("198.18.0.12", "198.18.0.13", "198.18.0.99"))
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover)  # type: ignore[arg-type]
    before = ServingMap(epoch=0, owners={}, nodes=(), vacant=frozenset(), draining=frozenset(), stand_ins=())
    m = fleet_map({1: "p1", 2: "p1", 3: "p3"}, vacant={"p2"})

    async def run() -> tuple[frozenset[str], frozenset[str]]:
        first = await shell.sync(before, draining=False)  # no peer named yet: nothing read
        await shell.sync(m, draining=False)
        deadline = time.monotonic() + 5
        while "p3" in shell.held and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return first, shell.held

    first, held = asyncio.run(run())
    assert first == frozenset() and held == {"p1", "p2"}
    assert mover.calls == ["take 198.18.0.11/24", "release 198.18.0.13/24"] and mover.reads == 1


def test_tickles_go_out_only_once_the_data_path_listens_on_the_taken_address(monkeypatch):
    sent: list[tuple[str, tuple]] = []
    monkeypatch.setattr(floating, "send_segments",
                        lambda host, segments: sent.append((host, tuple(ip for _, ip in segments))) or len(segments))
    monkeypatch.setattr(floating, "TICKLE_AGAIN_S", 0.0)
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=FakeMover(), clock=lambda: 0.0)  # type: ignore[arg-type]
    pair = ClientPair(9102, "198.18.0.3", 40000)

    class Known:
        def at(self, address, owner):
            return (pair,) if (address, owner) == ("198.18.0.12", "p2") else ()

    shell.peer_clients = Known()  # type: ignore[assignment]

    async def run() -> None:
        await shell.sync(fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2"}), draining=False)
        for _ in range(5):
            await asyncio.sleep(0)
        assert sent == []  # taken, but its stand-in listeners are not bound yet
        shell.tickle_taken()
        for _ in range(50):
            if len(sent) == 2:
                break
            await asyncio.sleep(0.01)
        shell.tickle_taken()  # nothing new taken: nothing more sent

    asyncio.run(run())
    assert sent == [("198.18.0.12", ("198.18.0.3",))] * 2  # the tickle and its repeat


def test_a_taken_address_is_announced_again_while_held_and_not_once_given_back(monkeypatch):
    # The take's own gratuitous ARPs can be ignored by the clients (a neighbour entry changed
    # less than locktime ago keeps its MAC): the holder announces again later.
    monkeypatch.setattr(floating, "ANNOUNCE_AGAIN_S", (0.01, 0.5))
    mover = FakeMover()
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover)  # type: ignore[arg-type]
    both = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2"})
    own_only = fleet_map({1: "p1", 2: "p2", 3: "p1"})

    async def until(count: int) -> None:
        for _ in range(500):  # at most ~5 s
            if len(mover.calls) >= count:
                return
            await asyncio.sleep(0.01)

    async def run() -> None:
        await shell.sync(both, draining=False)
        await until(4)  # the first re-announcement of both (at 10 ms; the second is at 500 ms)
        await shell.sync(own_only, draining=False)  # p2 is back: its address is given back
        await until(6)
        await asyncio.sleep(0.05)  # nothing more may come: p2's second announcement is off

    asyncio.run(run())
    assert mover.calls == ["take 198.18.0.11/24", "take 198.18.0.12/24",
                           "announce 198.18.0.11/24", "announce 198.18.0.12/24",
                           "release 198.18.0.12/24", "announce 198.18.0.11/24"]


def test_before_another_nodes_address_is_given_back_its_clients_here_are_vacated_first():
    # Once the address is gone this host can send its clients nothing: they would wait out
    # their request timeout. The data path resets them while the address is still held.
    mover = FakeMover()
    now = [0.0]
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover, clock=lambda: now[0])  # type: ignore[arg-type]

    async def vacate(node: str, host: str) -> None:
        mover.calls.append(f"vacate {node} {host}")

    shell.before_release = vacate

    async def run() -> None:
        await shell.sync(fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2"}), draining=False)
        await shell.sync(fleet_map({1: "p1", 2: "p2", 3: "p1"}), draining=False)  # p2 is back
        await until_released(shell, "p2")  # handed over (no client poll here: HANDOVER_WAIT_S)
        now[0] = 2.0
        assert shell.fence.tick(now[0], 5) is True  # a stall: its own address goes too, no vacate
        await shell.sync(fleet_map({1: "p1", 2: "p2", 3: "p1"}), draining=False)

    asyncio.run(run())
    assert mover.calls == ["take 198.18.0.11/24", "take 198.18.0.12/24",
                           "vacate p2 198.18.0.12", "release 198.18.0.12/24", "release 198.18.0.11/24"]


async def until_released(shell: FloatingAddresses, node: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while node in shell.held:
        assert time.monotonic() < deadline, f"{node}'s address still held after {timeout_s} s"
        await asyncio.sleep(0.005)


class Polled:
    """The peers' client lists as the shell reads them: only whether a node holds its address."""

    def __init__(self, peers: tuple[str, ...]) -> None:
        self.peers = {p: f"http://{p}" for p in peers}
        self.holding: dict[str, bool | None] = {}

    def holds_own(self, node: str) -> bool | None:
        return self.holding.get(node)

    def at(self, address, owner):
        return ()


def handover_shell(monkeypatch, polled: Polled | None) -> tuple[FloatingAddresses, FakeMover, dict[str, float]]:
    monkeypatch.setattr(floating, "HANDOVER_WAIT_S", 0.2)
    monkeypatch.setattr(floating, "HANDOVER_MAX_S", 0.6)
    mover = FakeMover()
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover)  # type: ignore[arg-type]
    shell.peer_clients = polled  # type: ignore[assignment]
    at: dict[str, float] = {}

    async def vacate(node: str, host: str) -> None:
        at[node] = time.monotonic()

    shell.before_release = vacate
    return shell, mover, at


DOWN_P2 = fleet_map({1: "p1", 2: "p1", 3: "p3"}, vacant={"p2"})
BACK_P2 = fleet_map({1: "p1", 2: "p2", 3: "p3"})


def test_an_address_going_back_to_its_node_is_released_once_the_node_says_it_holds_it(monkeypatch):
    # Released at the map that marks the node up, the address was on no host until the node
    # took it (it takes it once it serves): the clients' reconnects got no answer for 1 s.
    polled = Polled(("p2", "p3"))
    shell, mover, at = handover_shell(monkeypatch, polled)

    async def run() -> float:
        await shell.sync(DOWN_P2, draining=False)
        assert await shell.sync(BACK_P2, draining=False) == {"p1", "p2"}  # still held: not yet
        await asyncio.sleep(0.3)
        assert "p2" in shell.held and "p2" not in at
        assert await shell.refresh() == 1  # its own only: p2's is p2's to announce now
        t0 = time.monotonic()
        polled.holding["p2"] = True
        await until_released(shell, "p2")
        return t0

    t0 = asyncio.run(run())
    assert 0 <= at["p2"] - t0 < 0.2
    assert mover.calls[-2:] == ["announce 198.18.0.11/24", "release 198.18.0.12/24"]


def released_after(shell: FloatingAddresses, at: dict[str, float]) -> float:
    """p2 down, then back: seconds from the map that gives its address back to the vacate."""
    async def run() -> float:
        await shell.sync(DOWN_P2, draining=False)
        t0 = time.monotonic()
        await shell.sync(BACK_P2, draining=False)
        await until_released(shell, "p2")
        return t0

    t0 = asyncio.run(run())
    return at["p2"] - t0


def test_an_address_going_back_is_released_after_the_longest_wait_if_its_node_never_says_so(monkeypatch):
    shell, mover, at = handover_shell(monkeypatch, Polled(("p2", "p3")))
    assert released_after(shell, at) >= 0.6 and mover.calls[-1] == "release 198.18.0.12/24"


def test_without_a_poll_of_the_node_the_address_goes_back_after_the_fixed_wait(monkeypatch):
    shell, _mover, at = handover_shell(monkeypatch, None)
    assert 0.2 <= released_after(shell, at) < 0.6


def test_an_address_whose_node_goes_down_again_during_the_handover_is_kept(monkeypatch):
    shell, mover, at = handover_shell(monkeypatch, Polled(("p2", "p3")))

    async def run() -> None:
        await shell.sync(DOWN_P2, draining=False)
        await shell.sync(BACK_P2, draining=False)
        await shell.sync(DOWN_P2, draining=False)  # down again before it took its address
        await asyncio.sleep(0.8)  # past the longest wait

    asyncio.run(run())
    assert "p2" in shell.held and at == {} and "release 198.18.0.12/24" not in mover.calls


def test_handing_over_is_only_for_an_address_going_back_to_its_own_node():
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=FakeMover())  # type: ignore[arg-type]
    back = BACK_P2
    assert shell.handing_over("p2", back) is True
    assert shell.handing_over("p3", fleet_map({1: "p1", 2: "p2", 3: "p1"}, vacant={"p3"})) is False  # still down
    assert shell.handing_over("p1", back) is False  # this node's own address
    assert shell.handing_over("p9", back) is False  # not in the map (removed)
    assert shell.handing_over("p2", attrs.evolve(back, degraded=True)) is False
    shell.fence.fenced = True
    assert shell.handing_over("p2", back) is False  # fenced: everything goes back at once


def test_an_address_handed_on_to_another_survivor_is_not_held_back(monkeypatch):
    monkeypatch.setattr(floating, "HANDOVER_WAIT_S", 5.0)
    mover = FakeMover()
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover)  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2"})

    async def run() -> None:
        await shell.sync(m, draining=False)
        t0 = time.monotonic()
        assert await shell.sync(m, draining=True) == {"p1"}  # draining: p2's address goes to p3
        assert time.monotonic() - t0 < 1.0

    asyncio.run(run())
    assert mover.calls[-1] == "release 198.18.0.12/24"


def test_the_mover_opens_what_a_take_uses_before_the_first_take():
    opened: list[str] = []
    mover = AddressMover(parse_mover_config({"mover": "netns", "interface": "eth9"}),
                         link_addresses=lambda i: opened.append(f"netlink {i}") or [],
                         mac_of=lambda i: opened.append(f"mac {i}") or b"\x02" * 6,
                         open_sender=lambda i: opened.append(f"arp {i}"))
    mover.prepare()
    assert opened == ["netlink eth9", "mac eth9", "arp eth9"]
    quiet = AddressMover(parse_mover_config({"mover": "command", "command": ["true"],
                                                           "networks": ["198.18.0.0/24"]}),
                         link_addresses=lambda i: opened.append("no"), open_sender=lambda i: opened.append("no"))
    quiet.prepare()  # a command mover has nothing to open
    assert "no" not in opened


# -------------------------------------------------------------------------- config
def raw_config(addresses: dict | None, floating: list[str | None]) -> dict:
    nodes = [{"id": f"p{i + 1}", "host": f"198.18.0.11{i + 1}", "bootstrap_port": 9092, "workers": 1,
              **({"floating_host": f} if f else {})} for i, f in enumerate(floating)]
    raw: dict = {"upstream": {"bootstrap": ["198.18.0.2:19092"]}, "ports": {"base": 9100}, "nodes": nodes}
    if addresses is not None:
        raw["addresses"] = addresses
    return raw


def test_config_advertises_the_floating_address_and_keeps_host_for_the_rest():
    from proxy.config import proxy_node

    cfg = parse(raw_config({"mover": "netns"}, ["198.18.0.11", "198.18.0.12"]))
    assert cfg.addresses.kind == "netns"
    assert proxy_node(cfg, "p1").host == "198.18.0.11" and cfg.node("p1").host == "198.18.0.111"
    assert parse(raw_config(None, [None, None])).addresses.kind == "none"


@pytest.mark.parametrize("addresses, floating, field, words", [
    (None, ["198.18.0.11", None], "nodes[0].floating_host", "set [addresses] mover"),
    ({"mover": "netns"}, ["198.18.0.11", None], "nodes[1].floating_host", "set it"),
    ({"mover": "netns"}, ["198.18.0.11", "10.0.0.12"], "nodes[1].floating_host", "outside"),
    ({"mover": "netns"}, ["198.18.0.11", "198.18.0.11"], "nodes", "share one floating_host"),
    ({"mover": "netns"}, ["198.18.0.11", "198.18.0.111"], "nodes[1].floating_host", "own host address"),
    ({"mover": "teleport"}, [None, None], "addresses", "not one of"),
])
def test_config_refuses_floating_addresses_that_do_not_fit(addresses, floating, field, words):
    with pytest.raises(ConfigError) as info:
        parse(raw_config(addresses, floating))
    assert info.value.field == field and words in str(info.value)


def test_without_quorum_the_nodes_in_reach_share_the_addresses_of_the_nodes_out_of_reach():
    # p1 alone after its lease: p2 and p3 out of reach, the committed view still has them up.
    m = attrs.evolve(fleet_map({1: "p1", 2: "p1", 3: "p1"}), degraded=True, unreachable=frozenset({"p2", "p3"}))
    assert address_holder(m, "p2") == address_holder(m, "p3") == "p1"
    assert wanted_addresses(m, "p1", fleet=True, fenced=False, draining=False) == {"p1", "p2", "p3"}
    # p1 and p2 in reach of each other, p3 out of reach: exactly one of them takes p3's address.
    two = attrs.evolve(fleet_map({1: "p1", 2: "p2", 3: "p1"}), degraded=True, unreachable=frozenset({"p3"}))
    takers = [n for n in ("p1", "p2") if "p3" in wanted_addresses(two, n, fleet=True, fenced=False, draining=False)]
    assert takers == [address_holder(two, "p3")] and len(takers) == 1


def test_the_degraded_map_names_the_nodes_out_of_reach_and_the_quorate_one_none():
    from membership.effective import build_serving_map
    from membership.state import FleetState

    nodes = {n.id: n for n in NODES}
    degraded = build_serving_map(FleetState(), self_id="p1", configured=nodes, reachable={"p1"}, degraded=True)
    assert degraded.unreachable == {"p2", "p3"}
    quorate = build_serving_map(FleetState(), self_id="p1", configured=nodes, reachable={"p1"}, degraded=False)
    assert quorate.unreachable == frozenset()
    # p2 is heard but does not hear p1 yet (its link just came back, or p1's send path is
    # broken): not live, yet not unreachable: p1 must not claim p2's address
    healing = build_serving_map(FleetState(), self_id="p1", configured=nodes, reachable={"p1"},
                                hearing={"p1", "p2"}, degraded=True)
    assert healing.unreachable == {"p3"}
    assert down_nodes(healing) == {"p3"}


def test_an_isolated_node_gives_its_address_up_at_once_and_stays_fenced_until_it_knows_the_map():
    """Cut off, the host gives its own address up while its peers take it (held until the heal,
    its ARP traffic at link-up would point the clients at it just before it learns it is down);
    hearing its peers again it stays fenced until the committed map is known."""
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=FakeMover(), clock=lambda: 1.0)  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p2", 3: "p3"})
    assert shell.map_seen(m) is False
    isolated = attrs.evolve(m, isolated=True)
    assert shell.map_seen(isolated) is True and shell.fence.fenced
    assert wanted_addresses(isolated, "p1", fleet=True, fenced=shell.fence.fenced, draining=False) == frozenset()
    assert shell.map_seen(isolated) is False and shell.fence.fenced  # fenced once: connections dropped once
    assert shell.map_seen(m) is False and shell.fence.fenced  # peers heard again: still fenced
    assert shell.fence.may_unfence(1.0, False, m.epoch) is False  # no quorum yet
    assert wanted_addresses(m, "p1", fleet=True, fenced=shell.fence.fenced, draining=False) == frozenset()


def test_peers_back_in_reach_make_a_node_announce_its_own_address_again():
    """Two of three cut one after the other: the last node claimed this node's address without
    quorum and gives it back once it hears this node; this node, which kept its address, points
    the clients back at itself (at once, then at ANNOUNCE_AGAIN_S)."""
    mover = FakeMover()
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover, clock=lambda: 1.0)  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p2", 3: "p3"})
    cut = attrs.evolve(m, degraded=True, unreachable=frozenset({"p2", "p3"}))
    healing = attrs.evolve(cut, unreachable=frozenset({"p3"}))  # p2 heard again, still no quorum

    async def run() -> list[str]:
        assert await shell.sync(m, draining=False) == {"p1"}
        assert shell.map_seen(cut) is False
        await asyncio.sleep(0.05)
        assert "announce 198.18.0.11/24" not in mover.calls  # nobody came back yet
        assert shell.map_seen(healing) is False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while "announce 198.18.0.11/24" not in mover.calls and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return list(mover.calls)

    assert asyncio.run(run()) == ["take 198.18.0.11/24", "announce 198.18.0.11/24"]


def test_a_fenced_node_does_not_announce_when_peers_come_back():
    mover = FakeMover()
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1.0,
                              confirm_s=0.5, mover=mover, clock=lambda: 1.0)  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p2", 3: "p3"})

    async def run() -> None:
        await shell.sync(m, draining=False)
        shell.map_seen(attrs.evolve(m, degraded=True, unreachable=frozenset({"p2", "p3"})))
        assert shell.map_seen(m) is True  # quorum back: fenced, its address taken again later
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert mover.calls == ["take 198.18.0.11/24"]


def test_a_quorate_node_announces_what_it_holds_every_refresh_period_and_a_fenced_one_does_not():
    from proxy.addresses import floating

    mover = FakeMover()
    now = [0.0]
    shell = FloatingAddresses(parse_mover_config({"mover": "netns"}), "p1", "198.18.0.11", fleet=True, stall_s=1e9,
                              confirm_s=0.5, mover=mover, clock=lambda: now[0])  # type: ignore[arg-type]
    m = fleet_map({1: "p1", 2: "p1", 3: "p3"}, vacant={"p2"})
    degraded = attrs.evolve(m, degraded=True)
    current = [m]

    async def run() -> None:
        await shell.sync(m, draining=False)
        held = {c.split()[1] for c in mover.calls}
        watch = asyncio.ensure_future(shell.watch(lambda: current[0], lambda: None, asyncio.sleep))
        now[0] = floating.REFRESH_S  # the first refresh is due
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while sum(c.startswith("announce") for c in mover.calls) < len(held) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert sorted(c for c in mover.calls if c.startswith("announce")) == sorted(f"announce {a}" for a in held)
        mover.calls.clear()
        current[0] = degraded  # without quorum: who holds what is not known, nothing is refreshed
        now[0] = 2 * floating.REFRESH_S + 0.1
        await asyncio.sleep(3 * floating.FENCE_TICK_S)
        assert mover.calls == []
        watch.cancel()

    asyncio.run(run())


def test_a_removed_nodes_address_is_stood_in_for_like_a_vacant_ones():
    """p3 left the fleet: p1 stands in on p3's bootstrap port and on p3's port of the identity
    p1 owns (a client keeping identity 1's old address is still served); p2 on its own."""
    from proxy.takeover import removed_stand_ins

    p3 = next(n for n in NODES if n.id == "p3")
    m = attrs.evolve(fleet_map({1: "p1", 2: "p2", 3: "p2"}), nodes=tuple(n for n in NODES if n.id != "p3"))
    mine = removed_stand_ins(m, "p1", {1, 2, 3}, [p3], draining=False)
    assert {(s.vacant, s.listener, s.host, s.port) for s in mine} == {
        ("p3", BOOTSTRAP, p3.host, p3.bootstrap_port), ("p3", 1, p3.host, p3.ports.port_for(1))}
    assert {s.listener for s in removed_stand_ins(m, "p2", {1, 2, 3}, [p3], draining=False)} == {BOOTSTRAP, 2, 3}
    assert removed_stand_ins(m, "p1", {1, 2, 3}, [p3], draining=True) == ()
    back = fleet_map({1: "p1", 2: "p2", 3: "p3"})  # added back: its own node serves there
    assert removed_stand_ins(back, "p1", {1, 2, 3}, [p3], draining=False) == ()


class _FakePair:
    def __init__(self) -> None:
        self.closed, self.held, self.aborted, self.was_reset = False, False, None, False

    def hold(self) -> None:
        self.held = True

    def abort(self, reason: str) -> None:
        self.closed, self.aborted = True, reason

    def reset(self, reason: str) -> None:
        self.abort(reason)
        self.was_reset = True


def test_an_isolated_fence_holds_the_connections_silent_and_drops_them_when_it_lifts():
    """A host that hears nothing may still send: a drop at the fence would reach its clients
    before a survivor holds the address (they reconnect into the void); held, they wait for the
    survivor's tickles. A stall or a heal after a degraded spell still drops them at once."""
    from proxy.datapath import DataPath

    pairs = [_FakePair(), _FakePair()]
    node = attrs.make_class("Node", ["id"])("p1")
    dp = type("FakeDataPath", (), {})()
    dp.registry, dp.node, dp._held = attrs.make_class("Reg", ["pairs"])(set(pairs)), node, []
    DataPath._fenced(dp, isolated=True)
    assert all(p.held and p.aborted is None for p in pairs) and len(dp._held) == 2
    pairs[0].abort("its client closed it meanwhile")
    DataPath._drop_held(dp)
    assert pairs[1].aborted is not None and "isolated" in pairs[1].aborted and dp._held == []
    assert pairs[1].was_reset  # an RST, not a FIN queued behind what the client was sent
    assert pairs[0].aborted == "its client closed it meanwhile"  # not aborted twice

    stalled = [_FakePair()]
    dp.registry = attrs.make_class("Reg", ["pairs"])(set(stalled))
    DataPath._fenced(dp)
    assert stalled[0].aborted is not None and stalled[0].was_reset and not stalled[0].held and dp._held == []


# ---- DataPath._vacate on real loopback sockets (uvloop): every client at the address is reset on
# the wire before _vacate returns (the address is released right after it).

TCP_CLOSE, TCP_CLOSE_WAIT = 7, 8  # linux/tcp_states.h; a reset socket is CLOSE, one sent a FIN CLOSE_WAIT


def _tcp_state(sock, wanted: tuple[int, ...] = (TCP_CLOSE,), timeout_s: float = 1.0) -> int:
    """The client socket's TCP state once it is one of ``wanted`` or after ``timeout_s``. Blocking
    on purpose: the event loop does not run meanwhile (a softirq may deliver the RST a moment late)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while True:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
        if state in wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.005)


class _TransportPair:
    """The part of proxy.connection.Pair that _vacate uses, over a real server-side transport."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.client, self.closed = transport, False

    def reset(self, reason: str) -> None:
        from proxy.connection import reset_transport

        self.closed = True
        reset_transport(self.client)


def _vacating_datapath(server: asyncio.AbstractServer, pairs: set):
    """A stand-in for the DataPath _vacate runs on: its listeners' stand_in closes ``server``."""
    from proxy.datapath import DataPath

    class Listeners:
        bound: frozenset = frozenset()

        async def stand_in(self, wanted) -> None:
            server.close()

    dp = type("FakeDataPath", (), {"_vacate": DataPath._vacate})()
    dp.listeners = Listeners()
    dp.registry = attrs.make_class("Reg", ["pairs", "handshaking"])(pairs, set())
    dp.floating = attrs.make_class("Floating", ["held"])(frozenset({"p2"}))
    dp.serving = fleet_map({1: "p1", 2: "p1", 3: "p1"}, vacant={"p2"})
    dp.node = attrs.make_class("Node", ["id"])("p1")
    return dp


async def _server_with_a_full_client():
    """A loopback server, a client that reads nothing, and the server's transport to it with more
    queued than the socket buffers hold."""
    import socket

    accepted: asyncio.Future[asyncio.Transport] = asyncio.get_running_loop().create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            accepted.set_result(transport)

    server = await asyncio.get_running_loop().create_server(Server, "127.0.0.1", 0)
    client = socket.create_connection(("127.0.0.1", server.sockets[0].getsockname()[1]))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    transport = await asyncio.wait_for(accepted, 5)
    transport.write(b"x" * (8 << 20))  # more than the buffers hold: most of it stays queued
    await asyncio.sleep(0.05)
    assert transport.get_write_buffer_size() > 0
    return server, client, transport


def test_vacate_resets_its_clients_on_the_wire_before_it_returns_even_with_data_queued_for_them():
    """uvloop closes an aborted transport's socket on the loop's next pass, and a FIN waits behind
    unsent bytes: a host that released the address right after would never send either (seen: a
    client waiting out its 10 s request timeout after a heal). The client must be reset (TCP
    CLOSE, not CLOSE_WAIT or ESTABLISHED) by the time _vacate returns, without another pass."""
    import uvloop

    async def run() -> int:
        server, client, transport = await _server_with_a_full_client()
        try:
            dp = _vacating_datapath(server, {_TransportPair(transport)})
            await dp._vacate("p2", "127.0.0.1")
            return _tcp_state(client)  # no await since: the loop did not run again
        finally:
            client.close()

    assert uvloop.run(run()) == TCP_CLOSE


def test_a_pair_already_closing_with_bytes_queued_is_reset_too():
    """A drain closes a client gracefully: its FIN waits behind what is still queued. Reset at an
    address this host gives away (Pair.reset), it must get its RST at once like any other."""
    import uvloop

    from proxy.config import Limits
    from proxy.connection import Pair
    from proxy.drain import NodeDrain
    from proxy.metrics import ProxyMetrics
    from proxy.registry import ConnectionRegistry

    async def run() -> int:
        server, client, transport = await _server_with_a_full_client()
        try:
            pair = Pair(ConnectionRegistry("t", Limits(), ProxyMetrics("t"), None, NodeDrain(takeover=False)), 1)
            pair.client = transport
            transport.close()  # graceful: waits to flush
            assert transport.is_closing()
            pair.reset("its address goes back to its node")
            await asyncio.sleep(0)
            return _tcp_state(client)
        finally:
            client.close()
            server.close()

    assert uvloop.run(run()) == TCP_CLOSE


def test_vacate_resets_a_connection_whose_pair_the_loop_had_yet_to_make():
    """uvloop makes a pair in connection_made, which it calls on the loop's pass after the accept: a
    connection accepted just before the listener closed is not a pair yet when _vacate starts. It
    must be reset with the rest (seen: its client waited 10 s on an address no host answered)."""
    import socket

    import uvloop

    async def run() -> int:
        pairs: set = set()

        class Server(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                pairs.add(_TransportPair(transport))

        loop = asyncio.get_running_loop()
        server = await loop.create_server(Server, "127.0.0.1", 0)
        client = socket.create_connection(("127.0.0.1", server.sockets[0].getsockname()[1]))
        try:
            deadline = time.monotonic() + 5
            while not pairs:
                assert time.monotonic() < deadline, "the server never made the connection's pair"
                await asyncio.sleep(0.005)
            # As if accepted just now: its pair is made by a callback already in the loop's ready
            # queue when _vacate starts (uvloop's connection_made after an accept).
            loop.call_soon(pairs.add, pairs.pop())
            await _vacating_datapath(server, pairs)._vacate("p2", "127.0.0.1")
            return _tcp_state(client, (TCP_CLOSE, TCP_CLOSE_WAIT))  # no await since: the loop did not run again
        finally:
            client.close()

    assert uvloop.run(run()) in (TCP_CLOSE, TCP_CLOSE_WAIT)  # told, by an RST (or a FIN), before it returned


def test_only_a_fleet_with_a_mover_names_refused_peers_in_its_map():
    """membership.member passes the heartbeat's refused peers on only when addresses float: on
    loopback (no mover) the map stays what it was (nothing would read the field)."""
    from proxy.member_link import member_config

    def fleet(addresses: dict | None, floating: list[str | None]) -> dict:
        raw = raw_config(addresses, floating)
        raw["fleet"] = {"password": "pw"}
        for i, node in enumerate(raw["nodes"]):
            node["raft_port"] = 9500 + i
        return raw

    assert member_config(parse(fleet({"mover": "netns"}, ["198.18.0.11", "198.18.0.12"])), "p1").floating_addresses
    assert not member_config(parse(fleet(None, [None, None])), "p1").floating_addresses
