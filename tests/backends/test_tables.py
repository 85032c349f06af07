"""Heap state tables as Parquet: typed columns, and dictionaries that stay small."""

from __future__ import annotations

import io
import random

import pyarrow.parquet as pq

from backends import HeapKeyedStateBackend, KeyGroupRange, ValueStateDescriptor
from backends.serializers import INT64, STR
from backends.tables import parquet_to_table, snapshot_tables, table_to_parquet


def test_a_column_of_unique_values_falls_back_to_plain_early() -> None:
    """50K distinct int64 values would make a 400 KB dictionary under Arrow's 1 MiB
    limit; ours stops near 128 KiB (less CPU, fewer bytes), and the table reads back."""
    backend = HeapKeyedStateBackend(STR, KeyGroupRange(0, 128), 128)
    state = backend.get_state(ValueStateDescriptor("v", INT64))
    rnd = random.Random(3)
    for i in range(50_000):
        backend.set_current_key(f"k{i}")
        state.update(rnd.randrange(1 << 62))
    [(_, table)] = list(snapshot_tables(backend.snapshot()))
    data = table_to_parquet(table)
    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
    value = next(
        meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "value"
    )
    assert value.has_dictionary_page
    assert value.data_page_offset - value.dictionary_page_offset < 200_000
    assert parquet_to_table(data, "mem").equals(table)
    backend.close()


def test_packed_columns_are_the_serializers_columns() -> None:
    """int64 and float64 columns are packed from the dicts by ``pack``: the same column
    ``to_arrow`` makes, and what it refuses is refused."""
    import pyarrow as pa
    import pytest

    from backends.serializers import BYTES, FLOAT64
    from backends.tables import _column

    ints = [0, -1, (1 << 63) - 1, -(1 << 63), 7, True]
    parts = [{k: k for k in ints[:3]}, {}, {k: k for k in ints[3:]}]
    want = pa.array([int(i) for i in ints[:5]] + [1], pa.int64())
    assert _column(INT64, parts, values=False).equals(want)
    assert _column(INT64, parts, values=True).equals(want)
    floats = [0.5, -2.0, float("inf"), 3]
    assert _column(FLOAT64, [dict.fromkeys(floats, 0.0)], values=False).equals(
        FLOAT64.to_arrow(floats)
    )
    assert _column(STR, [{"a": 1}, {"bé": 2}], values=False).equals(STR.to_arrow(["a", "bé"]))
    texts = [{"a": "x", "b": "\ud800"}]  # a lone surrogate: refused as to_arrow refuses it
    with pytest.raises(UnicodeEncodeError):
        _column(STR, texts, values=True)
    with pytest.raises(UnicodeEncodeError):
        STR.to_arrow(["x", "\ud800"])
    assert _column(BYTES, [{1: b"x"}, {2: b""}], values=True).equals(BYTES.to_arrow([b"x", b""]))
    assert _column(BYTES, [{1: "s"}], values=True).equals(BYTES.to_arrow(["s"]))  # converted
    with pytest.raises(TypeError):
        _column(INT64, [{1: 1.5}], values=True)
    with pytest.raises(OverflowError):
        _column(INT64, [{1: 1 << 63}], values=True)


def test_integer_key_columns_are_delta_encoded_and_read_back() -> None:
    """Key groups and integer keys (and user keys) are DELTA_BINARY_PACKED; values,
    string keys and nested columns keep their dictionaries; every kind reads back."""
    from backends import ListStateDescriptor, MapStateDescriptor

    backend = HeapKeyedStateBackend(INT64, KeyGroupRange(0, 128), 128)
    count = backend.get_state(ValueStateDescriptor("count", INT64))
    seen = backend.get_state(ListStateDescriptor("seen", STR))
    tags = backend.get_state(MapStateDescriptor("tags", INT64, STR))
    for i in range(5000):
        backend.set_current_key(i)
        count.update(i % 10)
        seen.add(f"s{i % 4}")
        tags.put(i % 3, "t")
    encodings = {}
    codecs = {}
    for meta, table in snapshot_tables(backend.snapshot()):
        data = table_to_parquet(table)
        assert parquet_to_table(data, "mem").equals(table)
        rg = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0)
        for i in range(rg.num_columns):
            col = rg.column(i)
            encodings[(meta.name, col.path_in_schema)] = col.encodings
            codecs[(meta.name, col.path_in_schema)] = col.compression
    delta = {k for k, v in encodings.items() if "DELTA_BINARY_PACKED" in v}
    assert delta == {
        (name, col) for name in ("count", "seen", "tags") for col in ("key_group", "key")
    } | {("tags", "user_key")}
    dictionary = {k for k, v in encodings.items() if "RLE_DICTIONARY" in v}
    assert dictionary == {("count", "value"), ("seen", "value.list.element"), ("tags", "value")}
    raw = {k for k, v in codecs.items() if v == "UNCOMPRESSED"}  # integer keys: no zstd
    assert raw == {(name, "key") for name in ("count", "seen", "tags")} | {("tags", "user_key")}
    assert {v for k, v in codecs.items() if k not in raw} == {"ZSTD"}
    backend.close()
