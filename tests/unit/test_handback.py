"""proxy.handback: when a released stand-in's clients go back to the address's own node."""

from __future__ import annotations

import pytest

from membership.serving import BOOTSTRAP, ServingMap
from proxy.handback import NO_ANSWER, NODE_REMOVED, HandBack, Keep, Probe, StandInHandback, serves
from topology import PortScheme, ProxyNode

pytestmark = [pytest.mark.unit]

NODES = tuple(ProxyNode(f"p{i}", f"127.0.0.1{i}", 9092, ports=PortScheme(base=9100)) for i in (1, 2, 3))
P3_BOOTSTRAP = ("127.0.0.13", 9092)
P3_BROKER_1 = ("127.0.0.13", 9101)
KEY = ("p3", BOOTSTRAP)
KEY_1 = ("p3", 1)


def fleet(epoch: int = 5, *, vacant: frozenset[str] = frozenset(), draining: frozenset[str] = frozenset(),
          nodes: tuple[ProxyNode, ...] = NODES, degraded: bool = False,
          unreachable: frozenset[str] = frozenset()) -> ServingMap:
    return ServingMap(epoch=epoch, owners={1: "p1", 2: "p2", 3: "p3"}, nodes=nodes, vacant=vacant, draining=draining,
                      degraded=degraded, unreachable=unreachable)


P3_DOWN = fleet(vacant=frozenset({"p3"}))
P3_BACK = fleet(6)


def released(*keys: tuple[str, int], wait_s: float = 30.0) -> StandInHandback:
    h = StandInHandback(wait_s)
    for key in keys:
        h.stopped_standing_in(key, P3_BOOTSTRAP if key[1] == BOOTSTRAP else P3_BROKER_1, clients=2)
    return h


@pytest.mark.parametrize(("serving", "expected"), [
    (P3_BACK, True),
    (P3_DOWN, False),  # down in the committed view
    (fleet(draining=frozenset({"p3"}), vacant=frozenset({"p3"})), False),
    (fleet(draining=frozenset({"p3"})), False),
    (fleet(degraded=True), False),  # without quorum nobody knows
    (fleet(unreachable=frozenset({"p3"})), False),
    (fleet(nodes=NODES[:2]), False),  # removed
    (fleet(0), False),  # no committed map yet
])
def test_a_node_serves_its_address_only_as_a_committed_member_up_and_not_draining(serving, expected) -> None:
    assert serves(serving, "p3") is expected


def test_a_stand_in_released_without_clients_is_not_watched() -> None:
    h = StandInHandback()
    h.stopped_standing_in(KEY, P3_BOOTSTRAP, clients=0)
    assert not h.pending
    assert h.due(P3_BACK, 0.0) == []


def test_clients_wait_while_their_node_is_vacant_then_go_back_once_its_address_answers() -> None:
    """The duty moved to another survivor while p3 is still down: nothing happens until p3
    serves; then the address is probed, and only an answer hands the clients back."""
    h = released(KEY, KEY_1)
    assert h.due(P3_DOWN, 0.0) == []
    assert h.due(P3_DOWN, 100.0) == [] and h.pending  # however long it is down
    assert h.due(P3_BACK, 101.0) == [Probe(KEY, P3_BOOTSTRAP), Probe(KEY_1, P3_BROKER_1)]
    # Not bound yet (p3 binds after the survivors released): probed again on the next round.
    assert h.due(P3_BACK, 101.2) == [Probe(KEY, P3_BOOTSTRAP), Probe(KEY_1, P3_BROKER_1)]
    assert h.answered(KEY) == HandBack(KEY, P3_BOOTSTRAP)
    assert h.due(P3_BACK, 101.4) == [Probe(KEY_1, P3_BROKER_1)]
    assert h.answered(KEY_1) == HandBack(KEY_1, P3_BROKER_1)
    assert not h.pending and h.due(P3_BACK, 101.6) == []
    assert h.answered(KEY) is None  # once


def test_a_node_removed_from_the_fleet_keeps_its_clients_where_they_are() -> None:
    h = released(KEY)
    removed = fleet(7, nodes=NODES[:2])
    assert h.due(removed, 0.0) == [Keep(KEY, P3_BOOTSTRAP, NODE_REMOVED)]
    assert not h.pending
    assert h.answered(KEY) is None


def test_a_degraded_map_says_nothing_about_membership() -> None:
    h = released(KEY)
    assert h.due(fleet(7, nodes=NODES[:2], degraded=True), 0.0) == []
    assert h.pending


def test_a_node_that_serves_but_never_answers_keeps_its_clients_after_the_wait() -> None:
    h = released(KEY, wait_s=30.0)
    assert h.due(P3_BACK, 10.0) == [Probe(KEY, P3_BOOTSTRAP)]
    assert h.due(P3_BACK, 40.0) == [Probe(KEY, P3_BOOTSTRAP)]  # 30 s since it serves: still probed
    assert h.due(P3_BACK, 40.1) == [Keep(KEY, P3_BOOTSTRAP, NO_ANSWER)]
    assert not h.pending


def test_the_wait_counts_from_the_last_time_the_node_came_back() -> None:
    h = released(KEY, wait_s=30.0)
    assert h.due(P3_BACK, 0.0) == [Probe(KEY, P3_BOOTSTRAP)]
    assert h.due(P3_DOWN, 20.0) == []  # down again before it answered
    assert h.due(P3_BACK, 45.0) == [Probe(KEY, P3_BOOTSTRAP)]
    assert h.due(P3_BACK, 75.0) == [Probe(KEY, P3_BOOTSTRAP)]
    assert h.due(P3_BACK, 75.5) == [Keep(KEY, P3_BOOTSTRAP, NO_ANSWER)]


def test_standing_in_again_calls_the_handback_off() -> None:
    h = released(KEY, KEY_1)
    h.standing_in(KEY)
    assert h.due(P3_BACK, 0.0) == [Probe(KEY_1, P3_BROKER_1)]
    assert h.answered(KEY) is None


def test_a_draining_node_gets_its_clients_back_only_once_undrained() -> None:
    h = released(KEY)
    drained = fleet(6, draining=frozenset({"p3"}), vacant=frozenset({"p3"}))
    assert h.due(drained, 0.0) == []
    assert h.due(fleet(7), 1.0) == [Probe(KEY, P3_BOOTSTRAP)]
