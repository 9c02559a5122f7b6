"""`kproxy report TRACE_DIR`: the Spark failover report (thin: parse, call spark/, print).

Exit codes: 0 healthy, 1 lost or duplicated records, 2 bad input (the message
names the file and line of a malformed trace).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

EXIT_BAD_INPUT = 2


@click.command("report")
@click.argument("trace_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Report directory (default: TRACE_DIR/report).",
)
@click.option("--master", default="local[2]", show_default=True, help="Spark master URL.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json instead of the summary.")
@click.pass_context
def report(ctx: click.Context, trace_dir: Path, out: Path | None, master: str, as_json: bool) -> None:
    """Turn drill traces into RTO / loss / duplicate figures, plots and report.json.

    TRACE_DIR is one run's trace directory or a drill's --out directory (every run under it)."""
    from spark.extract import TraceFormatError
    from spark.jobs import exit_code, run_report

    try:
        result = run_report(trace_dir, out, master)
    except TraceFormatError as exc:
        click.echo(f"kproxy report: bad trace: {exc}", err=True)
        ctx.exit(EXIT_BAD_INPUT)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        from rich.console import Console

        from spark.report_text import render

        Console().print(render(result))
    ctx.exit(exit_code(result))
