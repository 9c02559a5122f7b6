"""Frame codec: request tracker, correlation table, response splitter.

Readers are tested whole, one byte at a time, at every split point and with
trailing garbage (h11's test_io.py shape). Expected values are worked out by
hand from the Kafka wire format, or built with kio's own encoder.
"""

from __future__ import annotations

import datetime
import struct

import pytest

from kio.schema.api_versions.v3.request import ApiVersionsRequest as ApiVersionsRequestV3
from kio.schema.metadata.v1.request import MetadataRequest as MetadataRequestV1
from kio.schema.metadata.v1.response import MetadataResponse as MetadataResponseV1
from kio.schema.metadata.v12.request import MetadataRequest as MetadataRequestV12
from kio.schema.metadata.v12.request import MetadataRequestTopic as MetadataRequestTopicV12
from kio.schema.metadata.v12.response import MetadataResponse as MetadataResponseV12
from kio.schema.produce.v3.request import ProduceRequest as ProduceRequestV3
from kio.schema.produce.v9.request import ProduceRequest as ProduceRequestV9
from kio.schema.produce.v9.response import ProduceResponse as ProduceResponseV9

from kio.static.primitive import i32Timedelta

from chaos.bench import frames as fx
from proxy.codec import DEFAULT_MAX_FRAME_SIZE
from proxy.codec import ConnectionCodec
from proxy.codec import CorrelationTable
from proxy.codec import RequestHeader
from proxy.codec import RequestTracker
from proxy.codec import ResponseSplitter
from proxy.codec import known_versions
from proxy.codec import request_header_version
from proxy.codec import response_header_version
from proxy.errors import DuplicateCorrelationId
from proxy.errors import FrameSizeError
from proxy.errors import MalformedFrame
from proxy.errors import ProtocolError
from proxy.errors import TooManyInFlight
from proxy.errors import UnknownBroker
from proxy.errors import UnknownCorrelationId
from proxy.errors import UnsupportedApi
from proxy.rewrite import ResponseRewriter

pytestmark = pytest.mark.unit

I32 = struct.Struct(">i")


def frame(payload: bytes) -> bytes:
    return I32.pack(len(payload)) + payload


# A Metadata v1 request built by hand: header v1 (api_key 3, version 1,
# correlation id 42, client_id "ab"), body: topics = null (int32 -1).
HAND_METADATA_V1 = frame(
    b"\x00\x03" b"\x00\x01" b"\x00\x00\x00\x2a" b"\x00\x02ab" b"\xff\xff\xff\xff"
)
# A Metadata v9 request (flexible, header v2) by hand, with one header tagged
# field (tag 0, 2 bytes "zz"); body: topics compact null (0),
# allow_auto_topic_creation, include_topic_authorized_operations, no tags.
HAND_METADATA_V9 = frame(
    b"\x00\x03\x00\x09\x00\x00\x00\x05\x00\x01c" b"\x01\x00\x02zz" b"\x00\x01\x00\x00"
)


def feed_all(tracker: RequestTracker, data: bytes, step: int | None = None) -> list[RequestHeader]:
    if step is None:
        return tracker.feed(data)
    out: list[RequestHeader] = []
    for i in range(0, len(data), step):
        out.extend(tracker.feed(data[i : i + step]))
    return out


# -- kio lookups -------------------------------------------------------------------


def test_header_versions_follow_kio() -> None:
    # Metadata became flexible in v9 (KIP-482), ApiVersions in v3.
    assert request_header_version(3, 8) == 1
    assert request_header_version(3, 9) == 2
    assert request_header_version(18, 2) == 1
    assert request_header_version(18, 3) == 2
    assert response_header_version(3, 8) == 0
    assert response_header_version(3, 9) == 1
    # ApiVersions responses always use header v0, even when flexible.
    assert response_header_version(18, 3) == 0
    assert response_header_version(18, 4) == 0


def test_known_versions() -> None:
    assert known_versions(3) == range(0, 14)
    assert known_versions(0) == range(3, 14)  # kio has no Produce v0-v2
    assert known_versions(4) is None  # LeaderAndIsr: gone from kio
    assert known_versions(9999) is None


def test_unknown_api_is_protocol_error() -> None:
    with pytest.raises(UnsupportedApi):
        request_header_version(9999, 0)
    with pytest.raises(UnsupportedApi):
        request_header_version(3, 99)


# -- request tracker ---------------------------------------------------------------


EXPECTED_V1 = RequestHeader(
    api_key=3,
    api_version=1,
    correlation_id=42,
    client_id="ab",
    expects_response=True,
    header_version=1,
    frame_offset=0,
    frame_size=20,
    header_size=12,
)
EXPECTED_V9 = RequestHeader(
    api_key=3,
    api_version=9,
    correlation_id=5,
    client_id="c",
    expects_response=True,
    header_version=2,
    frame_offset=20,  # follows HAND_METADATA_V1 (20 bytes)
    frame_size=4 + 20,
    header_size=16,
)


@pytest.mark.parametrize("step", [None, 1, 2, 3, 5, 7, 13])
def test_tracker_hand_built(step: int | None) -> None:
    tracker = RequestTracker()
    stream = HAND_METADATA_V1 + HAND_METADATA_V9
    assert feed_all(tracker, stream, step) == [EXPECTED_V1, EXPECTED_V9]
    assert tracker.position == len(stream) == 44
    assert tracker.at_frame_boundary
    assert tracker.table.pop(42) == (3, 1)
    assert tracker.table.pop(5) == (3, 9)
    assert EXPECTED_V9.body_offset == 20 + 4 + 16
    assert EXPECTED_V9.frame_end == 44


def test_tracker_every_split_point() -> None:
    stream = HAND_METADATA_V1 + HAND_METADATA_V9
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            tracker = RequestTracker()
            headers = tracker.feed(stream[:i]) + tracker.feed(stream[i:j]) + tracker.feed(stream[j:])
            assert headers == [EXPECTED_V1, EXPECTED_V9], (i, j)


def test_tracker_accepts_memoryview_and_bytearray() -> None:
    tracker = RequestTracker()
    assert tracker.feed(memoryview(HAND_METADATA_V1)) == [EXPECTED_V1]
    tracker = RequestTracker()
    assert tracker.feed(bytearray(HAND_METADATA_V1)) == [EXPECTED_V1]


def test_tracker_buffers_only_the_header() -> None:
    # A 1 MiB request: the tracker holds at most the 12 header bytes.
    body = b"\x00" * (1 << 20)
    payload = b"\x00\x03\x00\x01\x00\x00\x00\x07\x00\x02ab" + body
    data = frame(payload)
    tracker = RequestTracker()
    peak = 0
    headers = []
    for i in range(0, 4096):
        headers += tracker.feed(data[i : i + 1])
        peak = max(peak, tracker.buffered)
    assert peak <= 12
    headers += tracker.feed(data[4096:])
    assert [h.correlation_id for h in headers] == [7]
    assert headers[0].frame_size == len(data)


def test_tracker_with_kio_requests() -> None:
    topic = fx.make(MetadataRequestTopicV12, name="orders", topic_id=None)
    metadata = fx.make(MetadataRequestV12, topics=(topic,), allow_auto_topic_creation=True)
    api_versions = ApiVersionsRequestV3(client_software_name="kproxy", client_software_version="1")
    produce_acks0 = fx.make(ProduceRequestV9, transactional_id="tx-1", acks=0, timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)))
    produce_acks1 = fx.make(ProduceRequestV3, transactional_id=None, acks=1, timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)))
    produce_all = fx.make(ProduceRequestV9, transactional_id=None, acks=-1, timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)))
    frames = [
        fx.request_frame(metadata, 1, "app"),
        fx.request_frame(api_versions, 2, None),
        fx.request_frame(produce_acks0, 3, "app"),
        fx.request_frame(produce_acks1, 4, "app"),
        fx.request_frame(produce_all, 5, "app"),
    ]
    for step in (None, 1, 4):
        tracker = RequestTracker()
        headers = feed_all(tracker, b"".join(frames), step)
        got = [(h.api_key, h.api_version, h.correlation_id, h.client_id, h.expects_response, h.header_version) for h in headers]
        assert got == [
            (3, 12, 1, "app", True, 2),
            (18, 3, 2, None, True, 2),
            (0, 9, 3, "app", False, 2),
            (0, 3, 4, "app", True, 1),
            (0, 9, 5, "app", True, 2),
        ]
        assert [(h.acks, h.transactional_id) for h in headers[2:]] == [(0, "tx-1"), (1, None), (-1, None)]
        # acks=0 expects no response: correlation id 3 is not in the table
        assert sorted(tracker.table) == [1, 2, 4, 5]
        assert [h.frame_size for h in headers] == [len(f) for f in frames]


def test_tracker_api_versions_newer_than_kio() -> None:
    # A client may ask ApiVersions v99: Kafka reads header v2 for v>=3 and
    # answers with a v0 body (KIP-511); the tracker must let it through.
    payload = b"\x00\x12\x00\x63\x00\x00\x00\x09\xff\xff\x00" b"\x00"
    headers = RequestTracker().feed(frame(payload))
    assert [(h.api_key, h.api_version, h.correlation_id, h.client_id, h.header_version) for h in headers] == [
        (18, 99, 9, None, 2)
    ]


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\xff\xff\xff\xff", FrameSizeError),  # negative length
        (b"\x00\x00\x00\x00", FrameSizeError),  # empty frame
        (I32.pack(DEFAULT_MAX_FRAME_SIZE + 1), FrameSizeError),
        (b"GET / HTTP/1.1\r\n", FrameSizeError),  # "GET " = 1195725856
        (frame(b"\x00\x03\x00\x01\x00\x00"), MalformedFrame),  # 6 < 10 header bytes
        (frame(b"\x00\x03\x00\x01\x00\x00\x00\x01\x00\x05ab"), MalformedFrame),  # client_id past end
        (frame(b"\x00\x03\x00\x01\x00\x00\x00\x01\xff\xfe"), MalformedFrame),  # client_id len -2
        (frame(b"\x27\x0f\x00\x00\x00\x00\x00\x01\xff\xff"), UnsupportedApi),  # api key 9999
        (frame(b"\x00\x03\x00\x63\x00\x00\x00\x01\xff\xff"), UnsupportedApi),  # Metadata v99
        (frame(b"\x00\x03\x00\x09\x00\x00\x00\x01\xff\xff\x01\x00\x09z"), MalformedFrame),  # header tag past end
        (frame(b"\x00\x03\x00\x09\x00\x00\x00\x01\xff\xff\xff\xff\xff\xff\xff\x01"), MalformedFrame),  # 6-byte varint
    ],
)
def test_tracker_protocol_errors(data: bytes, error: type[ProtocolError]) -> None:
    for step in (None, 1):
        tracker = RequestTracker()
        with pytest.raises(error) as info:
            feed_all(tracker, data, step)
        assert info.value.side == "client"
        # the tracker is dead afterwards
        with pytest.raises(error):
            tracker.feed(HAND_METADATA_V1)


def test_tracker_max_frame_size_is_per_instance() -> None:
    tracker = RequestTracker(max_frame_size=16)
    assert tracker.feed(HAND_METADATA_V1) == [EXPECTED_V1]  # 16-byte payload
    with pytest.raises(FrameSizeError):
        tracker.feed(HAND_METADATA_V9)  # 20-byte payload


def test_tracker_trailing_garbage() -> None:
    tracker = RequestTracker()
    assert tracker.feed(HAND_METADATA_V1 + b"\x00\x00") == [EXPECTED_V1]
    assert not tracker.at_frame_boundary
    with pytest.raises(UnsupportedApi):  # length 0x00000000_27 ... api key 0x270f
        tracker.feed(b"\x00\x10" + b"\x27\x0f" + b"\x00" * 20)


def test_tracker_duplicate_correlation_id() -> None:
    tracker = RequestTracker()
    tracker.feed(HAND_METADATA_V1)
    with pytest.raises(DuplicateCorrelationId):
        tracker.feed(HAND_METADATA_V1)


def test_correlation_table_limit() -> None:
    table = CorrelationTable(max_in_flight=2)
    table.add(1, 3, 12)
    table.add(2, 3, 12)
    with pytest.raises(TooManyInFlight):
        table.add(3, 3, 12)
    assert table.pop(1) == (3, 12)
    table.add(3, 0, 9)
    assert len(table) == 2 and 3 in table and 1 not in table
    with pytest.raises(UnknownCorrelationId):
        table.pop(1)


# -- response splitter -------------------------------------------------------------


def produce_response_frame(correlation_id: int) -> bytes:
    # Produce v9 is not address-carrying: always cut through.
    return fx.response_frame(fx.make(ProduceResponseV9, responses=()), correlation_id)


def splitter_with(*pending: tuple[int, int, int], rewriter: ResponseRewriter | None = None) -> ResponseSplitter:
    table = CorrelationTable()
    for correlation_id, api_key, api_version in pending:
        table.add(correlation_id, api_key, api_version)
    return ResponseSplitter(table, rewriter)


def joined(segments: list) -> bytes:
    return b"".join(bytes(s) for s in segments)


def test_splitter_passes_through_unchanged_and_zero_copy() -> None:
    stream = produce_response_frame(1) + produce_response_frame(2)
    splitter = splitter_with((1, 0, 9), (2, 0, 9))
    out = splitter.feed(stream)
    assert len(out) == 1 and out[0] is stream  # the chunk itself, no copy
    assert len(splitter.table) == 0
    assert splitter.at_frame_boundary


@pytest.mark.parametrize("step", [1, 2, 3, 7, 8, 9])
def test_splitter_pass_through_small_steps(step: int) -> None:
    stream = produce_response_frame(1) + produce_response_frame(2) + produce_response_frame(3)
    splitter = splitter_with((1, 0, 9), (2, 0, 9), (3, 0, 9))
    out = []
    for i in range(0, len(stream), step):
        out += splitter.feed(stream[i : i + step])
    assert joined(out) == stream
    assert len(splitter.table) == 0


def test_splitter_cut_through_does_not_wait_for_the_frame() -> None:
    data = produce_response_frame(1)
    splitter = splitter_with((1, 0, 9))
    # The first 8 bytes (length + correlation id) decide; after that every
    # byte goes out as soon as it comes in.
    assert splitter.feed(data[:7]) == []  # held: correlation id incomplete
    assert joined(splitter.feed(data[7:8])) == data[:8]
    for i in range(8, len(data)):
        assert joined(splitter.feed(data[i : i + 1])) == data[i : i + 1]
    # whole head in the chunk: forwarded at once
    splitter = splitter_with((1, 0, 9))
    assert joined(splitter.feed(data[:8])) == data[:8]


def metadata_fixture(correlation_id: int) -> tuple[bytes, bytes]:
    """(response frame from the broker, expected frame to the client)."""
    broker_type = fx.nested(MetadataResponseV12, "brokers")
    real = fx.metadata_response(
        MetadataResponseV12, [(1, "b1.internal", 9092, "r1"), (2, "b2.internal", 9092, None)], partitions=3
    )
    expected = fx.make(
        MetadataResponseV12,
        throttle_time=real.throttle_time,
        brokers=(
            fx.make(broker_type, node_id=1, host="proxy.local", port=30001, rack="r1"),
            fx.make(broker_type, node_id=2, host="proxy.local", port=30002, rack=None),
        ),
        cluster_id=real.cluster_id,
        controller_id=real.controller_id,
        topics=real.topics,
    )
    return fx.response_frame(real, correlation_id), fx.response_frame(expected, correlation_id)


def proxy_address(node_id: int) -> tuple[str, int]:
    return "proxy.local", 30000 + node_id


def test_splitter_rewrites_metadata_between_pass_through_frames() -> None:
    meta, expected_meta = metadata_fixture(2)
    stream = produce_response_frame(1) + meta + produce_response_frame(3)
    expected = produce_response_frame(1) + expected_meta + produce_response_frame(3)
    for step in (None, 1, 5, 8, 64):
        splitter = splitter_with(
            (1, 0, 9), (2, 3, 12), (3, 0, 9), rewriter=ResponseRewriter(proxy_address)
        )
        chunks = [stream] if step is None else [stream[i : i + step] for i in range(0, len(stream), step)]
        out = []
        for chunk in chunks:
            out += splitter.feed(chunk)
        assert joined(out) == expected
        assert splitter.rewritten == 1 and splitter.frames == 3


def test_splitter_every_split_point_with_rewrite() -> None:
    meta, expected_meta = metadata_fixture(2)
    stream = produce_response_frame(1) + meta
    expected = produce_response_frame(1) + expected_meta
    rewriter = ResponseRewriter(proxy_address)
    for i in range(len(stream) + 1):
        splitter = splitter_with((1, 0, 9), (2, 3, 12), rewriter=rewriter)
        out = splitter.feed(stream[:i]) + splitter.feed(stream[i:])
        assert joined(out) == expected, i


def test_splitter_stalls_on_unknown_broker_and_resumes() -> None:
    meta, expected_meta = metadata_fixture(2)
    known = {1: ("proxy.local", 30001)}
    rewriter = ResponseRewriter(known.get)
    splitter = splitter_with((1, 0, 9), (2, 3, 12), (3, 0, 9), rewriter=rewriter)
    out = splitter.feed(produce_response_frame(1) + meta + produce_response_frame(3)[:5])
    assert joined(out) == produce_response_frame(1)  # stops before the Metadata frame
    stalled = splitter.stalled
    assert isinstance(stalled, UnknownBroker)
    assert [(b.node_id, b.host, b.port) for b in stalled.brokers] == [(2, "b2.internal", 9092)]
    assert splitter.feed(produce_response_frame(3)[5:]) == []  # queued while stalled
    assert splitter.resume() == []  # still unknown
    known[2] = ("proxy.local", 30002)
    out = splitter.resume()
    assert splitter.stalled is None
    assert joined(out) == expected_meta + produce_response_frame(3)
    assert splitter.at_frame_boundary


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\xff\xff\xff\xff\x00\x00\x00\x01", FrameSizeError),
        (b"\x00\x00\x00\x03\x00\x00\x00", FrameSizeError),  # too short for a correlation id
        (I32.pack(DEFAULT_MAX_FRAME_SIZE + 1) + b"\x00\x00\x00\x01", FrameSizeError),
        (b"\x00\x00\x00\x04\x00\x00\x00\x63", UnknownCorrelationId),  # never requested
    ],
)
def test_splitter_protocol_errors(data: bytes, error: type[ProtocolError]) -> None:
    for step in (None, 1):
        splitter = splitter_with((1, 0, 9))
        with pytest.raises(error) as info:
            if step is None:
                splitter.feed(data)
            else:
                for i in range(len(data)):
                    splitter.feed(data[i : i + 1])
        assert info.value.side == "broker"
        with pytest.raises(error):
            splitter.feed(b"")


def test_splitter_malformed_metadata_is_protocol_error() -> None:
    meta, _ = metadata_fixture(2)
    # cut the brokers array short: keep header + throttle + 3 bytes, fix length
    payload = meta[4:4 + 4 + 1 + 4 + 3]
    splitter = splitter_with((2, 3, 12), rewriter=ResponseRewriter(proxy_address))
    with pytest.raises(MalformedFrame):
        splitter.feed(frame(payload))


def test_splitter_trailing_garbage_is_held() -> None:
    splitter = splitter_with((1, 0, 9))
    out = splitter.feed(produce_response_frame(1) + b"\x00\x00")
    assert joined(out) == produce_response_frame(1)
    assert not splitter.at_frame_boundary


def test_connection_codec_idle_tracks_in_flight() -> None:
    codec = ConnectionCodec(ResponseRewriter(proxy_address))
    assert codec.idle
    meta_request = fx.request_frame(fx.make(MetadataRequestV1, topics=None), 2, "app")
    assert [h.correlation_id for h in codec.requests.feed(meta_request[:-1])] == [2]
    assert codec.in_flight == 1 and not codec.idle
    codec.requests.feed(meta_request[-1:])
    meta_v1 = fx.metadata_response(MetadataResponseV1, [(1, "b1", 9092, None)], partitions=1)
    out = codec.responses.feed(fx.response_frame(meta_v1, 2))
    assert codec.idle
    _, body = fx.decode_response(type(meta_v1), joined(out))
    assert [(b.node_id, b.host, b.port) for b in body.brokers] == [(1, "proxy.local", 30001)]


def test_splitter_rewrites_a_whole_frame_in_place() -> None:
    # Metadata frame entirely inside one chunk: the rewritten frame's tail
    # (the topics) is a view of that chunk, not a copy.
    meta, expected_meta = metadata_fixture(2)
    chunk = produce_response_frame(1) + meta
    splitter = splitter_with((1, 0, 9), (2, 3, 12), rewriter=ResponseRewriter(proxy_address))
    out = splitter.feed(chunk)
    assert joined(out) == produce_response_frame(1) + expected_meta
    assert isinstance(out[-1], memoryview) and out[-1].obj is chunk
    assert out[1] == I32.pack(len(expected_meta) - 4)  # corrected length prefix
