"""The --hosts option of `kproxy fleet up` and `kproxy drill run`: bad usage exits 2 before
anything starts (no root needed)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from cli.main import cli

pytestmark = pytest.mark.unit


def test_fleet_up_knows_only_loopback_and_netns(tmp_path):
    result = CliRunner().invoke(cli, ["fleet", "up", "--hosts", "vm", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "'vm' is not one of 'loopback', 'netns'" in result.output


def test_drill_hosts_applies_only_to_a_fleet_the_drill_brings_up(tmp_path):
    result = CliRunner().invoke(cli, ["drill", "run", "--fault", "none", "--hosts", "netns",
                                      "--state-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--hosts applies to a fleet the drill brings up" in result.output
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
