"""ApiVersions answered by the node from the broker's last answer (proxy.local_answers), against
the real cluster: one node, one worker, on 127.0.0.83; by default (a connection connects to its
broker at its first other request, ``Pair.lazy``) and with ``limits.share_upstream`` (it borrows
one per request while it only asks)."""

from __future__ import annotations

import socket
import struct

import pytest
from kio.schema.api_versions.v0.request import ApiVersionsRequest as ApiVersionsRequestV0
from kio.schema.api_versions.v0.response import ApiVersionsResponse as ApiVersionsResponseV0
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.api_versions.v3.response import ApiVersionsResponse
from kio.schema.metadata.v12.request import MetadataRequest
from kio.schema.metadata.v12.response import MetadataResponse

from chaos.bench.frames import decode_response, make, request_frame
from tests.node_probes import metric, upstream_connections
from tests.sockets import read_frame
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration]

HOST = "127.0.0.83"
BOOTSTRAP = (HOST, 9092)
ANSWERED = 'kproxy_local_answers_total{node="p1"}'
REUSED = 'kproxy_upstream_reused_total{node="p1"}'
_LEN = struct.Struct(">i")


@pytest.fixture(scope="module", params=["lazy", "shared"])
def answering_node(request, kafka_cluster, tmp_path_factory):
    from chaos.testbed.proxies import NodeProcess, fleet_config

    d = tmp_path_factory.mktemp("answers")
    # Kept a minute: no answer expires during the test, so which requests reach a broker is decided.
    limits = {"share_upstream": request.param == "shared", "api_versions_answer_s": 60}
    cfg = fleet_config(d / "fleet.toml", kafka_cluster.bootstrap, 1, first_ip=83, fleet=False, workers=1,
                       extra={"limits": limits})
    with NodeProcess(cfg, "p1", HOST, 9400, d / "p1.log").running() as node:
        node.mode = request.param
        yield node






def _versions(s: socket.socket, correlation_id: int) -> bytes:
    """Ask ApiVersions v3; the answer's frame, checked to carry ``correlation_id`` and no error."""
    s.sendall(request_frame(make(ApiVersionsRequest, client_software_name="t", client_software_version="1"),
                            correlation_id))
    frame = read_frame(s)
    correlation, body = decode_response(ApiVersionsResponse, frame)
    assert correlation == correlation_id and int(body.error_code) == 0
    return frame


def _broker_port(node) -> int:  # type: ignore[no-untyped-def]
    with socket.create_connection(BOOTSTRAP, timeout=10) as s:
        s.sendall(request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 1))
        _, body = decode_response(MetadataResponse, read_frame(s))
    ports = sorted(int(b.port) for b in body.brokers if b.host == HOST)
    assert ports
    return ports[0]


def test_api_versions_of_new_connections_are_answered_by_the_node_and_the_next_requests_still_reach_the_broker(
        answering_node, kafka_cluster):
    node = answering_node
    port = _broker_port(node)
    first_answered = metric(node, ANSWERED)
    with socket.create_connection((HOST, port), timeout=10) as s:
        learned = _versions(s, 1)  # nothing kept for this listener yet: the broker answers
    assert metric(node, ANSWERED) == first_answered
    wait_for(lambda: metric(node, 'kproxy_connections_active{node="p1"}') == 0, "the node's clients gone", 10)

    reused = metric(node, REUSED)
    upstream = upstream_connections(node, kafka_cluster.bootstrap)
    held = []
    try:
        for k in range(20):
            s = socket.create_connection((HOST, port), timeout=10)
            held.append(s)
            frame = _versions(s, 1000 + k)
            # The broker's answer, byte for byte, but for the correlation id (bytes 4-8 of the frame).
            assert frame[:4] + frame[8:] == learned[:4] + learned[8:]
        assert metric(node, ANSWERED) == first_answered + 20
        assert metric(node, REUSED) == reused  # no broker connection was borrowed for them ...
        assert upstream_connections(node, kafka_cluster.bootstrap) <= upstream  # ... nor made (20 before the change)
        # The connections go on: a Metadata request reaches the broker (lazy: over a broker connection
        # made for it, for good; shared: one borrowed) and gets its own answer.
        s = held[0]
        s.sendall(request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 5000))
        correlation, body = decode_response(MetadataResponse, read_frame(s))
        assert correlation == 5000 and {b.host for b in body.brokers} == {HOST}
        if node.mode == "lazy":
            wait_for(lambda: upstream_connections(node, kafka_cluster.bootstrap) == upstream + 1, "its broker connection", 10)
            _versions(s, 5001)  # over that connection now: the broker answers
            assert metric(node, ANSWERED) == first_answered + 20
        else:
            _versions(s, 5001)  # between exchanges again: the node answers
            assert metric(node, ANSWERED) == first_answered + 21
    finally:
        for s in held:
            s.close()

    # Another version of the request has its own answer: the first goes to the broker.
    answered = metric(node, ANSWERED)
    for k, expected in ((0, answered), (1, answered + 1)):
        with socket.create_connection((HOST, port), timeout=10) as s:
            s.sendall(request_frame(make(ApiVersionsRequestV0), 7000 + k))
            correlation, body = decode_response(ApiVersionsResponseV0, read_frame(s))
            assert correlation == 7000 + k and int(body.error_code) == 0 and len(body.api_keys) > 10
        assert metric(node, ANSWERED) == expected
    wait_for(lambda: metric(node, 'kproxy_connections_active{node="p1"}') == 0, "the node's clients gone", 10)


def test_api_versions_pipelined_with_another_request_go_to_the_broker(answering_node):
    """Only a request alone in what the client sent is answered by the node: two pipelined
    requests go to the broker together, in order."""
    node = answering_node
    port = _broker_port(node)
    with socket.create_connection((HOST, port), timeout=10) as s:
        _versions(s, 1)  # learned, if it was not
    answered = metric(node, ANSWERED)
    with socket.create_connection((HOST, port), timeout=10) as s:
        s.sendall(request_frame(make(ApiVersionsRequest, client_software_name="t", client_software_version="1"), 11)
                  + request_frame(make(MetadataRequest, topics=(), allow_auto_topic_creation=False), 12))
        assert decode_response(ApiVersionsResponse, read_frame(s))[0] == 11
        assert decode_response(MetadataResponse, read_frame(s))[0] == 12
    assert metric(node, ANSWERED) == answered
