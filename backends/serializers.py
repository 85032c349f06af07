"""Serializers: bytes for the changelog, typed Arrow columns for materialized tables.

Each serializer has a stable ``name`` recorded with the state; a restore compares names
and raises :class:`~dstl.errors.SchemaMismatchError` on a difference. ``serializer_for``
rebuilds one from its name. Typed serializers map to Arrow types so Spark reads typed
columns; :class:`PickleSerializer` is the fallback for arbitrary objects (a binary column).
"""

from __future__ import annotations

import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa

from dstl._records import pack_float64, pack_int64
from dstl.errors import ConfigError, CorruptionError


class Serializer(Protocol):
    """Turns values into bytes and Arrow columns and back. Stateless and thread-safe."""

    name: str
    arrow_type: pa.DataType

    def serialize(self, value: Any) -> bytes:
        """Bytes of ``value``."""
        ...

    def deserialize(self, data: bytes) -> Any:
        """The value of ``data``."""
        ...

    def to_arrow(self, values: Sequence[Any]) -> pa.Array:
        """A typed column of ``values``."""
        ...

    def from_arrow(self, column: pa.Array | pa.ChunkedArray) -> list[Any]:
        """The values of a column written by :meth:`to_arrow`."""
        ...


class _Typed:
    """Base of serializers whose values Arrow holds natively."""

    name = ""
    arrow_type: pa.DataType = pa.null()

    def to_arrow(self, values: Sequence[Any]) -> pa.Array:
        return pa.array(values, type=self.arrow_type)

    def from_arrow(self, column: pa.Array | pa.ChunkedArray) -> list[Any]:
        return column.to_pylist()

    def __repr__(self) -> str:
        return f"<serializer {self.name}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Typed) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        # By name: a keyed function pickled by value (the Spark host ships the driver's
        # classes to its state servers) carries the serializers its globals name.
        return (serializer_for, (self.name,))


class _Struct(_Typed):
    """A fixed-width number. ``pack`` writes what ``fmt`` does; int64 and float64 use the
    change-record buffer's C conversion (:mod:`dstl._records`), so a value is refused
    with the same error (TypeError, OverflowError) on every store and path."""

    def __init__(
        self,
        name: str,
        fmt: str,
        arrow_type: pa.DataType,
        pack: Callable[[Any], bytes] | None = None,
    ) -> None:
        self.name = name
        self._struct = struct.Struct(fmt)
        self.arrow_type = arrow_type
        self.serialize = pack or self._struct.pack  # type: ignore[method-assign,assignment]

    def serialize(self, value: Any) -> bytes:  # replaced per instance by ``pack``
        return self._struct.pack(value)

    def deserialize(self, data: bytes) -> Any:
        try:
            return self._struct.unpack(data)[0]
        except struct.error as exc:
            raise CorruptionError(f"{self.name}: cannot decode {len(data)} bytes") from exc


class StrSerializer(_Typed):
    """UTF-8 strings."""

    name = "str"
    arrow_type = pa.string()

    def __init__(self) -> None:
        self.serialize = str.encode  # type: ignore[method-assign,assignment]

    def serialize(self, value: Any) -> bytes:  # replaced per instance by str.encode
        return str.encode(value)

    def deserialize(self, data: bytes) -> Any:
        return data.decode()


class BytesSerializer(_Typed):
    """Raw bytes."""

    name = "bytes"
    arrow_type = pa.binary()

    def serialize(self, value: Any) -> bytes:
        return bytes(value)

    def deserialize(self, data: bytes) -> Any:
        return data


class PickleSerializer(_Typed):
    """Any picklable object; a binary column in tables. The fallback, not the fast path."""

    name = "pickle"
    arrow_type = pa.binary()

    def serialize(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=5)

    def deserialize(self, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except Exception as exc:
            raise CorruptionError(f"pickle: cannot decode {len(data)} bytes ({exc})") from exc

    def to_arrow(self, values: Sequence[Any]) -> pa.Array:
        return pa.array([self.serialize(v) for v in values], type=pa.binary())

    def from_arrow(self, column: pa.Array | pa.ChunkedArray) -> list[Any]:
        return [self.deserialize(b) for b in column.to_pylist()]


class OpaquePickleSerializer(BytesSerializer):
    """Pickled values left as their bytes: how a store's values are read when it is not
    trusted (tools, Spark jobs). Same name and column as :class:`PickleSerializer`, so a
    table written from it is byte-identical, but nothing is ever unpickled: unpickling runs
    code, and a store written by somebody else must not run code in the reader.
    """

    name = "pickle"


INT64: Serializer = _Struct("int64", "<q", pa.int64(), pack_int64)
FLOAT64: Serializer = _Struct("float64", "<d", pa.float64(), pack_float64)
BOOL: Serializer = _Struct("bool", "<?", pa.bool_())
STR: Serializer = StrSerializer()
BYTES: Serializer = BytesSerializer()
PICKLE: Serializer = PickleSerializer()

_FIXED = {"int64": "q", "float64": "d", "bool": "?"}
_VIEWED = {"int64": (8, pa.int64()), "float64": (8, pa.float64())}


def decode_column(serializer: Serializer, column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """The values of a binary column of ``serializer``'s bytes (the log's key or value
    column), with no Python call per value for int64, float64, str and bytes: Arrow
    reinterprets the bytes (little-endian, like the serializers) or checks UTF-8.

    Raises :class:`CorruptionError` when a value's bytes do not decode.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    name = serializer.name
    try:
        if name in _VIEWED and sys.byteorder == "little":
            width, typ = _VIEWED[name]
            return column.cast(pa.binary(width)).view(typ).to_pylist()
        if name == "str":
            return column.cast(pa.string()).to_pylist()
        if name == "bytes":
            return column.to_pylist()
    except pa.ArrowInvalid as exc:
        raise CorruptionError(f"{name}: cannot decode a column of {len(column)} values") from exc
    return list(map(serializer.deserialize, column.to_pylist()))


_LEN4 = struct.Struct("<I")


class TupleSerializer(_Typed):
    """Fixed-arity tuples of other serializers' values: ``tuple<int64,str>``.

    Bytes: all-fixed-width tuples are one ``struct`` (fast path); otherwise each element
    is written in order, variable-width ones with a 4-byte length prefix. Arrow: a struct
    column with fields ``f0, f1, ...`` typed by the elements, so Spark sees typed fields.
    Stateless and thread-safe; the name round-trips through :func:`serializer_for`.
    """

    def __init__(self, elements: Sequence[Serializer]) -> None:
        if not elements:
            raise ConfigError("a tuple serializer needs at least one element")
        self.elements = tuple(elements)
        self.name = "tuple<" + ",".join(e.name for e in self.elements) + ">"
        self.arrow_type = pa.struct(
            [pa.field(f"f{i}", e.arrow_type) for i, e in enumerate(self.elements)]
        )
        if all(e.name in _FIXED for e in self.elements):
            fixed = struct.Struct("<" + "".join(_FIXED[e.name] for e in self.elements))
            self._fixed: struct.Struct | None = fixed
        else:
            self._fixed = None

    def serialize(self, value: Any) -> bytes:
        fixed = self._fixed
        if fixed is not None:
            return fixed.pack(*value)
        if len(value) != len(self.elements):
            raise ConfigError(f"{self.name}: expected {len(self.elements)} fields, got {value!r}")
        out = bytearray()
        for e, v in zip(self.elements, value, strict=True):
            data = e.serialize(v)
            if e.name not in _FIXED:
                out += _LEN4.pack(len(data))
            out += data
        return bytes(out)

    def deserialize(self, data: bytes) -> Any:
        fixed = self._fixed
        try:
            if fixed is not None:
                return fixed.unpack(data)
            out = []
            pos = 0
            for e in self.elements:
                code = _FIXED.get(e.name)
                if code is not None:
                    n = struct.calcsize("<" + code)
                else:
                    (n,) = _LEN4.unpack_from(data, pos)
                    pos += 4
                if pos + n > len(data):
                    raise CorruptionError(f"{self.name}: truncated value")
                out.append(e.deserialize(data[pos : pos + n]))
                pos += n
            if pos != len(data):
                raise CorruptionError(f"{self.name}: {len(data) - pos} trailing bytes")
            return tuple(out)
        except struct.error as exc:
            raise CorruptionError(f"{self.name}: cannot decode {len(data)} bytes") from exc

    def to_arrow(self, values: Sequence[Any]) -> pa.Array:
        columns = [e.to_arrow([v[i] for v in values]) for i, e in enumerate(self.elements)]
        return pa.StructArray.from_arrays(columns, fields=list(self.arrow_type))

    def from_arrow(self, column: pa.Array | pa.ChunkedArray) -> list[Any]:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        fields = [e.from_arrow(column.field(i)) for i, e in enumerate(self.elements)]
        return list(zip(*fields, strict=True)) if fields else []


class TtlSerializer(_Typed):
    """The stored form of a value of a state with TTL: ``(timestamp_ms, value)``.

    Bytes: the 8-byte big-endian timestamp, then the value's bytes. Arrow: a struct
    ``<ts int64, value T>``. Internal to backends (the state's recorded serializer stays
    the user's); stateless and thread-safe.
    """

    _TS = struct.Struct(">q")

    def __init__(self, inner: Serializer) -> None:
        self.inner = inner
        self.name = f"ttl<{inner.name}>"
        self.arrow_type = pa.struct(
            [pa.field("ts", pa.int64()), pa.field("value", inner.arrow_type)]
        )

    def serialize(self, value: Any) -> bytes:
        return self._TS.pack(value[0]) + self.inner.serialize(value[1])

    def deserialize(self, data: bytes) -> Any:
        if len(data) < 8:
            raise CorruptionError(f"{self.name}: truncated value")
        return (self._TS.unpack_from(data)[0], self.inner.deserialize(data[8:]))

    def to_arrow(self, values: Sequence[Any]) -> pa.Array:
        return pa.StructArray.from_arrays(
            [
                pa.array([v[0] for v in values], pa.int64()),
                self.inner.to_arrow([v[1] for v in values]),
            ],
            fields=list(self.arrow_type),
        )

    def from_arrow(self, column: pa.Array | pa.ChunkedArray) -> list[Any]:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        ts = column.field(0).to_pylist()
        return list(zip(ts, self.inner.from_arrow(column.field(1)), strict=True))


_BY_NAME: dict[str, Serializer] = {s.name: s for s in (INT64, FLOAT64, BOOL, STR, BYTES, PICKLE)}
# Untrusted resolution: the same, with pickle kept as bytes (user serializers registered by
# name stay out: their code is the user's, and a store names them, it does not ship them).
_UNTRUSTED: dict[str, Serializer] = {
    **{name: s for name, s in _BY_NAME.items() if name != "pickle"},
    "pickle": OpaquePickleSerializer(),
}


def _split_top_level(inner: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(inner):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return parts


def serializer_for(name: str, trusted: bool = True) -> Serializer:
    """The serializer recorded as ``name`` (what a restore needs).

    Every built-in name round-trips, including composite ones (``tuple<int64,str>``,
    nested tuples, ``ttl<...>``). Composite serializers are built once and cached.
    ``trusted=False`` is for reading a store that may come from somebody else: pickled
    values stay bytes (:class:`OpaquePickleSerializer`) and user-registered serializers
    are unknown (:class:`ConfigError`), so reading runs none of the store's code.
    """
    known = _BY_NAME if trusted else _UNTRUSTED
    found = known.get(name)
    if found is not None:
        return found
    for prefix in ("tuple<", "ttl<"):
        if name.startswith(prefix) and name.endswith(">"):
            parts = _split_top_level(name[len(prefix) : -1])
            if prefix == "tuple<":
                made: Serializer = TupleSerializer([serializer_for(p, trusted) for p in parts])
            elif len(parts) == 1:
                made = TtlSerializer(serializer_for(parts[0], trusted))
            else:
                break
            known[made.name] = made
            return made
    raise ConfigError(f"unknown serializer {name!r}; known: {sorted(known)}") from None


def tuple_of(*elements: Serializer) -> Serializer:
    """The serializer of tuples of ``elements`` (e.g. ``tuple_of(STR, INT64)``)."""
    return serializer_for("tuple<" + ",".join(e.name for e in elements) + ">")


def ttl_of(inner: Serializer) -> Serializer:
    """The stored-form serializer of a TTL state whose values use ``inner``."""
    return serializer_for(f"ttl<{inner.name}>")


def register_serializer(serializer: Serializer) -> None:
    """Make a user serializer restorable by name. Names must be unique."""
    existing = _BY_NAME.get(serializer.name)
    if existing is not None and existing is not serializer:
        raise ConfigError(f"serializer name {serializer.name!r} already registered")
    _BY_NAME[serializer.name] = serializer


_LEN = struct.Struct("<I")


def pack_list(items: Sequence[bytes]) -> bytes:
    """Frame serialized list elements into one value (length-prefixed)."""
    pack = _LEN.pack
    return b"".join([pack(len(item)) + item for item in items])


def unpack_list(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack_list`; a truncated frame is corruption."""
    out: list[bytes] = []
    pos, end = 0, len(data)
    while pos < end:
        if pos + 4 > end:
            raise CorruptionError("truncated list frame")
        (n,) = _LEN.unpack_from(data, pos)
        pos += 4
        if pos + n > end:
            raise CorruptionError("truncated list element")
        out.append(data[pos : pos + n])
        pos += n
    return out
