"""`kproxy run --config F --node N`: one proxy node in the foreground."""

from __future__ import annotations

import sys

import click

from proxy.config import ConfigError, load


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Fleet TOML file.")
@click.option("--node", "node_id", required=True, help="Which [[nodes]] entry this process is.")
def run(config_path: str, node_id: str) -> None:
    """Run one proxy node: data path, fleet member (with [fleet]) and admin endpoint."""
    from proxy import logs, runtime

    try:
        config = load(config_path)
        config.node(node_id)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    logs.setup(config.log_level, config.log_format, node_id)
    try:
        runtime.run(config, node_id)
    except OSError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
