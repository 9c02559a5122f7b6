"""`kproxy drill run`: a chaos drill under load with real clients -> trace + summary.

Thin: parses, finds or brings up the target, calls ``chaos.drills.drill.run_drill``,
shows progress (rich, on stderr) and prints the summary. Exit codes: 0 when no
record was lost or duplicated and every client recovered, 1 otherwise, 2 on
bad usage, on a target that cannot be found, or when the fault cannot be
injected on this machine (the drill is SKIPPED and says why).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from chaos.clients import FAMILIES
from chaos.drills.fault_names import CONTROLS, FAULTS
from chaos.testbed.hosts import HOST_MODES, LOOPBACK
from chaos.testbed.security import SECURITY_CHOICES as SECURITY
from proxy.admin_client import AdminError

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2


@click.group()
def drill() -> None:
    """Chaos drills: inject faults under load with real Kafka clients."""


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _clients(ctx: click.Context, param: click.Parameter, value: str) -> tuple[tuple[str, str], ...]:
    from chaos.drills.drill import parse_clients

    try:
        return parse_clients(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _check_security(asked: str | None, running: Any, state_dir: str) -> None:
    """With --state-dir, --security (if given) must be what runs there: the clients use its settings."""
    if asked is not None and asked != running.value.lower():
        _fail(f"--security {asked}: the fleet (or Kafka) in {state_dir} is {running.value.lower()}")


class _Live:
    """Progress on stderr: one rich table, refreshed by the drill's status callbacks."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.live: Any = None

    def __enter__(self) -> "_Live":
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            self.live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def __call__(self, status: dict[str, Any]) -> None:
        if self.live is None:
            return
        from rich.table import Table

        table = Table(title=f"drill {status.get('fault')}  run {status.get('run_id')}  seed {status.get('seed')}",
                      title_justify="left")
        table.add_column("client")
        table.add_column("successes", justify="right")
        table.add_column("errors", justify="right")
        for cid, c in sorted(status.get("clients", {}).items()):
            table.add_row(cid, str(c["ok"]), str(c["errors"]))
        table.caption = (f"{status.get('phase')}  |  {status.get('elapsed_s', 0):.1f} s  |  "
                         f"acked {status.get('acked', 0)}")
        self.live.update(table)


def _print_summary(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]drill {result['fault']}[/] x{result['repeat']}  seed {result['seed']}  "
                  f"run {result['run_id']}  ({result['duration_s']:.0f} s)")
    table = Table(title="RTO (ms) per client family; max gap = longest gap anywhere in the drill window",
                  title_justify="left")
    for name in ("family", "clients", "p50", "p99", "max", "unrecovered", "max gap"):
        table.add_column(name, justify="left" if name == "family" else "right")
    for family, s in sorted(result["rto_ms"].items()):
        gap = result["max_gap_ms"].get(family, {}).get("max")
        table.add_row(family, str(s["clients"]), f"{s['p50']:.1f}", f"{s['p99']:.1f}", f"{s['max']:.1f}",
                      str(s["unrecovered"]), "-" if gap is None else f"{gap:.1f}")
    console.print(table)
    for phase in ("detect_ms", "commit_ms", "failover_ms"):
        s = result[phase]
        if s["n"]:
            console.print(f"{phase}: p50 {s['p50']:.1f}  p99 {s['p99']:.1f}  max {s['max']:.1f}  (n={s['n']})")
        else:
            console.print(f"{phase}: none observed")
    r = result["records"]
    console.print(f"records: acked {r['acked']}, consumed {r['consumed']}, "
                  f"in the final read {r.get('final_read', 0)}, lost {result['lost']}, "
                  f"duplicated {result['duplicated']}, client errors {r['errors']}")
    final = result.get("final_read")
    console.print("final read: none (lost counts what no consumer group read)" if final is None else
                  f"final read via {final['via']}: {final['records']} records to the end of every partition")
    if result["lost_keys"]:
        console.print(f"lost: {', '.join(result['lost_keys'])}")
    if result["duplicated_keys"]:
        console.print(f"duplicated: {', '.join(result['duplicated_keys'])}")
    for err in result["errors"] + result["trace_errors"]:
        console.print(f"[red]error:[/] {err}")
    console.print(f"trace: {result['trace_dir']}")
    verdict = "[bold green]PASSED[/]" if result["passed"] else "[bold red]FAILED[/]"
    console.print(verdict)


@drill.command()
@click.option("--fault", type=click.Choice(FAULTS + CONTROLS), required=True,
              help="The fault to inject (none: no fault, the baseline).")
@click.option("--repeat", type=click.IntRange(1, 100), default=1, show_default=True, help="Drills in a row.")
@click.option("--clients", default=",".join(FAMILIES), show_default=True, callback=_clients,
              help="Client families (one producer and one consumer each), or family:role items.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="drills", show_default=True,
              help="Directory for the run's trace, logs and summary.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="A running local fleet (or, with --direct, Kafka). Default: bring one up and down.")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=None, help="Seed of every random choice.")
@click.option("--rate", type=click.FloatRange(1, 5000), default=100.0, show_default=True,
              help="Records per second per producer.")
@click.option("--direct", is_flag=True, help="Clients talk to Kafka itself, no proxy (baseline; broker-kill).")
@click.option("--progress/--no-progress", default=None, help="Live progress on stderr (default: on a terminal).")
@click.option("--hosts", type=click.Choice(HOST_MODES), default=None,
              help="The fleet this drill brings up: loopback (default) or netns (emulated hosts, needs root). "
                   "With --state-dir the running fleet's own mode is used.")
@click.option("--security", type=click.Choice(SECURITY), default=None,
              help="The Kafka (and fleet) this drill brings up: plaintext (default) or secured as `kproxy fleet up "
                   "--security` does; every client family connects with the matching TLS/SASL settings. "
                   "With --state-dir the running fleet's (or Kafka's) own is used (and must be this one if given).")
def run(fault: str, repeat: int, clients: tuple[tuple[str, str], ...], out_dir: str, as_json: bool,
        state_dir: str | None, seed: int | None, rate: float, direct: bool, progress: bool | None,
        hosts: str | None, security: str | None) -> None:
    """Run FAULT under load REPEAT times and print RTO, lost and duplicated records."""
    from chaos.drills.drill import DrillConfig, Target, new_seed, run_drill
    from chaos.testbed.fleet import LocalFleet
    from chaos.testbed.hosts import HostsError
    from chaos.testbed.kafka_cluster import KafkaCluster, KafkaError, free_base_port
    from chaos.testbed.proxies import ProxyProcessError
    from chaos.testbed.security import Protocol

    if hosts is not None and (state_dir or direct):
        raise click.UsageError("--hosts applies to a fleet the drill brings up (not with --state-dir or --direct)")
    protocol = Protocol.parse(security or "plaintext")
    seed = new_seed() if seed is None else seed
    click.echo(f"seed {seed}", err=True)
    config = DrillConfig(fault=fault, out_dir=Path(out_dir), repeat=repeat, clients=clients, rate=rate, seed=seed)
    show = sys.stderr.isatty() if progress is None else progress
    owned_dir: str | None = None
    owned: Any = None
    try:
        if direct:
            try:
                if state_dir:
                    kafka = KafkaCluster.load(state_dir)
                    _check_security(security, kafka.protocol, state_dir)
                else:
                    owned_dir = tempfile.mkdtemp(prefix="kproxy-drill-kafka-")
                    click.echo(f"starting a local Kafka in {owned_dir}", err=True)
                    kafka = owned = KafkaCluster(owned_dir, 3, base_port=free_base_port(), security=protocol).start()
            except KafkaError as exc:
                _fail(str(exc))
            target = Target.of_kafka(kafka)
        else:
            try:
                if state_dir:
                    fleet = LocalFleet.load(state_dir)
                    _check_security(security, fleet.security, state_dir)
                else:
                    owned_dir = tempfile.mkdtemp(prefix="kproxy-drill-fleet-")
                    click.echo(f"starting a local fleet in {owned_dir}", err=True)
                    if (hosts or LOOPBACK) == LOOPBACK:
                        fleet = owned = LocalFleet.up(owned_dir, kafka_base_port=free_base_port(), security=protocol)
                    else:  # a fresh namespace: the default ports are free there
                        fleet = owned = LocalFleet.up(owned_dir, hosts=hosts, security=protocol)
            except (AdminError, KafkaError, ProxyProcessError, HostsError) as exc:
                _fail(f"no local fleet: {exc}")
            target = Target.of_fleet(fleet)
        with _Live(show) as live:
            result = run_drill(config, target, live)
    finally:
        if owned is not None:
            try:
                owned.down() if hasattr(owned, "down") else owned.stop()
            finally:
                if owned_dir:
                    shutil.rmtree(owned_dir, ignore_errors=True)
    if result.get("skipped"):
        if as_json:
            click.echo(json.dumps(result))
        click.echo(f"SKIPPED: {result['reason']}", err=True)
        sys.exit(EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(result))
    else:
        _print_summary(result)
    sys.exit(EXIT_OK if result["passed"] else EXIT_UNHEALTHY)
