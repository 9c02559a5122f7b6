"""`kproxy drill run --security sasl_ssl`: one SIGKILL drill through the session's secure fleet
(127.0.0.61-63: TLS toward the clients, TLS and SCRAM-SHA-512 upstream to a SASL_SSL broker)
with a producer and a consumer of every client family, each connecting with the test bed's
SASL_SSL settings (the fleet's listeners speak nothing else); the verifier reads the topic back:
0 lost, 0 duplicated. The fleet is the session fixture's, not a new one: a secured 3-broker
cluster and fleet would cost a minute more of `make test`."""

from __future__ import annotations

import json
import stat

import pytest
from click.testing import CliRunner

from chaos.clients import FAMILIES
from cli.main import cli

pytestmark = [pytest.mark.drill, pytest.mark.slow]

SEED = 1400
RATE = 50


def test_security_must_match_the_running_fleet(secure_fleet, tmp_path):
    result = CliRunner().invoke(cli, ["drill", "run", "--fault", "none", "--state-dir", str(secure_fleet.state_dir),
                                      "--security", "plaintext", "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 2 and "is sasl_ssl" in result.output, result.output


def test_kill_drill_with_every_family_over_sasl_ssl(secure_fleet, tmp_path):
    secure_fleet.wait_healthy(60)
    result = CliRunner().invoke(cli, ["drill", "run", "--fault", "kill", "--state-dir", str(secure_fleet.state_dir),
                                      "--security", "sasl_ssl", "--clients", ",".join(FAMILIES), "--seed", str(SEED),
                                      "--rate", str(RATE), "--out", str(tmp_path), "--json", "--no-progress"])
    s = json.loads(result.stdout) if result.stdout.strip().startswith("{") else {}
    context = json.dumps({k: s.get(k) for k in ("errors", "records", "lost_keys", "duplicated_keys", "rto_ms",
                                                "final_read", "workload_exits")}, default=str) + result.output[-3000:]
    assert result.exit_code == 0, context
    assert s["passed"] is True and s["lost"] == 0 and s["duplicated"] == 0, context
    assert s["records"]["acked"] > 0 and s["final_read"]["via"] == "fleet", context
    assert s["verified_topics"] == [s["topic"]], context
    assert set(s["rto_ms"]) == set(FAMILIES) and all(r["unrecovered"] == 0 for r in s["rto_ms"].values()), context
    assert len(s["faults"]) == 1, context
    # The clients' password is in a 0600 file of the run, never in the run's manifest.
    settings = tmp_path / s["run_id"] / "client-security.json"
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600
    assert json.loads(settings.read_text())["protocol"] == "SASL_SSL"
    assert secure_fleet.client.password not in (tmp_path / s["run_id"] / "drill.json").read_text()
    # The drill restarted the victim through the state dir: the fixture's handle follows it (the
    # later tests signal nodes through it, and its teardown must stop the new process).
    secure_fleet.adopt_saved_pids()
    assert all(n.alive() for n in secure_fleet.nodes.values())
