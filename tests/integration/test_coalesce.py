"""Identical Metadata requests asked at once share one broker round trip (proxy.single_flight),
against the real cluster: one node, one worker, on 127.0.0.87, with ``limits.coalesce_metadata``
(the default) and without."""

from __future__ import annotations

import socket

import pytest
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse

from chaos.bench.frames import decode_response, make, request_frame
from tests.node_probes import metric
from tests.sockets import read_frame
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.87"
BOOTSTRAP = (HOST, 9092)
COALESCED = 'kproxy_coalesced_requests_total{node="p1"}'
ACTIVE = 'kproxy_connections_active{node="p1"}'
CLIENTS = 60


@pytest.fixture(scope="module", params=["on", "off"])
def coalescing_node(request, kafka_cluster, tmp_path_factory):
    from chaos.testbed.proxies import NodeProcess, fleet_config

    d = tmp_path_factory.mktemp("coalesce")
    cfg = fleet_config(d / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=87, fleet=False, workers=1,
                       extra={"limits": {"coalesce_metadata": request.param == "on",
                                         "accepts_per_source_per_s": 0}})
    with NodeProcess(cfg, "p1", HOST, 9400, d / "p1.log").running() as node:
        node.mode = request.param
        yield node


def _metadata(correlation_id: int) -> bytes:
    return request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), correlation_id)


def _brokers(body: MetadataResponse) -> list[tuple[int, str, int]]:
    return sorted((int(b.node_id), b.host, int(b.port)) for b in body.brokers)


def test_metadata_asked_at_once_on_many_connections_is_answered_on_each_with_its_own_correlation_id(
        coalescing_node, kafka_cluster):
    """CLIENTS bootstrap connections, all accepted first, then each sends the same Metadata request
    (with its own correlation id) in one burst, then an ApiVersions request: each gets the Metadata
    answer with its correlation id and the brokers at the node's address, then the ApiVersions answer,
    in order. With coalescing, some of the burst joined another's flight (the first is in flight for
    a broker connect and a round trip, the burst is sent in well under that) and that is counted;
    without, none is."""
    node = coalescing_node
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:  # what every answer must say
        s.sendall(_metadata(1))
        _, expected = decode_response(MetadataResponse, read_frame(s))
    expected_brokers = _brokers(expected)
    assert len(expected_brokers) == len(kafka_cluster.bootstrap)
    assert {host for _, host, _ in expected_brokers} == {HOST}
    wait_for(lambda: metric(node, ACTIVE) == 0, "the node's clients gone", 10)

    before = metric(node, COALESCED)
    sockets = [socket.create_connection(BOOTSTRAP, timeout=10) for _ in range(CLIENTS)]
    try:
        wait_for(lambda: metric(node, ACTIVE) == CLIENTS, "every connection accepted", 10)
        for k, s in enumerate(sockets):
            s.sendall(_metadata(100 + k))
        for k, s in enumerate(sockets):  # a request sent while the first may still wait for its answer
            s.sendall(request_frame(make(ApiVersionsRequest, client_software_name="t", client_software_version="1"),
                                    500 + k))
        frames = []
        for k, s in enumerate(sockets):
            frame = read_frame(s)
            correlation, body = decode_response(MetadataResponse, frame)
            assert correlation == 100 + k
            assert _brokers(body) == expected_brokers
            assert body.cluster_id == expected.cluster_id
            frames.append(frame)
            correlation, versions = decode_response(ApiVersionsResponse, read_frame(s))
            assert correlation == 500 + k and int(versions.error_code) == 0
    finally:
        for s in sockets:
            s.close()
    coalesced = metric(node, COALESCED) - before
    if node.mode == "on":
        assert 1 <= coalesced <= CLIENTS - 1  # the first of the burst at least led
        # A copy is its leader's answer byte for byte but for the correlation id (bytes 4-8).
        shapes = {f[:4] + f[8:] for f in frames}
        assert len(shapes) <= CLIENTS - coalesced
    else:
        assert coalesced == 0
    wait_for(lambda: metric(node, ACTIVE) == 0, "the node's clients gone", 10)


def test_metadata_with_other_topics_or_pipelined_behind_another_request_is_not_coalesced(coalescing_node):
    """Different requests never share an answer, and a Metadata request that is not all a connection
    has outstanding goes to the broker in order."""
    node = coalescing_node
    before = metric(node, COALESCED)
    with socket.create_connection(BOOTSTRAP, timeout=10) as a, socket.create_connection(BOOTSTRAP, timeout=10) as b:
        a.sendall(_metadata(1))
        b.sendall(request_frame(make(MetadataRequest, topics=None, allow_auto_topic_creation=False), 2))  # all topics
        assert decode_response(MetadataResponse, read_frame(a))[0] == 1
        correlation, body = decode_response(MetadataResponse, read_frame(b))
        assert correlation == 2 and body.topics is not None
        a.sendall(request_frame(make(ApiVersionsRequest, client_software_name="t", client_software_version="1"), 3)
                  + _metadata(4))
        assert decode_response(ApiVersionsResponse, read_frame(a))[0] == 3
        assert decode_response(MetadataResponse, read_frame(a))[0] == 4
    assert metric(node, COALESCED) == before
