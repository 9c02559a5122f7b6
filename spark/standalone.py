"""A throwaway Spark standalone cluster on 127.0.0.1, from the PySpark package.

The pip package has no ``start-master.sh``; ``spark-class`` starts the master
and worker in the foreground (it ``exec``s the JVM, so the PID we get is the
JVM's). Used by the spark-submit test and ``spark.bench --standalone``::

    with LocalStandalone(work_dir, cores=1, memory="1g") as cluster:
        subprocess.run([spark_submit(), "--master", cluster.url, ...])

Every port is free-picked on 127.0.0.1, the master's REST server is off, and
``stop`` ends exactly the two processes ``start`` launched, by PID.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from collections.abc import Callable
from typing import IO, Any

import pyspark

from spark.session import jvm_options

HOST = "127.0.0.1"
SPARK_BIN = Path(pyspark.__file__).resolve().parent / "bin"


def spark_class() -> str:
    return str(SPARK_BIN / "spark-class")


def spark_submit() -> str:
    return str(SPARK_BIN / "spark-submit")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def loopback_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["SPARK_LOCAL_IP"] = HOST
    env.update(extra)
    return env


class ClusterError(RuntimeError):
    pass


class LocalStandalone:
    def __init__(self, work_dir: str | Path, *, cores: int = 1, memory: str = "1g") -> None:
        self.work_dir = Path(work_dir)
        self.cores = cores
        self.memory = memory
        self.port = 0
        self.ui_port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    @property
    def url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in (self.master, self.worker) if p is not None)

    def _launch(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.work_dir / f"{name}.log", "wb")
        self._logs.append(log)
        return subprocess.Popen([spark_class(), *args], stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self, timeout_s: float = 90.0) -> LocalStandalone:
        """Start the master, wait until it is ALIVE, then start the worker and wait
        until it is registered. A worker launched before the master's endpoint
        exists fails its first registration ("Cannot find endpoint") and backs off
        for up to a minute, so the worker only starts once the master answers."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.ui_port, worker_ui = free_port(), free_port(), free_port()
        env = loopback_env(
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS=jvm_options(),
        )
        deadline = time.monotonic() + timeout_s
        self.master = self._launch(
            "master",
            ["org.apache.spark.deploy.master.Master", "--host", HOST, "--port", str(self.port), "--webui-port", str(self.ui_port)],
            env,
        )
        try:
            self._wait(deadline, "the master to be ALIVE", lambda state: state.get("status") == "ALIVE")
            self.worker = self._launch(
                "worker",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    self.url,
                    "--host",
                    HOST,
                    "--webui-port",
                    str(worker_ui),
                    "--cores",
                    str(self.cores),
                    "--memory",
                    self.memory,
                    "--work-dir",
                    str(self.work_dir / "work"),
                ],
                env,
            )
            self._wait(
                deadline, "a registered worker", lambda state: any(w.get("state") == "ALIVE" for w in state.get("workers", []))
            )
        except BaseException:
            self.stop()
            raise
        return self

    def state(self) -> dict[str, Any] | None:
        """The master's JSON status page, or None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.ui_port}/json/", timeout=2) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _wait(self, deadline: float, what: str, ready: Callable[[dict[str, Any]], bool]) -> None:
        """Poll the master's status page until ``ready`` holds, or fail at the deadline."""
        while time.monotonic() < deadline:
            for name, proc in (("master", self.master), ("worker", self.worker)):
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(f"{name} exited with {proc.returncode}: {self._tail(name)}")
            state = self.state()
            if state is not None and ready(state):
                return
            time.sleep(0.25)  # poll interval, the condition is checked above
        raise ClusterError(
            f"no {what} before the deadline\n--- master log ---\n{self._tail('master')}\n--- worker log ---\n{self._tail('worker')}"
        )

    def _tail(self, name: str) -> str:
        path = self.work_dir / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the worker then the master (by PID), SIGKILL what outlives the timeout."""
        for proc in (self.worker, self.master):
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> LocalStandalone:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
