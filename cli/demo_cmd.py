"""`kproxy demo` (what `make demo` runs): the whole operator story on the embedded default.

Local Kafka (3 real brokers) + 3 proxies on 127.0.0.11-13 → `cluster status` →
a kill-node drill under load with real clients → `cluster status` showing the
new map while the victim is down → the victim restarted → the fleet events →
`cluster status` rebalanced → `fleet down` → `kproxy report` on the drill's
trace (where the plots are) → the results per client family: RTO p50/p99/max in
whole ms, lost, duplicated.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.rule import Rule
from rich.table import Table

console = Console()


@click.command()
@click.option("--state-dir", default="state/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--out", "out_dir", default="out/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--clients", default="aiokafka:producer,confluent:producer,confluent:consumer,aiokafka:consumer",
              show_default=True)
@click.option("--replay", "replay_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Show only the final screen (report, results per client family) of an earlier run's --out.")
def demo(state_dir: str, out_dir: str, clients: str, replay_dir: str | None) -> None:
    """Fleet up, status, kill-node drill under load, status, fleet down, report, results per family."""
    if replay_dir is not None:
        sys.exit(final_screen(Path(replay_dir), step=1))
    from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
    from chaos.testbed.fleet import LocalFleet
    from cli.fleet_cmd import render_status

    state, out = Path(state_dir), Path(out_dir)
    for d in (state, out):
        if d.exists():
            shutil.rmtree(d)
    console.print(Rule("1. kproxy fleet up --brokers 3 --proxies 3"))
    fleet = LocalFleet.up(state, brokers=3, proxies=3)
    drill_passed = False
    try:
        console.print(f"Kafka brokers (real, {fleet.kafka.bootstrap_servers if fleet.kafka else fleet.upstream})")
        console.print(f"clients bootstrap against the fleet: [bold]{fleet.bootstrap_servers}[/bold]")
        console.print(Rule("2. kproxy cluster status"))
        before = fleet.fleet_view()
        render_status(before, before.health_problems())
        console.print(Rule("3. kproxy drill run --fault kill (SIGKILL a proxy node, under load)"))
        phases: list[str] = []

        def show_failover(step: dict) -> None:  # the victim is down, its identities have moved
            console.print(Rule(f"3a. kproxy cluster status ({step['node']} killed: its identities on the "
                               "survivors, epoch + 1, clients recovered)"))
            view = fleet.fleet_view()
            render_status(view, view.health_problems())
            console.print(Rule(f"3b. restarting {step['node']}"))

        config = DrillConfig(fault="kill", out_dir=out / "trace", clients=parse_clients(clients), repeat=1,
                             on_failover=show_failover)

        def progress(status: dict) -> None:  # print each phase once
            if status.get("phase") and status["phase"] not in phases[-1:]:
                phases.append(status["phase"])
                console.print(f"[dim]  … {status['phase']}[/dim]")

        summary = run_drill(config, Target.of_fleet(fleet), progress)
        drill_passed = summary.get("passed") is True
        console.print(Rule("4. what the fleet did (fleet events from the trace)"))
        render_timeline(Path(str(summary.get("trace_dir"))))
        console.print(Rule("5. kproxy cluster status (the victim restarted and took its identities back)"))
        after = fleet.wait_balanced(60)
        render_status(after, after.health_problems())
    finally:
        console.print(Rule("6. kproxy fleet down"))
        fleet.down()
        console.print("stopped every process the demo started")
    code = final_screen(out / "trace", step=7)
    sys.exit(code if code or drill_passed else 1)


def final_screen(drills_dir: Path, step: int) -> int:
    """`kproxy report` over the drill's --out directory, where its files are, then the results
    per client family; the exit code: 0 when nothing was lost or duplicated and every client
    came back (1 otherwise, 2 when the report could not be made)."""
    from chaos.measures import family_outcomes
    from chaos.trace import load_events

    console.print(Rule(f"{step}. kproxy report {drills_dir}"))
    report = _report(drills_dir)
    if report is not None:
        # Paths whole on their lines (soft_wrap): copied from the terminal, they must still work.
        console.print(f"report: {report['out_dir']}/report.json, summary.txt", soft_wrap=True)
        console.print("plots:  " + "\n        ".join(report["plots"].values()), soft_wrap=True)
    trace_dirs = sorted({p.parent for p in drills_dir.rglob("*.jsonl")})
    rows = family_outcomes([e for d in trace_dirs for e in load_events(d)])
    console.print(Rule(f"{step + 1}. results per client family"))
    console.print(family_table(rows))
    healthy = bool(rows) and not any(r.lost or r.duplicated for r in rows)
    console.print("[green]no record lost, none duplicated[/green]" if healthy else
                  "[red]records lost or duplicated (see the report)[/red]" if rows else "[red]no clients in the trace[/red]")
    if report is None:
        return 2
    return 0 if healthy and report["healthy"] and not report["unrecovered"] else 1


def _report(drills_dir: Path) -> dict | None:
    from spark.extract import TraceFormatError
    from spark.jobs import run_report

    try:
        return run_report(drills_dir)
    except TraceFormatError as exc:
        console.print(f"[red]kproxy report: bad trace: {exc}[/red]")
        return None


def family_table(rows: list) -> Table:
    """RTO p50/p99/max in whole milliseconds, lost and duplicated, a row per client family."""
    table = Table(title="failover as the clients saw it: RTO in ms", title_justify="left")
    for col in ("family", "clients", "p50", "p99", "max", "lost", "duplicated"):  # fits 80 columns
        table.add_column(col, justify="left" if col == "family" else "right")

    def ms(value: float | None) -> str:
        return "—" if value is None else str(round(value))

    for r in rows:
        table.add_row(r.family, str(r.clients), ms(r.rto_p50_ms), ms(r.rto_p99_ms), ms(r.rto_max_ms), str(r.lost),
                      str(r.duplicated))
    return table


def render_timeline(trace_dir: Path) -> None:
    """Fault, detection, each committed map (broker -> proxy) with its epoch, in ms from the fault."""
    from chaos.trace import iter_events

    events = sorted((e for e in iter_events(trace_dir) if e["source"] == "fleet"), key=lambda e: e["ts_ns"])
    t0 = next((e["ts_ns"] for e in events if e["event"] == "fault"), events[0]["ts_ns"] if events else 0)
    table = Table()
    for col in ("+ms", "event", "node", "epoch", "broker → proxy"):
        table.add_column(col)
    for e in events:
        table.add_row(f"{(e['ts_ns'] - t0) / 1e6:+.0f}", e["event"], e.get("node") or "", str(e.get("epoch") or ""),
                      e.get("detail") or "")
    console.print(table)
