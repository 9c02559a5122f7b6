"""chaos.bench.storm_load against a fake Kafka endpoint in the same loop: served, failed and why."""

from __future__ import annotations

import asyncio
import struct

import pytest
import uvloop
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.errors import ErrorCode
from kio.schema.metadata.v12.response import MetadataResponse, MetadataResponseTopic
from kio.schema.produce.v9.response import PartitionProduceResponse, ProduceResponse, TopicProduceResponse

from chaos.bench.frames import make, response_frame
from chaos.bench.storm_load import light_requests, source_addresses, storm

pytestmark = [pytest.mark.unit]

_LEN = struct.Struct(">i")


def _answer(api_key: int, correlation_id: int, produce_error: ErrorCode) -> bytes:
    if api_key == 18:
        return response_frame(make(ApiVersionsResponse), correlation_id)
    if api_key == 3:
        topic = make(MetadataResponseTopic, name="t", topic_id=None)
        return response_frame(make(MetadataResponse, topics=(topic,)), correlation_id)
    partition = make(PartitionProduceResponse, index=0, error_code=produce_error)
    topic = make(TopicProduceResponse, name="t", partition_responses=(partition,))
    return response_frame(make(ProduceResponse, responses=(topic,)), correlation_id)


class FakeKafka:
    """Answers every request; connection number k (1-based) is closed unanswered when
    ``k % close_every == 0``; Produce answers carry ``produce_error``."""

    def __init__(self, close_every: int = 0, produce_error: ErrorCode = ErrorCode.none) -> None:
        self.close_every = close_every
        self.produce_error = produce_error
        self.connections = 0
        self.open_now = 0
        self.open_peak = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open_now += 1
        self.open_peak = max(self.open_peak, self.open_now)
        try:
            if self.close_every and self.connections % self.close_every == 0:
                return
            while True:
                (size,) = _LEN.unpack(await reader.readexactly(4))
                payload = await reader.readexactly(size)
                api_key, _, correlation_id = struct.unpack_from(">hhi", payload)
                writer.write(_answer(api_key, correlation_id, self.produce_error))
        except asyncio.IncompleteReadError:
            pass
        finally:
            self.open_now -= 1
            writer.close()


def _run(fake: FakeKafka, clients: int):  # type: ignore[no-untyped-def]
    async def scenario():  # type: ignore[no-untyped-def]
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        held = []

        async def hold() -> None:
            held.append(fake.open_now)

        try:
            return await storm("127.0.0.1", port, clients, light_requests("t"), sources=source_addresses(3),
                               deadline_s=10, hold=hold), held
        finally:
            server.close()

    return uvloop.run(scenario())


def test_every_client_served_and_held_open_until_all_are() -> None:
    fake = FakeKafka()
    result, held = _run(fake, 60)
    assert (result.clients, result.served, result.failed, result.errors) == (60, 60, 0, {})
    assert held == [60]  # every served client still connected while hold ran
    assert result.all_served_s is not None and result.p50_s is not None and result.p99_s is not None
    assert result.p50_s <= result.p99_s <= result.all_served_s
    assert result.connect_p99_s is not None and result.connect_p99_s <= result.p99_s


def test_unanswered_and_error_answers_count_as_failed_by_kind() -> None:
    result, _ = _run(FakeKafka(close_every=4), 40)
    assert (result.served, result.failed, result.errors) == (30, 10, {"closed by peer": 10})
    result, _ = _run(FakeKafka(produce_error=ErrorCode.not_leader_or_follower), 5)
    assert (result.served, result.failed) == (0, 5)
    assert result.errors == {"Produce not_leader_or_follower": 5}
    assert result.all_served_s is None and result.p50_s is None


def test_light_requests_are_three_frames_without_produce_only_two() -> None:
    assert len(light_requests("t").frames) == 3
    assert len(light_requests("t", produce=False).frames) == 2
    assert len(light_requests(None).frames) == 2
    with pytest.raises(ValueError):
        source_addresses(0)


def test_the_storm_target_is_the_largest_size_within_twice_direct_and_none_failed() -> None:
    from chaos.bench.storm import _targets

    rows = [{"clients": 1000, "proxy_all_served_s": 9.0, "direct_all_served_s": 1.0, "proxy_failed": 3},
            {"clients": 10_000, "proxy_all_served_s": 7.9, "direct_all_served_s": 4.0, "proxy_failed": 0}]
    assert _targets(rows) == {"10000_all_served_within_2x_direct": True, "10000_none_failed": True}
    rows[1].update(proxy_all_served_s=8.1, proxy_failed=1)
    assert _targets(rows) == {"10000_all_served_within_2x_direct": False, "10000_none_failed": False}
    rows[1].update(proxy_all_served_s=None)  # nobody served
    assert _targets(rows)["10000_all_served_within_2x_direct"] is False


def test_raise_nofile_raises_both_limits_or_falls_back_to_the_hard_one(monkeypatch) -> None:
    from chaos.bench import storm as storm_bench

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(storm_bench.resource, "getrlimit", lambda which: limits["now"])

    def setrlimit(which, value) -> None:  # type: ignore[no-untyped-def]
        if value[1] > 4096 and not limits.get("root"):
            raise ValueError("not permitted")
        limits["now"] = value

    monkeypatch.setattr(storm_bench.resource, "setrlimit", setrlimit)
    assert storm_bench.raise_nofile(512) == (1024, 4096)  # enough already: untouched
    assert storm_bench.raise_nofile(65536) == (4096, 4096)  # not root: the hard limit is the most
    limits.update(now=(1024, 4096), root=True)
    assert storm_bench.raise_nofile(65536) == (65536, 65536)


@pytest.mark.parametrize("sizes", ["abc", "", "0", "1000,200000"])
def test_bench_storm_rejects_bad_sizes_naming_the_option(sizes: str) -> None:
    from click.testing import CliRunner

    from cli.main import cli

    result = CliRunner().invoke(cli, ["bench", "storm", "--clients", sizes])
    assert result.exit_code == 2 and "--clients" in result.output


def test_a_node_of_w_workers_holds_w_times_what_one_descriptor_limit_allows() -> None:
    from chaos.bench.storm import node_max_clients
    from proxy.listeners import RESERVED_DESCRIPTORS

    # The container's 20,000: one process held 9,872 clients (two descriptors each).
    assert node_max_clients(20_000, 1) == 9872 == (20_000 - RESERVED_DESCRIPTORS) // 2
    assert node_max_clients(20_000, 2) == 19_744
    assert node_max_clients(RESERVED_DESCRIPTORS, 2) == 2  # at least one client per worker
    assert node_max_clients(20_000, 2, max_connections=10_000) == 10_000  # the node's cap, half each


def test_the_refusals_a_node_counted_are_read_by_reason_over_its_workers() -> None:
    from chaos.bench.storm import parse_refused

    text = "\n".join([
        "# HELP kproxy_connections_refused_total Client connections refused at accept",
        "# TYPE kproxy_connections_refused_total counter",
        'kproxy_connections_refused_total{node="p1",reason="max_connections"} 128.0',
        'kproxy_connections_refused_total{node="p1",reason="accepts_per_source_per_s"} 0.0',
        'kproxy_connections_refused_created{node="p1",reason="max_connections"} 1.7e9',
        "# TYPE kproxy_connections_active gauge",
        'kproxy_connections_active{node="p1"} 3.0',
        ""])
    assert parse_refused(text) == {"max_connections": 128.0, "accepts_per_source_per_s": 0.0}
    assert parse_refused("") == {}
    untyped = 'kproxy_connections_refused_total{node="p1",reason="max_connections"} 5\n'
    assert parse_refused(untyped) == {"max_connections": 5.0}


def test_bench_storm_takes_the_node_s_worker_count(monkeypatch) -> None:
    from click.testing import CliRunner

    from chaos.bench import storm as storm_bench
    from cli.main import cli

    asked = {}

    def run(sizes, **kwargs):  # type: ignore[no-untyped-def]
        asked.update(kwargs, sizes=sizes)
        return {"storm": [], "targets": {}}

    monkeypatch.setattr(storm_bench, "run", run)
    result = CliRunner().invoke(cli, ["bench", "storm", "--clients", "10", "--workers", "3", "--idle-window", "0"])
    assert result.exit_code == 0, result.output
    assert asked["workers"] == 3 and asked["sizes"] == (10,)
    result = CliRunner().invoke(cli, ["bench", "storm", "--clients", "10", "--idle-window", "0"])
    assert asked["workers"] is None  # the bench's default: the node's own (default_workers)
    assert storm_bench.default_workers() >= 1
