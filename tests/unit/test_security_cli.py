"""The --security options of `kproxy fleet up`, `drill run` and `bench failover`: combinations
that cannot work are refused (exit 2, naming the option) before anything starts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from chaos.testbed.fleet import LocalFleet, LocalFleetError
from chaos.testbed.security import SECURITY_CHOICES, Protocol
from cli.main import cli

pytestmark = pytest.mark.unit


def test_every_protocol_is_a_choice():
    assert sorted(SECURITY_CHOICES) == sorted(p.value.lower() for p in Protocol)
    for command in (["fleet", "up"], ["drill", "run"], ["bench", "failover"]):
        help_text = CliRunner().invoke(cli, [*command, "--help"]).output
        assert "--security" in help_text and "sasl_ssl" in help_text, command


def test_a_secured_fleet_needs_its_own_kafka(tmp_path):
    result = CliRunner().invoke(cli, ["fleet", "up", "--state-dir", str(tmp_path / "f"), "--security", "sasl_ssl",
                                      "--bootstrap", "127.0.0.1:9092"])
    assert result.exit_code == 2 and "--security" in result.output and "--bootstrap" in result.output
    assert not (tmp_path / "f").exists()
    with pytest.raises(LocalFleetError, match="testbed"):
        LocalFleet.up(tmp_path / "g", kafka_bootstrap="127.0.0.1:9092", security=Protocol.SSL)


def test_bench_failover_refuses_what_it_cannot_secure(tmp_path):
    light = CliRunner().invoke(cli, ["bench", "failover", "--security", "ssl", "--light-clients", "5"])
    assert light.exit_code == 2 and "plaintext only" in light.output
    running = CliRunner().invoke(cli, ["bench", "failover", "--security", "ssl", "--state-dir", str(tmp_path)])
    assert running.exit_code == 2 and "running fleet's own" in running.output
