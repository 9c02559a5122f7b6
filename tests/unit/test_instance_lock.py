"""One `kproxy run` per node address: the second is refused at once, naming the first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from cli import instance_lock
from cli.main import cli

pytestmark = pytest.mark.unit

HOST, PORT = "127.0.0.99", 19992  # never bound: the lock is a name, not a port


def test_second_take_is_refused_naming_the_holder_and_release_frees_it():
    lock = instance_lock.take(HOST, PORT, {"node": "p1", "pid": 4242, "config": "/etc/kproxy.toml",
                                           "since": "2026-11-23T19:00:00Z"})
    try:
        with pytest.raises(instance_lock.InstanceRunning) as info:
            instance_lock.take(HOST, PORT, {"node": "p1"})
        message = str(info.value)
        assert "node p1 is already running for 127.0.0.99:19992" in message
        assert "pid 4242" in message and "/etc/kproxy.toml" in message and "kill -TERM 4242" in message
        other = instance_lock.take(HOST, PORT + 1, {"node": "p2"})  # another address: its own lock
        other.release()
    finally:
        lock.release()
    again = instance_lock.take(HOST, PORT, {"node": "p1"})
    again.release()


def test_a_holder_that_does_not_answer_is_still_refused():
    """A stopped (SIGSTOP) holder cannot answer: the refusal says so instead of hanging."""
    code = ("import sys, time; from cli import instance_lock; "
            f"instance_lock.take({HOST!r}, {PORT + 2}, {{'node': 'p3'}}); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env={**os.environ})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"held"
        os.kill(child.pid, signal.SIGSTOP)
        _wait_stopped(child.pid)
        started = time.monotonic()
        with pytest.raises(instance_lock.InstanceRunning) as info:
            instance_lock.take(HOST, PORT + 2, {"node": "p3"})
        assert time.monotonic() - started < instance_lock.ANSWER_TIMEOUT_S + 1.0
        assert "does not answer" in str(info.value)
    finally:
        child.kill()
        child.wait(10)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} not stopped within {timeout}s")


def test_run_refuses_a_node_whose_lock_is_held(tmp_path):
    config = tmp_path / "fleet.toml"
    config.write_text(f'[upstream]\nbootstrap = ["127.0.0.1:19092"]\n[ports]\nbase = 9100\n'
                      f'[[nodes]]\nid = "p1"\nhost = "{HOST}"\nbootstrap_port = {PORT + 3}\n')
    lock = instance_lock.take(HOST, PORT + 3, {"node": "p1", "pid": 777, "config": str(config), "since": "now"})
    try:
        started = time.monotonic()
        result = CliRunner().invoke(cli, ["run", "--config", str(config), "--node", "p1"])
        assert time.monotonic() - started < 5
        assert result.exit_code == 2
        assert result.output.startswith("error: node p1 is already running") and "pid 777" in result.output
    finally:
        lock.release()
