"""The exit codes of every `kproxy` command, in one place.

* 0 — done: the command did what was asked, the fleet it looked at is healthy.
* 1 — unhealthy: the command ran, but the result is not good (a node down, a drill that lost
  records, an action the fleet did not complete in time, a node that did not answer it).
* 2 — refused: the command could not act as asked. Bad usage (options, arguments), a bad
  config file (the message names the field), an unknown node, a missing or wrong admin
  token, no fleet at the state dir or admin URL given, a node already running, a port in use.

Messages go to stderr as ``error: …`` and never carry a Python repr.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2


def fail(message: object, code: int = EXIT_UNHEALTHY) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)
