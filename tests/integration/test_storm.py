"""Connection storms against a real node (issue 12): every client served; the admission limits
refuse the excess and leave the clients a node already has alone.

Loopback only, bounded: 2,000 light clients, each with a 30 s deadline."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import subprocess
import time

import pytest
import uvloop

from chaos.bench.frames import decode_response
from chaos.bench.storm import leader_address
from chaos.bench.storm_load import light_requests, source_addresses, storm
from proxy.config import DEFAULT_LISTEN_BACKLOG
from proxy.listeners import somaxconn

pytestmark = [pytest.mark.integration]

STORM_CLIENTS = 2000
LIMITED_HOST = "127.0.0.28"  # the node with tight admission limits
LIMITED_MAX_CONNECTIONS = 30
LIMITED_ACCEPTS_PER_SOURCE_PER_S = 5
_LEN = struct.Struct(">i")


def _metric(node, prefix: str) -> float:  # type: ignore[no-untyped-def]
    lines = [x for x in node.get("/metrics").text.splitlines() if x.startswith(prefix)]
    assert len(lines) == 1, (prefix, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def _wait_for(condition, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_storm_of_clients_is_served_every_one(proxy, kafka_cluster, topic_name):
    kafka_cluster.create_topic(topic_name, partitions=1)
    leader, host, port = leader_address("127.0.0.21", 9092, topic_name)
    assert (host, port) == ("127.0.0.21", 9100 + leader)  # the node's own address for the leader
    if shutil.which("ss"):  # the accept queue the node asked for: Send-Q of a listening socket
        listening = subprocess.run(["ss", "-ltnH", "src", f"{host}:{port}"], capture_output=True, text=True,
                                   check=True).stdout.split()
        assert int(listening[2]) == min(DEFAULT_LISTEN_BACKLOG, somaxconn() or DEFAULT_LISTEN_BACKLOG), listening
    accepted_before = sum(float(x.rsplit(" ", 1)[1]) for x in proxy.get("/metrics").text.splitlines()
                          if x.startswith("kproxy_connections_total{"))
    held: list[float] = []

    async def hold() -> None:
        held.append(_metric(proxy, "kproxy_connections_active{"))

    result = uvloop.run(storm(host, port, STORM_CLIENTS, light_requests(topic_name), sources=source_addresses(),
                              deadline_s=30, hold=hold))
    assert (result.served, result.failed, result.errors) == (STORM_CLIENTS, 0, {})
    assert held and held[0] >= STORM_CLIENTS  # the node held every client at once
    accepted = sum(float(x.rsplit(" ", 1)[1]) for x in proxy.get("/metrics").text.splitlines()
                   if x.startswith("kproxy_connections_total{"))
    assert accepted - accepted_before >= STORM_CLIENTS
    assert _metric(proxy, 'kproxy_connections_refused_total{node="p1",reason="max_connections"}') == 0
    assert _metric(proxy, 'kproxy_connections_refused_total{node="p1",reason="accepts_per_source_per_s"}') == 0
    _wait_for(lambda: _metric(proxy, "kproxy_connections_active{") < STORM_CLIENTS / 10, "the storm's clients gone")


@pytest.fixture(scope="module")
def limited_node(kafka_cluster, tmp_path_factory):
    """A node with tight admission limits in front of the session cluster."""
    from chaos.testbed.proxies import NodeProcess, fleet_config

    d = tmp_path_factory.mktemp("limited")
    cfg = fleet_config(d / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=28, fleet=False,
                       extra={"limits": {"max_connections": LIMITED_MAX_CONNECTIONS,
                                         "accepts_per_source_per_s": LIMITED_ACCEPTS_PER_SOURCE_PER_S}})
    with NodeProcess(cfg, "p1", LIMITED_HOST, 9400, d / "p1.log").running() as node:
        yield node


async def _connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(LIMITED_HOST, 9092, local_addr=(source, 0))


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, which: int) -> bool:
    """Request ``which`` of the light client's (0: ApiVersions, 1: Metadata): answered?"""
    requests = light_requests(None)
    writer.write(requests.frames[which])
    try:
        async with asyncio.timeout(10):
            (size,) = _LEN.unpack(await reader.readexactly(4))
            correlation_id, _ = decode_response(requests.response_types[which], await reader.readexactly(size),
                                                framed=False)
    except (OSError, asyncio.IncompleteReadError):
        return False
    return correlation_id == which + 1


async def _connect_and_ask(source: str) -> tuple[bool, asyncio.StreamWriter | None]:
    """A new connection from ``source`` and its ApiVersions: answered? (and the writer to close)"""
    try:
        reader, writer = await _connect(source)
    except OSError:  # refused so fast that the connect saw it
        return False, None
    return await _ask(reader, writer, 0), writer


def _refusal_lines(node, source: str) -> list[dict]:  # type: ignore[no-untyped-def]
    lines = [json.loads(x) for x in node.log_path.read_text().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("msg") == "refusing new client connections" and x.get("source") == source]


def test_the_per_source_rate_refuses_the_excess_and_the_admitted_keep_working(limited_node):
    source = "127.0.0.130"

    async def scenario() -> tuple[list[bool], list[bool], list[bool]]:
        first = [await _connect(source) for _ in range(LIMITED_ACCEPTS_PER_SOURCE_PER_S)]
        answered_first = [await _ask(r, w, 0) for r, w in first]
        burst = await asyncio.gather(*(_connect_and_ask(source) for _ in range(20)))
        answered_again = [await _ask(r, w, 1) for r, w in first]  # the admitted ones, after the refusals
        for _, w in first:
            w.close()
        for _, w in burst:
            if w is not None:
                w.close()
        return answered_first, [answered for answered, _ in burst], answered_again

    answered_first, answered_burst, answered_again = uvloop.run(scenario())
    assert answered_first == [True] * LIMITED_ACCEPTS_PER_SOURCE_PER_S
    refused = answered_burst.count(False)
    assert refused >= 15, answered_burst  # a bucket of 5, refilled at 5/s over well under a second
    assert answered_again == [True] * LIMITED_ACCEPTS_PER_SOURCE_PER_S
    reason = 'kproxy_connections_refused_total{node="p1",reason="accepts_per_source_per_s"}'
    assert _metric(limited_node, reason) == refused
    _wait_for(lambda: len(_refusal_lines(limited_node, source)) >= 1, "the refusal logged")
    [line] = _refusal_lines(limited_node, source)  # one line for the whole burst
    assert line["limit_name"] == "limits.accepts_per_source_per_s" and line["limit"] == LIMITED_ACCEPTS_PER_SOURCE_PER_S


def test_the_node_cap_refuses_new_clients_and_the_connected_keep_working(limited_node):
    _wait_for(lambda: _metric(limited_node, "kproxy_connections_active{") == 0, "no client connected")
    holders = source_addresses(LIMITED_MAX_CONNECTIONS, first=140)  # one connection per source: no rate limit
    newcomers = source_addresses(10, first=140 + LIMITED_MAX_CONNECTIONS)
    refused_before = _metric(limited_node, 'kproxy_connections_refused_total{node="p1",reason="max_connections"}')

    async def scenario() -> tuple[list[bool], list[bool], list[bool]]:
        held = [await _connect(s) for s in holders]
        answered_held = [await _ask(r, w, 0) for r, w in held]
        new = [await _connect_and_ask(s) for s in newcomers]
        answered_new = [answered for answered, _ in new]
        answered_again = [await _ask(r, w, 1) for r, w in held]
        for _, w in held:
            w.close()
        for _, w in new:
            if w is not None:
                w.close()
        return answered_held, answered_new, answered_again

    answered_held, answered_new, answered_again = uvloop.run(scenario())
    assert answered_held == [True] * LIMITED_MAX_CONNECTIONS
    assert answered_new == [False] * len(newcomers)
    assert answered_again == [True] * LIMITED_MAX_CONNECTIONS
    refused = _metric(limited_node, 'kproxy_connections_refused_total{node="p1",reason="max_connections"}')
    assert refused - refused_before == len(newcomers)
    assert all(len(_refusal_lines(limited_node, s)) == 1 for s in newcomers)
