"""Waiting for a condition with a deadline (never a bare sleep standing in for it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], what: str, timeout: float = 30.0, interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy and return that; AssertionError
    naming ``what`` once ``timeout`` seconds passed without it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def wait_until(what: str, predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> None:
    """:func:`wait_for` with the description first (the in-process Raft tests' order)."""
    wait_for(predicate, what, timeout, interval)


async def until(condition: Callable[[], object], what: str, timeout: float = 5.0, interval: float = 0.01) -> None:
    """:func:`wait_for` inside a running event loop: poll ``condition`` between the loop's other
    work; AssertionError naming ``what`` once ``timeout`` seconds passed without it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)
