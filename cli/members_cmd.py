"""`kproxy cluster add-node|remove-node`: grow and shrink a running fleet live.

Both are admin actions (token-authenticated) of any node, through ``--admin URL``
or the local fleet of ``--state-dir D``; with ``--state-dir`` the launcher also
starts the added node's process (after the fleet has added it) or stops the
removed one (after the fleet has drained and removed it). A change that would
lose quorum, or a second change while one is in flight, is refused: exit 2
with the reason (cli/exit_codes.py). The rules are membership/roster.py's.
"""

from __future__ import annotations

import json

import click

from cli.exit_codes import EXIT_USAGE
from cli.fleet_cmd import _fail, _target, cluster, fleet_target
from proxy.admin_client import AdminError


def _report(result: dict, as_json: bool, line: str) -> None:
    click.echo(json.dumps(result) if as_json else line)


@cluster.command("add-node")
@click.argument("node")
@click.option("--host", required=True, help="The new node's address (advertised, bound, Raft and heartbeat).")
@click.option("--rack", default=None, help="The new node's rack (identities of that rack's brokers go home to it).")
@click.option("--bootstrap-port", type=click.IntRange(1, 65535), default=None,
              help="Default: the same as the node answering the action.")
@click.option("--raft-port", type=click.IntRange(1, 65535), default=None,
              help="Default: the same as the node answering the action.")
@fleet_target
@click.option("--json", "as_json", is_flag=True)
def add_node(node: str, host: str, rack: str | None, bootstrap_port: int | None, raft_port: int | None,
             state_dir: str | None, admin_url: str | None, token_env: str, as_json: bool) -> None:
    """Add NODE to the running fleet (a Raft membership change, one at a time).

    With --state-dir the node's process is started too and the command returns once the
    fleet is balanced again; with --admin start it yourself afterwards (kproxy run, with a
    fleet file that lists it: it learns the current members from the fleet)."""
    f = _target(state_dir, admin_url, token_env)
    try:
        if state_dir is not None:
            if bootstrap_port is not None or raft_port is not None:
                raise click.UsageError("--bootstrap-port/--raft-port: a local fleet's nodes share one port layout")
            result = f.add_node(node, host, rack=rack)  # type: ignore[call-arg]
        else:
            result = f.add_node(node, host, bootstrap_port=bootstrap_port, raft_port=raft_port, rack=rack)
    except (AdminError, RuntimeError, OSError) as exc:  # RuntimeError, OSError: the launcher's process
        _fail(exc)
    started = "" if state_dir is not None else f"; start its process now (kproxy run --node {node})"
    _report(result, as_json, f"added {node} at epoch {result.get('epoch')}; members "
                             f"{', '.join(result.get('members', []))}{started}")


@cluster.command("remove-node")
@click.argument("node")
@fleet_target
@click.option("--json", "as_json", is_flag=True)
def remove_node(node: str, state_dir: str | None, admin_url: str | None, token_env: str, as_json: bool) -> None:
    """Drain NODE, then remove it from the running fleet (a Raft membership change).

    With --state-dir its process is stopped too; with --admin stop it yourself afterwards."""
    f = _target(state_dir, admin_url, token_env)
    if node not in f.node_ids and state_dir is not None:
        _fail(f"no node {node!r} in this fleet (nodes: {', '.join(f.node_ids)})", EXIT_USAGE)
    try:
        result = f.remove_node(node)
    except AdminError as exc:
        _fail(exc)
    stopped = "" if state_dir is not None else "; stop its process now"
    _report(result, as_json, f"removed {node} at epoch {result.get('epoch')}; members "
                             f"{', '.join(result.get('members', []))}{stopped}")
