"""light_recovered_s: from the drill's faults and the light clients' events to recovery times."""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import sys
import time

import pytest
import uvloop
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.metadata.v12.response import MetadataResponse

from chaos.bench.frames import make, metadata_response, response_frame
from chaos.bench.light_clients import (
    GENERATOR_NICE,
    FaultSpan,
    LightClientProcess,
    LightClients,
    LightEvent,
    fault_spans,
    light_recovered_s,
    recovered_stats,
    recovery_stages_ms,
)
from chaos.bench.storm_load import source_addresses
from chaos.testbed.process import AUTOGROUP_SWITCH

pytestmark = pytest.mark.unit

S = 1_000_000_000  # ns per second
_LEN = struct.Struct(">i")


def ev(client: int, event: str, t_s: float) -> LightEvent:
    return LightEvent(client, event, int(t_s * S))


def test_each_cut_client_counts_from_the_fault_to_its_first_answer_after_the_loss():
    events = [
        ev(0, "back", 1.0), ev(1, "back", 1.0), ev(2, "back", 1.0), ev(3, "back", 1.0),
        # fault 1 at t=10 s, the victim back at t=20 s
        ev(0, "lost", 10.01), ev(0, "lost", 10.2), ev(0, "back", 10.4),  # a failed reconnect: still one client
        ev(1, "lost", 10.05), ev(1, "back", 11.5),
        # client 2 was not on the victim: never lost, not counted
        ev(3, "lost", 12.0), ev(3, "back", 13.0),
        # identities moving back after the victim's restart: outside the window
        ev(2, "lost", 20.5), ev(2, "back", 20.7),
        # fault 2 at t=30 s, no end known: client 1 never came back
        ev(1, "lost", 30.02),
        ev(0, "lost", 29.0), ev(0, "back", 29.5),  # before the fault: not this fault's
    ]
    recovered, never = light_recovered_s(events, [FaultSpan(10 * S, 20 * S), FaultSpan(30 * S, None)])
    assert sorted(recovered) == pytest.approx([0.4, 1.5, 3.0])
    assert never == 1


def test_fault_spans_end_at_the_victim_back_or_the_next_fault():
    steps = [{"fault_ts_ns": 30, "back_ts_ns": None}, {"fault_ts_ns": 10, "back_ts_ns": 20},
             {"fault": "kill", "fault_ts_ns": None}]
    assert fault_spans(steps) == [FaultSpan(10, 20), FaultSpan(30, None)]
    assert fault_spans([{"fault_ts_ns": 10, "back_ts_ns": None}, {"fault_ts_ns": 40}]) == [
        FaultSpan(10, 40), FaultSpan(40, None)]


def test_recovered_stats_in_seconds():
    assert recovered_stats([]) == {"p50": None, "p99": None, "max": None}
    values = [0.1 * i for i in range(1, 101)]  # 0.1 ... 10.0
    stats = recovered_stats(values)
    assert stats["p50"] == pytest.approx(5.05)
    assert stats["p99"] == pytest.approx(9.901)
    assert stats["max"] == pytest.approx(10.0)


class FakeFleet:
    """One endpoint that is both bootstrap and broker 1: Metadata names itself (port
    ``advertised``) as broker 1; ApiVersions answered; ``cut()`` closes every open connection."""

    def __init__(self) -> None:
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(4))
                payload = await reader.readexactly(size)
                api_key, _, correlation_id = struct.unpack_from(">hhi", payload)
                if api_key == 3:
                    body = metadata_response(MetadataResponse, [(1, "127.0.0.1", self.port, None)], 0, 0)
                else:
                    body = make(ApiVersionsResponse)
                writer.write(response_frame(body, correlation_id))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    def cut(self) -> None:
        for w in list(self.writers):
            w.transport.abort()


def test_light_clients_come_back_after_their_connections_are_cut():
    fake, clients = FakeFleet(), 20

    async def scenario() -> tuple[list[LightEvent], int]:
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        fake.port = server.sockets[0].getsockname()[1]
        out = io.StringIO()
        run = LightClients([("127.0.0.1", fake.port)], clients, source_addresses(3), out)
        tasks = [asyncio.ensure_future(run.client(i)) for i in range(clients)]
        try:
            await asyncio.wait_for(run.all_back.wait(), 10)
            cut_at = time.time_ns()
            fake.cut()

            def backs_after_cut() -> int:
                events = [LightEvent(**json.loads(x)) for x in out.getvalue().splitlines()]
                return len({e.client for e in events if e.event == "back" and e.ts_ns > cut_at})

            deadline = time.monotonic() + 10
            while backs_after_cut() < clients and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            server.close()
        return [LightEvent(**json.loads(x)) for x in out.getvalue().splitlines()], cut_at

    events, cut_at = uvloop.run(scenario())
    recovered, never = light_recovered_s(events, [FaultSpan(cut_at, None)])
    assert (len(recovered), never) == (clients, 0)
    assert max(recovered) < 5.0


def test_held_tracker_sees_every_client_holding_only_after_each_is_back(tmp_path):
    from chaos.bench.light_clients import HeldTracker

    events = tmp_path / "events.jsonl"
    tracker = HeldTracker(events, clients=2)
    tracker.read_new()
    assert not tracker.all_held()  # no file yet
    lines = [{"client": 0, "event": "back", "ts_ns": 1}, {"client": 1, "event": "back", "ts_ns": 2},
             {"client": 1, "event": "lost", "ts_ns": 3}, {"client": 1, "event": "fail", "ts_ns": 4, "reason": "x"}]
    events.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"client": 1, "ev')  # last line unfinished
    tracker.read_new()
    assert not tracker.all_held()  # client 1 lost its connection
    with open(events, "a") as f:
        f.write('ent": "back", "ts_ns": 5}\n')
    tracker.read_new()
    assert tracker.all_held()


def test_split_gives_every_client_to_exactly_one_process():
    from chaos.bench.light_clients import split

    parts = split(10, 4)
    assert parts == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert split(2, 4) == [(0, 1), (1, 1)]  # never a process without clients


def test_the_generator_processes_run_at_the_nice_value_asked_for(tmp_path):
    """A positive value (lower priority) is allowed to any parent, so the test runs anywhere;
    the bench asks for GENERATOR_NICE (raised priority), which needs root."""
    gen = LightClientProcess(["127.0.0.1:1"], 2, tmp_path / "e.jsonl", processes=2, nice=7)
    gen.cmds = [[sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
                for _ in gen.cmds]  # stand-ins that only say ready and wait (killed below)
    try:
        gen.start(timeout_s=30)
        assert gen.nice_applied
        assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in gen.procs] == [7, 7]
        # each leads a session of its own: under autogroup, its own group, at that nice value too
        assert [os.getsid(p.pid) for p in gen.procs] == [p.pid for p in gen.procs]
        if AUTOGROUP_SWITCH.exists() and AUTOGROUP_SWITCH.read_text().strip() == "1":
            assert gen.autogroup_nice_applied
            for p in gen.procs:
                assert open(f"/proc/{p.pid}/autogroup").read().split()[-1] == "7"
    finally:
        for p in gen.procs:
            p.kill()
            p.wait(10)
    assert GENERATOR_NICE < 0  # ahead of the brokers, which run at 0


def test_recovery_stages_come_from_the_attempt_that_brought_each_cut_client_back():
    def back(client: int, t_s: float, **stages: float) -> LightEvent:
        return LightEvent(client, "back", int(t_s * S), stages={k.replace("_", "-"): v for k, v in stages.items()})

    events = [
        back(0, 1.0, metadata=1.0), back(1, 1.0, metadata=2.0),  # the first connects: before the fault
        ev(0, "lost", 10.1), back(0, 11.0, wait=0.0, metadata=300.0, api_versions=500.0),
        ev(1, "lost", 10.3), ev(1, "fail", 10.4), back(1, 12.0, wait=400.0, metadata=700.0, api_versions=100.0),
        ev(2, "lost", 25.0), back(2, 26.0, metadata=9000.0),  # after the window
    ]
    stages = recovery_stages_ms(events, [FaultSpan(10 * S, 20 * S)])
    assert stages["noticed"]["max"] == pytest.approx(300.0)
    assert stages["metadata"]["max"] == 700.0
    assert stages["metadata"]["p50"] == pytest.approx(500.0)  # chaos.measures.percentile interpolates
    assert stages["wait"]["max"] == 400.0
    assert stages["api-versions"]["max"] == 500.0
    assert set(stages) == {"noticed", "wait", "metadata", "api-versions"}


def test_a_cut_client_asks_the_bootstrap_nodes_from_a_random_one_then_the_next(monkeypatch):
    """As a Kafka client picks the node for a Metadata request: a fixed order would send every
    client of a dead node's identity to one survivor."""
    import random as random_module

    fleet = [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)]
    asked: list[int] = []

    class Stop(Exception):
        pass

    async def scenario() -> None:
        run = LightClients(fleet, 1, source_addresses(1), io.StringIO())

        async def locate(client: int, attempt: int, stage: object) -> tuple[str, int]:
            asked.append(fleet[attempt % len(fleet)][1])
            if len(asked) >= 4:
                raise Stop
            raise ConnectionRefusedError

        async def no_sleep(_: float) -> None:
            return None

        monkeypatch.setattr(run, "_locate", locate)
        monkeypatch.setattr(asyncio, "sleep", no_sleep)
        with pytest.raises(Stop):
            await run.client(0)

    starts = set()
    for seed in range(12):
        random_module.seed(seed)
        asked.clear()
        uvloop.run(scenario())
        assert [(a - asked[0]) % 3 for a in asked] == [0, 1, 2, 0]  # then the next, round
        starts.add(asked[0])
    assert starts == {1, 2, 3}
