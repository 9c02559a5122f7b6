"""The `kproxy` console command: one click group, subcommands registered lazily.

Each subcommand lives in its own module under ``cli/`` and holds no logic that
belongs to ``proxy/``, ``membership/``, ``chaos/`` or ``spark/``: it parses,
calls, prints. Exit codes everywhere (``cli/exit_codes.py``): 0 success, 1 unhealthy
result, 2 refused (bad usage or config, unknown node, missing or wrong token).
"""

from __future__ import annotations

import importlib
import sys

import click

# name -> "module:attribute". Imported only when the subcommand runs, so that
# `kproxy --help` does not pay for pyspark or uvloop.
SUBCOMMANDS: dict[str, str] = {
    "kafka": "cli.kafka_cmd:kafka",
    "report": "cli.report_cmd:report",
    "run": "cli.run_cmd:run",
    "bench": "cli.bench_cmd:bench",
    "fleet": "cli.fleet_cmd:fleet",
    "cluster": "cli.members_cmd:cluster",  # fleet_cmd's group with add-node/remove-node
    "drill": "cli.drill_cmd:drill",
    "demo": "cli.demo_cmd:demo",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(SUBCOMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)


@click.group(cls=LazyGroup)
@click.version_option(package_name="kproxy")
def cli() -> None:
    """kproxy: a highly available proxy fleet for Apache Kafka."""


# The third-party modules of each extra (pyproject.toml): a command whose import fails on one
# of them names the extra to install instead of showing a traceback.
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("trio", "aiokafka", "confluent_kafka", "kafka", "psutil", "tomli_w"), "chaos"),
    **dict.fromkeys(("pyspark", "pyarrow", "pandas", "numpy", "matplotlib"), "spark"),
}


def main() -> None:
    try:
        cli()
    except ModuleNotFoundError as exc:
        extra = EXTRA_OF_MODULE.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        click.echo(f"error: this command needs the [{extra}] extra ({exc.name} is not installed): "
                   f"pip install 'kproxy[{extra}]'", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
