"""`kproxy bench proxy|failover|storm`: benchmarks that print figures (not pass/fail)."""

from __future__ import annotations

import json
from collections.abc import Iterable

import click
from rich.console import Console

from chaos.testbed.hosts import HOST_MODES, LOOPBACK
from chaos.testbed.security import SECURITY_CHOICES as SECURITY


@click.group()
def bench() -> None:
    """Benchmarks: figures measured side by side in one run."""


@bench.command("proxy")
@click.option("--bootstrap", default=None, help="Existing brokers (host:port,...); default: start a local Kafka.")
@click.option("--records", type=click.IntRange(1000, 10_000_000), default=200_000, show_default=True)
@click.option("--rounds", type=click.IntRange(1, 10), default=2, show_default=True)
@click.option("--fetch-rounds", type=click.IntRange(1, 40), default=None,
              help="Fetch runs per arm (default: 2 x rounds). Each reads 2 x records x rounds records.")
@click.option("--fetch-max-version", type=click.IntRange(4, 100), default=None,
              help="Proxy's Fetch cap (default: the proxy default, 15; 18 rewrites KIP-951 node_endpoints).")
@click.option("--splice-min-bytes", type=click.IntRange(0, 1 << 30), default=None,
              help="Proxy's limits.splice_min_bytes (default: the proxy default; 0: never splice).")
@click.option("--compare-splice", is_flag=True,
              help="Fetch phases also through a second proxy with splice off (third arm, alternating).")
@click.option("--relay/--no-relay", default=True, show_default=True,
              help="Fetch phases also through a Kafka-unaware splice relay (chaos.bench.relay): the baseline hop. "
                   "Needs the bench's own Kafka (ignored with --bootstrap).")
@click.option("--security", type=click.Choice(SECURITY),
              default="plaintext", show_default=True,
              help="The brokers' listener; not plaintext: the proxy speaks TLS to its clients, and no relay arm.")
@click.option("--json", "as_json", is_flag=True)
def bench_proxy(bootstrap: str | None, records: int, rounds: int, fetch_rounds: int | None,
                fetch_max_version: int | None,
                splice_min_bytes: int | None, compare_splice: bool, relay: bool, security: str, as_json: bool) -> None:
    """Throughput, CPU/GB, added latency and Metadata rewrite cost: proxy vs direct."""
    from chaos.bench.throughput import run
    from chaos.testbed.security import Protocol

    console = Console(stderr=True)
    results = run(bootstrap, records=records, rounds=rounds, fetch_rounds=fetch_rounds,
                  fetch_max_version=fetch_max_version, security=Protocol.parse(security),
                  splice_min_bytes=splice_min_bytes, compare_splice=compare_splice, relay=relay,
                  progress=lambda m: console.print(f"[dim]… {m}[/dim]"))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for key in ("produce_ratio", "fetch_ratio", "proxy_cpu_s_per_gb", "latency_added_ms", "metadata_rewrite_us",
                "targets", "spliced_gb", "nosplice", "fetch_ratio_relay", "fetch_vs_relay", "relay"):
        if key in results:
            click.echo(f"{key}: {results[key]}")


@bench.command("failover")
@click.option("--drills", type=click.IntRange(1, 500), default=20, show_default=True, help="Drills of --fault (SIGKILL by default).")
@click.option("--drains", type=click.IntRange(0, 100), default=5, show_default=True, help="Graceful drain drills.")
@click.option("--clients", default=None, help="family:role list (default: 4 producer families, 2 consumers).")
@click.option("--rate", type=float, default=50.0, show_default=True, help="Records/s per producer.")
@click.option("--state-dir", default=None, help="Use a running local fleet instead of starting one.")
@click.option("--out", "out_dir", default=None, help="Keep the traces here.")
@click.option("--seed", type=int, default=None)
@click.option("--hosts", type=click.Choice(HOST_MODES), default=LOOPBACK, show_default=True,
              help="The fleet brought up: on loopback, or each node on an emulated host (netns, needs root).")
@click.option("--light-clients", type=click.IntRange(0, 50_000), default=0, show_default=True,
              help="Also N light clients (connect, Metadata, hold a connection; reconnect on loss) during the "
                   "SIGKILL drills: light_recovered_s, fault to each cut client back. Loopback only.")
@click.option("--fault", type=click.Choice(("kill", "freeze", "partition", "partition-one-way", "flap", "leader-kill",
                                            "kill-two", "freeze-two", "partition-two")),
              default="kill", show_default=True,
              help="The fault of the main drills (partition-one-way, flap, partition-two: --hosts netns only).")
@click.option("--security", type=click.Choice(SECURITY), default="plaintext", show_default=True,
              help="The Kafka and fleet brought up: secured as `kproxy fleet up --security` does (TLS toward the "
                   "clients, TLS/SASL upstream); every client family connects with the matching settings. "
                   "With --state-dir the running fleet's own.")
@click.option("--workers", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Data-path workers per node of the fleet brought up (not with --state-dir).")
@click.option("--share-upstream", is_flag=True,
              help="The fleet brought up runs with limits.share_upstream on (not with --state-dir).")
@click.option("--no-coalesce", is_flag=True,
              help="The fleet brought up runs with limits.coalesce_metadata off (not with --state-dir).")
@click.option("--fair-accept/--no-fair-accept", default=True, show_default=True,
              help="limits.fair_accept of the fleet brought up (not with --state-dir).")
@click.option("--json", "as_json", is_flag=True)
def bench_failover(drills: int, drains: int, clients: str | None, rate: float, state_dir: str | None,
                   out_dir: str | None, seed: int | None, hosts: str, light_clients: int, fault: str,
                   security: str, workers: int, share_upstream: bool, no_coalesce: bool, fair_accept: bool,
                   as_json: bool) -> None:
    """RTO per client family over many drills of one fault (SIGKILL by default) and drains,
    detection and commit times (and, on emulated hosts, fault to address moved)."""
    from chaos.bench.failover import DEFAULT_CLIENTS, run
    from chaos.testbed.security import Protocol

    if light_clients and hosts != LOOPBACK:
        raise click.BadParameter("light clients run on loopback only", param_hint="--light-clients")
    if light_clients and security != "plaintext":
        raise click.BadParameter("light clients speak plaintext only", param_hint="--light-clients")
    if state_dir and workers != 1:
        raise click.BadParameter("with --state-dir the running fleet's own workers are used", param_hint="--workers")
    if state_dir and (share_upstream or no_coalesce or not fair_accept):
        raise click.BadParameter("with --state-dir the running fleet's own limits are used",
                                 param_hint="--share-upstream" if share_upstream else
                                 "--no-coalesce" if no_coalesce else "--no-fair-accept")
    if state_dir and security != "plaintext":
        raise click.BadParameter("with --state-dir the running fleet's own security is used", param_hint="--security")

    console = Console(stderr=True)
    phases: list[str] = []

    def progress(status: dict) -> None:
        if status.get("phase") and status["phase"] not in phases[-1:]:
            phases.append(status["phase"])
            console.print(f"[dim]… {status['phase']}[/dim]")

    results = run(drills=drills, drains=drains, clients=clients or DEFAULT_CLIENTS, rate=rate, state_dir=state_dir,
                  out_dir=out_dir, seed=seed, light_clients=light_clients, progress=progress, hosts=hosts,
                  fault=fault, security=Protocol.parse(security), workers=workers, share_upstream=share_upstream,
                  coalesce_metadata=not no_coalesce, fair_accept=fair_accept)
    if as_json:
        click.echo(json.dumps(results, indent=2, default=str))
        return
    for key in ("drills", "fault", "rto_ms", "detect_ms", "commit_ms", "address_moved_ms", "lost", "duplicated",
                "drain", "light_clients",
                "light_recovered_s", "light_never_back", "targets"):
        click.echo(f"{key}: {results.get(key)}")


@bench.command("storm")
@click.option("--clients", default="1000,4000,10000", show_default=True,
              help="Comma-separated storm sizes: light clients connecting at once, each size directly and through "
                   "kproxy.")
@click.option("--backlog", type=click.IntRange(1, 1 << 20), default=None,
              help="Also run each size through a node with this limits.listen_backlog (100: the old default).")
@click.option("--deadline", type=click.FloatRange(1, 600), default=60.0, show_default=True,
              help="Seconds a light client has to be served.")
@click.option("--idle-window", type=click.FloatRange(0, 3600), default=60.0, show_default=True,
              help="Seconds over which to measure the CPU of an idle 5-node fleet on the same brokers "
                   "(idle_cpu_fraction, of a core per node); 0: skip.")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="The node's data-path processes (default: the node's default, one per core).")
@click.option("--share-upstream", is_flag=True, help="The node runs with limits.share_upstream on.")
@click.option("--fair-accept/--no-fair-accept", default=True, show_default=True,
              help="limits.fair_accept of the node.")
@click.option("--json", "as_json", is_flag=True)
def bench_storm(clients: str, backlog: int | None, deadline: float, idle_window: float, workers: int | None,
                share_upstream: bool, fair_accept: bool, as_json: bool) -> None:
    """N clients connect at once (ApiVersions, Metadata, a small Produce): kproxy vs a broker directly."""
    from chaos.bench.storm import run

    try:
        sizes = tuple(int(c) for c in clients.split(",") if c.strip())
    except ValueError:
        raise click.BadParameter("a comma-separated list of integers", param_hint="--clients") from None
    if not sizes or any(not 1 <= n <= 100_000 for n in sizes):
        raise click.BadParameter("sizes between 1 and 100000", param_hint="--clients")
    console = Console(stderr=True)
    results = run(sizes, backlog=backlog, deadline_s=deadline, idle_window_s=idle_window, workers=workers,
                  share_upstream=share_upstream, fair_accept=fair_accept,
                  progress=lambda m: console.print(f"[dim]… {m}[/dim]"))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for row in results["storm"]:
        click.echo(f"{row['clients']:>6} clients: direct {row['direct_all_served_s']} s ({row['direct_failed']} failed)"
                   f", kproxy {row['proxy_all_served_s']} s ({row['proxy_failed']} failed),"
                   f" {row['rss_bytes_per_connection']} B/connection, refused {row['proxy_refused']}")
    if "idle_cpu_fraction" in results:
        click.echo(f"idle CPU per node (of a core, over {results['idle_window_s']:g} s): "
                   f"mean {results['idle_cpu_fraction']}, max {results['idle_cpu_fraction_max']}"
                   f" (leader {results['idle_leader']})")
    click.echo(f"targets: {results['targets']}")


@bench.command("workers")
@click.option("--workers", "workers", default="1,2", show_default=True,
              help="Comma-separated worker counts, one node each (1 and/or 2).")
@click.option("--rounds", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option("--duration", type=click.FloatRange(1, 600), default=10.0, show_default=True,
              help="Seconds of load per arm and round.")
@click.option("--connections", type=click.IntRange(1, 10_000), default=64, show_default=True)
@click.option("--depth", type=click.IntRange(1, 1000), default=4, show_default=True,
              help="Produce requests in flight per connection.")
@click.option("--acks", type=click.Choice(["all", "1"]), default="all", show_default=True,
              help="1: the leader answers alone (less broker work per request, more of it on the proxy).")
@click.option("--json", "as_json", is_flag=True)
def bench_workers(workers: str, rounds: int, duration: float, connections: int, depth: int, acks: str,
                  as_json: bool) -> None:
    """Request-heavy produce (small batches, acks=all): requests/s and node CPU-µs per request, W = 1 vs 2."""
    from chaos.bench.workers import NODE_IPS, run

    counts = _worker_counts(workers, NODE_IPS)
    console = Console(stderr=True)
    results = run(counts, rounds=rounds, duration_s=duration, connections=connections, depth=depth,
                  acks=-1 if acks == "all" else 1, progress=lambda m: console.print(f"[dim]… {m}[/dim]"))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for arm, row in results["arms"].items():
        click.echo(f"{arm:>6}: {row['requests_per_s']} requests/s"
                   + (f", {row['cpu_us_per_request']} CPU-µs/request, ratio to direct {row['ratio_to_direct']}"
                      if arm != "direct" else ""))


def _worker_counts(text: str, allowed: Iterable[int]) -> tuple[int, ...]:
    """``--workers 1,2``: the worker counts asked for, each one the bench has a node address for."""
    try:
        counts = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise click.BadParameter("a comma-separated list of integers", param_hint="--workers") from None
    if not counts or any(w not in allowed for w in counts):
        raise click.BadParameter(f"worker counts among {sorted(allowed)}", param_hint="--workers")
    return counts


@bench.command("handshakes")
@click.option("--workers", "workers", default="1,2", show_default=True,
              help="Comma-separated worker counts, one TLS node each (1 and/or 2).")
@click.option("--rounds", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option("--duration", type=click.FloatRange(1, 600), default=10.0, show_default=True,
              help="Seconds of handshakes per arm and round.")
@click.option("--clients", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Client processes, each handshaking in a loop (connect, full handshake, close).")
@click.option("--tls-version", type=click.Choice(["1.2", "1.3"]), default="1.3", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_handshakes(workers: str, rounds: int, duration: float, clients: int, tls_version: str,
                     as_json: bool) -> None:
    """The TLS handshake rate of one node: handshakes/s and handshakes per node CPU second, W = 1 vs 2."""
    from chaos.bench.handshakes import NODE_IPS, run

    counts = _worker_counts(workers, NODE_IPS)
    console = Console(stderr=True)
    results = run(counts, rounds=rounds, duration_s=duration, clients=clients, tls_version=tls_version,
                  progress=lambda m: console.print(f"[dim]… {m}[/dim]"))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for arm, row in results["arms"].items():
        click.echo(f"{arm:>3}: {row['handshakes_per_s']} handshakes/s end to end, {row['handshakes_per_core_s']} "
                   f"per node CPU second ({row['node_cpu_ms_per_handshake']} ms each), {row['failed']} failed")
