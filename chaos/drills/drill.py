"""Drill orchestration: real clients under load, one fault type, N repetitions, a verdict.

Theory of operation
-------------------
Everything runs in one ``trio.run``: every workload process, the fleet
watcher and every fault step live in nurseries, so an exception anywhere
cancels the rest and the processes are always stopped (SIGTERM, then SIGKILL
after ``stop_timeout_s``). Every wait is for a condition, with a deadline.
One ``DrillRun`` holds a run (its identity, files, clients and progress); each
step below is one of its methods. The clients and their processes are in
``chaos.drills.load``.

1. Create a topic for the run; start one consumer (own group) and one
   producer per (family, role) of ``clients`` (``python -m chaos.clients.workload``,
   one OS process each, trace in ``<out>/<run_id>/trace/<client_id>.jsonl``,
   output in ``<out>/<run_id>/logs/``).
2. Warm-up: wait until every client has a success (ack / consume).
3. ``repeat`` times: wait until the fleet is healthy and every client has a
   success since the previous drill, and until the fleet's map has not
   changed for ``settle_s`` (a returned node's identities handed back); wait a
   seeded jitter; ``drill_start``;
   inject the fault (``chaos.drills.faults``: victim, recovery with a deadline,
   fleet reaction, undo, node_back, healthy); ``drill_end``. The fleet
   watcher polls the fleet view every 50 ms inside each drill.
4. Stop the producers (SIGTERM: they flush, so everything acked is written),
   wait until every consumer group has read every acked record (deadline
   ``drain_timeout_s``), stop the consumers.
5. The final read (``chaos.drills.verify``): every partition of the topic from
   its start to its end, through the fleet or, when that fails, directly from
   the brokers; its records go into the trace, and ``lost`` is what the
   producers saw acknowledged and the log does not hold.
6. Validate the trace against the schema and summarize it
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
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from chaos.clients import FAMILIES, ROLES
from chaos.drills import faults as faults_mod
from chaos.drills import summary as drill_summary
from chaos.drills import verify
from chaos.drills.load import ClientSpec, DrillError, TraceTail, WorkloadGroup, client_specs, workload_commands
from chaos.drills.watcher import POLL_PERIOD_S, ReactionWatcher, in_thread
from chaos.testbed.security import ClientSecurity, client_settings
from chaos.trace import TraceWriter, validate_trace

DEFAULT_CLIENTS = tuple((f, r) for f in FAMILIES for r in ("consumer", "producer"))
TAIL_PERIOD_S = 0.1
PROGRESS_PERIOD_S = 0.5
MAX_SETTLE_CHECKS = 20  # DrillRun.wait_settled: map changes waited out before a fault, at most


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
    verify_timeout_s: float = 60.0  # the final read, per path (fleet, then brokers)
    poll_period_s: float = POLL_PERIOD_S
    jitter_s: tuple[float, float] = (0.3, 1.0)
    # The fault lands no sooner than this after the fleet's map last changed (before the jitter),
    # so that it finds no client still backing off from the previous drill's moves: librdkafka
    # doubles a broker's reconnect backoff at each connect (twice for a refused one) until it
    # has gone reconnect.backoff.max.ms (1 s here) past its last scheduled attempt; a kill 0.6-0.8 s
    # after a handback that redirected a consumer's coordinator cost that consumer 0.55-0.7 s
    # where 30-140 ms is the norm (BENCHMARKS.md, session 42). 0: no wait.
    settle_s: float = 1.5
    python: str = sys.executable
    # Called (in a worker thread) once a killed node's identities have moved and every client
    # recovered, before the node is restarted: `kproxy demo` shows the fleet at that moment.
    on_failover: Callable[[dict[str, Any]], None] | None = attrs.field(default=None, eq=False)
    # Called (in a worker thread) once the fleet is steady, before each fault: a load beside the
    # drill (chaos.bench.light_clients) settles there, so two faults' reconnect storms never overlap.
    before_fault: Callable[[], None] | None = attrs.field(default=None, eq=False)


# ------------------------------------------------------------------ target
@attrs.define
class Target:
    """Where the clients connect: a proxy fleet (``fleet``), or Kafka itself (``kafka`` only).
    ``security``: what a client of ``bootstrap`` needs (TLS, SASL), ``broker_security`` what one
    of the brokers needs (the final read's fallback); None for plaintext."""

    bootstrap: list[str]
    fleet: Any | None = None
    kafka: Any | None = None
    client_exec: tuple[str, ...] = ()  # runs a workload on the clients' host (emulated hosts)
    security: ClientSecurity | None = None
    broker_security: ClientSecurity | None = None

    @classmethod
    def of_fleet(cls, fleet: Any) -> "Target":
        return cls(list(fleet.bootstrap), fleet, getattr(fleet, "kafka", None),
                   tuple(getattr(fleet, "client_exec", ())), getattr(fleet, "client_security", None),
                   getattr(fleet, "broker_security", None))

    @classmethod
    def of_kafka(cls, kafka: Any) -> "Target":
        return cls(list(kafka.bootstrap), None, kafka, security=_broker_security(kafka),
                   broker_security=_broker_security(kafka))

    def create_topic(self, name: str, partitions: int, replication: int) -> None:
        if self.kafka is not None:  # as many replicas as there are brokers, at most (a one-broker test bed)
            self.kafka.create_topic(name, partitions, max(1, min(replication, len(self.kafka.specs))))
            return
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": ",".join(self.bootstrap), "log_level": 3,
                             **client_settings(self.security, "confluent")})
        replication = max(1, min(replication, len(admin.list_topics(timeout=30).brokers)))
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


def _broker_security(kafka: Any | None) -> ClientSecurity | None:
    security = getattr(kafka, "security", None)
    return None if security is None else security.client


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
    return await DrillRun.create(config, target, progress, seed).run()


@attrs.frozen
class ClientProgress:
    ok: int
    errors: int


@attrs.frozen
class DrillProgress:
    """One moment of a run, as the progress callback sees it (a copy: the run goes on)."""

    phase: str
    run_id: str
    seed: int
    fault: str
    repeat: int
    drill: int  # the current drill, from 1; 0 before the first
    steps: tuple[dict[str, Any], ...]
    errors: tuple[str, ...]
    tracebacks: tuple[str, ...]
    elapsed_s: float
    clients: dict[str, ClientProgress]
    acked: int
    passed: bool | None = None  # known once the run is done

    def to_json(self) -> dict[str, Any]:
        """The callback's dict; ``passed`` appears only once it is known."""
        out: dict[str, Any] = {
            "phase": self.phase, "run_id": self.run_id, "seed": self.seed, "fault": self.fault,
            "repeat": self.repeat, "drill": self.drill, "steps": [dict(s) for s in self.steps],
            "errors": list(self.errors), "tracebacks": list(self.tracebacks), "elapsed_s": self.elapsed_s,
            "clients": {cid: {"ok": c.ok, "errors": c.errors} for cid, c in self.clients.items()},
            "acked": self.acked,
        }
        if self.passed is not None:
            out["passed"] = self.passed
        return out


@attrs.define(eq=False)
class DrillRun:
    """One drill run, owned by the trio task that runs it: its identity, files, clients and progress.

    ``run`` is the whole sequence (see the module docstring); each step is a method. Errors of a
    step are recorded in ``errors`` (tracebacks to ``errors.log``), never raised out of ``run``.
    """

    config: DrillConfig
    target: Target
    progress: Progress
    seed: int
    rng: random.Random
    run_id: str
    run_dir: Path
    topic: str
    specs: list[ClientSpec]
    fleet_trace: TraceWriter
    tail: TraceTail
    clock: Callable[[], float] = time.monotonic
    started_at: float = attrs.field(init=False)
    groups: dict[str, WorkloadGroup] = attrs.Factory(dict)
    phase: str = "starting"
    drill: int = 0
    steps: list[dict[str, Any]] = attrs.Factory(list)
    errors: list[str] = attrs.Factory(list)
    tracebacks: list[str] = attrs.Factory(list)  # of failed steps, written to errors.log at the end
    passed: bool | None = None
    final_read: dict[str, Any] | None = None  # FinalRead.summary() once the topic was read to its end
    map_epoch: int | None = None  # the fleet's map as the drill last saw it (its epoch) ...
    map_seen: float = -math.inf  # ... and when the drill first saw that epoch (clock)

    def __attrs_post_init__(self) -> None:
        self.started_at = self.clock()

    @classmethod
    def create(cls, config: DrillConfig, target: Target, progress: Progress, seed: int,
               clock: Callable[[], float] = time.monotonic) -> "DrillRun":
        """A new run: its identity from the fault, the seed and the wall clock; its directories made."""
        run_id = f"{config.fault}-{seed}-{time.time_ns() // 1_000_000 % 10**9}"
        run_dir = Path(config.out_dir) / run_id
        (run_dir / "trace").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        run = cls(config=config, target=target, progress=progress, seed=seed, rng=random.Random(seed),
                  run_id=run_id, run_dir=run_dir, topic=f"drill-{run_id}",
                  specs=client_specs(config.clients, run_id),
                  fleet_trace=TraceWriter(run_dir / "trace", "fleet", run_id), tail=TraceTail(run_dir / "trace"),
                  clock=clock)
        run.write_manifest()
        return run

    @property
    def trace_dir(self) -> Path:
        return self.run_dir / "trace"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def client_ids(self) -> list[str]:
        return [s.client_id for s in self.specs]

    @property
    def consumer_groups(self) -> list[str]:
        return [s.group for s in self.specs if s.group is not None]

    # ------------------------------------------------------------ progress
    def snapshot(self) -> DrillProgress:
        return DrillProgress(
            phase=self.phase, run_id=self.run_id, seed=self.seed, fault=self.config.fault,
            repeat=self.config.repeat, drill=self.drill, steps=tuple(dict(s) for s in self.steps),
            errors=tuple(self.errors), tracebacks=tuple(self.tracebacks), elapsed_s=self.clock() - self.started_at,
            clients={cid: ClientProgress(self.tail.ok_count.get(cid, 0), self.tail.errors.get(cid, 0))
                     for cid in self.client_ids},
            acked=len(self.tail.acked), passed=self.passed)

    def report(self, phase: str | None = None) -> None:
        if phase is not None:
            self.phase = phase
        self.progress(self.snapshot().to_json())

    # --------------------------------------------------------------- files
    def manifest(self, pids: dict[str, int] | None = None) -> dict[str, Any]:
        """What ``drill.json`` records about the run (the PIDs once the clients run)."""
        config = self.config
        out: dict[str, Any] = {
            "run_id": self.run_id, "fault": config.fault, "repeat": config.repeat, "seed": self.seed,
            "topic": self.topic, "bootstrap": self.target.bootstrap, "rate": config.rate,
            "with_fleet": self.target.fleet is not None, "clients": [attrs.asdict(s) for s in self.specs],
            "client_exec": list(self.target.client_exec),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in attrs.asdict(config).items()
                       if not callable(v)},
        }
        if pids is not None:
            out["pids"] = pids
        return out

    def write_manifest(self, pids: dict[str, int] | None = None) -> None:
        (self.run_dir / "drill.json").write_text(json.dumps(self.manifest(pids), indent=2) + "\n")

    def _append_errors_log(self, text: str) -> None:
        with open(self.run_dir / "errors.log", "a") as fh:
            fh.write(text)

    # --------------------------------------------------------------- steps
    async def run(self) -> dict[str, Any]:
        """Workloads, warm-up, the drills, the orderly stop, the summary; return the result."""
        try:
            async with trio.open_nursery() as root:
                if threading.current_thread() is threading.main_thread():
                    await root.start(_stop_on_signal)
                await self.start_workloads(root)
                await self.drive()
                root.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001 - reported in the result and the exit code, never swallowed
            self.errors.append(describe_error(exc))
            self._append_errors_log("".join(traceback.format_exception(exc)) + "\n")
        finally:
            self.fleet_trace.close()
        if self.tracebacks:
            self._append_errors_log("\n".join(self.tracebacks))
        return await self.summarize()

    async def start_workloads(self, nursery: trio.Nursery) -> None:
        """Create the topic, start the consumers, then the producers; record their PIDs."""
        config = self.config
        self.report("creating topic")
        await in_thread(self.target.create_topic, self.topic, config.partitions, config.replication, timeout_s=120)
        security_file = None
        if self.target.security is not None:  # the password stays off the command lines (0600 file)
            security_file = self.target.security.save(self.run_dir / "client-security.json")
        cmds = workload_commands(self.specs, bootstrap=self.target.bootstrap, topic=self.topic,
                                 trace_dir=self.trace_dir, run_id=self.run_id, rate=config.rate, python=config.python,
                                 prefix=self.target.client_exec, security_file=security_file)
        for role in ("consumer", "producer"):
            if cmds[role]:
                self.groups[role] = WorkloadGroup(role, cmds[role], self.log_dir, config.stop_timeout_s)
                await nursery.start(self.groups[role].run)
        self.write_manifest({cid: pid for g in self.groups.values() for cid, pid in g.pids.items()})

    async def drive(self) -> None:
        """Warm-up and the drills; then the orderly stop, also after a failed step."""
        try:
            await self.warm_up()
            await self.drill_loop()
        except Exception as exc:  # noqa: BLE001 - a failed step: record it, still stop in order
            self.errors.append(describe_error(exc))
            self.tracebacks.append("".join(traceback.format_exception(exc)))
        await self.stop_in_order()
        if "producer" in self.groups:
            await self.verify()

    async def warm_up(self) -> None:
        self.report("warm-up")
        clients, timeout_s = self.client_ids, self.config.warmup_timeout_s
        if not await self.wait_until(lambda: not self.tail.lagging(clients, 0), timeout_s):
            raise DrillError(f"warm-up: no success within {timeout_s:.0f} s from "
                             f"{self.tail.lagging(clients, 0)} (see logs/)")

    async def drill_loop(self) -> None:
        """``repeat`` times: steady load, seeded jitter, the fault."""
        since_ns = time.time_ns()
        for i in range(self.config.repeat):
            self.drill = i + 1
            await self.wait_steady(since_ns)
            await trio.sleep(self.rng.uniform(*self.config.jitter_s))  # seeded jitter: the fault instant varies
            await self.inject()
            since_ns = time.time_ns()

    async def wait_steady(self, since_ns: int) -> None:
        """The fleet healthy and balanced, and every client with a success since then (at the
        earliest since ``since_ns``, the previous drill). Balanced: a returned node gets its
        identities back ``rebalance_delay_s`` after it is up, and that move must not land inside
        the next fault's recovery (it did, 0.16 s before a freeze, and the freeze was charged
        with both). On emulated hosts steady also means every floating address back on its own
        node (``LocalFleet.wait_steady``)."""
        config, clients = self.config, self.client_ids
        self.report(f"drill {self.drill}/{config.repeat}: steady")
        if self.target.fleet is not None:
            view = await in_thread(self.target.fleet.wait_steady, config.restore_timeout_s,
                                   timeout_s=config.restore_timeout_s + 10)
            self.saw_map(view.epoch)
            since_ns = max(since_ns, time.time_ns())
        if not await self.wait_until(lambda: not self.tail.lagging(clients, since_ns), config.recovery_timeout_s):
            raise DrillError(f"drill {self.drill}: clients {self.tail.lagging(clients, since_ns)} had no success "
                             f"within {config.recovery_timeout_s:.0f} s before the fault")
        if config.before_fault is not None:
            await in_thread(config.before_fault, timeout_s=config.recovery_timeout_s + 10)
        await self.wait_settled()

    def saw_map(self, epoch: int | None) -> None:
        """The fleet's map has ``epoch``: if that is new, it changed by now (at the latest)."""
        if epoch != self.map_epoch:
            self.map_epoch, self.map_seen = epoch, self.clock()

    async def wait_settled(self) -> None:
        """Until the fleet's map has not changed for ``settle_s`` (DrillConfig), as far as the
        drill saw: the epoch when it first saw the current one, checked again at the end."""
        fleet, settle_s = self.target.fleet, self.config.settle_s
        if fleet is None or settle_s <= 0:
            return
        for _ in range(MAX_SETTLE_CHECKS):  # each check returns, or waits out a change it saw
            remaining = self.map_seen + settle_s - self.clock()
            if remaining > 0:
                await trio.sleep(remaining)
                continue
            view = await in_thread(fleet.fleet_view, timeout_s=10)
            if view.epoch == self.map_epoch:
                return
            self.saw_map(view.epoch)
        self.report(f"drill {self.drill}/{self.config.repeat}: the fleet's map kept changing; fault anyway")

    async def inject(self) -> None:
        """One fault between ``drill_start`` and ``drill_end``, the fleet watcher polling meanwhile."""
        config, fleet, trace = self.config, self.target.fleet, self.fleet_trace
        async with trio.open_nursery() as nursery:
            watcher = None
            if fleet is not None:
                watcher = ReactionWatcher(fleet, trace, period_s=config.poll_period_s)
                await nursery.start(watcher.run)
            ctx = faults_mod.FaultContext(
                fault=config.fault, trace=trace, rng=self.rng, wait_recovered=self.wait_recovered,
                fleet=fleet, kafka=self.target.kafka, watcher=watcher, hold_s=config.hold_s,
                react_timeout_s=config.react_timeout_s, restore_timeout_s=config.restore_timeout_s,
                stop_timeout_s=config.stop_timeout_s, on_failover=config.on_failover)
            self.report(f"drill {self.drill}/{config.repeat}: fault")
            # The fleet as the drill found it, for post-mortems (not read by the summaries).
            before = None if watcher is None else json.dumps(
                {"epoch": watcher.epoch, "assignment": watcher.assignment, "up": watcher.up}, sort_keys=True)
            trace.fleet("drill_start", fault=config.fault, detail=before)
            try:
                await faults_mod.INJECT[config.fault](ctx)
            finally:
                trace.fleet("drill_end", fault=config.fault)
                if watcher is not None and watcher.epoch is not None:
                    self.saw_map(watcher.epoch)  # the fault's own moves
                for step in ctx.steps:
                    step["drill"] = self.drill
                    if watcher is not None:
                        step["watcher_polls"] = watcher.polls
                        step["watcher_failures"] = watcher.failures
                self.steps.extend(ctx.steps)
                self.errors.extend(ctx.errors)
                nursery.cancel_scope.cancel()

    async def stop_in_order(self) -> None:
        """Producers first (they flush), then wait until every group read every acked record, then
        the consumers: so that "lost" counts records that are really lost."""
        self.report("stopping producers")
        if "producer" in self.groups:
            await self.groups["producer"].stop()
        groups, timeout_s = self.consumer_groups, self.config.drain_timeout_s
        self.report("draining consumers")
        if not await self.wait_until(lambda: not any(self.tail.unread(groups).values()), timeout_s):
            lagging = self.tail.unread_detail(groups)
            last_errors = {c: self.tail.last_error[c]
                           for c in (s.client_id for s in self.specs if s.group is not None)
                           if c in self.tail.last_error}
            fleet = await self.fleet_snapshot("drain-timeout-status.json")
            self.errors.append(f"drain: consumers still missing acked records after "
                               f"{timeout_s:.0f} s: {self.tail.unread(groups)}; missing: {lagging}; "
                               f"consumers' last errors: {last_errors}; fleet: {fleet}")
        self.report("stopping consumers")
        if "consumer" in self.groups:
            await self.groups["consumer"].stop()

    async def fleet_snapshot(self, name: str) -> dict[str, Any] | None:
        """Every node's /status into ``run_dir/name`` (a post-mortem of a stuck drill); returns
        what says most in an error line: per node its map, role, quorum and stand-ins."""
        fleet = self.target.fleet
        if fleet is None:
            return None
        try:
            statuses = await in_thread(fleet.statuses, timeout_s=30)
        except Exception as exc:  # a post-mortem must not hide the error it explains
            return {"error": f"{type(exc).__name__}: {exc}"}
        raw = {node: None if st is None else st.to_json() for node, st in statuses.items()}
        (self.run_dir / name).write_text(json.dumps(raw, indent=1, default=str))
        keys = ("epoch", "committed_epoch", "assignment", "role", "has_quorum", "degraded", "draining",
                "standing_in", "floating", "connections")
        return {node: None if st is None else {k: st.get(k) for k in keys} for node, st in raw.items()}

    async def verify(self) -> None:
        """The final read of the topic into the trace; a read that fails is an error of the run."""
        self.report("final read")
        target = self.target
        fleet_bootstrap = list(target.bootstrap) if target.fleet is not None else None
        if target.kafka is not None:
            broker_bootstrap: list[str] | None = list(target.kafka.bootstrap)
        else:
            broker_bootstrap = None if target.fleet is not None else list(target.bootstrap)
        timeout_s = self.config.verify_timeout_s
        try:
            final = await in_thread(lambda: verify.read_final(
                self.topic, fleet_bootstrap, broker_bootstrap, timeout_s,
                fleet_security=target.security, broker_security=target.broker_security), timeout_s=2 * timeout_s + 30)
        except Exception as exc:  # noqa: BLE001 - the run fails with the reason; lost falls back to the groups
            self.errors.append(describe_error(exc))
            return
        with TraceWriter(self.trace_dir, "verifier", self.run_id) as writer:
            verify.write_final_read(writer, final)
        self.final_read = final.summary()

    async def summarize(self) -> dict[str, Any]:
        """Validate and summarize the trace; write ``summary.json``; return the result."""
        self.report("summarizing")
        trace_errors = await trio.to_thread.run_sync(validate_trace, self.trace_dir)
        summary = await trio.to_thread.run_sync(
            lambda: drill_summary.summarize(self.trace_dir, fault=self.config.fault, repeat=self.config.repeat))
        result = self.result(summary, trace_errors)
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        self.passed = result["passed"]
        self.report("done")
        return result

    def result(self, summary: dict[str, Any], trace_errors: list[Any]) -> dict[str, Any]:
        """The summary plus the run's fields; passed when healthy, without errors, the trace valid."""
        workload_exits = {cid: rc for g in self.groups.values() for cid, rc in g.exits.items()}
        unclean = {cid: rc for cid, rc in workload_exits.items() if rc != 0}
        result = dict(summary)
        result.update({
            "run_id": self.run_id, "seed": self.seed, "skipped": False, "out_dir": str(self.run_dir),
            "trace_dir": str(self.trace_dir), "topic": self.topic, "with_fleet": self.target.fleet is not None,
            "clients_spec": self.client_ids, "steps": self.steps, "workload_exits": workload_exits,
            "trace_errors": trace_errors, "final_read": self.final_read,
            "errors": self.errors + ([f"workloads exited uncleanly: {unclean}"] if unclean else []),
            "duration_s": round(self.clock() - self.started_at, 3),
        })
        result["passed"] = bool(result["healthy"] and not result["errors"] and not trace_errors)
        return result

    # ---------------------------------------------------------------- waits
    async def wait_recovered(self, since_ns: int) -> bool:
        """Every client had a success after ``since_ns`` (faults call this); a miss is an error."""
        clients, timeout_s = self.client_ids, self.config.recovery_timeout_s
        ok = await self.wait_until(lambda: not self.tail.lagging(clients, since_ns), timeout_s)
        if not ok:
            self.errors.append(f"not recovered within {timeout_s:.0f} s of "
                               f"{since_ns}: {self.tail.lagging(clients, since_ns)}")
        return ok

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Poll the trace every ``TAIL_PERIOD_S`` until ``condition()`` or ``timeout_s``; report meanwhile."""
        next_report = 0.0
        with trio.move_on_after(timeout_s):
            for _ in range(int(timeout_s / TAIL_PERIOD_S) + 2):
                await trio.to_thread.run_sync(self.tail.poll)
                if condition():
                    return True
                if time.monotonic() >= next_report:
                    self.report()
                    next_report = time.monotonic() + PROGRESS_PERIOD_S
                await trio.sleep(TAIL_PERIOD_S)
        await trio.to_thread.run_sync(self.tail.poll)
        return condition()


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


def default_out_dir() -> Path:
    return Path(os.environ.get("KPROXY_DRILL_OUT", "drills"))
