"""Fuzz harness (h11 style): garbage in -> parsed, or a ProtocolError.

Never any other exception, for the request tracker, the response splitter and
every rewriter. Also: the output does not depend on how the input is chunked.
"""

from __future__ import annotations

import os
import struct

import pytest

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kio.index import load_response_schema
from kio.static.primitive import Records

from chaos.bench import frames as fx
from proxy.codec import CorrelationTable
from proxy.codec import RequestTracker
from proxy.codec import ResponseSplitter
from proxy.codec import known_versions
from proxy.errors import ProtocolError
from proxy.rewrite import ResponseRewriter
from proxy.rewrite import address_versions

pytestmark = pytest.mark.unit

st.register_type_strategy(Records, st.binary(max_size=64).map(Records))

EXAMPLES = int(os.environ.get("KPROXY_HYPOTHESIS_EXAMPLES", "15"))
FUZZ = settings(
    max_examples=EXAMPLES * 8,
    derandomize=EXAMPLES <= 50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
I32 = struct.Struct(">i")


def advertised(node_id: int) -> tuple[str, int]:
    return f"proxy-{node_id}", 9000 + node_id % 1000


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


# Requests: valid header prefixes of known (key, version) + random rest.
KNOWN = [(k, v) for k in (0, 1, 3, 10, 18, 19, 60, 78) for v in known_versions(k) or ()]


@st.composite
def request_streams(draw: st.DrawFn) -> bytes:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 2))
        if kind == 0:
            parts.append(draw(st.binary(max_size=64)))
            continue
        api_key, version = draw(st.sampled_from(KNOWN))
        head = struct.pack(">hhi", api_key, version, draw(st.integers(-5, 5)))
        head += draw(st.sampled_from([b"\xff\xff", b"\x00\x00", b"\x00\x02ab", b"\x00\x09a"]))
        rest = draw(st.binary(max_size=48))
        payload = head + rest
        length = len(payload) if kind == 1 else draw(st.integers(-3, len(payload) + 8))
        parts.append(I32.pack(length) + payload)
    return b"".join(parts)


@FUZZ
@given(request_streams() | st.binary(max_size=200), st.lists(st.integers(0, 400), max_size=6))
def test_tracker_garbage(data: bytes, cuts: list[int]) -> None:
    whole = RequestTracker()
    try:
        expected = whole.feed(data)
    except ProtocolError:
        expected = None
    tracker = RequestTracker()
    got: list = []
    try:
        for chunk in chunked(data, cuts):
            got += tracker.feed(chunk)
    except ProtocolError:
        assert expected is None  # the same garbage fails whatever the chunking
        return
    # chunking does not change what is seen
    assert got == expected


# Responses: frames for pending correlation ids with random or mutated bodies.
PENDING = [(1, 3, 12), (2, 0, 13), (3, 1, 17), (4, 18, 3), (5, 10, 2), (6, 2, 5), (7, 60, 1), (8, 78, 1)]


@st.composite
def response_streams(draw: st.DrawFn) -> bytes:
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            parts.append(draw(st.binary(max_size=40)))
            continue
        correlation_id = draw(st.integers(0, 9))
        body = draw(st.binary(max_size=80))
        payload = I32.pack(correlation_id) + body
        parts.append(I32.pack(len(payload)) + payload)
    return b"".join(parts)


def new_splitter() -> ResponseSplitter:
    table = CorrelationTable()
    for correlation_id, api_key, version in PENDING:
        table.add(correlation_id, api_key, version)
    return ResponseSplitter(table, ResponseRewriter(advertised))


@FUZZ
@given(response_streams() | st.binary(max_size=200), st.lists(st.integers(0, 400), max_size=6))
def test_splitter_garbage(data: bytes, cuts: list[int]) -> None:
    try:
        expected = b"".join(bytes(s) for s in new_splitter().feed(data))
    except ProtocolError:
        expected = None
    splitter = new_splitter()
    got = b""
    try:
        for chunk in chunked(data, cuts):
            got += b"".join(bytes(s) for s in splitter.feed(chunk))
    except ProtocolError:
        assert expected is None
        return
    assert got == expected


REWRITE_CASES = [(k, v) for k, vs in sorted(address_versions().items()) for v in vs] + [
    (18, v) for v in (0, 3, 4, 9)
]


@FUZZ
@given(st.sampled_from(REWRITE_CASES), st.binary(max_size=300))
def test_rewriters_random_bytes(case: tuple[int, int], payload: bytes) -> None:
    api_key, version = case
    try:
        ResponseRewriter(advertised).rewrite(api_key, version, payload)
    except ProtocolError:
        pass


@st.composite
def mutated_responses(draw: st.DrawFn) -> tuple[int, int, bytes]:
    api_key, version = draw(st.sampled_from(REWRITE_CASES))
    body_type = load_response_schema(api_key, min(version, 4) if api_key == 18 else version)
    payload = bytearray(fx.response_payload(draw(st.from_type(body_type)), 1))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.integers(0, 2))
        at = draw(st.integers(0, len(payload)))
        if action == 0 and at < len(payload):
            payload[at] = draw(st.integers(0, 255))
        elif action == 1:
            del payload[at:]
        else:
            payload[at:at] = draw(st.binary(min_size=1, max_size=4))
    return api_key, version, bytes(payload)


@settings(FUZZ, max_examples=EXAMPLES * 4)
@given(mutated_responses())
def test_rewriters_mutated_responses(case: tuple[int, int, bytes]) -> None:
    api_key, version, payload = case
    try:
        result = ResponseRewriter(advertised).rewrite(api_key, version, payload)
    except ProtocolError:
        return
    assert isinstance(result.to_bytes(), bytes)


def test_fuzz_cases_cover_every_rewriter() -> None:
    assert {k for k, _ in REWRITE_CASES} == {0, 1, 3, 10, 18, 60, 78, 79}

