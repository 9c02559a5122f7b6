"""Light clients beside a failover drill: how long N clients take to come back after a fault.

``kproxy bench failover --light-clients N`` runs this module as processes of
their own (each its own event loop, descriptor limit and slice of the clients;
:class:`LightClientProcess`) beside the drill's real clients.
Each of the N light clients (asyncio, raw sockets, like chaos.bench.storm_load)
does what a Kafka client does on a lost connection, and nothing else:

1. bootstrap through the fleet: Metadata (no topic) gives the brokers and the
   address advertised for each. The first node asked is one at random, then the
   next one after each failed attempt, as a Kafka client picks the node for a
   Metadata request (Java's ``leastLoadedNode`` starts at a random offset; a
   fixed order would send every client of a dead node's identity to the same
   survivor);
2. connect to the address of its broker identity (client ``i`` takes the
   ``i % M``-th of the M identities, so the clients spread evenly over the
   identities and a node carries the clients of the identities it owns) and
   send ApiVersions: answered = **back**;
3. hold the connection until it is lost (**lost**), then start again at 1,
   with a Java-like reconnect backoff (50 ms doubling to 1 s, jittered).

Events go to a JSON-lines file per process (``{"client", "event":
"lost"|"back"|"fail", "ts_ns"}``, wall clock, the drill traces' clock; a
"fail" also has ``reason``: the step and the error); the process prints
``ready`` once each of its clients is back for the first time and runs until
SIGTERM.
:func:`light_recovered_s` turns the events and the drill's faults into, per
client that lost its connection in a fault's window, the time from the fault
to that client being back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse

from chaos.bench.frames import decode_response, make, request_frame
from chaos.measures import percentile
from chaos.testbed.process import die_with_parent, raise_priority

_LEN = struct.Struct(">i")
CLIENT_ID = "kproxy-light"
# A real client's patience (Java: socket.connection.setup.timeout.ms 10 s, request.timeout.ms 30 s):
# a light client that gives up sooner than real ones throws away the work the fleet did for it
# and asks again, which under a storm makes the storm last longer.
REQUEST_TIMEOUT_S = 10.0
# How often the events file is flushed (the bench reads it while the process runs: wait_settled()).
FLUSH_INTERVAL_S = 0.2
# Generator processes (LightClientProcess): see there.
DEFAULT_PROCESSES = 4
# The generator processes run at this nice value (LightClientProcess), ahead of everything else
# on the machine, where the process may raise its priority (root): see there.
GENERATOR_NICE = -5
# Set in the bench's environment: each generator process also writes its loop's lag (_lag_probe).
LAG_ENV = "KPROXY_LIGHT_LAG"
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0


@attrs.frozen
class LightEvent:
    client: int
    event: str  # "lost", "back", or "fail" (an attempt that failed; ``reason`` says where and how)
    ts_ns: int
    reason: str = ""
    # On "back": milliseconds each step of this attempt took (bootstrap-connect, metadata,
    # connect, api-versions; "wait": from the loss to this attempt's start, the attempts that
    # failed before it and their backoffs included).
    stages: dict[str, float] = attrs.field(factory=dict)


@attrs.frozen
class FaultSpan:
    """One fault: its instant and the end of its window (the victim back, or the next fault)."""

    fault_ts_ns: int
    end_ts_ns: int | None


def light_recovered_s(events: Iterable[LightEvent], faults: Sequence[FaultSpan]) -> tuple[list[float], int]:
    """Per fault, per client whose connection was lost in the fault's window
    [fault, end): seconds from the fault to the client's first "back" after that
    loss. Returns (those times, how many such clients never came back)."""
    by_client: dict[int, list[LightEvent]] = {}
    for e in sorted(events, key=lambda e: e.ts_ns):
        by_client.setdefault(e.client, []).append(e)
    recovered: list[float] = []
    never = 0
    for fault in faults:
        for history in by_client.values():
            lost = next((e for e in history if e.event == "lost" and e.ts_ns >= fault.fault_ts_ns
                         and (fault.end_ts_ns is None or e.ts_ns < fault.end_ts_ns)), None)
            if lost is None:
                continue
            back = next((e for e in history if e.event == "back" and e.ts_ns >= lost.ts_ns), None)
            if back is None:
                never += 1
            else:
                recovered.append((back.ts_ns - fault.fault_ts_ns) / 1e9)
    return recovered, never


def recovery_stages_ms(events: Iterable[LightEvent], faults: Sequence[FaultSpan]) -> dict[str, dict[str, float | None]]:
    """Where the recoveries :func:`light_recovered_s` measures went: per step of the attempt that
    brought a client back (``LightEvent.stages``), p50 / p99 / max in ms over those clients;
    ``noticed``: from the fault to the client reading its connection lost."""
    by_client: dict[int, list[LightEvent]] = {}
    for e in sorted(events, key=lambda e: e.ts_ns):
        by_client.setdefault(e.client, []).append(e)
    steps: dict[str, list[float]] = {}
    for fault in faults:
        for history in by_client.values():
            lost = next((e for e in history if e.event == "lost" and e.ts_ns >= fault.fault_ts_ns
                         and (fault.end_ts_ns is None or e.ts_ns < fault.end_ts_ns)), None)
            back = None if lost is None else next(
                (e for e in history if e.event == "back" and e.ts_ns >= lost.ts_ns), None)
            if lost is None or back is None:
                continue
            steps.setdefault("noticed", []).append((lost.ts_ns - fault.fault_ts_ns) / 1e6)
            for name, ms in back.stages.items():
                steps.setdefault(name, []).append(ms)
    out: dict[str, dict[str, float | None]] = {}
    for name, values in steps.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        out[name] = {"p50": None if p50 is None else round(p50, 1), "p99": None if p99 is None else round(p99, 1),
                     "max": round(max(values), 1)}
    return out


def recovered_stats(recovered: list[float]) -> dict[str, float | None]:
    """p50 / p99 / max in seconds (chaos.measures' percentile definition)."""
    if not recovered:
        return {"p50": None, "p99": None, "max": None}
    p50, p99 = percentile(recovered, 0.5), percentile(recovered, 0.99)
    assert p50 is not None and p99 is not None
    return {"p50": round(p50, 3), "p99": round(p99, 3), "max": round(max(recovered), 3)}


def fault_spans(steps: Sequence[dict[str, Any]]) -> list[FaultSpan]:
    """The drill result's steps (``fault_ts_ns``, ``back_ts_ns``) as fault windows."""
    ordered = sorted((s for s in steps if s.get("fault_ts_ns")), key=lambda s: s["fault_ts_ns"])
    spans = []
    for i, step in enumerate(ordered):
        nxt = ordered[i + 1]["fault_ts_ns"] if i + 1 < len(ordered) else None
        end = step.get("back_ts_ns") or nxt
        spans.append(FaultSpan(step["fault_ts_ns"], end))
    return spans


def read_events(path: Path) -> list[LightEvent]:
    if not path.exists():
        return []
    return [LightEvent(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------- the process


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frame: bytes,
                   body_type: type) -> Any:
    writer.write(frame)
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        (size,) = _LEN.unpack(await reader.readexactly(4))
        _, body = decode_response(body_type, await reader.readexactly(size), framed=False)
    return body


class _Stages:
    """The step an attempt is at, and how long each step took (ms). ``wait``: from the loss to
    this attempt's start (the attempts that failed before it and their backoffs)."""

    __slots__ = ("name", "ms", "_at")

    def __init__(self, since_ns: int) -> None:
        self.name = "wait"
        self.ms: dict[str, float] = {}
        self._at = since_ns

    def begin(self, name: str) -> None:
        now = time.monotonic_ns()
        self.ms[self.name] = round(self.ms.get(self.name, 0.0) + (now - self._at) / 1e6, 1)
        self.name, self._at = name, now


class LightClients:
    """The N clients of one process (see the module doc)."""

    def __init__(self, bootstrap: Sequence[tuple[str, int]], clients: int, sources: Sequence[str],
                 out: IO[str]) -> None:
        self.bootstrap = list(bootstrap)
        self.clients = clients
        self.sources = sources
        self.out = out
        self.metadata = request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 1,
                                      CLIENT_ID)
        self.api_versions = request_frame(make(ApiVersionsRequest, client_software_name=CLIENT_ID,
                                               client_software_version="1"), 2, CLIENT_ID)
        self.first_back = 0
        self.all_back = asyncio.Event()

    def record(self, client: int, event: str, reason: str = "", stages: dict[str, float] | None = None) -> None:
        line: dict[str, Any] = {"client": client, "event": event, "ts_ns": time.time_ns()}
        if reason:
            line["reason"] = reason
        if stages:
            line["stages"] = stages
        self.out.write(json.dumps(line) + "\n")

    async def _open(self, client: int, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            return await asyncio.open_connection(host, port, local_addr=(self.sources[client % len(self.sources)], 0))

    async def _locate(self, client: int, attempt: int, stage: _Stages) -> tuple[str, int]:
        """The address the fleet advertises now for this client's broker identity."""
        host, port = self.bootstrap[attempt % len(self.bootstrap)]
        stage.begin("bootstrap-connect")
        reader, writer = await self._open(client, host, port)
        try:
            stage.begin("metadata")
            body = await _request(reader, writer, self.metadata, MetadataResponse)
        finally:
            writer.transport.abort()
        brokers = sorted((b.node_id, b.host, b.port) for b in body.brokers)
        if not brokers:
            raise ValueError("Metadata without brokers")
        _, bhost, bport = brokers[client % len(brokers)]
        return bhost, int(bport)

    async def client(self, client: int) -> None:
        attempt, backoff = random.randrange(len(self.bootstrap)), BACKOFF_FIRST_S  # the node asked first
        first = True
        lost_ns = time.monotonic_ns()
        while True:
            writer = None
            stage = _Stages(lost_ns)
            try:
                host, port = await self._locate(client, attempt, stage)
                stage.begin("connect")
                reader, writer = await self._open(client, host, port)
                stage.begin("api-versions")
                await _request(reader, writer, self.api_versions, ApiVersionsResponse)
                stage.begin("held")
                self.record(client, "back", stages=stage.ms)
                backoff = BACKOFF_FIRST_S
                if first:
                    first = False
                    self.first_back += 1
                    if self.first_back == self.clients:
                        self.all_back.set()
                await reader.read(1)  # the broker never sends unasked: this returns when the connection is lost
                lost_ns = time.monotonic_ns()
                attempt = random.randrange(len(self.bootstrap))
                self.record(client, "lost")
            except (OSError, EOFError, ValueError, TimeoutError) as exc:
                if stage.name == "held":
                    lost_ns = time.monotonic_ns()
                    attempt = random.randrange(len(self.bootstrap))
                    self.record(client, "lost")
                else:
                    self.record(client, "fail", f"{stage.name}:{type(exc).__name__}")
                attempt += 1
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(2 * backoff, BACKOFF_MAX_S)
            finally:
                if writer is not None:
                    writer.transport.abort()


async def _main(args: argparse.Namespace) -> None:
    from chaos.bench.storm_load import source_addresses

    bootstrap = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in args.bootstrap.split(","))]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    with open(args.out, "a", buffering=1 << 16) as out:
        run = LightClients(bootstrap, args.clients, source_addresses(args.sources), out)
        tasks = [asyncio.ensure_future(run.client(args.first + i)) for i in range(args.clients)]
        tasks.append(asyncio.ensure_future(_flush_often(out)))
        if os.environ.get(LAG_ENV):
            tasks.append(asyncio.ensure_future(_lag_probe(args.out + ".lag")))
        ready = asyncio.ensure_future(run.all_back.wait())
        await asyncio.wait([ready, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            print("ready", flush=True)
            await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _lag_probe(path: str) -> None:
    """Diagnosis (``LAG_ENV``): every 0.25 s, the loop's worst lateness over 10 ms sleeps and the
    process's CPU time so far, to ``<events>.lag``: a generator whose loop runs late while it uses
    little CPU is waiting for the CPU (BENCHMARKS.md, session 32)."""
    with open(path, "a") as f:
        while True:
            worst, end = 0.0, time.monotonic() + 0.25
            while time.monotonic() < end:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                worst = max(worst, time.monotonic() - t - 0.01)
            f.write(json.dumps({"ts_ns": time.time_ns(), "lag_ms": round(worst * 1e3, 1),
                                "cpu_s": round(time.process_time(), 3)}) + "\n")
            f.flush()


async def _flush_often(out: IO[str]) -> None:
    while True:
        await asyncio.sleep(FLUSH_INTERVAL_S)
        out.flush()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True, help="host:port,... of the fleet's bootstrap")
    parser.add_argument("--clients", type=int, required=True, help="how many clients this process runs")
    parser.add_argument("--first", type=int, default=0, help="the id of its first client (ids are contiguous)")
    parser.add_argument("--sources", type=int, default=20, help="loopback source addresses, 127.0.0.100 on")
    parser.add_argument("--out", required=True, help="JSON-lines events file")
    args = parser.parse_args(argv)
    from chaos.bench.storm import raise_nofile
    import uvloop

    raise_nofile(2 * args.clients + 1024)
    uvloop.run(_main(args))


if __name__ == "__main__":
    main(sys.argv[1:])


# ---------------------------------------------------------------------- the bench's side


SETTLE_POLL_S = 0.1


class HeldTracker:
    """Which light clients hold a connection now, from the events file as it grows."""

    def __init__(self, events: Path, clients: int) -> None:
        self.events = events
        self.clients = clients
        self.offset = 0
        self.last: dict[int, str] = {}

    def read_new(self) -> None:
        if not self.events.exists():
            return
        with open(self.events, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += end
        for line in data[:end].splitlines():
            if line.strip():
                e = json.loads(line)
                if e["event"] in ("back", "lost"):
                    self.last[e["client"]] = e["event"]

    def all_held(self) -> bool:
        return len(self.last) == self.clients and all(v == "back" for v in self.last.values())


def split(clients: int, processes: int) -> list[tuple[int, int]]:
    """(first client id, count) of each of ``processes`` generator processes: contiguous, even."""
    processes = max(1, min(processes, clients))
    base, extra = divmod(clients, processes)
    out, first = [], 0
    for k in range(processes):
        count = base + (1 if k < extra else 0)
        out.append((first, count))
        first += count
    return out


def events_file(events: Path, k: int) -> Path:
    """The events file of generator process ``k``."""
    return events.with_name(f"{events.stem}.{k}{events.suffix}")


class LightClientProcess:
    """``python -m chaos.bench.light_clients`` beside a drill, as ``processes`` processes
    (each its own slice of the clients and its own events file): start, wait ready, stop, read.

    Several processes, because one Python process sharing this 2-core machine with the
    brokers, the fleet and the drill's clients is itself the bottleneck of a storm: its one
    thread gets a few tenths of a core, and it then notices the cut connections (and answers
    arriving) seconds late, which the bench would count against the fleet.

    And at ``nice`` (``GENERATOR_NICE``, where allowed; ``nice_applied`` and, for the kernel's
    session autogroups, ``autogroup_nice_applied`` say whether it was): the light clients stand
    for thousands of application hosts with CPUs of their own, but here they share two cores
    with the system under test. The brokers, nodes and drill clients each lead a session, so
    under autogroup each is scheduled as one group, and the four generator processes were one
    more group, shared with the bench: in the session-31 and -32 runs (the nice value alone,
    which only ranks a process within its group) they got 0.11-0.16 of a core through each
    storm, their loops ran up to 1.5 s late while using 0.02-0.16 of a core each, and read the
    first fault's cut connections over 0-3 s after the SIGKILL (BENCHMARKS.md)."""

    def __init__(self, bootstrap: Sequence[str], clients: int, events: Path, *, sources: int = 20,
                 processes: int = DEFAULT_PROCESSES, python: str = sys.executable,
                 nice: int | None = GENERATOR_NICE) -> None:
        self.events = events
        self.nice = nice
        self.nice_applied = False
        self.autogroup_nice_applied = False
        self.cmds = [[python, "-m", "chaos.bench.light_clients", "--bootstrap", ",".join(bootstrap),
                      "--clients", str(count), "--first", str(first), "--sources", str(sources),
                      "--out", str(events_file(events, k))]
                     for k, (first, count) in enumerate(split(clients, processes))]
        self.procs: list[subprocess.Popen[str]] = []
        self._held = [HeldTracker(events_file(events, k), count)
                      for k, (_, count) in enumerate(split(clients, processes))]

    def start(self, timeout_s: float = 120.0) -> None:
        # Each a session of its own: the kernel's autogroup then schedules it apart from the bench
        # (see raise_priority); and it dies with the bench.
        self.procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                       preexec_fn=die_with_parent) for cmd in self.cmds]
        if self.nice is not None:
            applied = [raise_priority(proc.pid, self.nice) for proc in self.procs]
            self.nice_applied = all(nice for nice, _ in applied)
            self.autogroup_nice_applied = all(group for _, group in applied)
        ready: list[str] = []

        def read_ready(proc: subprocess.Popen[str]) -> None:
            assert proc.stdout is not None
            ready.append(proc.stdout.readline())

        readers = [threading.Thread(target=read_ready, args=(p,), daemon=True) for p in self.procs]
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout_s
        for r in readers:
            r.join(max(0.0, deadline - time.monotonic()))
        if len(ready) < len(self.procs) or any(line.strip() != "ready" for line in ready):
            self.stop()
            raise RuntimeError(f"the light clients were not all connected within {timeout_s:.0f} s")

    def wait_settled(self, timeout_s: float = 60.0) -> bool:
        """Until every client holds a connection (its last event is "back"), at most
        ``timeout_s``: the failover bench calls it before each fault, so a fault's
        reconnect storm never overlaps the previous drill's (the victim's restart
        moves identities back and cuts their clients too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for held in self._held:
                held.read_new()
            if all(held.all_held() for held in self._held):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(SETTLE_POLL_S)  # the events files have no readiness to wait on: a bounded poll

    def stop(self, timeout_s: float = 30.0) -> list[LightEvent]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return [e for k in range(len(self.cmds)) for e in read_events(events_file(self.events, k))]
