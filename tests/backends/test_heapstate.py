"""backends._heapstate: the heap store's C writes, with and without the change log."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from backends._heapstate import HeapList, HeapMap, HeapValue, KeyContext
from backends.serializers import INT64, pack_list
from dstl._records import KIND_INT64, KIND_NONE, KIND_STR, RecordColumns


class Ctx(KeyContext):
    def at(self, key: str, group: int) -> Ctx:
        self.current_key, self.current_key_bytes, self.current_key_group = key, key.encode(), group
        return self


class Flushes:
    """A flush() that takes the buffer, as the changelog wrapper's does."""

    def __init__(self, records: RecordColumns, table: dict[Any, Any]) -> None:
        self.records, self.table, self.taken, self.seen = records, table, [], []

    def __call__(self) -> None:
        self.seen.append({g: dict(d) for g, d in self.table.items()})  # state at flush time
        self.taken.append(self.records.take())


def test_key_context_starts_as_none_and_is_read_by_the_states() -> None:
    ctx = Ctx()
    assert (ctx.current_key, ctx.current_key_bytes, ctx.current_key_group) == (None, None, None)
    table: dict[Any, Any] = {}
    v, lst, m = HeapValue(ctx, table), HeapList(ctx, {}), HeapMap(ctx, {})
    ctx.at("a", 3)
    v.update(1)
    lst.add(1)
    lst.add(2)
    m.put("u", 1)
    ctx.at("b", 3)
    v.update(2)
    m.put("u", 2)
    ctx.at("a", 5)
    v.update(3)
    assert table == {3: {"a": 1, "b": 2}, 5: {"a": 3}}
    assert lst._table == {3: {"a": [1, 2]}}
    assert m._table == {3: {"a": {"u": 1}, "b": {"u": 2}}}
    assert v._backend is ctx and v._table is table


def test_logged_writes_append_one_record_each_and_flush_when_full() -> None:
    ctx = Ctx().at("k", 7)
    table: dict[Any, Any] = {}
    records = RecordColumns(2, 1 << 20, KIND_NONE, KIND_INT64)
    flush = Flushes(records, table)
    v = HeapValue(ctx, table, records, 1, flush)
    v.update(10)
    assert len(records) == 1 and not flush.taken
    v.update(11)  # the second record fills the buffer: flushed after the write
    assert flush.seen == [{7: {"k": 11}}]
    rows, groups, ops, _, key_data, user_keys, values = flush.taken[0]
    assert (rows, groups, ops, key_data, user_keys) == (
        2,
        bytes([7, 0, 0, 0] * 2),
        b"\1\1",
        b"kk",
        None,
    )
    assert values[3] == (10).to_bytes(8, "little") + (11).to_bytes(8, "little")


@pytest.mark.parametrize("bad", [1 << 63, "x", None, 1.5])
def test_a_refused_value_changes_neither_the_table_nor_the_log(bad: Any) -> None:
    ctx = Ctx().at("k", 1)
    records = RecordColumns(16, 1 << 20, KIND_STR, KIND_INT64)
    states = (
        HeapValue(ctx, {}, RecordColumns(16, 1 << 20, KIND_NONE, KIND_INT64), 1, lambda: None),
        HeapList(ctx, {}, RecordColumns(16, 1 << 20, KIND_NONE, KIND_INT64), 2, lambda: None),
        HeapMap(ctx, {}, records, 3, lambda: None),
    )
    with pytest.raises((TypeError, OverflowError)):
        states[0].update(bad)  # type: ignore[attr-defined]
    with pytest.raises((TypeError, OverflowError)):
        states[1].add(bad)  # type: ignore[attr-defined]
    with pytest.raises((TypeError, OverflowError)):
        states[2].put("u", bad)  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        states[2].put(7, 1)  # type: ignore[attr-defined]  # a user key that is not a str
    assert all(s._table == {} for s in states)
    assert len(records) == 0


def test_a_failing_flush_raises_after_the_write() -> None:
    ctx = Ctx().at("k", 1)
    records = RecordColumns(1, 1 << 20, KIND_NONE, KIND_INT64)

    def flush() -> None:
        raise OSError("upload queue closed")

    v = HeapValue(ctx, {}, records, 1, flush)
    with pytest.raises(OSError):
        v.update(5)
    assert v._table == {1: {"k": 5}} and len(records) == 1  # logged and stored: consistent


def test_a_value_that_switches_the_key_while_converted_is_written_under_the_old_key() -> None:
    ctx = Ctx().at("a", 1)

    class Sneaky:
        def __index__(self) -> int:
            ctx.at("b", 2)  # drops the context's references to "a", b"a", 1
            gc.collect()
            return 9

    records = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
    v = HeapValue(ctx, {}, records, 1, lambda: None)
    value = Sneaky()
    v.update(value)
    assert v._table == {1: {"a": value}}
    taken = records.take()
    assert taken is not None and taken[4] == b"a" and taken[1] == bytes([1, 0, 0, 0])


def test_constructor_checks_its_arguments() -> None:
    ctx = Ctx()
    with pytest.raises(TypeError):
        HeapValue(object(), {})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        HeapValue(ctx, [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RecordColumns"):
        HeapValue(ctx, {}, object(), 1, lambda: None)  # type: ignore[arg-type]
    records = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
    with pytest.raises(TypeError, match="op and flush"):
        HeapValue(ctx, {}, records)
    v = HeapValue(ctx, {})
    with pytest.raises(RuntimeError):
        v.__init__(ctx, {})  # type: ignore[misc]


def test_an_unhashable_key_is_refused_before_it_is_logged() -> None:
    ctx = Ctx().at("k", 1)
    ctx.current_key = ["not", "hashable"]
    value_records = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
    map_records = RecordColumns(8, 1 << 20, KIND_STR, KIND_INT64)
    v = HeapValue(ctx, {}, value_records, 1, lambda: None)
    m = HeapMap(Ctx().at("k", 1), {}, map_records, 3, lambda: None)
    with pytest.raises(TypeError):
        v.update(1)
    with pytest.raises(TypeError):
        m.put(["u"], 1)
    assert len(value_records) == 0 and len(map_records) == 0
    assert v._table == {} and m._table == {}


def test_replace_stores_the_list_and_logs_every_element_in_one_record() -> None:
    ctx = Ctx().at("k", 2)
    table: dict[Any, Any] = {}
    plain = HeapList(ctx, {})
    items = [3, 4, 5]
    plain.replace(items)
    assert plain._table == {2: {"k": items}} and plain._table[2]["k"] is items
    records = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
    logged = HeapList(ctx, table, records, 9, lambda: None)
    logged.add(1)
    logged.replace([7, 8])
    assert table == {2: {"k": [7, 8]}}
    taken = records.take()
    assert taken is not None
    rows, _, ops, _, _, _, values = taken
    assert (rows, ops) == (2, b"\t\t")  # the op it was made with (LIST_SET's, in the wrapper)
    offsets = memoryview(values[2]).cast("i")
    assert values[3][offsets[1] : offsets[2]] == pack_list([INT64.serialize(v) for v in (7, 8)])


def test_replace_refuses_a_bad_element_or_a_non_list_and_changes_nothing() -> None:
    ctx = Ctx().at("k", 2)
    records = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
    lst = HeapList(ctx, {}, records, 9, lambda: None)
    lst.replace([1])
    records.take()
    with pytest.raises(TypeError):
        lst.replace([2, "x"])
    with pytest.raises(OverflowError):
        lst.replace([2, 1 << 64])
    with pytest.raises(TypeError):
        lst.replace((2, 3))  # type: ignore[arg-type]
    assert lst._table == {2: {"k": [1]}} and len(records) == 0
