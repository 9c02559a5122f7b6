"""Drill orchestration: real clients under load, one fault type, N repetitions, a verdict.

Theory of operation
-------------------
Everything runs in one ``trio.run``: every workload process, the fleet
watcher and every fault step live in nurseries, so an exception anywhere
cancels the rest and the processes are always stopped (SIGTERM, then SIGKILL
after ``stop_timeout_s``). Every wait is for a condition, with a deadline.

1. Create a topic for the run; start one consumer (own group) and one
   producer per (family, role) of ``clients`` (``python -m chaos.clients.workload``,
   one OS process each, trace in ``<out>/<run_id>/trace/<client_id>.jsonl``,
   output in ``<out>/<run_id>/logs/``).
2. Warm-up: wait until every client has a success (ack / consume).
3. ``repeat`` times: wait until the fleet is healthy and every client has a
   success since the previous drill; wait a seeded jitter; ``drill_start``;
   inject the fault (``chaos.drills.faults``: victim, recovery with a deadline,
   fleet reaction, undo, node_back, healthy); ``drill_end``. The fleet
   watcher polls the fleet view every 50 ms inside each drill.
4. Stop the producers (SIGTERM: they flush, so everything acked is written),
   wait until every consumer group has read every acked record (deadline
   ``drain_timeout_s``), stop the consumers.
5. Validate the trace against the schema and summarize it
   (``chaos.measures``); write ``summary.json`` and ``drill.json`` next to it.

One seed (``seed``; random and reported when not given) seeds a
``random.Random`` that makes every random choice: victims, jitter, the
rolling-restart order. The run's identity and the fleet's own behaviour are
not seeded, so a seed reproduces the choices, not the timings.

A fault that cannot run here (``FaultUnavailable``: no fleet, no nft or
CAP_NET_ADMIN for ``partition``) returns ``{"skipped": true, "reason": ...}``
before anything starts.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from chaos.drills import faults as faults_mod
from chaos.drills import summary as drill_summary
from chaos.drills.watcher import POLL_PERIOD_S, ReactionWatcher, in_thread
from chaos.trace import TraceWriter, validate_trace
from chaos.clients import FAMILIES, ROLES
from chaos.clients.workload import command

DEFAULT_CLIENTS = tuple((f, r) for f in FAMILIES for r in ("consumer", "producer"))
TAIL_PERIOD_S = 0.1
PROGRESS_PERIOD_S = 0.5


class DrillError(RuntimeError):
    """The drill could not run as planned (message says which step)."""


class WorkloadExited(DrillError):
    def __init__(self, client_id: str, returncode: int | None) -> None:
        super().__init__(f"workload {client_id} exited unexpectedly with code {returncode}")
        self.client_id = client_id
        self.returncode = returncode


# ------------------------------------------------------------------ config
def parse_clients(text: str) -> tuple[tuple[str, str], ...]:
    """``"aiokafka,java:producer"`` -> ((aiokafka, consumer), (aiokafka, producer), (java, producer))."""
    out: list[tuple[str, str]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        family, _, role = item.partition(":")
        if family not in FAMILIES:
            raise ValueError(f"unknown client family {family!r} (one of {', '.join(FAMILIES)})")
        if role and role not in ROLES:
            raise ValueError(f"unknown role {role!r} in {item!r} (one of {', '.join(ROLES)})")
        for r in ([role] if role else ["consumer", "producer"]):
            if (family, r) not in out:
                out.append((family, r))
    if not out:
        raise ValueError("no clients given")
    if not any(r == "producer" for _, r in out):
        raise ValueError("a drill needs at least one producer")
    return tuple(out)


@attrs.frozen
class DrillConfig:
    fault: str
    out_dir: Path
    repeat: int = 1
    clients: tuple[tuple[str, str], ...] = DEFAULT_CLIENTS
    rate: float = 100.0  # records/s per producer
    seed: int | None = None
    partitions: int = 6
    replication: int = 3
    warmup_timeout_s: float = 120.0  # JVM start-up on a busy 2-core machine
    recovery_timeout_s: float = 60.0
    react_timeout_s: float = 15.0
    hold_s: float = 2.0  # freeze / partition: the least time the fault lasts
    restore_timeout_s: float = 90.0
    drain_timeout_s: float = 60.0
    stop_timeout_s: float = 45.0
    poll_period_s: float = POLL_PERIOD_S
    jitter_s: tuple[float, float] = (0.3, 1.0)
    python: str = sys.executable
    # Called (in a worker thread) once a killed node's identities have moved and every client
    # recovered, before the node is restarted: `kproxy demo` shows the fleet at that moment.
    on_failover: Callable[[dict[str, Any]], None] | None = attrs.field(default=None, eq=False)


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


# ------------------------------------------------------------------ target
@attrs.define
class Target:
    """Where the clients connect: a proxy fleet (``fleet``), or Kafka itself (``kafka`` only)."""

    bootstrap: list[str]
    fleet: Any | None = None
    kafka: Any | None = None

    @classmethod
    def of_fleet(cls, fleet: Any) -> "Target":
        return cls(list(fleet.bootstrap), fleet, getattr(fleet, "kafka", None))

    @classmethod
    def of_kafka(cls, kafka: Any) -> "Target":
        return cls(list(kafka.bootstrap), None, kafka)

    def create_topic(self, name: str, partitions: int, replication: int) -> None:
        if self.kafka is not None:
            self.kafka.create_topic(name, partitions, replication)
            return
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": ",".join(self.bootstrap), "log_level": 3})
        fut = admin.create_topics([NewTopic(name, partitions, replication,
                                            config={"min.insync.replicas": str(min(2, replication))})],
                                  operation_timeout=30)[name]
        fut.result(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            md = admin.list_topics(topic=name, timeout=5).topics.get(name)
            if md is not None and md.error is None and len(md.partitions) == partitions and all(
                    p.leader >= 0 for p in md.partitions.values()):
                return
            time.sleep(0.2)
        raise DrillError(f"topic {name} has no leader for every partition after 30 s")


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
        self.consumed: dict[str, set[tuple[str, int]]] = defaultdict(set)

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
            else:
                self.consumed[e["group"] or f"client:{cid}"].add((e["key"], e["seq"]))
        elif ev == "error":
            self.errors[cid] += 1

    def lagging(self, clients: list[str], since_ns: int) -> list[str]:
        """Clients without a success after ``since_ns``."""
        return [c for c in clients if self.last_ok_ns.get(c, 0) <= since_ns]

    def unread(self, groups: list[str]) -> dict[str, int]:
        """Per group: acked records it has not read yet."""
        return {g: len(self.acked - self.consumed.get(g, set())) for g in groups}


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
            raise WorkloadExited(cid, proc.returncode)

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


# --------------------------------------------------------------------- drill
Progress = Callable[[dict[str, Any]], None]


def _no_progress(status: dict[str, Any]) -> None:
    pass


def new_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def run_drill(config: DrillConfig, target: Target, progress: Progress | None = None) -> dict[str, Any]:
    """Run one drill (blocking); return its result (the summary plus drill fields)."""
    return trio.run(run_drill_async, config, target, progress or _no_progress)


async def run_drill_async(config: DrillConfig, target: Target, progress: Progress) -> dict[str, Any]:
    seed = config.seed if config.seed is not None else new_seed()
    if config.repeat < 1:
        raise ValueError("repeat must be at least 1")
    try:
        faults_mod.check(config.fault, fleet=target.fleet, kafka=target.kafka)
    except faults_mod.FaultUnavailable as exc:
        return {"fault": config.fault, "repeat": config.repeat, "seed": seed, "skipped": True, "reason": str(exc),
                "passed": None}
    rng = random.Random(seed)
    run_id = f"{config.fault}-{seed}-{time.time_ns() // 1_000_000 % 10**9}"
    run_dir = Path(config.out_dir) / run_id
    trace_dir, log_dir = run_dir / "trace", run_dir / "logs"
    trace_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    topic = f"drill-{run_id}"
    specs = client_specs(config.clients, run_id)
    manifest = _manifest(config, target, run_id, seed, topic, specs)
    (run_dir / "drill.json").write_text(json.dumps(manifest, indent=2) + "\n")
    state: dict[str, Any] = {"phase": "starting", "run_id": run_id, "seed": seed, "fault": config.fault,
                             "repeat": config.repeat, "drill": 0, "steps": [], "errors": [], "tracebacks": []}
    fleet_trace = TraceWriter(trace_dir, "fleet", run_id)
    tail = TraceTail(trace_dir)
    groups: dict[str, WorkloadGroup] = {}
    t0 = time.monotonic()

    def report(phase: str | None = None, **extra: Any) -> None:
        if phase is not None:
            state["phase"] = phase
        state.update(extra)
        state["elapsed_s"] = time.monotonic() - t0
        state["clients"] = {s.client_id: {"ok": tail.ok_count.get(s.client_id, 0),
                                          "errors": tail.errors.get(s.client_id, 0)} for s in specs}
        state["acked"] = len(tail.acked)
        progress(dict(state))

    try:
        async with trio.open_nursery() as root:
            if threading.current_thread() is threading.main_thread():
                await root.start(_stop_on_signal)
            report("creating topic")
            await in_thread(target.create_topic, topic, config.partitions, config.replication,
                                       timeout_s=120)
            cmds = _workload_commands(config, target, specs, topic, trace_dir, run_id)
            for role in ("consumer", "producer"):
                if cmds[role]:
                    groups[role] = WorkloadGroup(role, cmds[role], log_dir, config.stop_timeout_s)
                    await root.start(groups[role].run)
            manifest["pids"] = {cid: pid for g in groups.values() for cid, pid in g.pids.items()}
            (run_dir / "drill.json").write_text(json.dumps(manifest, indent=2) + "\n")
            await _drill_body(config, target, specs, rng, fleet_trace, tail, groups, state, report)
            root.cancel_scope.cancel()
    except Exception as exc:  # noqa: BLE001 - reported in the result and the exit code, never swallowed
        state["errors"].append(describe_error(exc))
        with open(run_dir / "errors.log", "a") as fh:
            fh.write("".join(traceback.format_exception(exc)) + "\n")
    finally:
        fleet_trace.close()
    if state["tracebacks"]:
        with open(run_dir / "errors.log", "a") as fh:
            fh.write("\n".join(state["tracebacks"]))
    report("summarizing")
    invalid = await trio.to_thread.run_sync(validate_trace, trace_dir)
    result = await trio.to_thread.run_sync(
        lambda: drill_summary.summarize(trace_dir, fault=config.fault, repeat=config.repeat))
    workload_exits = {cid: rc for g in groups.values() for cid, rc in g.exits.items()}
    unclean = {cid: rc for cid, rc in workload_exits.items() if rc != 0}
    result.update({
        "run_id": run_id, "seed": seed, "skipped": False, "out_dir": str(run_dir), "trace_dir": str(trace_dir),
        "topic": topic, "with_fleet": target.fleet is not None, "clients_spec": [s.client_id for s in specs],
        "steps": state["steps"], "workload_exits": workload_exits, "trace_errors": invalid,
        "errors": state["errors"] + ([f"workloads exited uncleanly: {unclean}"] if unclean else []),
        "duration_s": round(time.monotonic() - t0, 3),
    })
    result["passed"] = bool(result["healthy"] and not result["errors"] and not invalid)
    (run_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    report("done", passed=result["passed"])
    return result


def _manifest(config: DrillConfig, target: Target, run_id: str, seed: int, topic: str,
              specs: list[ClientSpec]) -> dict[str, Any]:
    """What ``drill.json`` records about the run (the PIDs are added once the clients run)."""
    return {
        "run_id": run_id, "fault": config.fault, "repeat": config.repeat, "seed": seed, "topic": topic,
        "bootstrap": target.bootstrap, "rate": config.rate, "with_fleet": target.fleet is not None,
        "clients": [attrs.asdict(s) for s in specs],
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in attrs.asdict(config).items()
                   if not callable(v)},
    }


def _workload_commands(config: DrillConfig, target: Target, specs: list[ClientSpec], topic: str, trace_dir: Path,
                       run_id: str) -> dict[str, dict[str, list[str]]]:
    """{role: {client_id: the command line of its workload process}}."""
    bootstrap = ",".join(target.bootstrap)
    return {
        role: {
            s.client_id: command(s.role, s.family, bootstrap=bootstrap, topic=topic, trace_dir=trace_dir,
                                 client_id=s.client_id, run_id=run_id, rate=config.rate, prefix=s.prefix,
                                 group=s.group, python=config.python)
            for s in specs if s.role == role
        }
        for role in ROLES
    }


def describe_error(exc: BaseException, limit: int = 1500) -> str:
    """One line per leaf exception (exception groups flattened): ``Type: message (file:line)``,
    each message cut to ``limit`` characters from its start."""
    leaves: list[BaseException] = []
    stack = [exc]
    for _ in range(1000):  # bounded walk over nested groups
        if not stack:
            break
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(reversed(e.exceptions))
        else:
            leaves.append(e)
    lines = []
    for e in leaves:
        tb = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
        where = f" ({Path(tb[0].filename).name}:{tb[0].lineno} in {tb[0].name})" if tb else ""
        message = str(e)
        if len(message) > limit:
            message = message[:limit] + f" ... ({len(message) - limit} more characters)"
        lines.append(f"{type(e).__name__}: {message}{where}")
    return "\n".join(lines)


async def _stop_on_signal(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """SIGTERM/SIGHUP end the drill like an error: nurseries unwind, so every process is stopped,
    a frozen node continued and a partition healed before the process exits."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        task_status.started()
        async for sig in signals:
            raise DrillError(f"drill stopped by signal {signal.Signals(sig).name}")


async def _wait_condition(tail: TraceTail, condition: Callable[[], bool], timeout_s: float,
                          report: Callable[..., None]) -> bool:
    """Poll the trace every ``TAIL_PERIOD_S`` until ``condition()`` or ``timeout_s``."""
    next_report = 0.0
    with trio.move_on_after(timeout_s):
        for _ in range(int(timeout_s / TAIL_PERIOD_S) + 2):
            await trio.to_thread.run_sync(tail.poll)
            if condition():
                return True
            if time.monotonic() >= next_report:
                report()
                next_report = time.monotonic() + PROGRESS_PERIOD_S
            await trio.sleep(TAIL_PERIOD_S)
    await trio.to_thread.run_sync(tail.poll)
    return condition()


async def _drill_body(config: DrillConfig, target: Target, specs: list[ClientSpec], rng: random.Random,
                      fleet_trace: TraceWriter, tail: TraceTail, groups: dict[str, WorkloadGroup],
                      state: dict[str, Any], report: Callable[..., None]) -> None:
    clients = [s.client_id for s in specs]

    async def wait_recovered(since_ns: int) -> bool:
        ok = await _wait_condition(tail, lambda: not tail.lagging(clients, since_ns), config.recovery_timeout_s,
                                   report)
        if not ok:
            state["errors"].append(f"not recovered within {config.recovery_timeout_s:.0f} s of "
                                   f"{since_ns}: {tail.lagging(clients, since_ns)}")
        return ok

    try:
        report("warm-up")
        if not await _wait_condition(tail, lambda: not tail.lagging(clients, 0), config.warmup_timeout_s, report):
            raise DrillError(f"warm-up: no success within {config.warmup_timeout_s:.0f} s from "
                             f"{tail.lagging(clients, 0)} (see logs/)")
        await _drills(config, target, clients, rng, fleet_trace, tail, state, report, wait_recovered)
    except Exception as exc:  # noqa: BLE001 - a failed step: record it, still stop in order
        state["errors"].append(describe_error(exc))
        state["tracebacks"].append("".join(traceback.format_exception(exc)))
    # Orderly stop, also after a failed step, so that "lost" counts records that are really lost.
    report("stopping producers")
    if "producer" in groups:
        await groups["producer"].stop()
    consumer_groups = [s.group for s in specs if s.group is not None]
    report("draining consumers")
    drained = await _wait_condition(tail, lambda: not any(tail.unread(consumer_groups).values()),
                                    config.drain_timeout_s, report)
    if not drained:
        state["errors"].append(f"drain: consumers still missing acked records after "
                               f"{config.drain_timeout_s:.0f} s: {tail.unread(consumer_groups)}")
    report("stopping consumers")
    if "consumer" in groups:
        await groups["consumer"].stop()


async def _drills(config: DrillConfig, target: Target, clients: list[str], rng: random.Random,
                  fleet_trace: TraceWriter, tail: TraceTail, state: dict[str, Any], report: Callable[..., None],
                  wait_recovered: Callable[[int], Any]) -> None:
    """``repeat`` times: steady load, seeded jitter, drill_start, the fault, drill_end."""
    since_ns = time.time_ns()
    for i in range(config.repeat):
        report(f"drill {i + 1}/{config.repeat}: steady", drill=i + 1)
        if target.fleet is not None:
            await in_thread(target.fleet.wait_healthy, config.restore_timeout_s,
                                       timeout_s=config.restore_timeout_s + 10)
        if not await _wait_condition(tail, lambda: not tail.lagging(clients, since_ns), config.recovery_timeout_s,
                                     report):
            raise DrillError(f"drill {i + 1}: clients {tail.lagging(clients, since_ns)} had no success "
                             f"within {config.recovery_timeout_s:.0f} s before the fault")
        await trio.sleep(rng.uniform(*config.jitter_s))  # seeded jitter: the fault instant varies
        async with trio.open_nursery() as nursery:
            watcher = None
            if target.fleet is not None:
                watcher = ReactionWatcher(target.fleet, fleet_trace, period_s=config.poll_period_s)
                await nursery.start(watcher.run)
            ctx = faults_mod.FaultContext(
                fault=config.fault, trace=fleet_trace, rng=rng, wait_recovered=wait_recovered,
                fleet=target.fleet, kafka=target.kafka, watcher=watcher, hold_s=config.hold_s,
                react_timeout_s=config.react_timeout_s, restore_timeout_s=config.restore_timeout_s,
                stop_timeout_s=config.stop_timeout_s, on_failover=config.on_failover)
            report(f"drill {i + 1}/{config.repeat}: fault")
            # The fleet as the drill found it, for post-mortems (not read by the summaries).
            before = None if watcher is None else json.dumps(
                {"epoch": watcher.epoch, "assignment": watcher.assignment, "up": watcher.up}, sort_keys=True)
            fleet_trace.fleet("drill_start", fault=config.fault, detail=before)
            try:
                await faults_mod.INJECT[config.fault](ctx)
            finally:
                fleet_trace.fleet("drill_end", fault=config.fault)
                for step in ctx.steps:
                    step["drill"] = i + 1
                    if watcher is not None:
                        step["watcher_polls"] = watcher.polls
                        step["watcher_failures"] = watcher.failures
                state["steps"].extend(ctx.steps)
                state["errors"].extend(ctx.errors)
                nursery.cancel_scope.cancel()
        since_ns = time.time_ns()


def default_out_dir() -> Path:
    return Path(os.environ.get("KPROXY_DRILL_OUT", "drills"))
