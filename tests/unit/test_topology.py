"""Properties of topology.assign and the address map, driven by Hypothesis.

The expected values come from independent oracles (the minimum number of moves
any balanced assignment needs, computed from the previous loads), never from
the function under test.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topology import (
    AddressConflict,
    AddressMap,
    Broker,
    NoLiveNodes,
    PortScheme,
    ProxyNode,
    assign,
    is_balanced,
    same_rack,
    validate_addresses,
)

pytestmark = pytest.mark.unit

RACKS = st.sampled_from([None, "a", "b", "c"])


@st.composite
def brokers_st(draw, max_size=24):
    ids = draw(st.lists(st.integers(0, 60), unique=True, max_size=max_size))
    return [Broker(i, f"kafka{i}", 9092, draw(RACKS)) for i in ids]


@st.composite
def nodes_st(draw, min_size=1, max_size=7):
    ids = draw(st.lists(st.integers(0, 9), unique=True, min_size=min_size, max_size=max_size))
    return [ProxyNode(f"p{i}", f"127.0.0.{10 + i}", 9000, draw(RACKS)) for i in ids]


@st.composite
def previous_st(draw, brokers, node_ids):
    """An arbitrary previous mapping: may name dead nodes, unknown nodes, gone brokers."""
    owners = sorted(node_ids) + ["dead1", "dead2"]
    prev = {}
    for b in brokers:
        if draw(st.booleans()):
            prev[b.id] = draw(st.sampled_from(owners))
    if draw(st.booleans()):
        prev[999] = owners[0]  # a broker that no longer exists
    return prev


def loads(mapping, node_ids):
    out = {n: 0 for n in node_ids}
    for p in mapping.values():
        out[p] += 1
    return out


def minimal_moves(brokers, node_ids, previous):
    """Oracle: the fewest identities any balanced assignment must move.

    Brokers whose previous owner is not live always move. Of the rest, node i
    keeps at most its cap; the best caps give q+1 to the `extra` nodes that
    hold the most."""
    m, n = len(brokers), len(node_ids)
    q, extra = divmod(m, n)
    kept = {nid: 0 for nid in node_ids}
    for b in brokers:
        owner = previous.get(b.id)
        if owner in kept:
            kept[owner] += 1
    ks = sorted(kept.values(), reverse=True)
    keepable = sum(min(k, q + 1) for k in ks[:extra]) + sum(min(k, q) for k in ks[extra:])
    return m - keepable


def moved(brokers, previous, result):
    return {b.id for b in brokers if previous.get(b.id) != result[b.id]}


@given(st.data())
def test_every_broker_has_exactly_one_live_owner_and_loads_are_balanced(data):
    brokers = data.draw(brokers_st())
    nodes = data.draw(nodes_st())
    prev = data.draw(previous_st(brokers, [n.id for n in nodes]))
    result = assign(brokers, nodes, prev)
    assert set(result) == {b.id for b in brokers}
    assert set(result.values()) <= {n.id for n in nodes}
    ls = loads(result, [n.id for n in nodes])
    if brokers:
        assert max(ls.values()) - min(ls.values()) <= 1, ls
    assert is_balanced(result, [n.id for n in nodes])


@given(st.data())
def test_moves_are_minimal(data):
    brokers = data.draw(brokers_st())
    nodes = data.draw(nodes_st())
    node_ids = [n.id for n in nodes]
    prev = data.draw(previous_st(brokers, node_ids))
    result = assign(brokers, nodes, prev)
    assert len(moved(brokers, prev, result)) == minimal_moves(brokers, node_ids, prev)


@given(st.data())
def test_a_death_moves_only_the_dead_nodes_identities(data):
    brokers = data.draw(brokers_st())
    nodes = data.draw(nodes_st(min_size=2))
    start = data.draw(previous_st(brokers, [n.id for n in nodes]))
    before = assign(brokers, nodes, start)  # balanced, as the fleet's table is
    dead = data.draw(st.sampled_from(nodes))
    survivors = [n for n in nodes if n.id != dead.id]
    after = assign(brokers, survivors, before)
    assert moved(brokers, before, after) == {b for b, p in before.items() if p == dead.id}
    assert dead.id not in after.values()


@given(st.data())
def test_a_join_moves_at_most_what_balance_needs(data):
    brokers = data.draw(brokers_st())
    nodes = data.draw(nodes_st(min_size=2))
    newcomer = data.draw(st.sampled_from(nodes))
    old = [n for n in nodes if n.id != newcomer.id]
    before = assign(brokers, old, data.draw(previous_st(brokers, [n.id for n in old])))
    after = assign(brokers, nodes, before)
    q = len(brokers) // len(nodes)
    moves = moved(brokers, before, after)
    assert len(moves) == minimal_moves(brokers, [n.id for n in nodes], before)
    assert len(moves) <= q + 1
    # The newcomer ends with its fair share.
    assert loads(after, [n.id for n in nodes])[newcomer.id] in (q, q + 1)


@given(st.data())
def test_rack_affinity_within_forced_moves(data):
    brokers = data.draw(brokers_st())
    nodes = data.draw(nodes_st())
    prev = data.draw(previous_st(brokers, [n.id for n in nodes]))
    result = assign(brokers, nodes, prev)
    by_id = {n.id: n for n in nodes}
    bro = {b.id: b for b in brokers}
    ls = loads(result, list(by_id))
    q = len(brokers) // len(nodes)
    movers = [b for b in brokers if prev.get(b.id) != result[b.id]]
    off = [b for b in movers if not same_rack(b, by_id[result[b.id]])]
    for b in off:
        p = by_id[result[b.id]]
        for x in nodes:
            if same_rack(b, x):
                # Moving b from p to x would keep balance: then x should have had it.
                assert not (ls[p.id] == q + 1 and ls[x.id] == q), (b, p, x, result)
                # Swapping with an off-rack mover on x would gain a rack match.
                for b2 in off:
                    assert result[b2.id] != x.id, (b, b2, result)
    # A node that lost an in-rack identity kept no off-rack identity.
    for n in nodes:
        lost = [bro[b] for b, p in prev.items() if p == n.id and b in bro and result[b] != n.id]
        kept = [bro[b] for b, p in prev.items() if p == n.id and b in bro and result[b] == n.id]
        if any(same_rack(b, n) for b in lost):
            assert all(same_rack(b, n) for b in kept), (n, lost, kept)


def test_rack_preference_by_hand():
    # Two racks, one node each; four brokers, two per rack: each goes home.
    nodes = [ProxyNode("p1", "h1", 9000, "east"), ProxyNode("p2", "h2", 9000, "west")]
    brokers = [Broker(i, "k", 9092, "east" if i % 2 else "west") for i in (1, 2, 3, 4)]
    assert assign(brokers, nodes) == {1: "p1", 2: "p2", 3: "p1", 4: "p2"}
    # Balance beats rack: three east brokers, two nodes -> one goes west.
    brokers = [Broker(i, "k", 9092, "east") for i in (1, 2, 3)]
    result = assign(brokers, nodes)
    assert sorted(loads(result, ["p1", "p2"]).values()) == [1, 2]
    assert result == {1: "p1", 2: "p1", 3: "p2"}
    # p2 dies and comes back: p1 sheds an off-rack identity first.
    brokers = [Broker(1, "k", 9092, "east"), Broker(2, "k", 9092, "west")]
    both = assign(brokers, nodes[:1])
    assert both == {1: "p1", 2: "p1"}
    assert assign(brokers, nodes, both) == {1: "p1", 2: "p2"}


def test_death_and_rejoin_by_hand():
    nodes = [ProxyNode(f"p{i}", f"127.0.0.1{i}", 9000) for i in (1, 2, 3)]
    brokers = [Broker(i, "k", 9092) for i in range(1, 7)]
    first = assign(brokers, nodes)
    assert first == {1: "p1", 2: "p2", 3: "p3", 4: "p1", 5: "p2", 6: "p3"}
    after = assign(brokers, nodes[:2], first)
    # p3's 3 and 6 move, one to each survivor; nothing else moves.
    assert after == {1: "p1", 2: "p2", 3: "p1", 4: "p1", 5: "p2", 6: "p2"}
    back = assign(brokers, nodes, after)
    assert sorted(loads(back, ["p1", "p2", "p3"]).values()) == [2, 2, 2]
    assert len(moved(brokers, after, back)) == 2


@given(st.data())
def test_deterministic_and_idempotent(data):
    brokers = data.draw(brokers_st())
    nodes = data.draw(nodes_st())
    prev = data.draw(previous_st(brokers, [n.id for n in nodes]))
    result = assign(brokers, nodes, prev)
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    b2, n2 = brokers[:], nodes[:]
    rng.shuffle(b2)
    rng.shuffle(n2)
    prev2 = dict(sorted(prev.items(), key=lambda kv: rng.random()))
    assert assign(b2, n2, prev2) == result
    assert assign(brokers, nodes, result) == result


def test_errors():
    with pytest.raises(NoLiveNodes):
        assign([Broker(1, "k", 9092)], [])
    assert assign([], []) == {}
    with pytest.raises(ValueError):
        assign([Broker(1, "k", 9092), Broker(1, "k2", 9092)], [ProxyNode("p", "h", 1)])
    with pytest.raises(ValueError):
        assign([Broker(1, "k", 9092)], [ProxyNode("p", "h", 1), ProxyNode("p", "h2", 1)])


# ---- address map -------------------------------------------------------------------------


@given(st.data())
def test_address_map_never_gives_one_address_to_two_brokers(data):
    brokers = data.draw(brokers_st(max_size=12))
    # Several nodes may share a host (one machine, port ranges apart).
    k = data.draw(st.integers(1, 4))
    nodes = [ProxyNode(f"p{i}", "127.0.0.1", 10000 + 1000 * i) for i in range(k)]
    validate_addresses(nodes, [b.id for b in brokers])
    result = assign(brokers, nodes)
    amap = AddressMap.build(result, nodes)
    addrs = [amap.advertised_address(b.id) for b in brokers]
    assert len(set(addrs)) == len(addrs)
    for b in brokers:
        owner = next(n for n in nodes if n.id == result[b.id])
        assert amap.advertised_address(b.id) == ("127.0.0.1", owner.bootstrap_port + 1 + b.id)


def test_address_map_by_hand():
    p1 = ProxyNode("p1", "127.0.0.11", 9092, ports=PortScheme.offset(19000))
    p2 = ProxyNode("p2", "127.0.0.12", 9092, ports=PortScheme.explicit_map({1: 7001, 2: 7002}))
    amap = AddressMap.build({1: "p1", 2: "p2"}, [p1, p2])
    assert amap.advertised_address(1) == ("127.0.0.11", 19001)
    assert amap.advertised_address(2) == ("127.0.0.12", 7002)
    with pytest.raises(KeyError):
        amap.advertised_address(3)


def test_address_conflicts_are_rejected():
    # Same host, overlapping port ranges: p1 serves broker 100 at 9192 = p2's bootstrap.
    p1 = ProxyNode("p1", "127.0.0.1", 9091)
    p2 = ProxyNode("p2", "127.0.0.1", 9192)
    validate_addresses([p1, p2], [1, 2])
    with pytest.raises(AddressConflict):
        validate_addresses([p1, p2], [1, 100])
    # Identical hosts spelled in another case are the same host.
    a = ProxyNode("a", "Host", 9000, ports=PortScheme.offset(10000))
    b = ProxyNode("b", "host", 9001, ports=PortScheme.offset(10000))
    with pytest.raises(AddressConflict):
        AddressMap.build({1: "a"}, [a, b])
    # Explicit map colliding with the node's own bootstrap port.
    c = ProxyNode("c", "h", 9000, ports=PortScheme.explicit_map({5: 9000}))
    with pytest.raises(AddressConflict):
        validate_addresses([c], [5])
    # Port out of range (base + a large broker id).
    d = ProxyNode("d", "h", 9000, ports=PortScheme.offset(65000))
    with pytest.raises(ValueError):
        validate_addresses([d], [1000])
    with pytest.raises(ValueError):
        PortScheme.explicit_map({1: 7000, 2: 7000})
    with pytest.raises(ValueError):
        AddressMap.build({1: "ghost"}, [p1])
