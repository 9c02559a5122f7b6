"""[security]: files are checked at load, a bad one exits 2 naming its field."""

from __future__ import annotations

import os

import pytest
import tomli_w
from click.testing import CliRunner

from chaos.testbed.security import Protocol, TestbedSecurity
from cli.main import cli
from proxy.config import ConfigError, parse

pytestmark = [pytest.mark.unit]

BASE = {
    "upstream": {"bootstrap": ["127.0.0.1:19092"]},
    "ports": {"base": 9100},
    "nodes": [{"id": "p1", "host": "127.0.0.11", "bootstrap_port": 9092}],
}


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    return TestbedSecurity.create(tmp_path_factory.mktemp("sec"), Protocol.SASL_SSL)


def config(security):  # type: ignore[no-untyped-def]
    return {**BASE, "security": security}


def test_a_full_section_parses(bed):
    cfg = parse(config(bed.proxy_config(mtls=True)), env={"KPROXY_UPSTREAM_PASSWORD": "pw"})
    sec = cfg.security
    assert sec.listeners.cert == str(bed.proxy.cert) and sec.listeners.client_ca == str(bed.ca)
    assert sec.listeners.client_required and sec.listeners.plaintext == frozenset()
    assert sec.upstream_tls.ca == str(bed.ca) and sec.upstream_tls.check_hostname
    assert sec.upstream_sasl.mechanism == "SCRAM-SHA-512" and sec.upstream_sasl.password == "pw"
    assert "pw" not in repr(sec)  # configs get logged; the password never


def test_no_section_is_plaintext():
    assert parse(BASE, env={}).security is None


@pytest.mark.parametrize(("section", "field"), [
    ({"listeners": {"cert": "/nonexistent.crt", "key": "/nonexistent.key"}}, "security.listeners.cert"),
    ({"listeners": {"cert": "{cert}", "key": "/nonexistent.key"}}, "security.listeners.key"),
    ({"listeners": {"cert": "{cert}", "key": "{key}", "client_ca": "/nope"}}, "security.listeners.client_ca"),
    ({"listeners": {"cert": "{cert}", "key": "{other_key}"}}, "security.listeners.cert"),  # not its key
    ({"listeners": {"cert": "{cert}", "key": "{key}", "plaintext": ["nope"]}}, "security.listeners.plaintext[0]"),
    ({"upstream": {"ca": "/nonexistent-ca.pem"}}, "security.upstream.ca"),
    ({"upstream": {"ca": "{key}"}}, "security.upstream.ca"),  # a key is no CA bundle
    ({"upstream_sasl": {"mechanism": "GSSAPI", "password": "x"}}, "security.upstream_sasl.mechanism"),
    ({"upstream_sasl": {"mechanism": "PLAIN", "username": "u"}}, "security.upstream_sasl.password"),
    ({"tls": {}}, "security.tls"),
])
def test_a_bad_field_is_named(bed, tmp_path, section, field):
    other = TestbedSecurity.create(tmp_path, Protocol.SSL)
    names = {"{cert}": str(bed.proxy.cert), "{key}": str(bed.proxy.key), "{other_key}": str(other.proxy.key)}

    def fill(v):  # type: ignore[no-untyped-def]
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return names.get(v, v) if isinstance(v, str) else v

    with pytest.raises(ConfigError) as err:
        parse(config(fill(section)), env={})
    assert err.value.field == field


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a 0000 file")
def test_an_unreadable_key_is_named(bed, tmp_path):
    key = tmp_path / "unreadable.key"
    key.write_bytes(bed.proxy.key.read_bytes())
    key.chmod(0)
    with pytest.raises(ConfigError, match="security.listeners.key"):
        parse(config({"listeners": {"cert": str(bed.proxy.cert), "key": str(key)}}), env={})


def test_run_exits_2_naming_a_missing_key(bed, tmp_path):
    path = tmp_path / "node.toml"
    path.write_text(tomli_w.dumps(config({"listeners": {"cert": str(bed.proxy.cert),
                                                        "key": str(tmp_path / "gone.key")}})))
    result = CliRunner().invoke(cli, ["run", "--config", str(path), "--node", "p1"])
    assert result.exit_code == 2
    assert "security.listeners.key" in result.output and "gone.key" in result.output
