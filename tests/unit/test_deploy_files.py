"""deploy/systemd/: the unit says what docs/DEPLOY.md says it does, systemd accepts it, and the
example fleet TOML is a valid config. (tests/integration/test_deploy_systemd.py runs the unit's
ExecStart line against a real node.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from cli.exit_codes import EXIT_USAGE
from proxy.config import load, proxy_nodes

pytestmark = pytest.mark.unit

SYSTEMD = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNIT = SYSTEMD / "kproxy@.service"
EXAMPLE = SYSTEMD / "fleet.example.toml"


def read_unit(path: Path) -> dict[str, dict[str, str]]:
    """A systemd unit file as {section: {key: value}} (comments dropped; a repeated key: the last)."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not key=value: {line!r}"
        current[key.strip()] = value.strip()
    return sections


def test_the_unit_runs_one_node_of_the_fleet_and_stops_it_by_draining():
    service = read_unit(UNIT)["Service"]
    argv = service["ExecStart"].split()
    assert argv[1:] == ["run", "--config", "/etc/kproxy/fleet.toml", "--node", "%i"]
    assert argv[0].endswith("/kproxy")
    assert service["EnvironmentFile"] == "/etc/kproxy/kproxy.env"  # the secrets, never in the TOML
    assert service["KillSignal"] == "SIGTERM"  # the graceful drain (proxy.runtime.shutdown)
    assert service["KillMode"] == "mixed"  # SIGTERM to the supervisor only: it stops its workers itself
    assert int(service["TimeoutStopSec"]) > 5  # the drain takes up to limits.drain_timeout_s (5 s by default)
    assert service["RestartPreventExitStatus"] == str(EXIT_USAGE)  # a refusal is not retried
    assert read_unit(UNIT)["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path):
    """systemd-analyze verify warns about unknown keys and bad values (it exits 0 regardless), and
    about an ExecStart binary that does not exist here: it checks a copy pointing at /bin/true."""
    program = read_unit(UNIT)["Service"]["ExecStart"].split()[0]
    (tmp_path / UNIT.name).write_text(UNIT.read_text().replace(program, "/bin/true"))
    proc = subprocess.run(["systemd-analyze", "verify", "./kproxy@p1.service"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if "kproxy@" in line]
    assert proc.returncode == 0 and complaints == [], proc.stdout + proc.stderr


def test_the_example_fleet_is_a_valid_config():
    config = load(EXAMPLE, env={"KPROXY_ADMIN_TOKEN": "t", "KPROXY_RAFT_PASSWORD": "p"})
    assert [n.id for n in config.nodes] == ["p1", "p2", "p3"]
    assert [(n.host, n.advertised) for n in config.nodes] == [
        ("10.0.1.11", "proxy-1.example"), ("0.0.0.0", "203.0.113.12"), ("10.0.1.13", "10.0.1.13")]
    assert [n.address_for(2) for n in proxy_nodes(config)] == [
        ("proxy-1.example", 9102), ("203.0.113.12", 9102), ("10.0.1.13", 9102)]
    assert config.fleet is not None and config.admin_token == "t"
