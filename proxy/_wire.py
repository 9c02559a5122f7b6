"""Kafka wire primitives and a schema-driven byte walker (internal).

Nothing here decodes whole messages. The walker is *compiled from kio's
generated dataclasses* (never a hand-written schema, STYLE.md): for an entity
type it builds a function ``skip(buf, off, end) -> off`` that steps over one
encoded instance, and for the entities that carry a broker address
(``node_id``/``broker_id`` + ``host`` + ``port``) a parser that returns the byte
spans of ``host`` and ``port`` so that a rewriter can splice new values in and
copy every other byte verbatim (including tagged fields it does not know).

Conventions: ``buf`` is any bytes-like object (bytes, bytearray, memoryview of
format "B"), ``off`` the position to read at, ``end`` the first position past
the region that belongs to the value. Every read is bounds-checked against
``end``; a violation raises :class:`WireError`, which public callers turn into
:class:`proxy.errors.MalformedFrame` with the right side.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import types
import typing

from collections.abc import Callable
from typing import Final
from typing import TypeAlias

__all__ = (
    "WireError",
    "Buffer",
    "Skip",
    "I16",
    "I32",
    "read_uvarint",
    "encode_uvarint",
    "read_array_count",
    "encode_array_count",
    "read_string",
    "encode_string",
    "skip_tagged_fields",
    "skipper",
    "AddressEntity",
    "AddressSpan",
    "address_entity",
    "regular_fields",
    "field_tag",
    "is_address_entity",
    "element_type",
)

Buffer: TypeAlias = "bytes | bytearray | memoryview"
Skip: TypeAlias = Callable[[typing.Any, int, int], int]

I16: Final = struct.Struct(">h")
I32: Final = struct.Struct(">i")
_I16_unpack = I16.unpack_from
_I32_unpack = I32.unpack_from


class WireError(Exception):
    """Internal: the bytes do not follow the schema (converted at the API)."""


# -- primitives -----------------------------------------------------------------


def read_i16(buf: Buffer, off: int, end: int) -> int:
    if off + 2 > end:
        raise WireError("int16 past end")
    return _I16_unpack(buf, off)[0]


def read_i32(buf: Buffer, off: int, end: int) -> int:
    if off + 4 > end:
        raise WireError("int32 past end")
    return _I32_unpack(buf, off)[0]


def read_uvarint(buf: Buffer, off: int, end: int) -> tuple[int, int]:
    """Unsigned varint as Kafka writes it (at most 5 bytes for 32 bits)."""
    result = 0
    shift = 0
    while True:
        if off >= end:
            raise WireError("varint past end")
        byte = buf[off]
        off += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, off
        shift += 7
        if shift > 28:
            raise WireError("varint longer than 5 bytes")


def encode_uvarint(value: int) -> bytes:
    if value < 0:
        raise ValueError("uvarint must be non-negative")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_array_count(buf: Buffer, off: int, end: int, flexible: bool) -> tuple[int, int]:
    """Element count of an array; -1 for a null array."""
    if flexible:
        n, off = read_uvarint(buf, off, end)
        return n - 1, off
    n = read_i32(buf, off, end)
    if n < -1:
        raise WireError(f"negative array length {n}")
    return n, off + 4


def encode_array_count(count: int, flexible: bool) -> bytes:
    return encode_uvarint(count + 1) if flexible else I32.pack(count)


def _string_bounds(buf: Buffer, off: int, end: int, flexible: bool, wide: bool) -> tuple[int, int]:
    """(start, length) of a string/bytes value; length -1 for null."""
    if flexible:
        n, off = read_uvarint(buf, off, end)
        n -= 1
    elif wide:
        n = read_i32(buf, off, end)
        off += 4
    else:
        n = read_i16(buf, off, end)
        off += 2
    if n < -1:
        raise WireError(f"negative length {n}")
    if n > 0 and off + n > end:
        raise WireError("string past end")
    return off, n


def read_string(buf: Buffer, off: int, end: int, flexible: bool) -> tuple[str | None, int]:
    """A (nullable) string; invalid UTF-8 is replaced, as Java's decoder does."""
    start, n = _string_bounds(buf, off, end, flexible, wide=False)
    if n < 0:
        return None, start
    return str(buf[start : start + n], "utf-8", "replace"), start + n


def encode_string(value: str, flexible: bool) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 0x7FFF:
        raise ValueError("string longer than 32767 bytes")
    if flexible:
        return encode_uvarint(len(raw) + 1) + raw
    return I16.pack(len(raw)) + raw


def skip_tagged_fields(buf: Buffer, off: int, end: int) -> int:
    count, off = read_uvarint(buf, off, end)
    if count > end - off:
        raise WireError("tagged field count larger than the rest")
    for _ in range(count):
        _, off = read_uvarint(buf, off, end)
        size, off = read_uvarint(buf, off, end)
        off += size
        if off > end:
            raise WireError("tagged field past end")
    return off


# -- kio schema introspection -------------------------------------------------------

# Fixed-size Kafka types (bytes on the wire).
_FIXED: Final[dict[str, int]] = {
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "int16": 2,
    "uint16": 2,
    "error_code": 2,
    "int32": 4,
    "uint32": 4,
    "timedelta_i32": 4,
    "int64": 8,
    "uint64": 8,
    "timedelta_i64": 8,
    "datetime_i64": 8,
    "float64": 8,
    "uuid": 16,
}
_STRINGS: Final = frozenset({"string"})
_BYTES: Final = frozenset({"bytes", "records"})


def field_tag(field: dataclasses.Field) -> int | None:
    tag = field.metadata.get("tag")
    return None if tag is None else int(tag)


def regular_fields(entity_type: type) -> list[dataclasses.Field]:
    """The non-tagged fields of a kio entity, in wire order."""
    return [f for f in dataclasses.fields(entity_type) if field_tag(f) is None]


def _unwrap_optional(tp: typing.Any) -> tuple[typing.Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        return args[0], True
    return tp, False


def _split_type(field: dataclasses.Field) -> tuple[bool, typing.Any, bool]:
    """(is_array, inner type, optional) of a kio field."""
    tp, optional = _unwrap_optional(field.type)
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0]
        inner, _ = _unwrap_optional(inner)
        return True, inner, optional
    return False, tp, optional


def element_type(field: dataclasses.Field) -> type | None:
    """The entity type of an array-of-entities field, else None."""
    is_array, inner, _ = _split_type(field)
    if is_array and dataclasses.is_dataclass(inner):
        return inner
    return None


def _fixed_step(size: int) -> Skip:
    def step(buf: Buffer, off: int, end: int) -> int:
        return off + size

    return step


def _string_step(flexible: bool, wide: bool) -> Skip:
    def step(buf: Buffer, off: int, end: int) -> int:
        start, n = _string_bounds(buf, off, end, flexible, wide)
        return start + n if n > 0 else start

    return step


def _array_step(flexible: bool, element: Skip, min_size: int) -> Skip:
    floor = max(min_size, 1)

    def step(buf: Buffer, off: int, end: int) -> int:
        count, off = read_array_count(buf, off, end, flexible)
        if count <= 0:
            return off
        if count * floor > end - off:
            raise WireError("array longer than the rest")
        for _ in range(count):
            off = element(buf, off, end)
        return off

    return step


def _fixed_array_step(flexible: bool, size: int) -> Skip:
    def step(buf: Buffer, off: int, end: int) -> int:
        count, off = read_array_count(buf, off, end, flexible)
        if count <= 0:
            return off
        off += count * size
        if off > end:
            raise WireError("array past end")
        return off

    return step


def _nullable_entity_step(inner: Skip) -> Skip:
    # KIP-893 nullable struct: int8 marker, -1 = null, 1 = present.
    def step(buf: Buffer, off: int, end: int) -> int:
        if off >= end:
            raise WireError("struct marker past end")
        marker = buf[off]
        if marker == 0xFF:
            return off + 1
        if marker != 1:
            raise WireError(f"bad nullable struct marker {marker}")
        return inner(buf, off + 1, end)

    return step


def _primitive_step(kafka_type: str, flexible: bool) -> tuple[Skip | int, int]:
    """A step (or a fixed size) and the minimum encoded size of one value."""
    if kafka_type in _FIXED:
        return _FIXED[kafka_type], _FIXED[kafka_type]
    if kafka_type in _STRINGS:
        return _string_step(flexible, wide=False), 1 if flexible else 2
    if kafka_type in _BYTES:
        return _string_step(flexible, wide=True), 1 if flexible else 4
    raise TypeError(f"unknown kafka_type {kafka_type!r}")


def _field_step(field: dataclasses.Field, flexible: bool) -> tuple[Skip | int, int]:
    is_array, inner, optional = _split_type(field)
    if dataclasses.is_dataclass(inner):
        skip, min_size = _compiled(inner)
        if is_array:
            return _array_step(flexible, skip, min_size), 1 if flexible else 4
        if optional:
            return _nullable_entity_step(skip), 1
        return skip, min_size
    kafka_type = field.metadata["kafka_type"]
    step, min_size = _primitive_step(kafka_type, flexible)
    if not is_array:
        return step, min_size
    if isinstance(step, int):
        return _fixed_array_step(flexible, step), 1 if flexible else 4
    return _array_step(flexible, step, min_size), 1 if flexible else 4


def _chain(parts: list[Skip | int]) -> list[Skip]:
    """Coalesce consecutive fixed sizes into one step."""
    steps: list[Skip] = []
    pending = 0
    for part in parts:
        if isinstance(part, int):
            pending += part
            continue
        if pending:
            steps.append(_fixed_step(pending))
            pending = 0
        steps.append(part)
    if pending:
        steps.append(_fixed_step(pending))
    return steps


def field_steps(fields: list[dataclasses.Field], flexible: bool) -> list[Skip]:
    return _chain([_field_step(f, flexible)[0] for f in fields])


@functools.cache
def _compiled(entity_type: type) -> tuple[Skip, int]:
    flexible = bool(entity_type.__flexible__)
    parts: list[Skip | int] = []
    min_size = 0
    for f in regular_fields(entity_type):
        step, size = _field_step(f, flexible)
        parts.append(step)
        min_size += size
    if flexible:
        parts.append(skip_tagged_fields)
        min_size += 1
    steps = tuple(_chain(parts))

    def skip(buf: Buffer, off: int, end: int) -> int:
        for step in steps:
            off = step(buf, off, end)
        if off > end:
            raise WireError("entity past end")
        return off

    return skip, min_size


def skipper(entity_type: type) -> Skip:
    """``skip(buf, off, end) -> off`` for one encoded instance of a kio entity."""
    return _compiled(entity_type)[0]


# -- address-carrying entities ------------------------------------------------------

NODE_FIELDS: Final = ("node_id", "broker_id")


def is_address_entity(entity_type: type) -> bool:
    """Has an int32 node id, a string ``host`` and an int32 ``port``."""
    kinds = {
        f.name: f.metadata.get("kafka_type") for f in regular_fields(entity_type)
    }
    return (
        kinds.get("host") == "string"
        and kinds.get("port") == "int32"
        and any(kinds.get(name) == "int32" for name in NODE_FIELDS)
    )


class AddressSpan(typing.NamedTuple):
    """Where one address sits in the buffer, and what it says."""

    start: int  # first byte of the entity (or of the first walked field)
    end: int  # first byte after the entity (after the port, if not ``whole``)
    node_id: int
    host: str
    host_start: int
    host_end: int
    port: int
    port_start: int
    rack: str | None


_NODE, _HOST, _PORT, _RACK = range(4)


@dataclasses.dataclass(frozen=True, slots=True)
class AddressEntity:
    """Compiled parser for an entity carrying (node id, host, port[, rack])."""

    flexible: bool
    # Each step is either a Skip or one of the markers above.
    steps: tuple[Skip | int, ...]
    tagged: bool  # skip the entity's own tagged-field section at the end

    def parse(self, buf: Buffer, off: int, end: int) -> AddressSpan:
        start = off
        node_id = port = -1
        host = ""
        rack = None
        host_start = host_end = port_start = -1
        flexible = self.flexible
        for step in self.steps:
            if step.__class__ is int:
                if step == _NODE:
                    node_id = read_i32(buf, off, end)
                    off += 4
                elif step == _HOST:
                    host_start = off
                    value, off = read_string(buf, off, end, flexible)
                    if value is None:
                        raise WireError("null host")
                    host = value
                    host_end = off
                elif step == _PORT:
                    port_start = off
                    port = read_i32(buf, off, end)
                    off += 4
                else:
                    rack, off = read_string(buf, off, end, flexible)
            else:
                off = step(buf, off, end)  # type: ignore[operator]
        if self.tagged:
            off = skip_tagged_fields(buf, off, end)
        if off > end:
            raise WireError("entity past end")
        return AddressSpan(
            start, off, node_id, host, host_start, host_end, port, port_start, rack
        )


@functools.cache
def address_entity(entity_type: type, tagged: bool = True) -> AddressEntity:
    """Compile :class:`AddressEntity` for a kio entity (see is_address_entity).

    With ``tagged=False`` the walk stops after the last regular field, which is
    how a top-level response that *is* the address (FindCoordinator v0-v3) is
    handled: its own tagged fields are then copied by the caller.
    """
    if not is_address_entity(entity_type):
        raise TypeError(f"{entity_type.__qualname__} carries no address")
    flexible = bool(entity_type.__flexible__)
    parts: list[Skip | int] = []
    steps: list[Skip | int] = []
    fields = regular_fields(entity_type)
    node_name = next(
        f.name for f in fields if f.name in NODE_FIELDS and f.metadata.get("kafka_type") == "int32"
    )
    markers = {node_name: _NODE, "host": _HOST, "port": _PORT}
    if any(f.name == "rack" and f.metadata.get("kafka_type") == "string" for f in fields):
        markers["rack"] = _RACK

    def flush() -> None:
        steps.extend(_chain(parts))
        parts.clear()

    for f in fields:
        if f.name in markers:
            flush()
            steps.append(markers[f.name])
        else:
            parts.append(_field_step(f, flexible)[0])
    flush()
    return AddressEntity(flexible=flexible, steps=tuple(steps), tagged=tagged and flexible)
