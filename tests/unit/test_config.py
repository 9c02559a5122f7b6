"""A bad config exits with a message naming the field; a good one parses."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli.main import cli
from proxy.config import ConfigError, parse, proxy_node, proxy_nodes

pytestmark = [pytest.mark.unit]

GOOD = {
    "upstream": {"bootstrap": ["127.0.0.1:19092"]},
    "ports": {"base": 9100},
    "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092, "admin_port": 9400, "raft_port": 9500}],
    "fleet": {"password_env": "PW"},
}


def _with(**changes):  # type: ignore[no-untyped-def]
    import copy

    raw = copy.deepcopy(GOOD)
    for path, value in changes.items():
        target = raw
        keys = path.split("__")
        for k in keys[:-1]:
            target = target[int(k)] if isinstance(target, list) else target[k]
        if value is None:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return raw


def test_good_config_parses():
    cfg = parse(GOOD, env={"PW": "s3cret"})
    assert cfg.node("p1").host == "127.0.0.11"
    assert proxy_node(cfg, "p1").address_for(3) == ("127.0.0.11", 9103)
    assert cfg.fleet is not None and cfg.fleet.password == "s3cret"
    assert cfg.limits.fetch_max_version == 15
    assert (cfg.limits.listen_backlog, cfg.limits.max_connections, cfg.limits.accepts_per_source_per_s) == \
        (4096, 50_000, 1000.0)
    tuned = parse(_with(limits={"listen_backlog": 100, "max_connections": 10, "accepts_per_source_per_s": 0}),
                  env={"PW": "s3cret"})
    assert (tuned.limits.listen_backlog, tuned.limits.max_connections, tuned.limits.accepts_per_source_per_s) == \
        (100, 10, 0.0)


@pytest.mark.parametrize(("changes", "field"), [
    ({"upstream__bootstrap": []}, "upstream.bootstrap"),
    ({"upstream__bootstrap": ["nocolon"]}, "upstream.bootstrap[0]"),
    ({"upstream__bootstrap": ["h:99999"]}, "upstream.bootstrap[0]"),
    ({"nodes__0__bootstrap_port": "9092"}, "nodes[0].bootstrap_port"),
    ({"nodes__0__host": None}, "nodes[0].host"),
    ({"nodes__0__admin_port": 9150}, "nodes[0].admin_port"),
    ({"nodes__0__raft_port": None}, "nodes[0].raft_port"),
    ({"ports__base": None}, "ports"),
    ({"fleet__password_env": None}, "fleet.password"),
    ({"fleet__raft_min_timeout_s": 0.9, "fleet__raft_max_timeout_s": 0.5}, "fleet.raft_max_timeout_s"),
    ({"limits": {"max_frame_bytes": 10}}, "limits.max_frame_bytes"),
    ({"limits": {"listen_backlog": 0}}, "limits.listen_backlog"),
    ({"limits": {"listen_backlog": "4096"}}, "limits.listen_backlog"),
    ({"limits": {"max_connections": 0}}, "limits.max_connections"),
    ({"limits": {"accepts_per_source_per_s": -1}}, "limits.accepts_per_source_per_s"),
    ({"logging": {"level": "LOUD"}}, "logging.level"),
    ({"surprise": {}}, "surprise"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ConfigError) as info:
        parse(_with(**changes), env={"PW": "s3cret"})
    assert info.value.field == field
    assert f"'{field}'" in str(info.value)


def test_missing_secret_env_is_named():
    with pytest.raises(ConfigError) as info:
        parse(GOOD, env={})
    assert info.value.field == "fleet.password_env" and "PW" in str(info.value)


def test_run_with_bad_config_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
                   '[[nodes]]\nid = "p1"\nhost = "127.0.0.11"\nbootstrap_port = 70000\n')
    result = CliRunner().invoke(cli, ["run", "--config", str(bad), "--node", "p1"])
    assert result.exit_code == 2
    assert "nodes[0].bootstrap_port" in result.output
    missing = CliRunner().invoke(cli, ["run", "--config", str(tmp_path / "nope.toml"), "--node", "p1"])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    unknown = CliRunner().invoke(cli, ["run", "--config", str(bad).replace("bad", "x"), "--node", "p9"])
    assert unknown.exit_code == 2


def test_proxy_nodes_carry_the_port_scheme_of_every_node():
    """The node table the data path binds from: an explicit port wins over the base,
    every node gets the same scheme, a broker without a port is a ValueError."""
    raw = {"upstream": {"bootstrap": ["127.0.0.1:19092"]}, "ports": {"map": {"1": 7001, "2": 7002}},
           "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092, "rack": "r1"},
                     {"id": "p2", "host": "127.0.0.12", "bootstrap_port": 9092}]}
    p1, p2 = proxy_nodes(parse(raw, env={}))
    assert (p1.id, p1.rack, p2.id, p2.rack) == ("p1", "r1", "p2", None)
    assert p1.address_for(2) == ("127.0.0.11", 7002) and p2.address_for(1) == ("127.0.0.12", 7001)
    with pytest.raises(ValueError):
        p1.address_for(3)
    raw["ports"] = {"base": 9100, "map": {"1": 7001}}
    assert proxy_node(parse(raw, env={}), "p2").address_for(1) == ("127.0.0.12", 7001)
    assert proxy_node(parse(raw, env={}), "p2").address_for(5) == ("127.0.0.12", 9105)
    with pytest.raises(ConfigError):
        proxy_node(parse(raw, env={}), "p9")


@pytest.mark.parametrize(("changes", "field", "suggestion"), [
    ({"admin": {"token-env": "T"}}, "admin.token-env", "token_env"),
    ({"admin": {"admin_prot": 9400}}, "admin.admin_prot", None),
    ({"fleet__adress_takeover": False}, "fleet.adress_takeover", "address_takeover"),
    ({"nodes__0__admin_prot": 9400}, "nodes[0].admin_prot", "admin_port"),
    ({"limits": {"max_conections": 10}}, "limits.max_conections", "max_connections"),
    ({"upstream__refresh_interval": 5}, "upstream.refresh_interval", "refresh_interval_s"),
    ({"ports__bsae": 9000}, "ports.bsae", "base"),
    ({"logging": {"lvl": "INFO"}}, "logging.lvl", "level"),
    ({"debug": {"tapdir": "/tmp"}}, "debug.tapdir", "tap_dir"),
    ({"limit": {}}, "limit", "limits"),
])
def test_unknown_key_is_named_with_the_closest_known_name(changes, field, suggestion):
    with pytest.raises(ConfigError) as info:
        parse(_with(**changes), env={"PW": "s3cret", "T": "tok"})
    assert info.value.field == field
    message = str(info.value)
    assert "unknown" in message
    if suggestion is not None:
        assert f"did you mean '{suggestion}'?" in message
    else:
        assert "did you mean" not in message and "token_env" in message  # lists the section's keys


def test_secret_written_in_the_file_is_refused_naming_the_env_key(tmp_path):
    head = ('[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
            '[[nodes]]\nid = "p1"\nhost = "127.0.0.11"\nbootstrap_port = 9092\nraft_port = 9500\n')
    for section, body, env_key in (("admin", 'token = "hunter2"', "admin.token_env"),
                                   ("fleet", 'password = "hunter2"', "fleet.password_env")):
        path = tmp_path / f"{section}.toml"
        path.write_text(head + f"[{section}]\n{body}\n")
        result = CliRunner().invoke(cli, ["run", "--config", str(path), "--node", "p1"])
        assert result.exit_code == 2, result.output
        assert f"{section}." in result.output and env_key in result.output
        assert "hunter2" not in result.output


def test_run_with_an_unknown_key_exits_2_suggesting_the_name(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text('[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
                    '[[nodes]]\nid = "p1"\nhost = "127.0.0.11"\nbootstrap_port = 9092\n'
                    '[admin]\ntoken-env = "KPROXY_ADMIN_TOKEN"\n')
    result = CliRunner().invoke(cli, ["run", "--config", str(path), "--node", "p1"])
    assert result.exit_code == 2
    assert "admin.token-env" in result.output and "did you mean 'token_env'?" in result.output


def test_readme_field_reference_lists_every_key():
    """The README's field reference is the operator's; a key the parser accepts is listed there."""
    from pathlib import Path

    from proxy.config import INLINE_SECRETS, SECTION_KEYS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    reference = readme[readme.index("### Field reference"):readme.index("### Deploy by hand")]
    missing = []
    for section, keys in SECTION_KEYS.items():
        for key in sorted(keys):
            field = f"nodes[].{key}" if section == "nodes" else f"{section}.{key}"
            if f"{section}.{key}" not in INLINE_SECRETS and f"`{field}`" not in reference:
                missing.append(field)
    assert missing == []
