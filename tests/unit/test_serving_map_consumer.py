"""The data path's side of the one map: what it advertises (proxy.advertised). The
producer side (build_serving_map: vacancies, stand-ins) is tested in test_fleet_state.py."""

from __future__ import annotations

import attrs
import pytest

from membership.serving import ServingMap, standalone_map
from proxy.advertised import AdvertisedAddresses
from proxy.config import parse, proxy_node, proxy_nodes

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
    moved = attrs.evolve(P1, host="127.0.0.99")
    adv.apply(ServingMap(epoch=2, owners={1: "p2"}, addresses={1: ("127.0.0.12", 9101)}, nodes=(moved, P2)))
    assert adv.address_of(1) == ("127.0.0.12", 9101)
    assert adv.address_of(7) == ("127.0.0.99", 9107)  # the map's record of this node wins over the config


def test_standalone_map_advertises_every_bound_identity_here() -> None:
    adv = AdvertisedAddresses(P2)
    adv.set_bound({0, 3})
    adv.apply(standalone_map(P2, {0, 3}))
    assert adv.as_dict() == {0: ("127.0.0.12", 9100), 3: ("127.0.0.12", 9103)}
    assert adv.serving.owned_by("p2") == {0, 3}


def test_proxy_node_matches_the_member_config_table() -> None:
    from proxy.member_link import member_config

    assert tuple(m.node for m in member_config(CONFIG, "p1").members) == proxy_nodes(CONFIG)
    assert proxy_node(CONFIG, "p3") == P3
