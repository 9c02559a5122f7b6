"""Address rewriting, per API and per version, and the ApiVersions clamp.

Shape of every test (kroxylicious' fixture style): build a response with
kio's types and encoder, run the rewriter, decode the result with kio and
compare it to an expected response built by hand -- the same response with
only host/port changed.
"""

from __future__ import annotations

import dataclasses
import struct
import typing

import pytest

from kio.index import load_response_schema
from kio.schema.errors import ErrorCode
from kio.schema.index import api_key_map
from kio.schema.index import schema_name_map
from kio.static.primitive import Records

from chaos.bench import frames as fx
from proxy import rewrite
from proxy._wire import encode_uvarint
from proxy.codec import known_versions
from proxy.errors import AddressConflict
from proxy.errors import EmptyBrokerList
from proxy.errors import MalformedFrame
from proxy.errors import ProtocolError
from proxy.errors import UnknownBroker
from proxy.rewrite import BrokerAddress
from proxy.rewrite import ResponseRewriter
from proxy.rewrite import address_versions

pytestmark = pytest.mark.unit

I32 = struct.Struct(">i")

# The real cluster and what the proxy advertises for it (chosen by hand).
REAL = {
    1: ("kafka-1.internal", 9092, "rack-a"),
    2: ("kafka-2.internal", 9093, None),
    3: ("kafka-3.internal", 9094, "rack-b"),
}
ADVERTISED = {1: ("127.0.0.11", 19001), 2: ("127.0.0.11", 19002), 3: ("127.0.0.12", 19003)}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[BrokerAddress, ...], bool]] = []

    def __call__(self, api_key: int, brokers: tuple[BrokerAddress, ...], complete: bool) -> None:
        self.calls.append((api_key, brokers, complete))


def rewriter(**kwargs: typing.Any) -> tuple[ResponseRewriter, Recorder]:
    seen = Recorder()
    return ResponseRewriter(ADVERTISED.get, on_brokers=seen, **kwargs), seen


def roundtrip(rw: ResponseRewriter, body: typing.Any, correlation_id: int = 77) -> typing.Any:
    """Encode with kio, rewrite, decode with kio; check the correlation id."""
    frame = fx.response_frame(body, correlation_id)
    out = rw.rewrite_frame(body.__api_key__, body.__version__, frame)
    got_id, decoded = fx.decode_response(type(body), out)
    assert got_id == correlation_id
    return decoded


def versions(api_key: int, low: int = 0, high: int = 99) -> list[int]:
    known = known_versions(api_key)
    assert known is not None
    return [v for v in known if low <= v <= high]


# -- the set of rewritten responses ---------------------------------------------------


def test_address_versions_match_design_table() -> None:
    # DESIGN §3, bounded by the versions kio 0.6.5 knows (worked out by hand
    # from kio/schema/*/v*/response.py).
    assert dict(address_versions()) == {
        0: range(10, 14),  # Produce node_endpoints
        1: range(16, 19),  # Fetch node_endpoints
        3: range(0, 14),  # Metadata brokers
        10: range(0, 7),  # FindCoordinator
        60: range(0, 3),  # DescribeCluster
        78: range(1, 3),  # ShareFetch
        79: range(1, 3),  # ShareAcknowledge
    }


# Responses with host/port fields that are deliberately not rewritten.
NOT_BROKER_ADDRESSES = {
    29: "DescribeAcls: ACL host pattern, not an address",
    31: "DeleteAcls: ACL host pattern, not an address",
    52: "Vote: controller quorum (uint16 port), controller-to-controller only",
    53: "BeginQuorumEpoch: controller quorum, controller-to-controller only",
    54: "EndQuorumEpoch: controller quorum, controller-to-controller only",
    55: "DescribeQuorum: controller listeners, not broker identities",
    59: "FetchSnapshot: controller quorum, controller-to-controller only",
    82: "UpdateRaftVoter: controller quorum",
    88: "StreamsGroupHeartbeat: application endpoints of Streams instances",
    89: "StreamsGroupDescribe: application endpoints of Streams instances",
}


def _has_field(entity_type: type, names: set[str], seen: set[type]) -> bool:
    if entity_type in seen:
        return False
    seen.add(entity_type)
    fields = dataclasses.fields(entity_type)
    if names <= {f.name for f in fields}:
        return True
    for f in fields:
        stack = [f.type]
        while stack:
            t = stack.pop()
            if dataclasses.is_dataclass(t):
                if _has_field(t, names, seen):
                    return True
            else:
                stack.extend(typing.get_args(t))
    return False


def test_every_kio_response_with_a_host_is_rewritten_or_excused() -> None:
    wanted = address_versions()
    rw = ResponseRewriter(ADVERTISED.get)
    for api_key, name in api_key_map.items():
        for version in schema_name_map[name]:
            has_host = _has_field(load_response_schema(api_key, version), {"host", "port"}, set())
            if api_key in NOT_BROKER_ADDRESSES:
                assert api_key not in wanted
                continue
            assert has_host == (api_key in wanted and version in wanted[api_key]), (name, version)
            assert rw.wants(api_key, version) == has_host or api_key == 18


# -- Metadata v0-v13 ------------------------------------------------------------------


def metadata_pair(version: int) -> tuple[typing.Any, typing.Any]:
    body_type = load_response_schema(3, version)
    broker_type = fx.nested(body_type, "brokers")
    real = fx.metadata_response(
        body_type, [(n, h, p, r) for n, (h, p, r) in REAL.items()], partitions=7, topics=2
    )
    expected = dataclasses.replace(
        real,
        brokers=(
            fx.make(broker_type, node_id=1, host="127.0.0.11", port=19001, rack="rack-a"),
            fx.make(broker_type, node_id=2, host="127.0.0.11", port=19002, rack=None),
            fx.make(broker_type, node_id=3, host="127.0.0.12", port=19003, rack="rack-b"),
        ),
    )
    return real, expected


@pytest.mark.parametrize("version", versions(3))
def test_metadata(version: int) -> None:
    rw, seen = rewriter()
    real, expected = metadata_pair(version)
    assert roundtrip(rw, real) == expected
    has_rack = version >= 1
    assert seen.calls == [
        (
            3,
            (
                BrokerAddress(1, "kafka-1.internal", 9092, "rack-a" if has_rack else None),
                BrokerAddress(2, "kafka-2.internal", 9093, None),
                BrokerAddress(3, "kafka-3.internal", 9094, "rack-b" if has_rack else None),
            ),
            True,
        )
    ]
    assert rw.counts == {3: 1}


@pytest.mark.parametrize("version", [0, 8, 9, 12, 13])
def test_metadata_topics_bytes_are_not_copied(version: int) -> None:
    real, _ = metadata_pair(version)
    payload = fx.response_payload(real, 5)
    rw, _ = rewriter()
    result = rw.rewrite(3, version, payload)
    # the last piece is a view of the original payload: the topics were
    # neither decoded nor copied
    tail = result.pieces[-1]
    assert isinstance(tail, memoryview) and tail.obj is payload
    assert bytes(tail) == payload[len(payload) - len(tail) :]


def test_metadata_unknown_tagged_field_in_a_broker_is_kept() -> None:
    body_type = load_response_schema(3, 12)
    broker_type = fx.nested(body_type, "brokers")
    real = fx.metadata_response(body_type, [(1, "kafka-1.internal", 9092, None)], partitions=1)
    payload = fx.response_payload(real, 5)
    # kio encodes the broker as node_id, host, port, rack, tags(=0). Give it
    # an unknown tag 9 with 3 bytes "abc" by hand.
    broker_bytes = fx.encode(real.brokers[0])
    assert broker_bytes.endswith(b"\x00") and payload.count(broker_bytes) == 1
    tagged = broker_bytes[:-1] + b"\x01\x09\x03abc"
    expected_broker = fx.encode(fx.make(broker_type, node_id=1, host="127.0.0.11", port=19001, rack=None))
    rw, _ = rewriter()
    out = rw.rewrite(3, 12, payload.replace(broker_bytes, tagged)).to_bytes()
    assert out == payload.replace(broker_bytes, expected_broker[:-1] + b"\x01\x09\x03abc")


def test_metadata_zero_brokers_is_refused() -> None:
    body_type = load_response_schema(3, 12)
    real = fx.metadata_response(body_type, [], partitions=0)
    rw, _ = rewriter()
    with pytest.raises(EmptyBrokerList):
        rw.rewrite(3, 12, fx.response_payload(real, 1))


def test_unknown_broker_carries_every_missing_real_address() -> None:
    real, _ = metadata_pair(12)
    seen = Recorder()
    rw = ResponseRewriter({1: ("127.0.0.11", 19001)}.get, on_brokers=seen)
    with pytest.raises(UnknownBroker) as info:
        rw.rewrite(3, 12, fx.response_payload(real, 1))
    assert info.value.brokers == (
        BrokerAddress(2, "kafka-2.internal", 9093, None),
        BrokerAddress(3, "kafka-3.internal", 9094, "rack-b"),
    )
    assert info.value.node_ids == (2, 3)
    assert not isinstance(info.value, ProtocolError)
    assert len(seen.calls) == 1  # discovery still learns about them


def test_one_address_for_two_node_ids_is_refused() -> None:
    real, _ = metadata_pair(12)
    rw = ResponseRewriter(lambda node_id: ("127.0.0.11", 19000))
    with pytest.raises(AddressConflict):
        rw.rewrite(3, 12, fx.response_payload(real, 1))


def test_mapping_change_is_seen_at_once() -> None:
    mapping = dict(ADVERTISED)
    rw = ResponseRewriter(mapping.get)
    real, _ = metadata_pair(12)
    assert [b.port for b in roundtrip(rw, real).brokers] == [19001, 19002, 19003]
    mapping[2] = ("127.0.0.13", 19102)
    assert [(b.host, b.port) for b in roundtrip(rw, real).brokers] == [
        ("127.0.0.11", 19001),
        ("127.0.0.13", 19102),
        ("127.0.0.12", 19003),
    ]


# -- FindCoordinator ----------------------------------------------------------------


@pytest.mark.parametrize("version", versions(10, high=3))
def test_find_coordinator_single(version: int) -> None:
    body_type = load_response_schema(10, version)
    real = fx.make(body_type, error_code=ErrorCode.none, error_message=None, node_id=2, host="kafka-2.internal", port=9093)
    expected = fx.make(body_type, error_code=ErrorCode.none, error_message=None, node_id=2, host="127.0.0.11", port=19002)
    rw, seen = rewriter()
    assert roundtrip(rw, real) == expected
    assert seen.calls == [(10, (BrokerAddress(2, "kafka-2.internal", 9093, None),), False)]


@pytest.mark.parametrize("version", versions(10, high=3))
def test_find_coordinator_error_has_no_address(version: int) -> None:
    body_type = load_response_schema(10, version)
    # Kafka's Node.noNode(): id -1, host "", port -1
    real = fx.make(body_type, error_code=ErrorCode.coordinator_not_available, node_id=-1, host="", port=-1)
    rw, seen = rewriter()
    assert roundtrip(rw, real) == real
    assert seen.calls == []


@pytest.mark.parametrize("version", versions(10, low=4))
def test_find_coordinator_batched(version: int) -> None:
    body_type = load_response_schema(10, version)
    coordinator = fx.nested(body_type, "coordinators")
    real = fx.make(
        body_type,
        coordinators=(
            fx.make(coordinator, key="group-a", node_id=3, host="kafka-3.internal", port=9094, error_code=ErrorCode.none),
            fx.make(coordinator, key="group-b", node_id=-1, host="", port=-1, error_code=ErrorCode.coordinator_not_available, error_message="wait"),
            fx.make(coordinator, key="group-c", node_id=3, host="kafka-3.internal", port=9094, error_code=ErrorCode.none),
        ),
    )
    expected = fx.make(
        body_type,
        coordinators=(
            fx.make(coordinator, key="group-a", node_id=3, host="127.0.0.12", port=19003, error_code=ErrorCode.none),
            fx.make(coordinator, key="group-b", node_id=-1, host="", port=-1, error_code=ErrorCode.coordinator_not_available, error_message="wait"),
            fx.make(coordinator, key="group-c", node_id=3, host="127.0.0.12", port=19003, error_code=ErrorCode.none),
        ),
    )
    rw, _ = rewriter()
    assert roundtrip(rw, real) == expected


def test_negative_node_id_with_a_host_is_refused() -> None:
    body_type = load_response_schema(10, 3)
    real = fx.make(body_type, node_id=-1, host="kafka-2.internal", port=9093)
    rw, _ = rewriter()
    with pytest.raises(MalformedFrame):
        rw.rewrite(10, 3, fx.response_payload(real, 1))


# -- DescribeCluster ---------------------------------------------------------------


@pytest.mark.parametrize("version", versions(60))
def test_describe_cluster(version: int) -> None:
    body_type = load_response_schema(60, version)
    broker = fx.nested(body_type, "brokers")
    real = fx.make(
        body_type,
        cluster_id="cluster-x",
        controller_id=1,
        brokers=tuple(fx.make(broker, broker_id=n, host=h, port=p, rack=r) for n, (h, p, r) in REAL.items()),
    )
    expected = fx.make(
        body_type,
        cluster_id="cluster-x",
        controller_id=1,
        brokers=(
            fx.make(broker, broker_id=1, host="127.0.0.11", port=19001, rack="rack-a"),
            fx.make(broker, broker_id=2, host="127.0.0.11", port=19002, rack=None),
            fx.make(broker, broker_id=3, host="127.0.0.12", port=19003, rack="rack-b"),
        ),
    )
    rw, seen = rewriter()
    assert roundtrip(rw, real) == expected
    assert seen.calls[0][2] is True and len(seen.calls[0][1]) == 3


# -- node_endpoints: Produce v10+, Fetch v16+, ShareFetch, ShareAcknowledge ------------

RECORDS = Records(b"\x00" * 11 + b"kafka-2.internal\x00\x00\x23\x85" + b"\xff" * 40)


def _produce(version: int, endpoints: tuple[tuple[int, str, int, str | None], ...]) -> typing.Any:
    body_type = load_response_schema(0, version)
    topic = fx.nested(body_type, "responses")
    partition = fx.nested(topic, "partition_responses")
    leader = [f for f in dataclasses.fields(partition) if f.name == "current_leader"][0].type
    endpoint = fx.nested(body_type, "node_endpoints")
    return fx.make(
        body_type,
        responses=(
            fx.make(
                topic,
                name="orders",
                partition_responses=(
                    fx.make(
                        partition,
                        index=0,
                        error_code=ErrorCode.not_leader_or_follower,
                        base_offset=-1,
                        current_leader=fx.make(leader, leader_id=2, leader_epoch=5),
                    ),
                ),
            ),
        ),
        node_endpoints=tuple(fx.make(endpoint, node_id=n, host=h, port=p, rack=r) for n, h, p, r in endpoints),
    )


def _fetch(version: int, endpoints: tuple[tuple[int, str, int, str | None], ...]) -> typing.Any:
    body_type = load_response_schema(1, version)
    topic = fx.nested(body_type, "responses")
    partition = fx.nested(topic, "partitions")
    leader = [f for f in dataclasses.fields(partition) if f.name == "current_leader"][0].type
    endpoint = fx.nested(body_type, "node_endpoints")
    return fx.make(
        body_type,
        responses=(
            fx.make(
                topic,
                partitions=(
                    fx.make(partition, partition_index=0, high_watermark=10, records=RECORDS, aborted_transactions=None),
                    fx.make(
                        partition,
                        partition_index=1,
                        error_code=ErrorCode.not_leader_or_follower,
                        high_watermark=-1,
                        current_leader=fx.make(leader, leader_id=3, leader_epoch=9),
                        records=None,
                        aborted_transactions=None,
                    ),
                ),
            ),
        ),
        node_endpoints=tuple(fx.make(endpoint, node_id=n, host=h, port=p, rack=r) for n, h, p, r in endpoints),
    )


def _share(api_key: int, version: int, endpoints: tuple[tuple[int, str, int, str | None], ...]) -> typing.Any:
    body_type = load_response_schema(api_key, version)
    topic = fx.nested(body_type, "responses")
    partition = fx.nested(topic, "partitions")
    leader = [f for f in dataclasses.fields(partition) if f.name == "current_leader"][0].type
    endpoint = fx.nested(body_type, "node_endpoints")
    return fx.make(
        body_type,
        responses=(
            fx.make(
                topic,
                partitions=(
                    fx.make(partition, partition_index=4, current_leader=fx.make(leader, leader_id=1, leader_epoch=2), records=RECORDS),
                ),
            ),
        ),
        node_endpoints=tuple(fx.make(endpoint, node_id=n, host=h, port=p, rack=r) for n, h, p, r in endpoints),
    )


REAL_ENDPOINTS = ((2, "kafka-2.internal", 9093, None), (3, "kafka-3.internal", 9094, "rack-b"))
PROXY_ENDPOINTS = ((2, "127.0.0.11", 19002, None), (3, "127.0.0.12", 19003, "rack-b"))

NODE_ENDPOINT_CASES = (
    [("produce", 0, v, lambda v, e: _produce(v, e)) for v in versions(0, low=10)]
    + [("fetch", 1, v, lambda v, e: _fetch(v, e)) for v in versions(1, low=16)]
    + [("share_fetch", 78, v, lambda v, e: _share(78, v, e)) for v in versions(78)]
    + [("share_ack", 79, v, lambda v, e: _share(79, v, e)) for v in versions(79)]
)


@pytest.mark.parametrize(
    ("name", "api_key", "version", "build"),
    NODE_ENDPOINT_CASES,
    ids=[f"{c[0]}-v{c[2]}" for c in NODE_ENDPOINT_CASES],
)
def test_node_endpoints(name: str, api_key: int, version: int, build: typing.Callable) -> None:
    rw, seen = rewriter()
    real = build(version, REAL_ENDPOINTS)
    assert roundtrip(rw, real) == build(version, PROXY_ENDPOINTS)
    assert seen.calls == [
        (
            api_key,
            (BrokerAddress(2, "kafka-2.internal", 9093, None), BrokerAddress(3, "kafka-3.internal", 9094, "rack-b")),
            False,
        )
    ]
    # without endpoints the frame goes out as it came, as one piece
    bare = fx.response_payload(build(version, ()), 9)
    result = rw.rewrite(api_key, version, bare)
    assert not result.changed and len(result.pieces) == 1 and bytes(result.pieces[0]) == bare
    assert rw.counts[api_key] == 2 and rw.changed[api_key] == 1


def test_produce_unknown_top_level_tag_is_kept() -> None:
    # Tag section by hand: count 2, tag 0 (node_endpoints), tag 7 "hi".
    def with_tags(endpoints: tuple) -> bytes:
        bare = fx.response_payload(_produce(13, ()), 3)
        assert bare.endswith(b"\x00")
        endpoint = fx.nested(load_response_schema(0, 13), "node_endpoints")
        value = encode_uvarint(len(endpoints) + 1) + b"".join(
            fx.encode(fx.make(endpoint, node_id=n, host=h, port=p, rack=r)) for n, h, p, r in endpoints
        )
        return bare[:-1] + b"\x02" + b"\x00" + encode_uvarint(len(value)) + value + b"\x07\x02hi"

    rw, _ = rewriter()
    assert rw.rewrite(0, 13, with_tags(REAL_ENDPOINTS)).to_bytes() == with_tags(PROXY_ENDPOINTS)


def test_fetch_trailing_bytes_are_malformed() -> None:
    payload = fx.response_payload(_fetch(16, REAL_ENDPOINTS), 3)
    rw, _ = rewriter()
    with pytest.raises(MalformedFrame):
        rw.rewrite(1, 16, payload + b"\x00")
    with pytest.raises(MalformedFrame):
        rw.rewrite(1, 16, payload[:-3])


@pytest.mark.parametrize(("api_key", "version"), [(3, 0), (3, 12), (10, 0), (10, 6), (60, 1), (0, 13), (1, 18), (78, 1), (18, 3)])
def test_every_truncation_is_a_protocol_error(api_key: int, version: int) -> None:
    builders = {
        3: lambda: metadata_pair(version)[0],
        10: lambda: fx.make(load_response_schema(10, version)),
        60: lambda: fx.make(load_response_schema(60, version), brokers=(fx.make(fx.nested(load_response_schema(60, version), "brokers"), broker_id=1, host="h", port=1),)),
        0: lambda: _produce(version, REAL_ENDPOINTS),
        1: lambda: _fetch(version, REAL_ENDPOINTS),
        78: lambda: _share(78, version, REAL_ENDPOINTS),
        18: lambda: api_versions_body(3, [(0, 3, 14), (1, 4, 19)]),
    }
    payload = fx.response_payload(builders[api_key](), 1)
    rw, _ = rewriter()
    for cut in range(len(payload)):
        try:
            rw.rewrite(api_key, version, payload[:cut])
        except ProtocolError:
            pass


# -- ApiVersions clamp -------------------------------------------------------------


def api_versions_body(version: int, entries: list[tuple[int, int, int]], error: ErrorCode = ErrorCode.none, **extra: typing.Any) -> typing.Any:
    body_type = load_response_schema(18, version)
    entry = fx.nested(body_type, "api_keys")
    return fx.make(
        body_type,
        error_code=error,
        api_keys=tuple(fx.make(entry, api_key=k, min_version=lo, max_version=hi) for k, lo, hi in entries),
        **extra,
    )


# What a newer broker could offer, and what the proxy must let through
# (kio 0.6.5 knows Produce 3-13, Fetch 4-18, Metadata 0-13, SaslHandshake 0-1,
# ApiVersions 0-4; key 4 LeaderAndIsr and key 1000 it does not know).
BROKER_OFFER = [(0, 0, 14), (1, 4, 19), (3, 0, 13), (4, 0, 7), (17, 0, 1), (18, 0, 5), (1000, 0, 1)]
CLAMPED = [(0, 3, 13), (1, 4, 18), (3, 0, 13), (17, 1, 1), (18, 0, 4)]


@pytest.mark.parametrize("version", versions(18))
def test_api_versions_clamp(version: int) -> None:
    extra = {}
    if version >= 3:
        features = fx.nested(load_response_schema(18, version), "supported_features")
        extra = {"supported_features": (fx.make(features, name="metadata.version", min_version=1, max_version=27),), "finalized_features_epoch": 12}
    real = api_versions_body(version, BROKER_OFFER, **extra)
    expected = api_versions_body(version, CLAMPED, **extra)
    rw, _ = rewriter()
    assert roundtrip(rw, real) == expected
    assert rw.counts == {18: 1}


def test_api_versions_unsupported_version_has_v0_body() -> None:
    # The client asked v4; the broker answers UNSUPPORTED_VERSION with a v0 body.
    real = api_versions_body(0, [(18, 0, 5)], ErrorCode.unsupported_version)
    rw, _ = rewriter()
    out = rw.rewrite_frame(18, 4, fx.response_frame(real, 3))
    assert fx.decode_response(type(real), out) == (3, api_versions_body(0, [(18, 0, 4)], ErrorCode.unsupported_version))


def test_api_versions_request_newer_than_kio() -> None:
    # Client asked v7 (unknown to kio) and the broker answered v7: read with
    # kio's newest layout (v4), clamp ApiVersions itself to 4.
    real = api_versions_body(4, [(18, 0, 7), (3, 0, 13)])
    rw, _ = rewriter()
    out = rw.rewrite_frame(18, 7, fx.response_frame(real, 3))
    assert fx.decode_response(type(real), out)[1] == api_versions_body(4, [(18, 0, 4), (3, 0, 13)])


def test_api_versions_caps_keep_fetch_cut_through() -> None:
    real = api_versions_body(3, [(1, 4, 18), (0, 3, 13)])
    rw, _ = rewriter(version_caps={1: 15, 0: 9})
    assert roundtrip(rw, real) == api_versions_body(3, [(1, 4, 15), (0, 3, 9)])
    assert rw.max_version(1) == 15 and rw.max_version(3) == 13 and rw.max_version(4) is None


def test_api_versions_already_fine_is_not_touched() -> None:
    real = api_versions_body(3, [(0, 3, 12), (3, 0, 12), (18, 0, 4)])
    payload = fx.response_payload(real, 3)
    rw, _ = rewriter()
    result = rw.rewrite(18, 3, payload)
    assert not result.changed and bytes(result.pieces[0]) == payload


def test_api_versions_clamp_can_be_disabled() -> None:
    rw = ResponseRewriter(ADVERTISED.get, clamp_api_versions=False)
    assert not rw.wants(18, 3)
    assert rw.wants(3, 0) and rw.wants(1, 16) and not rw.wants(1, 15) and not rw.wants(0, 9)


def test_api_versions_empty_intersection_is_dropped() -> None:
    # SaslHandshake only v0 (floor is 1) and Produce only v0-v2 (kio knows 3+):
    # no version is left that the proxy can carry, so the keys disappear.
    real = api_versions_body(3, [(17, 0, 0), (0, 0, 2), (3, 0, 13)])
    rw, _ = rewriter()
    assert roundtrip(rw, real) == api_versions_body(3, [(3, 0, 13)])


def test_api_versions_clamped_once_per_body_each_answer_keeps_its_correlation_id(monkeypatch: pytest.MonkeyPatch) -> None:
    rw, _ = rewriter()
    clamps = []
    real_clamp = rw._clamp_entries
    monkeypatch.setattr(rw, "_clamp_entries", lambda *a: clamps.append(a[0]) or real_clamp(*a))
    real = api_versions_body(3, BROKER_OFFER)
    for correlation_id in (7, 8, 9):
        out = rw.rewrite_frame(18, 3, fx.response_frame(real, correlation_id))
        assert fx.decode_response(type(real), out) == (correlation_id, api_versions_body(3, CLAMPED))
    assert clamps == [3]  # the second and third answers came from the kept body
    fine = api_versions_body(3, [(0, 3, 12), (18, 0, 4)])
    for correlation_id in (1, 2):
        payload = fx.response_payload(fine, correlation_id)
        result = rw.rewrite(18, 3, payload)
        assert not result.changed and bytes(result.pieces[0]) == payload  # unchanged, kept as such
    assert clamps == [3, 3]
    out = rw.rewrite_frame(18, 0, fx.response_frame(api_versions_body(0, BROKER_OFFER), 5))  # another version
    assert fx.decode_response(type(api_versions_body(0, [])), out) == (5, api_versions_body(0, CLAMPED))
    assert clamps == [3, 3, 0]


def test_api_versions_kept_bodies_are_bounded() -> None:
    rw, _ = rewriter()
    for hi in range(13, 13 + 2 * rewrite.CLAMP_CACHE_ENTRIES):  # distinct bodies: Metadata up to v13..
        rw.rewrite(18, 3, fx.response_payload(api_versions_body(3, [(3, 0, hi)]), 1))
        assert len(rw._clamped) <= rewrite.CLAMP_CACHE_ENTRIES
    out = rw.rewrite_frame(18, 3, fx.response_frame(api_versions_body(3, [(3, 0, 20)]), 4))
    assert fx.decode_response(type(api_versions_body(3, [])), out) == (4, api_versions_body(3, [(3, 0, 13)]))
