"""Proxy node processes on their own loopback addresses (127.0.0.11, .12, …).

``fleet_config`` writes the one TOML file that describes a fleet (every node
reads the same file and picks itself with ``--node``); ``NodeProcess`` starts
``kproxy run`` for one node, waits until its admin endpoint says ready, and
signals or stops it by PID.

Every node runs in its own session, so its own process group: a node of
several processes (a supervisor and its data-path workers, proxy.supervisor)
is frozen, thawed or killed whole by signalling the group, as a host's
processes would all stop with it.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import tomli_w

from proxy.admin_client import DEFAULT_ADMIN_PORT, DEFAULT_BOOTSTRAP_PORT, NodeAdmin

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "CONT": signal.SIGCONT, "TERM": signal.SIGTERM}
BOOTSTRAP_PORT = DEFAULT_BOOTSTRAP_PORT
PORT_BASE = 9100  # broker B is served on 9100 + B by every node
ADMIN_PORT = DEFAULT_ADMIN_PORT
RAFT_PORT = 9500
# The fleet's log level, from the environment of whoever starts it (a bench run traced at DEBUG).
FLEET_LOG_LEVEL_ENV = "KPROXY_FLEET_LOG_LEVEL"


class ProxyProcessError(RuntimeError):
    pass


def node_ip(index: int, first: int = 11) -> str:
    """Node ``index`` (0-based) gets 127.0.0.<first+index>."""
    return f"127.0.0.{first + index}"


def fleet_config(path: str | os.PathLike[str], upstream: list[str], proxies: int, *, first_ip: int = 11,
                 fleet: bool = True, racks: list[str] | None = None, tap_dir: str | None = None,
                 bootstrap_port: int = BOOTSTRAP_PORT, port_base: int = PORT_BASE, admin_port: int = ADMIN_PORT,
                 raft_port: int = RAFT_PORT, log_format: str = "json", extra: dict[str, Any] | None = None,
                 hosts: list[str] | None = None, floating: list[str] | None = None, workers: int = 1,
                 secrets_env: dict[str, str] | None = None) -> Path:
    """Write the fleet's TOML. Secrets go to ``<path>.env`` (0600), never into the TOML
    (``secrets_env``: more of them, e.g. the upstream SASL password the ``[security]`` section names).
    ``hosts``: node i's address (emulated hosts); default 127.0.0.<first_ip + i>. ``floating``:
    node i's floating address (its advertised one; the netns address mover moves it).
    ``workers``: data-path processes per node. One unless asked: several nodes
    share this machine's few cores, where more processes per node add only noise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nodes = []
    for i in range(proxies):
        host = hosts[i] if hosts else node_ip(i, first_ip)
        node: dict[str, Any] = {"id": f"p{i + 1}", "host": host, "bootstrap_port": bootstrap_port,
                                "admin_port": admin_port, "workers": workers}
        if floating:
            node["floating_host"] = floating[i]
        if fleet:
            node["raft_port"] = raft_port
        if racks:
            node["rack"] = racks[i % len(racks)]
        nodes.append(node)
    doc: dict[str, Any] = {
        "upstream": {"bootstrap": list(upstream), "refresh_interval_s": 5.0},
        "ports": {"base": port_base},
        "nodes": nodes,
        "logging": {"level": os.environ.get(FLEET_LOG_LEVEL_ENV, "INFO"), "format": log_format},
        "admin": {"token_env": "KPROXY_ADMIN_TOKEN"},
    }
    if fleet:
        doc["fleet"] = {"password_env": "KPROXY_RAFT_PASSWORD"}
    if floating:
        doc["addresses"] = {"mover": "netns"}
    if tap_dir:
        doc["debug"] = {"tap_dir": tap_dir}
    for section, values in (extra or {}).items():
        doc.setdefault(section, {}).update(values)
    path.write_text(tomli_w.dumps(doc))
    env_path = env_file(path)
    if not env_path.exists():
        env_path.write_text(f"KPROXY_ADMIN_TOKEN={secrets.token_urlsafe(24)}\n"
                            f"KPROXY_RAFT_PASSWORD={secrets.token_urlsafe(24)}\n")
        env_path.chmod(0o600)
    if secrets_env:
        merged = {**read_env(path), **secrets_env}
        env_path.write_text("".join(f"{k}={v}\n" for k, v in merged.items()))
    return path


def env_file(config_path: Path) -> Path:
    return config_path.with_suffix(".env")


def read_env(config_path: str | os.PathLike[str]) -> dict[str, str]:
    out = {}
    for line in env_file(Path(config_path)).read_text().splitlines():
        if "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


class NodeProcess(NodeAdmin):
    """One ``kproxy run`` process, and the client of its admin endpoint."""

    def __init__(self, config_path: str | os.PathLike[str], node_id: str, host: str, admin_port: int,
                 log_path: str | os.PathLike[str], pid: int | None = None, exec_prefix: tuple[str, ...] = (),
                 bootstrap_host: str | None = None) -> None:
        """``exec_prefix``: run the node through it (``ip netns exec NS``: an emulated host);
        ``bootstrap_host``: its floating address, where clients reach it (default ``host``)."""
        super().__init__(node_id, host, admin_port, bootstrap_host=bootstrap_host)
        self.exec_prefix = tuple(exec_prefix)
        self.config_path = Path(config_path).resolve()
        self.log_path = Path(log_path)
        self.pid = pid
        self._proc: subprocess.Popen[bytes] | None = None

    def token(self) -> str:
        return read_env(self.config_path)["KPROXY_ADMIN_TOKEN"]

    def adopt(self, pid: int) -> None:
        """The node now runs as ``pid``, started by another handle on the fleet (a restart
        through ``fleet.json``): signal that process from now on."""
        self.pid, self._proc = pid, None

    def start(self) -> "NodeProcess":
        if self.alive():
            raise ProxyProcessError(f"node {self.node_id} is already running (pid {self.pid})")
        env = dict(os.environ)
        env.update(read_env(self.config_path))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [*self.exec_prefix, sys.executable, "-m", "cli.main", "run", "--config", str(self.config_path), "--node", self.node_id],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        self.pid = self._proc.pid
        return self

    @contextmanager
    def running(self, ready_timeout: float = 60.0) -> Iterator["NodeProcess"]:
        """Start the node, wait until it is ready, stop it when the block ends (a test fixture's
        body: ``with NodeProcess(...).running() as node: yield node``)."""
        self.start()
        try:
            self.wait_ready(ready_timeout)
            yield self
        finally:
            self.stop()

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self._proc is not None:  # our child: its cmdline may not be exec'ed yet, ask the handle
            return self._proc.poll() is None
        try:
            p = psutil.Process(self.pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return False
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            return False
        return str(self.config_path) in cmd and self.node_id in cmd

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProxyProcessError(f"node {self.node_id} exited:\n{self.log_tail()}")
            try:
                if self.get("/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ProxyProcessError(f"node {self.node_id} not ready within {timeout}s:\n{self.log_tail()}")

    def signal(self, name: str) -> None:
        if not self.alive():
            raise ProxyProcessError(f"node {self.node_id} is not running")
        assert self.pid is not None
        sig = SIGNALS[name]
        if name == "TERM":
            os.kill(self.pid, sig)  # the node drains, then stops its own workers
        else:
            self._signal_group(sig)
        if name == "KILL":
            self.wait_gone(10.0)

    def _signal_group(self, sig: int) -> None:
        """Every process of the node at once when it leads its own process group (start() makes it so)."""
        assert self.pid is not None
        try:
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
                return
        except ProcessLookupError:
            return
        os.kill(self.pid, sig)

    def wait_gone(self, timeout: float) -> bool:
        if self.pid is None:
            return True
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        try:
            psutil.Process(self.pid).wait(timeout)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.pid is not None
        self._signal_group(signal.SIGCONT)
        os.kill(self.pid, signal.SIGTERM)
        if not self.wait_gone(timeout):
            self._signal_group(signal.SIGKILL)
            self.wait_gone(10.0)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
