"""The C record buffer (dstl._records.RecordColumns) against a Python model of it.

Every record appended must come back from ``take`` as Arrow columns with exactly the
bytes the Python serializers produce (struct "<q"/"<d", str.encode), nulls where given,
and a refused record must leave the buffer as it was.
"""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.serializers import pack_list
from dstl import ChangelogStorage, FileIO, read_changes
from dstl._records import (
    KIND_BYTES,
    KIND_FLOAT64,
    KIND_INT64,
    KIND_NONE,
    KIND_STR,
    RecordColumns,
)
from dstl.buffer import _binary_column

SERIALIZE = {
    KIND_BYTES: lambda v: v,
    KIND_INT64: struct.Struct("<q").pack,
    KIND_FLOAT64: struct.Struct("<d").pack,
    KIND_STR: str.encode,
}


def _columns(taken: Any) -> dict[str, list[Any]]:
    rows, kgs, ops, key_offsets, key_data, uks, values = taken
    return {
        "key_group": pa.Array.from_buffers(pa.int32(), rows, [None, pa.py_buffer(kgs)]).to_pylist(),
        "op": pa.Array.from_buffers(pa.int8(), rows, [None, pa.py_buffer(ops)]).to_pylist(),
        "key": _binary_column(rows, (0, None, key_offsets, key_data)).to_pylist(),
        "user_key": None if uks is None else _binary_column(rows, uks).to_pylist(),
        "value": _binary_column(rows, values).to_pylist(),
    }


def _valid(taken: Any) -> None:
    rows, _, _, key_offsets, key_data, uks, values = taken
    for column in (uks, values, (0, None, key_offsets, key_data)):
        if column is not None:
            _binary_column(rows, column).validate(full=True)


values_of = {
    KIND_BYTES: st.binary(max_size=40),
    KIND_INT64: st.integers(-(1 << 63), (1 << 63) - 1),
    KIND_FLOAT64: st.floats(allow_nan=False),
    KIND_STR: st.text(max_size=20),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_records_come_back_as_the_serializers_bytes(data: st.DataObject) -> None:
    uk_kind = data.draw(st.sampled_from([KIND_NONE, KIND_BYTES, KIND_INT64, KIND_STR]))
    value_kind = data.draw(st.sampled_from([KIND_BYTES, KIND_INT64, KIND_FLOAT64, KIND_STR]))
    capacity = data.draw(st.integers(1, 50))
    buf = RecordColumns(capacity, 1 << 30, uk_kind, value_kind)
    model: dict[str, list[Any]] = {
        "key_group": [],
        "op": [],
        "key": [],
        "user_key": [],
        "value": [],
    }
    n = data.draw(st.integers(1, 120))  # past the capacity: growth of every per-row array
    for i in range(n):
        key = data.draw(st.binary(max_size=12))
        kg = data.draw(st.integers(-1, 32767))
        op = data.draw(st.integers(-128, 127))
        typed = data.draw(st.booleans())
        uk_in: Any
        if uk_kind == KIND_NONE:
            uk_in = uk_out = None
        elif typed:
            uk_in = data.draw(values_of[uk_kind])
            uk_out = SERIALIZE[uk_kind](uk_in)
        else:
            uk_in = uk_out = data.draw(st.none() | st.binary(max_size=8))
        v_in: Any
        if typed:
            v_in = data.draw(values_of[value_kind])
            v_out = SERIALIZE[value_kind](v_in)
            full = buf.append_typed(op, key, kg, uk_in, v_in)
        else:
            v_in = v_out = data.draw(st.none() | st.binary(max_size=8))
            full = buf.append(op, key, kg, uk_in, v_in)
        assert full == (i + 1 >= capacity)
        for name, v in zip(model, (kg, op, key, uk_out, v_out), strict=True):
            model[name].append(v)
    assert len(buf) == n
    taken = buf.take()
    _valid(taken)
    got = _columns(taken)
    if uk_kind == KIND_NONE:
        model["user_key"] = None  # type: ignore[assignment]
    assert got == model
    assert len(buf) == 0 and buf.take() is None


@pytest.mark.parametrize(
    ("kind", "bad", "error"),
    [
        (KIND_INT64, 1 << 63, OverflowError),
        (KIND_INT64, -(1 << 63) - 1, OverflowError),
        (KIND_INT64, 1.5, TypeError),
        (KIND_INT64, "7", TypeError),
        (KIND_FLOAT64, "x", TypeError),
        (KIND_STR, b"x", TypeError),
        (KIND_STR, "\ud800", UnicodeEncodeError),
        (KIND_BYTES, "x", TypeError),
        (KIND_BYTES, None, TypeError),
        (KIND_INT64, None, TypeError),
    ],
)
def test_a_refused_record_leaves_the_buffer_as_it_was(kind: int, bad: Any, error: type) -> None:
    buf = RecordColumns(8, 1 << 20, kind, kind)
    good = {KIND_INT64: 5, KIND_FLOAT64: 0.5, KIND_STR: "é", KIND_BYTES: b"b"}[kind]
    buf.append(1, b"k0", 0, None, None)
    buf.append_typed(2, b"k1", 1, good, good)
    with pytest.raises(error):
        buf.append_typed(3, b"k2", 2, bad, good)
    with pytest.raises(error):
        buf.append_typed(3, b"k2", 2, good, bad)
    taken = buf.take()
    _valid(taken)
    assert _columns(taken)["key"] == [b"k0", b"k1"]
    assert _columns(taken)["value"] == [None, SERIALIZE[kind](good)]


def test_arguments_outside_their_columns_are_refused() -> None:
    buf = RecordColumns(8, 1 << 20, KIND_NONE, KIND_BYTES)
    with pytest.raises(OverflowError):
        buf.append(128, b"k", 0, None, None)  # op is int8
    with pytest.raises(OverflowError):
        buf.append(1, b"k", 1 << 31, None, None)  # key group is int32
    with pytest.raises(TypeError):
        buf.append(1, "k", 0, None, None)  # keys are serialized already
    with pytest.raises(TypeError):
        buf.append(1, b"k", 0, b"uk", None)  # no user-key column
    with pytest.raises(TypeError):
        buf.append(1, b"k", 0, None)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        RecordColumns(8, 1 << 20, KIND_NONE, KIND_NONE)  # values always have a column
    assert buf.take() is None


def test_full_by_bytes_before_capacity() -> None:
    buf = RecordColumns(1000, 100, KIND_NONE, KIND_BYTES)
    assert not buf.append(1, b"k", 0, None, b"x" * 50)
    assert buf.append(1, b"k", 0, None, b"x" * 50)  # 2 + 100 bytes >= 100


def test_nulls_after_growth_and_after_take() -> None:
    """The validity bitmap appears with the first null, grows with the rows, and is all
    valid again after a take (a null in one batch must not leak into the next)."""
    buf = RecordColumns(4, 1 << 20, KIND_BYTES, KIND_BYTES)
    for i in range(10):
        buf.append(1, b"k", i, b"u", b"v")
    buf.append(1, b"k", 10, None, None)
    for i in range(11, 30):
        buf.append(1, b"k", i, b"u", None if i % 7 == 0 else b"v")
    taken = buf.take()
    _valid(taken)
    cols = _columns(taken)
    assert cols["user_key"] == [None if i == 10 else b"u" for i in range(30)]
    assert cols["value"] == [
        None if i == 10 or (i > 10 and i % 7 == 0) else b"v" for i in range(30)
    ]
    for i in range(20):
        buf.append(1, b"k", i, b"u", b"v")
    again = buf.take()
    _valid(again)
    assert again[5][0] == 0 and again[5][1] is None  # no nulls, no bitmap
    assert _columns(again)["value"] == [b"v"] * 20
    for i in range(20):  # one null: the rows that were null two batches ago are valid
        buf.append(1, b"k", i, b"u", None if i == 19 else b"v")
    third = buf.take()
    _valid(third)
    assert _columns(third)["value"] == [b"v"] * 19 + [None]


def test_the_writer_logs_a_record_buffer_as_it_is(tmp_path: Any) -> None:
    with ChangelogStorage(FileIO(str(tmp_path)), "job", "w0") as storage:
        writer = storage.create_writer("b1")
        buf = RecordColumns(16, 1 << 20, KIND_STR, KIND_INT64)
        writer.append_meta("m", 0, b"{}")
        buf.append_typed(5, b"k1", 3, "a", 1)
        buf.append(6, b"k1", 3, b"a", None)
        writer.append_records("m", buf)
        writer.append_records("m", buf)  # empty: nothing more
        assert len(buf) == 0
        table = writer._buffer.to_table()
    assert table.column("op").to_pylist() == [0, 5, 6]
    assert table.column("state").to_pylist() == ["m", "m", "m"]
    assert table.column("user_key").to_pylist() == [None, b"a", b"a"]
    assert table.column("value").to_pylist() == [b"{}", struct.pack("<q", 1), None]
    assert table.column("key_group").to_pylist() == [-1, 3, 3]


def test_a_truncate_drops_record_buffer_chunks_below_it(tmp_path: Any) -> None:
    """Record-buffer chunks stay unwrapped until a persist; truncation must still see their
    sequence numbers."""
    fileio = FileIO(str(tmp_path))
    with ChangelogStorage(fileio, "job", "w0") as storage:
        writer = storage.create_writer("b1")
        buf = RecordColumns(16, 1 << 20, KIND_NONE, KIND_INT64)
        for i in range(3):
            buf.append_typed(1, b"old", 0, None, i)
        writer.append_records("s", buf)
        boundary = writer.next_sqn()
        buf.append_typed(1, b"new", 0, None, 7)
        writer.append_records("s", buf)
        writer.truncate(boundary)
        handles = writer.persist(boundary, 1).result()
    tables = list(read_changes(fileio, handles))
    assert [k for t in tables for k in t.column("key").to_pylist()] == [b"new"]
    assert [s for t in tables for s in t.column("sqn").to_pylist()] == [boundary]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_list_value_is_framed_as_pack_list_frames_it(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from([KIND_BYTES, KIND_INT64, KIND_FLOAT64, KIND_STR]))
    buf = RecordColumns(64, 1 << 30, KIND_NONE, kind)
    lists = data.draw(st.lists(st.lists(values_of[kind], max_size=20), min_size=1, max_size=10))
    for i, items in enumerate(lists):
        buf.append_typed_list(4, b"k", i, None, items)
    taken = buf.take()
    _valid(taken)
    assert _columns(taken)["value"] == [pack_list([SERIALIZE[kind](v) for v in x]) for x in lists]


def test_a_refused_list_element_appends_nothing() -> None:
    buf = RecordColumns(64, 1 << 20, KIND_NONE, KIND_INT64)
    buf.append_typed_list(4, b"k", 0, None, [1, 2])
    with pytest.raises(OverflowError):
        buf.append_typed_list(4, b"k", 0, None, [1, 1 << 63])
    with pytest.raises(TypeError):
        buf.append_typed_list(4, b"k", 0, None, [1, "2"])
    with pytest.raises(TypeError):
        buf.append_typed_list(4, b"k", 0, None, (1, 2))  # a list, nothing else
    many = list(range(100))  # more elements than the converter keeps on its stack
    buf.append_typed_list(4, b"k", 1, None, many)
    taken = buf.take()
    assert taken is not None and taken[0] == 2
    assert _columns(taken)["value"] == [
        struct.pack("<I", 8).join([b"", *(struct.pack("<q", v) for v in (1, 2))]),
        b"".join(struct.pack("<I", 8) + struct.pack("<q", v) for v in many),
    ]


def test_a_list_changed_while_its_elements_convert_is_framed_as_it_was() -> None:
    items: list[Any] = []

    class Grows:
        def __index__(self) -> int:
            items.append(99)  # the buffer converts a snapshot
            return 5

    items.extend([1, Grows(), 3])
    buf = RecordColumns(64, 1 << 20, KIND_NONE, KIND_INT64)
    buf.append_typed_list(4, b"k", 0, None, items)
    taken = buf.take()
    assert taken is not None
    assert _columns(taken)["value"] == [pack_list([struct.pack("<q", v) for v in (1, 5, 3)])]
