"""What tests read of a running node process (chaos.testbed.proxies.NodeProcess): one metric's
value, and its processes' connections to the brokers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psutil


def metric(node: Any, name: str) -> float:
    """The value of the one sample of ``/metrics`` whose line starts with ``name`` (labels included)."""
    lines = [x for x in node.get("/metrics").text.splitlines() if x.startswith(name)]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def upstream_connections(node: Any, bootstrap: Iterable[str]) -> int:
    """The node's (its processes') established TCP connections to the brokers at ``bootstrap``."""
    brokers = {(h, int(p)) for h, _, p in (a.rpartition(":") for a in bootstrap)}
    root = psutil.Process(node.pid)
    return sum(1 for proc in [root, *root.children(recursive=True)] for c in proc.net_connections("tcp4")
               if c.status == psutil.CONN_ESTABLISHED and c.raddr and (c.raddr.ip, c.raddr.port) in brokers)
