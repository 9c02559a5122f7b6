"""Property tests: splicing equals "decode with kio, replace, re-encode".

For random responses of every address-carrying API and version (kio's types
plus Hypothesis' ``from_type``), the rewriter's output must be byte for byte
what kio's encoder writes for the same response with only host/port
replaced. Fast and derandomized by default; set KPROXY_HYPOTHESIS_EXAMPLES
for a thorough run.
"""

from __future__ import annotations

import dataclasses
import os
import typing

import pytest

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from kio.index import load_response_schema
from kio.static.primitive import Records

from chaos.bench import frames as fx
from proxy._wire import is_address_entity
from proxy.errors import EmptyBrokerList
from proxy.rewrite import FULL_LIST_APIS
from proxy.rewrite import ResponseRewriter
from proxy.rewrite import address_versions

pytestmark = pytest.mark.unit

st.register_type_strategy(Records, st.binary(max_size=64).map(Records))

EXAMPLES = int(os.environ.get("KPROXY_HYPOTHESIS_EXAMPLES", "15"))
FAST = settings(
    max_examples=EXAMPLES,
    derandomize=EXAMPLES <= 50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def advertised(node_id: int) -> tuple[str, int]:
    """A total mapping, one distinct host per node id."""
    return f"proxy-{node_id}.fleet", 10000 + node_id % 50000


def map_entities(value: typing.Any, fn: typing.Callable[[typing.Any], typing.Any]) -> typing.Any:
    """Apply ``fn`` to every address entity inside a kio value (bottom-up)."""
    if isinstance(value, tuple):
        return tuple(map_entities(v, fn) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for field in dataclasses.fields(value):
            old = getattr(value, field.name)
            new = map_entities(old, fn)
            if new is not old:
                changes[field.name] = new
        if changes:
            value = dataclasses.replace(value, **changes)
        if is_address_entity(type(value)):
            value = fn(value)
        return value
    return value


def _node_field(entity: typing.Any) -> str:
    return "node_id" if hasattr(entity, "node_id") else "broker_id"


def sanitize(entity: typing.Any) -> typing.Any:
    # Real brokers have node ids >= 0; -1 is "no node" with host "".
    name = _node_field(entity)
    return dataclasses.replace(entity, **{name: abs(getattr(entity, name)) % (2**31)})


def replace_address(entity: typing.Any) -> typing.Any:
    host, port = advertised(getattr(entity, _node_field(entity)))
    return dataclasses.replace(entity, host=host, port=port)


# -- Metadata with hand-shaped strategies ------------------------------------------------


@st.composite
def metadata_responses(draw: st.DrawFn) -> typing.Any:
    version = draw(st.integers(0, 13))
    body_type = load_response_schema(3, version)
    broker_type = fx.nested(body_type, "brokers")
    topic_type = fx.nested(body_type, "topics")
    node_ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6, unique=True))
    brokers = tuple(
        fx.make(
            broker_type,
            node_id=n,
            host=draw(st.text(min_size=1, max_size=40)),
            port=draw(st.integers(0, 65535)),
            rack=draw(st.none() | st.text(max_size=10)),
        )
        for n in node_ids
    )
    topics = draw(st.lists(st.from_type(topic_type), max_size=4).map(tuple))
    base = draw(st.from_type(body_type))
    return dataclasses.replace(base, brokers=brokers, topics=topics)


@FAST
@given(metadata_responses(), st.integers(-(2**31), 2**31 - 1))
def test_metadata_splice_equals_reencode(body: typing.Any, correlation_id: int) -> None:
    expected = dataclasses.replace(
        body, brokers=tuple(replace_address(b) for b in body.brokers)
    )
    rewriter = ResponseRewriter(advertised)
    result = rewriter.rewrite(3, body.__version__, fx.response_payload(body, correlation_id))
    assert result.to_bytes() == fx.response_payload(expected, correlation_id)
    assert [b.node_id for b in result.brokers] == [b.node_id for b in body.brokers]
    assert [b.host for b in result.brokers] == [b.host for b in body.brokers]


# -- every address-carrying API and version, random bodies --------------------------------

CASES = [(k, v) for k, vs in sorted(address_versions().items()) for v in vs]


@pytest.mark.parametrize(("api_key", "version"), CASES, ids=[f"{k}-v{v}" for k, v in CASES])
def test_splice_equals_reencode_for_every_version(api_key: int, version: int) -> None:
    body_type = load_response_schema(api_key, version)

    @settings(FAST, max_examples=max(3, EXAMPLES // 3))
    @given(st.from_type(body_type), st.integers(0, 2**31 - 1))
    def check(raw: typing.Any, correlation_id: int) -> None:
        body = map_entities(raw, sanitize)
        expected = map_entities(body, replace_address)
        payload = fx.response_payload(body, correlation_id)
        rewriter = ResponseRewriter(advertised)
        if api_key in FULL_LIST_APIS and not _brokers(body):
            with pytest.raises(EmptyBrokerList):
                rewriter.rewrite(api_key, version, payload)
            return
        assert rewriter.rewrite(api_key, version, payload).to_bytes() == fx.response_payload(expected, correlation_id)

    check()


def _brokers(body: typing.Any) -> tuple:
    return tuple(getattr(body, "brokers", ()))
