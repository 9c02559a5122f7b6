"""Clients share broker connections (proxy.upstream_pool, proxy.connection.Pair.shared), against
the real cluster.

One node, one worker (so that every client meets the same pool), on 127.0.0.81. Each client
waits for the node to have dropped the one before it (``kproxy_connections_active`` 0), or for
its own answer, so which broker connection it gets is decided, not raced. Every ApiVersions goes
to a broker here (``limits.api_versions_answer_s`` 0: the node answers none itself; that is
tests/integration/test_local_answers.py's)."""

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
from tests.node_probes import metric, upstream_connections
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
    cfg = fleet_config(d / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=81, fleet=False, workers=1,
                       extra={"limits": {"share_upstream": True, "api_versions_answer_s": 0}})
    with NodeProcess(cfg, "p1", HOST, 9400, d / "p1.log").running() as node:
        yield node




def _gone(node) -> None:  # type: ignore[no-untyped-def]
    """Wait until the node dropped every client (and so kept or closed its broker connection)."""
    wait_for(lambda: metric(node, 'kproxy_connections_active{node="p1"}') == 0, "the node's clients gone", 10)


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
    before = metric(pool_node, REUSED)
    answers = [_metadata_client(pool_node) for _ in range(6)]
    # Every client got the whole cluster at this node's address, whichever connection carried it.
    assert answers[0] and all(a == answers[0] for a in answers)
    assert {host for _, host, _ in answers[0]} == {HOST}
    assert len(answers[0]) == len(kafka_cluster.bootstrap)
    # The first may have found a kept connection too (an earlier test's); the next five did.
    assert metric(pool_node, REUSED) - before >= 5


def test_a_connection_that_carried_sasl_or_half_a_request_is_never_kept(pool_node):
    _metadata_client(pool_node)  # leaves one kept connection, the only one (each client waited for the last)
    before = metric(pool_node, REUSED)
    # A SASL exchange: this broker listener has no SASL and answers with an error, but it is the
    # request that matters: on a SASL listener the broker would have authenticated this client.
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:
        s.sendall(sasl.handshake_request("PLAIN", 7))
        assert read_frame(s)  # answered: the request went through the kept connection
    _gone(pool_node)
    assert metric(pool_node, REUSED) - before == 1  # it took the kept one ...
    # ... which was not given back: the next client's ApiVersions connects, its Metadata takes the
    # connection the ApiVersions exchange gave back (a client that only asks borrows per request).
    _metadata_client(pool_node)
    assert metric(pool_node, REUSED) - before == 2
    _metadata_client(pool_node)
    assert metric(pool_node, REUSED) - before == 4  # the kept one twice
    # Half a request, then the client leaves: the broker holds the other half's place.
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:
        frame = request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 3)
        s.sendall(frame[: len(frame) // 2])
        wait_for(lambda: metric(pool_node, REUSED) - before == 5, "the half-request client took the kept one", 10)
    _gone(pool_node)
    _metadata_client(pool_node)
    assert metric(pool_node, REUSED) - before == 6  # not given back: a connect, then the Metadata's reuse




def _ask(s: socket.socket, body, correlation_id: int, response_type: type):  # type: ignore[no-untyped-def]
    s.sendall(request_frame(body, correlation_id))
    correlation, answer = decode_response(response_type, read_frame(s))
    assert correlation == correlation_id
    return answer


def test_clients_that_only_ask_hold_no_broker_connection_and_the_first_other_request_binds(pool_node, kafka_cluster):
    """40 clients on a broker identity's port, each asking ApiVersions and Metadata and then held
    open: between their requests they hold no broker connection (one per client before), so the
    node's broker connections grow by no more than the pool keeps per broker. A ListGroups binds
    its client: its later requests go over its own broker connection, taking none from the pool."""
    from kio.schema.list_groups.v4.request import ListGroupsRequest
    from kio.schema.list_groups.v4.response import ListGroupsResponse

    brokers = _metadata_client(pool_node)
    node_id, host, port = brokers[0]
    assert host == HOST
    before = upstream_connections(pool_node, kafka_cluster.bootstrap)
    held: list[socket.socket] = []
    try:
        for k in range(40):
            s = socket.create_connection((HOST, port), timeout=10)
            held.append(s)
            versions = _ask(s, make(ApiVersionsRequest, client_software_name="t", client_software_version="1"),
                            10 * k + 1, ApiVersionsResponse)
            assert int(versions.error_code) == 0
            metadata = _ask(s, make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 10 * k + 2,
                            MetadataResponse)
            assert {(int(b.node_id), b.host, int(b.port)) for b in metadata.brokers} == set(brokers)
        assert len(held) == 40 and metric(pool_node, 'kproxy_connections_active{node="p1"}') >= 40
        grown = upstream_connections(pool_node, kafka_cluster.bootstrap) - before
        assert grown <= 8, f"{grown} more broker connections for 40 clients that only asked"  # limits.bootstrap_pool

        shared, bound = held[0], held[1]
        metadata = make(MetadataRequest, topics=(), allow_auto_topic_creation=False)
        reused = metric(pool_node, REUSED)
        _ask(shared, metadata, 1001, MetadataResponse)
        assert metric(pool_node, REUSED) == reused + 1  # borrowed a kept connection, gave it back
        groups = _ask(bound, make(ListGroupsRequest, states_filter=(), types_filter=()), 1002, ListGroupsResponse)
        assert int(groups.error_code) == 0
        assert metric(pool_node, REUSED) == reused + 2  # took a kept one, for good now
        for c in range(3):
            _ask(bound, metadata, 1003 + c, MetadataResponse)
        assert metric(pool_node, REUSED) == reused + 2  # over its own connection
    finally:
        for s in held:
            s.close()
    _gone(pool_node)


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

