"""`kproxy fleet up|down` and `kproxy cluster status|kill-node|drain|undrain|reload|restart-node`."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.table import Table

from chaos.testbed.hosts import HOST_MODES, LOOPBACK
from chaos.testbed.security import SECURITY_CHOICES as SECURITY
from cli.exit_codes import EXIT_UNHEALTHY, EXIT_USAGE, fail
from proxy.admin_client import AdminError, AdminRefused, ClusterAdmin
from proxy.status import FleetView, NodeRow

if TYPE_CHECKING:  # the local launcher needs the [chaos] extra: imported where a command uses it
    from chaos.testbed.fleet import LocalFleet

hosts_option = click.option(
    "--hosts", type=click.Choice(HOST_MODES), default=LOOPBACK, show_default=True,
    help="loopback: every process on this host's loopback (127.0.0.x); netns: each proxy node, the brokers "
         "and the drill clients on an emulated host of its own (a network namespace on a bridge, 198.18.0.0/24; "
         "needs root).")
security_option = click.option(
    "--security", type=click.Choice(SECURITY), default="plaintext", show_default=True,
    help="The local Kafka's listener (its own CA and SCRAM users, chaos.testbed.security). Not plaintext: "
         "the fleet speaks TLS to its clients and TLS/SASL upstream as the brokers need; clients then use "
         "SASL_SSL (or SSL) with the test bed's CA.")
state_dir_option = click.option("--state-dir", required=True, type=click.Path(file_okay=False),
                                help="Directory holding the local fleet's state.")
console = Console()


def _fail(exc: Exception, code: int | None = None) -> NoReturn:
    """Exit 2 when the request itself was wrong (unknown node, token refused), else 1."""
    fail(exc, code if code is not None else EXIT_USAGE if isinstance(exc, AdminRefused) else EXIT_UNHEALTHY)


def _load(state_dir: str) -> "LocalFleet":
    from chaos.testbed.fleet import LocalFleet

    try:
        return LocalFleet.load(state_dir)
    except AdminError as exc:
        _fail(exc, EXIT_USAGE)


def fleet_target(func: Any) -> Any:
    """``--state-dir D`` (a fleet `fleet up` started here) or ``--admin URL`` (any node's admin
    endpoint of a fleet running anywhere; actions take the bearer token from ``--token-env``)."""
    func = click.option("--token-env", default="KPROXY_ADMIN_TOKEN", show_default=True,
                        help="With --admin: the environment variable holding the fleet's admin token.")(func)
    func = click.option("--admin", "admin_url", default=None, metavar="URL",
                        help="Any node's admin endpoint (http://HOST:PORT) instead of a local state dir.")(func)
    return click.option("--state-dir", type=click.Path(file_okay=False), default=None,
                        help="Directory holding the local fleet's state.")(func)


def _target(state_dir: str | None, admin_url: str | None, token_env: str) -> ClusterAdmin:
    if (state_dir is None) == (admin_url is None):
        raise click.UsageError("give exactly one of --state-dir and --admin")
    if state_dir is not None:
        return _load(state_dir)
    try:
        return ClusterAdmin.discover(admin_url or "", os.environ.get(token_env) or None)
    except AdminError as exc:
        _fail(exc, EXIT_USAGE)


# ------------------------------------------------------------------ fleet
@click.group()
def fleet() -> None:
    """The embedded default: local Kafka + N proxies on 127.0.0.11, .12, …"""


@fleet.command("up")
@click.option("--brokers", type=click.IntRange(1, 9), default=3, show_default=True)
@click.option("--proxies", type=click.IntRange(1, 9), default=3, show_default=True)
@state_dir_option
@click.option("--bootstrap", default=None, help="Use an existing Kafka (host:port,...): start only the proxies.")
@click.option("--timeout", type=float, default=120.0, show_default=True)
@click.option("--first-ip", type=click.IntRange(2, 250), default=11, show_default=True,
              help="Node i gets 127.0.0.<first-ip + i>: two fleets on one machine need different ranges.")
@hosts_option
@click.option("--workers", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Data-path worker processes per node (nodes on one machine share its cores).")
@security_option
@click.option("--json", "as_json", is_flag=True)
def fleet_up(brokers: int, proxies: int, state_dir: str, bootstrap: str | None, timeout: float, first_ip: int,
             hosts: str, workers: int, security: str, as_json: bool) -> None:
    """Start the fleet, wait for a leader and every identity assigned, print the bootstrap list."""
    if first_ip + proxies - 1 > 254:
        raise click.BadParameter(f"127.0.0.{first_ip + proxies - 1} is past 127.0.0.254", param_hint="--first-ip")
    if security != "plaintext" and bootstrap is not None:
        raise click.BadParameter("a secured fleet brings up its own Kafka (its CA and SASL users): "
                                 "not with --bootstrap", param_hint="--security")
    from chaos.testbed.fleet import LocalFleet
    from chaos.testbed.hosts import HostsError
    from chaos.testbed.kafka_cluster import KafkaError
    from chaos.testbed.proxies import ProxyProcessError
    from chaos.testbed.security import Protocol

    try:
        f = LocalFleet.up(state_dir, brokers=brokers, proxies=proxies, kafka_bootstrap=bootstrap, timeout=timeout,
                          first_ip=first_ip, hosts=hosts, workers=workers, security=Protocol.parse(security))
    except (AdminError, KafkaError, ProxyProcessError, HostsError, OSError) as exc:
        _fail(exc)
    view = f.fleet_view()
    client = f.client_security
    props = None if client is None else client.java_properties(f.state_dir / "client.properties")
    if as_json:
        click.echo(json.dumps({"bootstrap": f.bootstrap, "epoch": view.epoch, "leader": view.leader,
                               "assignment": view.assignment, "nodes": [n.id for n in view.nodes],
                               "kafka": f.kafka.bootstrap if f.kafka else f.upstream, "state_dir": state_dir,
                               "security": f.security.value,
                               "client": None if client is None else {**client.describe(),
                                                                      "properties": str(props)}}))
    else:
        click.echo(f.bootstrap_servers)
        if props is not None:
            click.echo(f"client settings (Java properties, password inside, mode 0600): {props}", err=True)


@fleet.command("down")
@state_dir_option
def fleet_down(state_dir: str) -> None:
    """Stop every process `fleet up` started (proxies, then Kafka); remove its emulated hosts."""
    f = _load(state_dir)
    try:
        f.down()
    except AdminError as exc:  # LocalFleetError: an emulated host could not be removed
        _fail(exc)
    click.echo(f"stopped proxies {f.node_ids}" + (" and the local Kafka" if f.kafka else "")
               + (f"; removed emulated hosts {f.hosts.tag}-*" if f.hosts else ""))


# ---------------------------------------------------------------- cluster
@click.group()
def cluster() -> None:
    """Look at and act on a running fleet."""


def stand_in_summary(view: FleetView, node: NodeRow) -> str:
    """The addresses ``node`` stands in for, grouped by whose they are: ``p3 ×4`` (one
    line, however many identity ports a vacant node had)."""
    owner_of_host = {n.address: n.id for n in view.nodes}
    counts: dict[str, int] = {}
    for address in node.standing_in:
        host = address.rsplit(":", 1)[0]
        who = owner_of_host.get(host, host)
        counts[who] = counts.get(who, 0) + 1
    return ", ".join(f"{who} ×{k}" for who, k in sorted(counts.items())) or "—"


def _node_address(view: FleetView, node: NodeRow) -> str:
    """``host:bootstrap_port`` of a node (its identities are on ``[ports]``, see the broker table)."""
    member = view.members.get(node.id)
    if member is not None:
        return f"{node.address}:{member.bootstrap_port}"
    return next((b for b in view.bootstrap if b.rsplit(":", 1)[0] == node.address), node.address)


def _node_state(node: NodeRow) -> str:
    if not node.alive:
        return "[red]DOWN[/red]"
    if node.draining:
        return "[yellow]draining[/yellow]"
    return "serving" if node.up is not False else "[yellow]not up[/yellow]"


def render_status(view: FleetView, problems: list[str], out: Console | None = None) -> None:
    """The fleet as two tables that fit 80 columns (one line per node and per broker)."""
    out = out or console
    terms = sorted({n.term for n in view.nodes if n.term})
    title = (f"kproxy fleet — epoch {view.epoch if view.epoch is not None else '—'}, "
             f"leader {view.leader or '—'}" + (f", term {terms[-1]}" if terms else ""))
    nodes = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for col in ("node", "address", "role", "state", "epoch", "quorum", "brokers", "stands in for"):
        nodes.add_column(col, no_wrap=True, overflow="ellipsis")
    for n in view.nodes:
        nodes.add_row(n.id, _node_address(view, n), n.role if n.alive else "—", _node_state(n),
                      str(n.epoch if n.epoch is not None else "—"),
                      {True: "yes", False: "[yellow]no[/yellow]", None: "—"}[n.has_quorum],
                      ",".join(map(str, n.identities)) or "—", stand_in_summary(view, n))
    out.print(nodes)
    table = Table(title="broker identity → proxy", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    for col in ("broker", "upstream", "rack", "proxy", "advertised"):
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    brokers = {str(b.id): b for b in view.brokers}
    for bid, owner in view.assignment.items():
        b = brokers.get(bid)
        table.add_row(bid, f"{b.host}:{b.port}" if b else "?", str((b and b.rack) or "—"), owner,
                      str((b and b.advertised) or "—"))
    out.print(table)
    out.print("[green]healthy[/green]" if not problems else "[red]unhealthy:[/red] " + "; ".join(problems))


@cluster.command("status")
@fleet_target
@click.option("--json", "as_json", is_flag=True)
def cluster_status(state_dir: str | None, admin_url: str | None, token_env: str, as_json: bool) -> None:
    """Nodes, roles, epoch, broker-id → proxy table, upstream brokers. Exit 1 when unhealthy."""
    f = _target(state_dir, admin_url, token_env)
    view = f.fleet_view()
    problems = view.health_problems()
    if as_json:
        click.echo(json.dumps({**view.to_json(), "healthy": not problems, "problems": problems}))
    else:
        render_status(view, problems)
    sys.exit(1 if problems else 0)


@cluster.command("kill-node")
@click.argument("node")
@fleet_target
@click.option("--signal", "sig", type=click.Choice(["KILL", "STOP", "TERM", "CONT"], case_sensitive=False),
              default="KILL", show_default=True)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def kill_node(node: str, state_dir: str | None, admin_url: str | None, token_env: str, sig: str, yes: bool) -> None:
    """The drill: send SIGKILL (or STOP/TERM/CONT) to one proxy node.

    With --admin the node signals itself (POST /kill): CONT cannot reach a stopped node that way."""
    f = _target(state_dir, admin_url, token_env)
    if admin_url is not None and sig.upper() == "CONT":
        raise click.BadParameter("a stopped node cannot answer its admin endpoint: CONT needs --state-dir",
                                 param_hint="--signal")
    if node not in f.node_ids:
        raise click.BadParameter(f"no node {node!r} (nodes: {', '.join(f.node_ids)})", param_hint="NODE")
    if not yes:
        click.confirm(f"Send SIG{sig.upper()} to proxy node {node}?", abort=True)
    try:
        f.signal_node(node, sig)
    except AdminError as exc:
        _fail(exc)
    click.echo(f"sent SIG{sig.upper()} to {node}")


def _move(f: ClusterAdmin, node: str, action: str) -> None:
    try:
        result = getattr(f, action)(node)
    except AdminError as exc:
        _fail(exc)
    click.echo(f"{action}ed {node} at epoch {result.get('epoch')}")


@cluster.command("drain")
@click.argument("node")
@fleet_target
def drain(node: str, state_dir: str | None, admin_url: str | None, token_env: str) -> None:
    """Move every identity away from NODE without client errors."""
    _move(_target(state_dir, admin_url, token_env), node, "drain")


@cluster.command("undrain")
@click.argument("node")
@fleet_target
def undrain(node: str, state_dir: str | None, admin_url: str | None, token_env: str) -> None:
    """Let NODE take identities again."""
    _move(_target(state_dir, admin_url, token_env), node, "undrain")


@cluster.command("reload")
@click.argument("node")
@fleet_target
@click.option("--json", "as_json", is_flag=True)
def reload(node: str, state_dir: str | None, admin_url: str | None, token_env: str, as_json: bool) -> None:
    """NODE reads its config file and certificates again (as on SIGHUP): says what changed now
    and which changed fields need a restart."""
    f = _target(state_dir, admin_url, token_env)
    if node not in f.node_ids:
        raise click.BadParameter(f"no node {node!r} (nodes: {', '.join(f.node_ids)})", param_hint="NODE")
    try:
        result = f.reload(node)
    except AdminError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(result))
        return
    applied, restart = result.get("applied") or [], result.get("needs_restart") or []
    click.echo(f"{node}: reloaded; applied: {', '.join(applied) or 'nothing changed'}")
    if restart:
        click.echo(f"{node}: changed but needs a restart: {', '.join(restart)}")


@cluster.command("restart-node")
@click.argument("node")
@state_dir_option
def restart_node(node: str, state_dir: str) -> None:
    """Stop NODE gracefully (if running), start it again and wait until it serves."""
    from chaos.testbed.proxies import ProxyProcessError

    f = _load(state_dir)
    try:
        f.restart_node(node)
    except (AdminError, ProxyProcessError) as exc:
        _fail(exc)
    click.echo(f"{node} restarted")
