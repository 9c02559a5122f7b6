"""`kproxy run --config F --node N`: one proxy node in the foreground.

Before the node binds anything it takes the per-node lock (``cli/instance_lock.py``): a second
`kproxy run` of the same node is refused at once, naming the running one. A listener that
cannot bind ends the process with one line naming the listener and its address (exit 2).
"""

from __future__ import annotations

import errno
import os
import time

import click

from cli.exit_codes import EXIT_UNHEALTHY, EXIT_USAGE, fail
from proxy.config import ConfigError, load

# A bind that fails for these reasons is the operator's to fix (another process, a wrong host).
BIND_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES}


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Fleet TOML file.")
@click.option("--node", "node_id", required=True, help="Which [[nodes]] entry this process is.")
def run(config_path: str, node_id: str) -> None:
    """Run one proxy node: data path, fleet member (with [fleet]) and admin endpoint.

    SIGTERM (or Ctrl-C) drains it: the fleet moves its identities away, its clients are closed
    once their in-flight responses are out, then it exits."""
    from cli import instance_lock
    from proxy import logs, runtime

    try:
        config = load(config_path)
        node = config.node(node_id)
    except ConfigError as exc:
        fail(exc, EXIT_USAGE)
    try:
        lock = instance_lock.take(node.host, node.bootstrap_port, {
            "node": node_id, "pid": os.getpid(), "config": os.path.abspath(config_path),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    except instance_lock.InstanceRunning as exc:
        fail(exc, EXIT_USAGE)
    logs.setup(config.log_level, config.log_format, node_id)
    from membership.member import FormatRefused

    try:
        runtime.run(config, node_id)
    except (FormatRefused, ConfigError) as exc:  # a state format this node cannot read; a bad KPROXY_FORMATS
        fail(exc, EXIT_USAGE)
    except OSError as exc:
        # Our bind sites put the listener and its address in strerror; errno says whose fault it is.
        fail(exc.strerror or logs.describe_error(exc), EXIT_USAGE if exc.errno in BIND_ERRNOS else EXIT_UNHEALTHY)
    finally:
        lock.release()
