"""`kproxy demo` (what `make demo` runs): the whole operator story on the embedded default.

Local Kafka (3 real brokers) + 3 proxies on 127.0.0.11-13 → `cluster status` →
a kill-node drill under load with real clients → `cluster status` showing the
new map while the victim is down → the victim restarted → the fleet events →
`cluster status` rebalanced → the drill summary → `fleet down`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.rule import Rule

console = Console()


@click.command()
@click.option("--state-dir", default="state/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--out", "out_dir", default="out/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--clients", default="aiokafka:producer,confluent:producer,confluent:consumer,aiokafka:consumer",
              show_default=True)
def demo(state_dir: str, out_dir: str, clients: str) -> None:
    """Fleet up, status, kill-node drill under load, status, summary, fleet down."""
    from chaos.drills.drill import DrillConfig, Target, parse_clients, run_drill
    from chaos.testbed.fleet import LocalFleet
    from cli.fleet_cmd import render_status

    state, out = Path(state_dir), Path(out_dir)
    for d in (state, out):
        if d.exists():
            shutil.rmtree(d)
    console.print(Rule("1. kproxy fleet up --brokers 3 --proxies 3"))
    fleet = LocalFleet.up(state, brokers=3, proxies=3)
    code = 1
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
        console.print(Rule("4. what the fleet did (fleet events from the trace)"))
        render_timeline(Path(str(summary.get("trace_dir"))))
        console.print(Rule("5. kproxy cluster status (the victim restarted and took its identities back)"))
        after = fleet.wait_balanced(60)
        render_status(after, after.health_problems())
        console.print(Rule("6. drill summary"))
        console.print_json(json.dumps(summary, default=str))
        ok = summary.get("passed") is True
        console.print(f"trace: {summary.get('trace_dir')}   (replay it: kproxy report {summary.get('trace_dir')})")
        code = 0 if ok else 1
    finally:
        console.print(Rule("7. kproxy fleet down"))
        fleet.down()
        console.print("stopped every process the demo started")
    sys.exit(code)


def render_timeline(trace_dir: Path) -> None:
    """Fault, detection, each committed map (broker -> proxy) with its epoch, in ms from the fault."""
    from rich.table import Table

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
