"""The load under a drill: its clients (``ClientSpec``), their workload processes
(``WorkloadGroup``: one stop switch, SIGTERM then SIGKILL) and the trace tail that tells
whether they succeed (``TraceTail``)."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs
import trio

from chaos.clients import ROLES
from chaos.clients.workload import command


class DrillError(RuntimeError):
    """The drill could not run as planned (message says which step)."""


class WorkloadExited(DrillError):
    def __init__(self, client_id: str, returncode: int | None, last_lines: str = "") -> None:
        said = f"; its log ends: {last_lines}" if last_lines else ""
        super().__init__(f"workload {client_id} exited unexpectedly with code {returncode}{said}")
        self.client_id = client_id
        self.returncode = returncode


LOG_TAIL_BYTES = 4096
LOG_TAIL_LINES = 6


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines of a workload's log (an exit's reason), joined by " | "."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join([line.strip() for line in text.splitlines() if line.strip()][-lines:])


# ------------------------------------------------------------- client specs
@attrs.frozen
class ClientSpec:
    family: str
    role: str
    client_id: str
    prefix: int | None = None
    group: str | None = None


def client_specs(clients: tuple[tuple[str, str], ...], run_id: str) -> list[ClientSpec]:
    specs: list[ClientSpec] = []
    prefix = 0
    for family, role in clients:
        cid = f"{family}-{role}"
        if role == "producer":
            prefix += 1
            specs.append(ClientSpec(family, role, cid, prefix=prefix))
        else:
            specs.append(ClientSpec(family, role, cid, group=f"{run_id}-{cid}"))
    return specs


def workload_commands(specs: list[ClientSpec], *, bootstrap: list[str], topic: str, trace_dir: Path, run_id: str,
                      rate: float, python: str, prefix: tuple[str, ...] = (),
                      security_file: Path | None = None) -> dict[str, dict[str, list[str]]]:
    """{role: {client_id: the command line of its workload process}}, each after ``prefix``
    (``ip netns exec NS`` on emulated hosts); ``security_file``: the clients' TLS/SASL settings
    (``ClientSecurity.save``), none for plaintext."""
    return {
        role: {
            s.client_id: [*prefix, *command(s.role, s.family, bootstrap=",".join(bootstrap), topic=topic,
                                            trace_dir=trace_dir, client_id=s.client_id, run_id=run_id, rate=rate,
                                            prefix=s.prefix, group=s.group, python=python,
                                            security_file=security_file)]
            for s in specs if s.role == role
        }
        for role in ROLES
    }


# -------------------------------------------------------------- trace tail
class TraceTail:
    """Reads the trace files incrementally; answers "has every client succeeded since t?"."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir = trace_dir
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, str] = {}
        self.last_ok_ns: dict[str, int] = {}
        self.ok_count: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.acked: set[tuple[str, int]] = set()
        self.acked_partition: dict[tuple[str, int], int | None] = {}
        self.consumed: dict[str, set[tuple[str, int]]] = defaultdict(set)
        self.last_error: dict[str, str] = {}

    def poll(self) -> int:
        n = 0
        for path in sorted(self.trace_dir.glob("*.jsonl")):
            off = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(off)
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self._offsets[path] = off + len(chunk)
            text = self._partial.pop(path, "") + chunk.decode("utf-8", "replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                if line:
                    self._event(json.loads(line))
                    n += 1
        return n

    def _event(self, e: dict[str, Any]) -> None:
        if e.get("source") != "client":
            return
        cid, ev = e["client_id"], e["event"]
        if ev in ("ack", "consume"):
            self.last_ok_ns[cid] = max(self.last_ok_ns.get(cid, 0), e["ts_ns"])
            self.ok_count[cid] += 1
            if ev == "ack":
                self.acked.add((e["key"], e["seq"]))
                self.acked_partition[(e["key"], e["seq"])] = e.get("partition")
            else:
                self.consumed[e["group"] or f"client:{cid}"].add((e["key"], e["seq"]))
        elif ev == "error":
            self.errors[cid] += 1
            self.last_error[cid] = str(e.get("detail"))

    def lagging(self, clients: list[str], since_ns: int) -> list[str]:
        """Clients without a success after ``since_ns``."""
        return [c for c in clients if self.last_ok_ns.get(c, 0) <= since_ns]

    def unread(self, groups: list[str]) -> dict[str, int]:
        """Per group: acked records it has not read yet."""
        return {g: len(self.acked - self.consumed.get(g, set())) for g in groups}

    def unread_detail(self, groups: list[str]) -> dict[str, dict[str, Any]]:
        """Per group still missing records: how many per partition, and the first few keys."""
        out: dict[str, dict[str, Any]] = {}
        for g in groups:
            missing = sorted(self.acked - self.consumed.get(g, set()))
            if missing:
                per_partition: dict[str, int] = defaultdict(int)
                for m in missing:
                    per_partition[str(self.acked_partition.get(m))] += 1
                out[g] = {"missing": len(missing), "partitions": dict(sorted(per_partition.items())),
                          "first": [k for k, _ in missing[:3]]}
        return out


# ----------------------------------------------------------------- workloads
class WorkloadGroup:
    """A set of workload processes with one stop switch (SIGTERM, then SIGKILL after a deadline)."""

    def __init__(self, name: str, cmds: dict[str, list[str]], log_dir: Path, stop_timeout_s: float) -> None:
        self.name = name
        self.cmds = cmds
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.stopping = False
        self.pids: dict[str, int] = {}
        self.exits: dict[str, int | None] = {}

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    for cid, cmd in self.cmds.items():
                        await nursery.start(self._one, cid, cmd)
                    task_status.started()
        finally:
            self.done.set()

    async def _one(self, cid: str, cmd: list[str], task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        log = open(self.log_dir / f"{cid}.log", "ab")
        try:
            proc = await trio.lowlevel.open_process(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.pids[cid] = proc.pid
            task_status.started()
            try:
                await proc.wait()
            finally:
                if proc.returncode is None:
                    with trio.CancelScope(shield=True):
                        await _terminate(proc, self.stop_timeout_s)
                self.exits[cid] = proc.returncode
        finally:
            log.close()
        if not self.stopping:
            raise WorkloadExited(cid, proc.returncode, log_tail(self.log_dir / f"{cid}.log"))

    async def stop(self) -> None:
        self.stopping = True
        self.scope.cancel()
        await self.done.wait()


async def _terminate(proc: trio.Process, timeout_s: float) -> None:
    """SIGTERM, wait ``timeout_s``, then SIGKILL: only this process, by its handle."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    with trio.move_on_after(timeout_s):
        await proc.wait()
        return
    proc.kill()
    await proc.wait()
