"""Build Kafka frames with kio's own types and encoder (tests and benchmarks).

Not used on the data path. kio's pure-Python encoder is slow (DESIGN §9:
~100 ms for a 10k-partition Metadata) but it is the reference encoding the
rewriter's splices are checked against.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import struct
import uuid

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from kio.schema.errors import ErrorCode
from kio.schema.response_header.v0.header import ResponseHeader as ResponseHeaderV0
from kio.serial import entity_reader
from kio.serial import entity_writer
from kio.static.primitive import Records
from kio.static.primitive import i32Timedelta
from kio.static.primitive import i64Timedelta

from proxy._wire import _split_type
from proxy._wire import element_type

__all__ = (
    "encode",
    "make",
    "nested",
    "request_payload",
    "request_frame",
    "response_payload",
    "response_frame",
    "decode_response",
    "metadata_response",
)

_LEN = struct.Struct(">i")


def encode(entity: Any) -> bytes:
    buffer = io.BytesIO()
    entity_writer(type(entity))(buffer, entity)
    return buffer.getvalue()


def _zero(field: dataclasses.Field) -> Any:
    is_array, inner, optional = _split_type(field)
    if is_array:
        return ()
    if dataclasses.is_dataclass(inner):
        return None if optional else make(inner)
    kafka_type = field.metadata.get("kafka_type")
    if kafka_type == "error_code":
        return ErrorCode.none
    if kafka_type == "string":
        return None if optional else ""
    if kafka_type in ("bytes", "records"):
        return None if optional else Records(b"")
    if kafka_type == "timedelta_i32":
        return i32Timedelta.parse(datetime.timedelta(0))
    if kafka_type == "timedelta_i64":
        return i64Timedelta.parse(datetime.timedelta(0))
    if kafka_type == "uuid":
        return None if optional else uuid.UUID(int=0)
    if kafka_type == "bool":
        return False
    if kafka_type == "datetime_i64":
        return None
    if kafka_type == "float64":
        return 0.0
    return 0


def make(entity_type: type, **values: Any) -> Any:
    """Instantiate a kio entity of any version from the values that apply.

    Values for fields this version does not have are ignored (e.g. ``rack``
    for Metadata v0); required fields without a value get a zero value.
    """
    kwargs = {}
    for field in dataclasses.fields(entity_type):
        if field.name in values:
            kwargs[field.name] = values[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            kwargs[field.name] = _zero(field)
    return entity_type(**kwargs)


def nested(entity_type: type, field_name: str) -> type:
    """The element type of an array field (e.g. the broker type of Metadata)."""
    for field in dataclasses.fields(entity_type):
        if field.name == field_name:
            et = element_type(field)
            if et is not None:
                return et
            _, inner, _ = _split_type(field)
            return inner
    raise KeyError(field_name)


def request_payload(body: Any, correlation_id: int, client_id: str | None = "kproxy-test") -> bytes:
    header_type = body.__header_schema__
    header = header_type(
        request_api_key=body.__api_key__,
        request_api_version=body.__version__,
        correlation_id=correlation_id,
        client_id=client_id,
    )
    return encode(header) + encode(body)


def request_frame(body: Any, correlation_id: int, client_id: str | None = "kproxy-test") -> bytes:
    payload = request_payload(body, correlation_id, client_id)
    return _LEN.pack(len(payload)) + payload


def _response_header_type(body_type: type) -> type:
    if body_type.__api_key__ == 18:  # ApiVersions: header v0 whatever the version
        return ResponseHeaderV0
    return body_type.__header_schema__


def response_payload(body: Any, correlation_id: int) -> bytes:
    header = _response_header_type(type(body))(correlation_id=correlation_id)
    return encode(header) + encode(body)


def response_frame(body: Any, correlation_id: int) -> bytes:
    payload = response_payload(body, correlation_id)
    return _LEN.pack(len(payload)) + payload


def decode_response(body_type: type, frame_or_payload: bytes, *, framed: bool = True) -> tuple[int, Any]:
    """(correlation_id, body) from a response frame; checks every byte is used."""
    data = memoryview(frame_or_payload)
    if framed:
        (length,) = _LEN.unpack_from(data, 0)
        if length != len(data) - 4:
            raise ValueError(f"length prefix {length} != {len(data) - 4}")
        data = data[4:]
    header_type = _response_header_type(body_type)
    header, offset = entity_reader(header_type)(data, 0)
    body, size = entity_reader(body_type)(data, offset)
    if offset + size != len(data):
        raise ValueError(f"{len(data) - offset - size} trailing bytes")
    return header.correlation_id, body


def metadata_response(
    body_type: type,
    brokers: Iterable[tuple[int, str, int, str | None]],
    partitions: int,
    topics: int = 1,
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """A Metadata response of ``body_type``'s version with ``partitions``
    partitions spread over ``topics`` topics, replicas on every broker."""
    broker_type = nested(body_type, "brokers")
    topic_type = nested(body_type, "topics")
    partition_type = nested(topic_type, "partitions")
    broker_list = tuple(
        make(broker_type, node_id=n, host=h, port=p, rack=r) for n, h, p, r in brokers
    )
    ids = tuple(b.node_id for b in broker_list)
    per_topic = [partitions // topics + (1 if i < partitions % topics else 0) for i in range(topics)]
    topic_list = []
    for t, count in enumerate(per_topic):
        parts = tuple(
            make(
                partition_type,
                partition_index=i,
                leader_id=ids[i % len(ids)] if ids else -1,
                leader_epoch=7,
                replica_nodes=ids,
                isr_nodes=ids,
            )
            for i in range(count)
        )
        topic_list.append(
            make(
                topic_type,
                name=f"topic-{t}",
                topic_id=uuid.UUID(int=t + 1),
                partitions=parts,
            )
        )
    return make(
        body_type,
        brokers=broker_list,
        cluster_id="cluster-x",
        controller_id=ids[0] if ids else -1,
        topics=tuple(topic_list),
        **dict(extra or {}),
    )
