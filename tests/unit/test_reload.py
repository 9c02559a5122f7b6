"""Config reload (proxy.reload): the pure diff into "apply now" and "needs a restart"; new limits in admission."""

from __future__ import annotations

import pytest

from proxy.admission import Admission, RefusalReason
from proxy.config import parse
from proxy.reload import RELOADABLE, changed_fields, plan_reload

pytestmark = pytest.mark.unit


def raw(**sections):  # type: ignore[no-untyped-def]
    base = {
        "upstream": {"bootstrap": ["127.0.0.1:19092"]},
        "ports": {"base": 9100},
        "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092, "admin_port": 9400, "workers": 1},
                  {"id": "p2", "host": "127.0.0.12", "bootstrap_port": 9092, "workers": 1}],
        "admin": {"token": "t1"},
    }
    for name, value in sections.items():
        base[name] = value
    return parse(base)


def test_nothing_changed_nothing_to_do():
    old = raw()
    plan = plan_reload(old, raw())
    assert plan.applied == () and plan.needs_restart == () and not plan.changed
    assert plan.config == old


def test_limits_level_token_and_interval_apply_now():
    old = raw()
    new = raw(limits={"max_connections": 10, "accepts_per_source_per_s": 5.0, "drain_timeout_s": 2.5,
                      "connect_timeout_s": 1.5},
              logging={"level": "debug"}, admin={"token": "t2"},
              upstream={"bootstrap": ["127.0.0.1:19092"], "refresh_interval_s": 3.0})
    plan = plan_reload(old, new)
    assert plan.applied == ("admin.token", "limits.accepts_per_source_per_s", "limits.connect_timeout_s",
                            "limits.drain_timeout_s", "limits.max_connections", "logging.level",
                            "upstream.refresh_interval_s")
    assert plan.needs_restart == ()
    assert plan.config.limits.max_connections == 10 and plan.config.limits.accepts_per_source_per_s == 5.0
    assert plan.config.limits.drain_timeout_s == 2.5 and plan.config.log_level == "DEBUG"
    assert plan.config.admin_token == "t2" and plan.config.refresh_interval_s == 3.0
    assert plan.to_json()["needs_restart"] == []


def test_other_changes_are_named_and_keep_their_old_value():
    old = raw()
    new = raw(limits={"listen_backlog": 128, "fetch_max_version": 17, "max_connections": 7},
              logging={"format": "text"}, ports={"base": 9600},
              nodes=[{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9093, "admin_port": 9400, "workers": 2},
                     {"id": "p3", "host": "127.0.0.13", "bootstrap_port": 9092, "workers": 1}])
    plan = plan_reload(old, new)
    assert plan.applied == ("limits.max_connections",)
    assert plan.needs_restart == ("limits.fetch_max_version", "limits.listen_backlog", "logging.format",
                                  "nodes[p1].bootstrap_port", "nodes[p1].workers", "nodes[p2]", "nodes[p3]",
                                  "ports.base")
    effective = plan.config
    assert effective.limits.max_connections == 7
    assert effective.limits.listen_backlog == old.limits.listen_backlog
    assert effective.limits.fetch_max_version == old.limits.fetch_max_version
    assert effective.nodes == old.nodes and effective.port_base == 9100 and effective.log_format == "json"


def test_fleet_and_security_sections_are_named_by_their_fields():
    fleet = {"password": "pw"}
    nodes = [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092, "raft_port": 9500, "workers": 1}]
    old = raw(fleet=fleet, nodes=nodes)
    new = raw(fleet={"password": "pw", "dead_after_s": 2.0, "address_takeover": False}, nodes=nodes)
    assert changed_fields(old, new) == ["fleet.address_takeover", "fleet.dead_after_s"]
    assert plan_reload(old, raw(nodes=nodes)).needs_restart == ("fleet",)  # the section went away


def test_every_reloadable_name_is_a_field_of_the_file():
    from proxy.config import SECTION_KEYS

    for name in RELOADABLE:
        section, key = name.split(".")
        assert key in SECTION_KEYS[section], name


def test_admission_takes_new_limits_at_the_next_connection():
    a = Admission(max_connections=3, accepts_per_source_per_s=0)
    assert a.admit("10.0.0.1", 2, now=0.0) is None
    a.retune(max_connections=2, accepts_per_source_per_s=0)
    refusal = a.admit("10.0.0.1", 2, now=0.1)  # two held: the third is refused, the two stay
    assert refusal is not None and refusal.reason is RefusalReason.NODE_CAP
    assert a.admit("10.0.0.1", 1, now=0.2) is None

    b = Admission(max_connections=100, accepts_per_source_per_s=10)
    for i in range(5):
        assert b.admit("10.0.0.2", 0, now=0.0) is None
    b.retune(max_connections=100, accepts_per_source_per_s=2)  # bucket capped at the new capacity
    assert b.admit("10.0.0.2", 0, now=0.0) is None
    assert b.admit("10.0.0.2", 0, now=0.0) is None
    refused = b.admit("10.0.0.2", 0, now=0.0)
    assert refused is not None and refused.reason is RefusalReason.SOURCE_RATE
    with pytest.raises(ValueError):
        b.retune(max_connections=0, accepts_per_source_per_s=1)


def test_reading_again_a_file_that_no_longer_loads_is_an_error_naming_the_field(tmp_path):
    from proxy.config import ConfigError, load
    from proxy.runtime import read_reload

    path = tmp_path / "fleet.toml"
    text = ('[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
            '[[nodes]]\nid = "p1"\nhost = "127.0.0.11"\nbootstrap_port = 9092\nworkers = 1\n')
    path.write_text(text)
    config = load(path)
    path.write_text(text + "[limits]\nmax_conections = 5\n")
    with pytest.raises(ConfigError, match="limits.max_conections"):
        read_reload(config)
    path.write_text(text + "[limits]\nmax_connections = 5\n")
    plan = read_reload(config)
    assert plan.applied == ("limits.max_connections",) and plan.config.limits.max_connections == 5
    with pytest.raises(ConfigError, match="not read from a file"):
        read_reload(raw())
