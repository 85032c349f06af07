"""The batch (columnar) path: many keys of one state in one call.

:func:`prepare_batch` serializes the keys and computes their key groups once (vectorized
where possible); the store applies the prepared batch (heap: dict inserts; RocksDB: one
write batch) and the changelog wrapper logs it with one ``append_columns`` call, reusing
the same key bytes and, for RocksDB, the same value bytes.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from backends.errors import KeyGroupOutOfRangeError, UnsupportedBatchError
from backends.keygroups import KeyGroupRange
from backends.serializers import Serializer
from backends.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    Op,
    StateDescriptor,
    StateMeta,
    ValueStateDescriptor,
)


@dataclass(slots=True)
class PreparedBatch:
    """One batch of changes of one state, ready for a store and the changelog.

    ``op`` is ``VALUE_SET`` (value state), ``LIST_ADD`` (append one element per row) or
    ``MAP_PUT``; ``values`` are raw (``(ts, v)`` with TTL). Byte columns are filled lazily
    and shared, so nothing is serialized twice. Owned by the calling (task) thread.
    """

    op: Op
    keys: list[Any]
    key_bytes: list[bytes]
    key_groups: list[int]
    key_group_array: pa.Array  # ``key_groups`` as Arrow int32 (for the changelog)
    values: list[Any]
    user_keys: list[Any] | None = None
    value_bytes: list[bytes] | None = None
    user_key_bytes: list[bytes] | None = None

    def value_bytes_with(self, serializer: Serializer) -> list[bytes]:
        """The serialized values (computed once)."""
        if self.value_bytes is None:
            self.value_bytes = serialize_all(serializer, self.values)
        return self.value_bytes

    def value_column_with(self, serializer: Serializer) -> pa.Array | list[bytes]:
        """The serialized values for the changelog; an Arrow array when that is cheaper.

        Reuses :meth:`value_bytes_with`'s bytes if a store already asked for them; plain
        int64 values become a binary column straight from an Arrow int64 array.
        """
        if self.value_bytes is None and serializer.name == "int64" and _LITTLE_ENDIAN:
            try:
                ints = pa.array(self.values, pa.int64())
            except (TypeError, ValueError, OverflowError, pa.ArrowException):
                return self.value_bytes_with(serializer)  # raises the serializer's error
            return int64_as_binary(ints)
        return self.value_bytes_with(serializer)

    def user_key_bytes_with(self, serializer: Serializer) -> list[bytes]:
        """The serialized user keys (computed once)."""
        if self.user_key_bytes is None:
            assert self.user_keys is not None
            self.user_key_bytes = serialize_all(serializer, self.user_keys)
        return self.user_key_bytes


_Q = struct.Struct("<q")
_LITTLE_ENDIAN = sys.byteorder == "little"
_offsets = pa.py_buffer(b"")


def fixed8_binary(n: int, data: pa.Buffer) -> pa.Array:
    """A binary array of ``n`` 8-byte values laid end to end in ``data``.

    Only the offsets (``0, 8, 16, ...``, one buffer shared and grown on demand) are new.
    """
    global _offsets
    need = 4 * (n + 1)
    if _offsets.size < need:
        _offsets = pa.py_buffer(array("i", range(0, 8 * (2 * n + 1), 8)))
    return pa.Array.from_buffers(pa.binary(), n, [None, _offsets.slice(0, need), data])


def int64_as_binary(ints: pa.Array) -> pa.Array:
    """``INT64.serialize`` of every value of a null-free int64 array, as a binary array.

    Little-endian only: the int64 data buffer *is* the serialized bytes.
    """
    if ints.null_count or ints.offset:
        ints = pa.array(ints.to_pylist(), pa.int64())  # pragma: no cover - not from lists
    return fixed8_binary(len(ints), ints.buffers()[1])


def serialize_all(serializer: Serializer, values: Sequence[Any]) -> list[bytes]:
    """``[serializer.serialize(v) for v in values]`` without a Python call per value
    for the common typed serializers (``map`` over C functions)."""
    if serializer.name == "str":
        return list(map(str.encode, values))
    if serializer.name == "int64":
        return list(map(_Q.pack, values))
    return list(map(serializer.serialize, values))


def key_group_array_of(key_bytes: Sequence[bytes], max_parallelism: int) -> pa.Array:
    """:func:`~backends.keygroups.key_group_for` of every key as an Arrow int32 array,
    vectorized."""
    h = pa.array(list(map(zlib.crc32, key_bytes)), pa.uint64())
    mask = pa.scalar(0xFFFFFFFF, pa.uint64())
    h = pc.bit_wise_xor(h, pc.shift_right(h, 16))
    h = pc.bit_wise_and(pc.multiply(h, pa.scalar(0x85EBCA6B, pa.uint64())), mask)
    h = pc.bit_wise_xor(h, pc.shift_right(h, 13))
    h = pc.bit_wise_and(pc.multiply(h, pa.scalar(0xC2B2AE35, pa.uint64())), mask)
    h = pc.bit_wise_xor(h, pc.shift_right(h, 16))
    m = pa.scalar(max_parallelism, pa.uint64())
    kg = pc.subtract(h, pc.multiply(pc.divide(h, m), m))
    return kg.cast(pa.int32())


def _as_list(values: Any) -> list[Any]:
    if isinstance(values, pa.Array | pa.ChunkedArray):
        out: list[Any] = values.to_pylist()
        return out
    return values if isinstance(values, list) else list(values)


def prepare_batch(
    descriptor: StateDescriptor,
    key_serializer: Serializer,
    key_group_range: KeyGroupRange,
    max_parallelism: int,
    now: int,
    keys: Any,
    values: Any,
    user_keys: Any = None,
) -> tuple[StateMeta, PreparedBatch]:
    """Serialize keys, compute and check key groups, stamp TTL timestamps.

    ``keys``/``values``/``user_keys`` are sequences or Arrow arrays of equal length.
    Raises :class:`KeyGroupOutOfRangeError` (nothing applied) if a key is not owned.
    """
    if isinstance(descriptor, ValueStateDescriptor):
        op = Op.VALUE_SET
    elif isinstance(descriptor, ListStateDescriptor):
        op = Op.LIST_ADD
    elif isinstance(descriptor, MapStateDescriptor):
        op = Op.MAP_PUT
        if user_keys is None:
            raise UnsupportedBatchError(f"map state {descriptor.name!r}: batch needs user_keys")
    else:
        raise UnsupportedBatchError(
            f"apply_batch supports value, list and map state, not {descriptor!r}"
        )
    meta = descriptor.meta
    key_list = _as_list(keys)
    value_list = _as_list(values)
    uk_list = None if user_keys is None else _as_list(user_keys)
    if len(value_list) != len(key_list) or (uk_list is not None and len(uk_list) != len(key_list)):
        raise UnsupportedBatchError("apply_batch: keys, values and user_keys differ in length")
    key_bytes = serialize_all(key_serializer, key_list)
    kg_array = key_group_array_of(key_bytes, max_parallelism)
    kgs: list[int] = kg_array.to_pylist()
    if kgs and (min(kgs) < key_group_range.start or max(kgs) >= key_group_range.end):
        bad = next(k for k, g in zip(key_list, kgs, strict=True) if g not in key_group_range)
        raise KeyGroupOutOfRangeError(
            f"batch key {bad!r} is outside key groups "
            f"[{key_group_range.start}, {key_group_range.end})"
        )
    if meta.ttl is not None:
        value_list = [(now, v) for v in value_list]
    return meta, PreparedBatch(op, key_list, key_bytes, kgs, kg_array, value_list, uk_list)
