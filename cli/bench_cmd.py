"""`kproxy bench proxy|failover`: benchmarks that print figures (not pass/fail)."""

from __future__ import annotations

import json

import click
from rich.console import Console


@click.group()
def bench() -> None:
    """Benchmarks: figures measured side by side in one run."""


@bench.command("proxy")
@click.option("--bootstrap", default=None, help="Existing brokers (host:port,...); default: start a local Kafka.")
@click.option("--records", type=click.IntRange(1000, 10_000_000), default=200_000, show_default=True)
@click.option("--rounds", type=click.IntRange(1, 10), default=2, show_default=True)
@click.option("--fetch-max-version", type=click.IntRange(4, 100), default=None,
              help="Proxy's Fetch cap (default: the proxy default, 15; 18 rewrites KIP-951 node_endpoints).")
@click.option("--json", "as_json", is_flag=True)
def bench_proxy(bootstrap: str | None, records: int, rounds: int, fetch_max_version: int | None,
                as_json: bool) -> None:
    """Throughput, CPU/GB, added latency and Metadata rewrite cost: proxy vs direct."""
    from chaos.bench_proxy import run

    console = Console(stderr=True)
    results = run(bootstrap, records=records, rounds=rounds, fetch_max_version=fetch_max_version,
                  progress=lambda m: console.print(f"[dim]… {m}[/dim]"))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for key in ("produce_ratio", "fetch_ratio", "proxy_cpu_s_per_gb", "latency_added_ms", "metadata_rewrite_us",
                "targets"):
        click.echo(f"{key}: {results[key]}")
