"""Materialized state tables of the heap backend: one typed Arrow table per state.

Columns (Spark reads them as typed columns; pickled values are binary):

- value, reducing, aggregating state: ``key_group int32, key <key type>, value <value type>``
- list state:  ``key_group int32, key <key type>, value list<value type>``
- map and timer state: ``key_group int32, key <key type>, user_key <type>, value <type>``
  (a row per entry; timers: user_key = timestamp)

With TTL, ``<value type>`` is ``struct<ts int64, value T>`` (the last-access timestamp).

The schema metadata ``state.meta`` holds the :class:`~backends.state.StateMeta` JSON and
``state.key`` the key serializer's name, so a table is self-describing.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from backends.heap import StateSnapshot, Table
from backends.serializers import Serializer, serializer_for
from backends.state import MAP_LIKE, StateKind, StateMeta
from dstl.errors import CorruptionError
from dstl.segment import DICTIONARY_PAGE_BYTES

META_KEY = b"state.meta"
KEY_SERIALIZER_KEY = b"state.key"


def schema_for(meta: StateMeta, key_serializer: Serializer) -> pa.Schema:
    """The Arrow schema of ``meta``'s table."""
    value = meta.raw_value_ser()
    fields = [
        pa.field("key_group", pa.int32(), nullable=False),
        pa.field("key", key_serializer.arrow_type),
    ]
    if meta.kind is StateKind.LIST:
        fields.append(pa.field("value", pa.list_(value.arrow_type)))
    elif meta.kind in MAP_LIKE:
        fields.append(pa.field("user_key", meta.user_key_ser().arrow_type))
        fields.append(pa.field("value", value.arrow_type))
    else:
        fields.append(pa.field("value", value.arrow_type))
    return pa.schema(
        fields,
        metadata={META_KEY: meta.to_json(), KEY_SERIALIZER_KEY: key_serializer.name.encode()},
    )


def table_for(
    meta: StateMeta, key_serializer: Serializer, table: Table, key_groups: range | None = None
) -> pa.Table:
    """The Arrow table of one state's raw entries (optionally only some key groups)."""
    value = meta.raw_value_ser()
    kgs: list[int] = []
    keys: list[Any] = []
    values: list[Any] = []
    user_keys: list[Any] = []
    groups = sorted(table) if key_groups is None else [kg for kg in key_groups if kg in table]
    for kg in groups:
        entries = table[kg]
        if meta.kind in MAP_LIKE:
            for key, mapping in entries.items():
                for uk, v in mapping.items():
                    kgs.append(kg)
                    keys.append(key)
                    user_keys.append(uk)
                    values.append(v)
        else:
            kgs.extend([kg] * len(entries))
            keys.extend(entries.keys())
            values.extend(entries.values())
    schema = schema_for(meta, key_serializer)
    columns: list[pa.Array] = [pa.array(kgs, pa.int32()), key_serializer.to_arrow(keys)]
    if meta.kind is StateKind.LIST:
        flat = [x for lst in values for x in lst]
        offsets = [0]
        for lst in values:
            offsets.append(offsets[-1] + len(lst))
        columns.append(
            pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), value.to_arrow(flat))
        )
    elif meta.kind in MAP_LIKE:
        columns.append(meta.user_key_ser().to_arrow(user_keys))
        columns.append(value.to_arrow(values))
    else:
        columns.append(value.to_arrow(values))
    return pa.Table.from_arrays(columns, schema=schema)


def snapshot_tables(snapshot: StateSnapshot) -> Iterator[tuple[StateMeta, pa.Table]]:
    """One table per state of ``snapshot`` (empty states give empty tables)."""
    for name, meta in sorted(snapshot.metas.items()):
        yield meta, table_for(meta, snapshot.key_serializer, snapshot.tables.get(name, {}))


def table_to_parquet(table: pa.Table) -> bytes:
    """Parquet bytes (zstd, page checksums) of a state table."""
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        write_page_checksum=True,
        dictionary_pagesize_limit=DICTIONARY_PAGE_BYTES,
    )
    return sink.getvalue()


def parquet_to_table(data: bytes, location: str) -> pa.Table:
    """Read a state table written by :func:`table_to_parquet`; corruption names the file."""
    try:
        return pq.read_table(io.BytesIO(data), page_checksum_verification=True)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise CorruptionError(f"unreadable state table ({exc})", location) from exc


def table_meta(table: pa.Table, location: str) -> tuple[StateMeta, Serializer]:
    """The state metadata and key serializer recorded in a table's schema."""
    md = table.schema.metadata or {}
    if META_KEY not in md or KEY_SERIALIZER_KEY not in md:
        raise CorruptionError("not a state table (no state.meta)", location)
    return StateMeta.from_json(md[META_KEY]), serializer_for(md[KEY_SERIALIZER_KEY].decode())


def table_entries(
    meta: StateMeta, key_serializer: Serializer, table: pa.Table
) -> tuple[list[int], list[Any], list[Any]]:
    """(key groups, keys, values) of a table; map rows are folded into one dict per key."""
    kgs: list[int] = table["key_group"].to_pylist()
    keys = key_serializer.from_arrow(table["key"])
    value = meta.raw_value_ser()
    if meta.kind not in MAP_LIKE and meta.kind is not StateKind.LIST:
        return kgs, keys, value.from_arrow(table["value"])
    if meta.kind is StateKind.LIST:
        col = table["value"].combine_chunks()
        flat = value.from_arrow(col.flatten())
        offsets = col.offsets.to_pylist()
        return kgs, keys, [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    user_keys = meta.user_key_ser().from_arrow(table["user_key"])
    values = value.from_arrow(table["value"])
    folded: dict[tuple[int, Any], dict[Any, Any]] = {}
    for kg, key, uk, v in zip(kgs, keys, user_keys, values, strict=True):
        folded.setdefault((kg, key), {})[uk] = v
    return [kg for kg, _ in folded], [k for _, k in folded], list(folded.values())
