"""The data path's side of the one map: what it advertises (proxy.advertised) and the
transitional FleetLink shim from main's EffectiveAssignment (proxy.fleet)."""

from __future__ import annotations

import attrs
import pytest

from membership.effective import EffectiveAssignment
from membership.serving import BOOTSTRAP, ServingMap, StandIn, standalone_map
from membership.state import FleetState
from proxy.advertised import AdvertisedAddresses
from proxy.config import parse, proxy_node, proxy_nodes
from proxy.fleet import serving_map_from_effective

pytestmark = pytest.mark.unit

CONFIG = parse({
    "upstream": {"bootstrap": ["127.0.0.1:19092"]}, "ports": {"base": 9100},
    "nodes": [{"id": f"p{i}", "host": f"127.0.0.1{i}", "bootstrap_port": 9092, "raft_port": 9500} for i in (1, 2, 3)],
    "fleet": {"password": "pw"}}, env={})
P1, P2, P3 = proxy_nodes(CONFIG)


def test_nothing_is_advertised_before_its_listener_is_bound() -> None:
    adv = AdvertisedAddresses(P1)
    adv.apply(ServingMap(epoch=4, owners={1: "p2", 2: "p1"}, addresses={1: ("127.0.0.12", 9101),
                                                                        2: ("127.0.0.11", 9102)}))
    assert adv.address_of(1) is None and adv.address_of(2) is None
    adv.set_bound({1})
    assert adv.address_of(1) == ("127.0.0.12", 9101) and adv.address_of(2) is None


def test_an_identity_the_map_does_not_cover_is_advertised_at_this_nodes_own_address() -> None:
    adv = AdvertisedAddresses(P1)
    adv.set_bound({1, 7})
    assert adv.as_dict() == {1: ("127.0.0.11", 9101), 7: ("127.0.0.11", 9107)}  # no map yet: the node as configured
    moved = attrs.evolve(P1, host="10.0.0.1")
    adv.apply(ServingMap(epoch=2, owners={1: "p2"}, addresses={1: ("127.0.0.12", 9101)}, nodes=(moved, P2)))
    assert adv.address_of(1) == ("127.0.0.12", 9101)
    assert adv.address_of(7) == ("10.0.0.1", 9107)  # the map's record of this node wins over the config


def test_standalone_map_advertises_every_bound_identity_here() -> None:
    adv = AdvertisedAddresses(P2)
    adv.set_bound({0, 3})
    adv.apply(standalone_map(P2, {0, 3}))
    assert adv.as_dict() == {0: ("127.0.0.12", 9100), 3: ("127.0.0.12", 9103)}
    assert adv.serving.owned_by("p2") == {0, 3}


def test_proxy_node_matches_the_member_config_table() -> None:
    from proxy.fleet import member_config

    assert tuple(m.node for m in member_config(CONFIG, "p1").members) == proxy_nodes(CONFIG)
    assert proxy_node(CONFIG, "p3") == P3


def _effective(epoch: int, owners: dict[int, str], *, degraded: bool = False, version: int = 1) -> EffectiveAssignment:
    nodes = {n.id: n for n in proxy_nodes(CONFIG)}
    return EffectiveAssignment(epoch=epoch, owners=owners, addresses=tuple(
        (b, nodes[p].address_for(b)) for b, p in sorted(owners.items())), degraded=degraded, version=version)


def test_shim_builds_vacancies_stand_ins_and_draining_from_the_committed_state() -> None:
    committed = FleetState(epoch=5, members=(P1, P2, P3), up=frozenset({"p1", "p2"}), draining=frozenset({"p2"}),
                           owners={1: "p1", 2: "p1"})
    m = serving_map_from_effective(_effective(5, {1: "p1", 2: "p1"}), committed, CONFIG, None)
    assert m.vacant == {"p2", "p3"} and m.draining == {"p2"}
    assert m.address_map() == {1: ("127.0.0.11", 9101), 2: ("127.0.0.11", 9102)}
    assert set(m.stand_ins_of("p1")) == {
        StandIn("p1", v, listener, f"127.0.0.1{v[1]}", port)
        for v in ("p2", "p3") for listener, port in ((BOOTSTRAP, 9092), (1, 9101), (2, 9102))}
    assert m.stand_ins_of("p2") == () and m.stand_ins_of("p3") == ()


def test_shim_keeps_the_previous_vacancies_in_degraded_mode() -> None:
    committed = FleetState(epoch=5, members=(P1, P2, P3), up=frozenset({"p1"}), owners={1: "p1"})
    before = serving_map_from_effective(_effective(5, {1: "p1"}), committed, CONFIG, None)
    assert before.vacant == {"p2", "p3"}
    now_up = FleetState(epoch=6, members=(P1, P2, P3), up=frozenset({"p1", "p2", "p3"}), owners={1: "p1"})
    degraded = serving_map_from_effective(_effective(6, {1: "p1"}, degraded=True, version=2), now_up, CONFIG, before)
    assert degraded.vacant == {"p2", "p3"} and degraded.degraded
    healthy = serving_map_from_effective(_effective(6, {1: "p1"}, version=3), now_up, CONFIG, degraded)
    assert healthy.vacant == frozenset() and healthy.stand_ins == ()
    assert serving_map_from_effective(_effective(0, {}), FleetState(), CONFIG, None).vacant == frozenset()
