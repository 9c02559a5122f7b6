"""Structured logging: one JSON object per line (or plain text), extras included."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def describe_error(exc: BaseException) -> str:
    """An I/O error as an operator reads it (``connection refused``, ``timed out``), never a repr."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return f"connection closed after {len(exc.partial)} of {exc.expected} bytes"
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno).lower()
    return str(exc) or type(exc).__name__


class JsonFormatter(logging.Formatter):
    def __init__(self, node: str | None = None, worker: int | None = None) -> None:
        super().__init__()
        self.node = node
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.node:
            out["kproxy_node"] = self.node
        if self.worker is not None:
            out["kproxy_worker"] = self.worker
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        return base + ("  " + " ".join(f"{k}={v}" for k, v in extras.items()) if extras else "")


def set_level(level: str) -> None:
    """The level of every logger from now on (``logging.level``, also on a config reload)."""
    logging.getLogger().setLevel(level)
    logging.getLogger("pysyncobj").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def setup(level: str = "INFO", fmt: str = "json", node: str | None = None, worker: int | None = None) -> None:
    """``worker``: the index of a data-path worker process (proxy.worker), in every line it logs."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(node, worker))
    else:
        who = "" if worker is None else f"[worker {worker}] "
        handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
