"""Serializers: bytes for the changelog, typed Arrow columns for materialized tables.

Each serializer has a stable ``name`` recorded with the state; a restore compares names
and raises :class:`~dstl.errors.SchemaMismatchError` on a difference. ``serializer_for``
rebuilds one from its name. Typed serializers map to Arrow types so Spark reads typed
columns; :class:`PickleSerializer` is the fallback for arbitrary objects (a binary column).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import pyarrow as pa

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


class _Struct(_Typed):
    def __init__(self, name: str, fmt: str, arrow_type: pa.DataType) -> None:
        self.name = name
        self._struct = struct.Struct(fmt)
        self.arrow_type = arrow_type
        self.serialize = self._struct.pack  # type: ignore[method-assign,assignment]

    def serialize(self, value: Any) -> bytes:  # replaced per instance by Struct.pack
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

    def serialize(self, value: Any) -> bytes:
        return value.encode()

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


INT64: Serializer = _Struct("int64", "<q", pa.int64())
FLOAT64: Serializer = _Struct("float64", "<d", pa.float64())
BOOL: Serializer = _Struct("bool", "<?", pa.bool_())
STR: Serializer = StrSerializer()
BYTES: Serializer = BytesSerializer()
PICKLE: Serializer = PickleSerializer()

_BY_NAME: dict[str, Serializer] = {s.name: s for s in (INT64, FLOAT64, BOOL, STR, BYTES, PICKLE)}


def serializer_for(name: str) -> Serializer:
    """The serializer recorded as ``name`` (what a restore needs)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown serializer {name!r}; known: {sorted(_BY_NAME)}") from None


def register_serializer(serializer: Serializer) -> None:
    """Make a user serializer restorable by name. Names must be unique."""
    existing = _BY_NAME.get(serializer.name)
    if existing is not None and existing is not serializer:
        raise ConfigError(f"serializer name {serializer.name!r} already registered")
    _BY_NAME[serializer.name] = serializer


_LEN = struct.Struct("<I")


def pack_list(items: Sequence[bytes]) -> bytes:
    """Frame serialized list elements into one value (length-prefixed)."""
    out = bytearray()
    for item in items:
        out += _LEN.pack(len(item))
        out += item
    return bytes(out)


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
