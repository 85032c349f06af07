"""The batch (columnar) path: many keys of one state in one call.

:func:`prepare_batch` serializes the keys and computes their key groups once (vectorized
where possible); the store applies the prepared batch (heap: dict inserts; RocksDB: one
write batch) and the changelog wrapper logs it with one ``append_columns`` call, reusing
the same key bytes and, for RocksDB, the same value bytes.
"""

from __future__ import annotations

import struct
import zlib
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
    values: list[Any]
    user_keys: list[Any] | None = None
    value_bytes: list[bytes] | None = None
    user_key_bytes: list[bytes] | None = None

    def value_bytes_with(self, serializer: Serializer) -> list[bytes]:
        """The serialized values (computed once)."""
        if self.value_bytes is None:
            self.value_bytes = serialize_all(serializer, self.values)
        return self.value_bytes

    def user_key_bytes_with(self, serializer: Serializer) -> list[bytes]:
        """The serialized user keys (computed once)."""
        if self.user_key_bytes is None:
            assert self.user_keys is not None
            self.user_key_bytes = serialize_all(serializer, self.user_keys)
        return self.user_key_bytes


_Q = struct.Struct("<q")


def serialize_all(serializer: Serializer, values: Sequence[Any]) -> list[bytes]:
    """``[serializer.serialize(v) for v in values]`` without a Python call per value
    for the common typed serializers (``map`` over C functions)."""
    if serializer.name == "str":
        return list(map(str.encode, values))
    if serializer.name == "int64":
        return list(map(_Q.pack, values))
    return list(map(serializer.serialize, values))


def key_groups_of(key_bytes: Sequence[bytes], max_parallelism: int) -> list[int]:
    """:func:`~backends.keygroups.key_group_for` of every key, vectorized with Arrow."""
    h = pa.array(list(map(zlib.crc32, key_bytes)), pa.uint64())
    mask = pa.scalar(0xFFFFFFFF, pa.uint64())
    h = pc.bit_wise_xor(h, pc.shift_right(h, 16))
    h = pc.bit_wise_and(pc.multiply(h, pa.scalar(0x85EBCA6B, pa.uint64())), mask)
    h = pc.bit_wise_xor(h, pc.shift_right(h, 13))
    h = pc.bit_wise_and(pc.multiply(h, pa.scalar(0xC2B2AE35, pa.uint64())), mask)
    h = pc.bit_wise_xor(h, pc.shift_right(h, 16))
    m = pa.scalar(max_parallelism, pa.uint64())
    kg = pc.subtract(h, pc.multiply(pc.divide(h, m), m))
    out: list[int] = kg.to_pylist()
    return out


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
    kgs = key_groups_of(key_bytes, max_parallelism) if key_list else []
    if kgs and (min(kgs) < key_group_range.start or max(kgs) >= key_group_range.end):
        bad = next(k for k, g in zip(key_list, kgs, strict=True) if g not in key_group_range)
        raise KeyGroupOutOfRangeError(
            f"batch key {bad!r} is outside key groups "
            f"[{key_group_range.start}, {key_group_range.end})"
        )
    if meta.ttl is not None:
        value_list = [(now, v) for v in value_list]
    return meta, PreparedBatch(op, key_list, key_bytes, kgs, value_list, uk_list)
