"""Bootstrap clients share broker connections (proxy.upstream_pool), against the real cluster.

One node, one worker (so that every client meets the same pool), on 127.0.0.81. Each client
waits for the node to have dropped the one before it (``kproxy_connections_active`` 0), so
which broker connection it gets is decided, not raced."""

from __future__ import annotations

import socket
import struct

import pytest
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse

from chaos.bench.frames import decode_response, make, request_frame
from proxy import sasl
from tests.sockets import read_frame
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.81"
BOOTSTRAP = (HOST, 9092)
_LEN = struct.Struct(">i")
REUSED = 'kproxy_upstream_reused_total{node="p1"}'


@pytest.fixture(scope="module")
def pool_node(kafka_cluster, tmp_path_factory):
    from chaos.testbed.proxies import NodeProcess, fleet_config

    d = tmp_path_factory.mktemp("pool")
    cfg = fleet_config(d / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=81, fleet=False, workers=1)
    with NodeProcess(cfg, "p1", HOST, 9400, d / "p1.log").running() as node:
        yield node


def _metric(node, name: str) -> float:  # type: ignore[no-untyped-def]
    lines = [x for x in node.get("/metrics").text.splitlines() if x.startswith(name)]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def _gone(node) -> None:  # type: ignore[no-untyped-def]
    """Wait until the node dropped every client (and so kept or closed its broker connection)."""
    wait_for(lambda: _metric(node, 'kproxy_connections_active{node="p1"}') == 0, "the node's clients gone", 10)


def _metadata_client(node) -> list[tuple[int, str, int]]:  # type: ignore[no-untyped-def]
    """Connect to the bootstrap port, ask ApiVersions and Metadata, close; the brokers named."""
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:
        s.sendall(request_frame(make(ApiVersionsRequest, client_software_name="t", client_software_version="1"), 1))
        _, versions = decode_response(ApiVersionsResponse, read_frame(s))
        assert int(versions.error_code) == 0
        s.sendall(request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 2))
        _, body = decode_response(MetadataResponse, read_frame(s))
    _gone(node)
    return sorted((int(b.node_id), b.host, int(b.port)) for b in body.brokers)


def test_sequential_bootstrap_clients_share_one_broker_connection(pool_node, kafka_cluster):
    _gone(pool_node)
    before = _metric(pool_node, REUSED)
    answers = [_metadata_client(pool_node) for _ in range(6)]
    # Every client got the whole cluster at this node's address, whichever connection carried it.
    assert answers[0] and all(a == answers[0] for a in answers)
    assert {host for _, host, _ in answers[0]} == {HOST}
    assert len(answers[0]) == len(kafka_cluster.bootstrap)
    # The first may have found a kept connection too (an earlier test's); the next five did.
    assert _metric(pool_node, REUSED) - before >= 5


def test_a_connection_that_carried_sasl_or_half_a_request_is_never_kept(pool_node):
    _metadata_client(pool_node)  # leaves one kept connection, the only one (each client waited for the last)
    before = _metric(pool_node, REUSED)
    # A SASL exchange: this broker listener has no SASL and answers with an error, but it is the
    # request that matters: on a SASL listener the broker would have authenticated this client.
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:
        s.sendall(sasl.handshake_request("PLAIN", 7))
        assert read_frame(s)  # answered: the request went through the kept connection
    _gone(pool_node)
    assert _metric(pool_node, REUSED) - before == 1  # it took the kept one ...
    _metadata_client(pool_node)
    assert _metric(pool_node, REUSED) - before == 1  # ... which was not given back: a new connect
    _metadata_client(pool_node)
    assert _metric(pool_node, REUSED) - before == 2  # that one was
    # Half a request, then the client leaves: the broker holds the other half's place.
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:
        frame = request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 3)
        s.sendall(frame[: len(frame) // 2])
        wait_for(lambda: _metric(pool_node, REUSED) - before == 3, "the half-request client took the kept one", 10)
    _gone(pool_node)
    _metadata_client(pool_node)
    assert _metric(pool_node, REUSED) - before == 3  # not given back


def test_a_burst_of_bootstrap_clients_each_gets_its_own_answer(pool_node, kafka_cluster):
    """500 at once, more than the turns toward the brokers (40 connects in flight per broker):
    the ones waiting for a turn may take a connection another one let go (how many depends on
    which comes first, a turn or a connection let go: 345 of 500 in one run alone, 1 in a full
    suite's). Whichever connection carried it, every client gets the answer to its own request
    (its correlation id, the whole cluster at this address)."""
    import asyncio

    import uvloop

    clients = 500
    _gone(pool_node)

    async def one(k: int) -> tuple[int, list[tuple[int, str, int]]]:
        reader, writer = await asyncio.open_connection(*BOOTSTRAP)
        try:
            writer.write(request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 1000 + k))
            async with asyncio.timeout(30):
                (size,) = _LEN.unpack(await reader.readexactly(4))
                correlation, body = decode_response(MetadataResponse, await reader.readexactly(size), framed=False)
        finally:
            writer.close()
        return correlation, sorted((int(b.node_id), b.host, int(b.port)) for b in body.brokers)

    async def burst() -> list[tuple[int, list[tuple[int, str, int]]]]:
        return await asyncio.gather(*(one(k) for k in range(clients)))

    answers = uvloop.run(burst())
    assert [c for c, _ in answers] == [1000 + k for k in range(clients)]
    assert all(brokers == answers[0][1] for _, brokers in answers)
    assert {host for _, host, _ in answers[0][1]} == {HOST} and len(answers[0][1]) == len(kafka_cluster.bootstrap)
    _gone(pool_node)  # and every pair closed: none left waiting
