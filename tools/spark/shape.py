"""The rows the Spark data source returns, as Arrow: schemas and conversions (no Spark).

State (one row per entry; list state: one row per key, its elements in a list)::

    key_group int, key K, [user_key U,] value V, [ttl_timestamp long]

Change feed (one row per change, in the order they were made per key)::

    sequence long, checkpoint_id long, writer string, sqn long, key_group int,
    operation string, key K, [user_key U,] value V, [ttl_timestamp long]

``K``, ``U``, ``V`` are the Arrow types of the state's serializers (typed columns:
``int64`` -> long, ``str`` -> string, ``tuple<...>`` -> struct, ``pickle`` -> binary,
left as the pickled bytes, never unpickled). List state's ``V`` is ``array<T>``; in the
change feed a ``list_add`` carries its one element, a ``list_set`` the whole new list.
With TTL the value is split into ``value`` and ``ttl_timestamp`` (epoch milliseconds of
the last write, or access with ``update_on_read``; ``array<long>`` for list state): the
reader returns every entry the checkpoint holds, expired or not, and leaves expiry to
the query. ``operation`` is the change's :class:`~backends.state.Op` name in lower case
(``value_set``, ``clear``, ``list_add``, ``list_set``, ``map_put``, ``map_remove``,
``acc_set``, ``timer_register``, ``timer_delete``); ``clear`` and removals have no value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from backends.serializers import Serializer, decode_column, unpack_list
from backends.state import MAP_LIKE, Op, StateKind, StateMeta
from backends.tables import schema_for

TTL_COLUMN = "ttl_timestamp"
_OP_NAMES = {int(op): op.name.lower() for op in Op}
CHANGE_PREFIX = [
    pa.field("sequence", pa.int64()),
    pa.field("checkpoint_id", pa.int64()),
    pa.field("writer", pa.string()),
    pa.field("sqn", pa.int64()),
    pa.field("key_group", pa.int32()),
    pa.field("operation", pa.string()),
]


def _value_type(meta: StateMeta) -> pa.DataType:
    element = meta.value_ser().arrow_type
    return pa.list_(element) if meta.kind is StateKind.LIST else element


def _tail(meta: StateMeta, key_serializer: Serializer) -> list[pa.Field]:
    fields = [pa.field("key", key_serializer.arrow_type)]
    if meta.kind in MAP_LIKE:
        fields.append(pa.field("user_key", meta.user_key_ser().arrow_type))
    fields.append(pa.field("value", _value_type(meta)))
    if meta.ttl is not None:
        ts = pa.int64()
        fields.append(pa.field(TTL_COLUMN, pa.list_(ts) if meta.kind is StateKind.LIST else ts))
    return fields


def state_schema(meta: StateMeta, key_serializer: Serializer) -> pa.Schema:
    """The Arrow schema of a state's rows (every field nullable)."""
    return pa.schema([pa.field("key_group", pa.int32()), *_tail(meta, key_serializer)])


def change_schema(meta: StateMeta, key_serializer: Serializer) -> pa.Schema:
    """The Arrow schema of a state's change feed (every field nullable)."""
    return pa.schema([*CHANGE_PREFIX, *_tail(meta, key_serializer)])


def _split_ttl(column: pa.Array) -> tuple[pa.Array, pa.Array]:
    """A ``struct<ts, value>`` column as its value and timestamp columns."""
    return column.field("value"), column.field("ts")


def state_rows(meta: StateMeta, table: pa.Table) -> pa.Table:
    """A state table (:func:`backends.tables.table_for`) in the shape of
    :func:`state_schema`: TTL structs split into value and timestamp."""
    if meta.ttl is None:
        return pa.Table.from_arrays(
            [c.combine_chunks() for c in table.columns], names=table.column_names
        )
    value = table["value"].combine_chunks()
    columns = {name: table[name].combine_chunks() for name in table.column_names}
    if meta.kind is StateKind.LIST:
        inner = value.values
        values, stamps = _split_ttl(inner)
        offsets = value.offsets
        columns["value"] = pa.ListArray.from_arrays(offsets, values)
        columns[TTL_COLUMN] = pa.ListArray.from_arrays(offsets, stamps)
    else:
        columns["value"], columns[TTL_COLUMN] = _split_ttl(value)
    return pa.table(columns)


def empty_state(meta: StateMeta, key_serializer: Serializer) -> pa.Table:
    """No rows, in the state's shape."""
    return state_rows(meta, schema_for(meta, key_serializer).empty_table())


# -- the change feed -------------------------------------------------------------------
def _scatter(values: pa.Array, valid: Sequence[bool]) -> pa.Array:
    """``values`` (one per valid position) spread over ``valid``, nulls elsewhere."""
    if all(valid):
        return values
    indices: list[int | None] = []
    i = 0
    for ok in valid:
        indices.append(i if ok else None)
        i += ok
    return values.take(pa.array(indices, pa.int64()))


def _decoded(serializer: Serializer, items: list[bytes]) -> list[Any]:
    return decode_column(serializer, pa.array(items, pa.binary())) if items else []


def _typed_values(meta: StateMeta, raw: list[Any]) -> tuple[list[Any], list[Any] | None]:
    """Raw (maybe TTL-wrapped) values as user values and timestamps (None: no TTL)."""
    if meta.ttl is None:
        return raw, None
    return [v[1] for v in raw], [v[0] for v in raw]


def change_rows(
    meta: StateMeta, key_serializer: Serializer, block: pa.Table, extra: dict[str, pa.Array]
) -> pa.Table:
    """Changes of one state (a block table of :data:`dstl.segment.BLOCK_SCHEMA`, filtered
    to the state, META records removed) in the shape of :func:`change_schema`.

    ``extra`` holds ``sequence``, ``checkpoint_id`` and ``writer``, one per row. Values are
    decoded without running the store's code (``meta`` untrusted).
    """
    ops = block["op"].to_pylist()
    keys = key_serializer.to_arrow(_decoded(key_serializer, block["key"].to_pylist()))
    columns: dict[str, pa.Array] = {
        **extra,
        "sqn": block["sqn"].combine_chunks(),
        "key_group": block["key_group"].combine_chunks(),
        "operation": pa.array([_OP_NAMES.get(op, str(op)) for op in ops], pa.string()),
        "key": keys,
    }
    if meta.kind in MAP_LIKE:
        uks = block["user_key"].to_pylist()
        uk_ser = meta.user_key_ser()
        present = [u is not None for u in uks]
        decoded = uk_ser.to_arrow(_decoded(uk_ser, [u for u in uks if u is not None]))
        columns["user_key"] = _scatter(decoded, present)
    raw_values = block["value"].to_pylist()
    element = meta.raw_value_ser()
    user_type = meta.value_ser()
    if meta.kind is StateKind.LIST:
        value, stamps = _list_changes(meta, element, ops, raw_values)
        columns["value"] = value
        if stamps is not None:
            columns[TTL_COLUMN] = stamps
    else:
        present = [v is not None for v in raw_values]
        raw = _decoded(element, [v for v in raw_values if v is not None])
        values, stamps_list = _typed_values(meta, raw)
        columns["value"] = _scatter(user_type.to_arrow(values), present)
        if stamps_list is not None:
            columns[TTL_COLUMN] = _scatter(pa.array(stamps_list, pa.int64()), present)
    names = [f.name for f in change_schema(meta, key_serializer)]
    return pa.table({name: columns[name] for name in names})


def _list_changes(
    meta: StateMeta, element: Serializer, ops: list[int], raw_values: list[bytes | None]
) -> tuple[pa.Array, pa.Array | None]:
    """List-state values: one element (``list_add``), the new list (``list_set``), or
    none; as ``array<T>`` (and ``array<long>`` of timestamps with TTL)."""
    offsets = [0]
    flat: list[bytes] = []
    present = []
    for op, value in zip(ops, raw_values, strict=True):
        if value is None:
            present.append(False)
        else:
            present.append(True)
            flat.extend(unpack_list(value) if op == Op.LIST_SET else [value])
        offsets.append(len(flat))
    values, stamps = _typed_values(meta, _decoded(element, flat))
    mask = pa.array([not p for p in present], pa.bool_())
    off = pa.array(offsets, pa.int32())
    out = pa.ListArray.from_arrays(off, meta.value_ser().to_arrow(values), mask=mask)
    if stamps is None:
        return out, None
    return out, pa.ListArray.from_arrays(off, pa.array(stamps, pa.int64()), mask=mask)


def op_filter(block: pa.Table, state: str) -> pa.Table:
    """The rows of ``block`` that change ``state`` (no META records)."""
    keep = pc.and_(pc.equal(block["state"], state), pc.not_equal(block["op"], int(Op.META)))
    return block.filter(keep)
