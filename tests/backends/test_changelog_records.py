"""What the changelog wrapper logs: typed records per state type, self-describing METAs."""

from __future__ import annotations

from typing import Any

from backends import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    Op,
    ReducingStateDescriptor,
    StateMeta,
    StateTtlConfig,
    TimeDomain,
    TimerService,
    ValueStateDescriptor,
)
from backends.serializers import FLOAT64, INT64, STR, pack_list, ttl_of, tuple_of
from dstl import read_changes
from tests.backends.conftest import Factory
from tests.backends.helpers import MeanAgg


def _records(factory: Factory, b: Any) -> list[tuple[str, int, bytes | None, bytes | None]]:
    handle = b.checkpoint(1).result()
    out = []
    for t in read_changes(factory.fileio, handle.changelog):
        for name, op, uk, v in zip(
            *(t[c].to_pylist() for c in ("state", "op", "user_key", "value")), strict=True
        ):
            out.append((name, op, uk, v))
    return out


def test_every_state_type_logs_typed_records(factory: Factory, store_kind: str) -> None:
    b = factory.logged(store_kind)
    v = b.get_state(ValueStateDescriptor("v", INT64))
    lst = b.get_state(ListStateDescriptor("l", STR))
    m = b.get_state(MapStateDescriptor("m", STR, INT64))
    r = b.get_state(ReducingStateDescriptor("r", lambda a, c: a + c, INT64))
    g = b.get_state(AggregatingStateDescriptor("g", MeanAgg(), tuple_of(INT64, FLOAT64)))
    timers = TimerService(b, TimeDomain.PROCESSING)
    b.set_current_key("a")
    v.update(5)
    v.clear()
    lst.add("x")
    lst.update(["y", "z"])
    m.put("u", 1)
    m.remove("u")
    r.add(2)
    r.add(3)
    g.add(4.0)
    timers.register(100)
    timers.fire_until(100, lambda ts, k: None)
    recs = _records(factory, b)
    metas = {n: StateMeta.from_json(val) for n, op, _, val in recs if op == Op.META and val}
    assert set(metas) == {"v", "l", "m", "r", "g", "__timers__.processing"}
    assert metas["g"].value_serializer == "tuple<int64,float64>"
    changes = [(n, op) for n, op, _, _ in recs if op != Op.META]
    assert changes == [
        ("v", Op.VALUE_SET),
        ("v", Op.CLEAR),
        ("l", Op.LIST_ADD),
        ("l", Op.LIST_SET),
        ("m", Op.MAP_PUT),
        ("m", Op.MAP_REMOVE),
        ("r", Op.ACC_SET),
        ("r", Op.ACC_SET),
        ("g", Op.ACC_SET),
        ("__timers__.processing", Op.TIMER_REGISTER),
        ("__timers__.processing", Op.TIMER_DELETE),
    ]
    # both stores frame a LIST_SET the same way (the heap's in C, RocksDB's with pack_list)
    list_set = next(val for n, op, _, val in recs if op == Op.LIST_SET)
    assert list_set == pack_list([b"y", b"z"])
    acc = [val for n, op, _, val in recs if n == "r" and op == Op.ACC_SET]
    assert [INT64.deserialize(a) for a in acc if a] == [2, 5]  # the accumulator, not the input
    g_acc = next(val for n, op, _, val in recs if n == "g" and op == Op.ACC_SET)
    assert g_acc is not None and tuple_of(INT64, FLOAT64).deserialize(g_acc) == (1, 4.0)
    ts = next(uk for n, op, uk, _ in recs if op == Op.TIMER_REGISTER)
    assert ts is not None and INT64.deserialize(ts) == 100


def test_ttl_values_are_logged_with_their_timestamp(factory: Factory, store_kind: str) -> None:
    b = factory.logged(store_kind)
    s = b.get_state(ValueStateDescriptor("t", STR, ttl=StateTtlConfig(10)))
    b.set_current_key("a")
    s.update("x")
    (val,) = [v for n, op, _, v in _records(factory, b) if op == Op.VALUE_SET]
    assert val is not None and ttl_of(STR).deserialize(val) == (factory.clock(), "x")


def test_op_codes_are_stable() -> None:
    # Segments already written use these numbers: they must never change.
    assert [int(o) for o in Op] == list(range(10))
    assert (Op.META, Op.VALUE_SET, Op.CLEAR, Op.LIST_ADD, Op.LIST_SET, Op.MAP_PUT) == (
        0,
        1,
        2,
        3,
        4,
        5,
    )
    assert Op.MAP_REMOVE == 6


def test_batch_logs_one_block_of_columns(factory: Factory, store_kind: str) -> None:
    b = factory.logged(store_kind)
    d = ValueStateDescriptor("v", INT64)
    b.apply_batch(d, [f"k{i}" for i in range(50)], list(range(50)))
    recs = [r for r in _records(factory, b) if r[1] != Op.META]
    assert len(recs) == 50 and {r[1] for r in recs} == {Op.VALUE_SET}
    assert sorted(INT64.deserialize(r[3]) for r in recs if r[3]) == list(range(50))


def test_buffered_records_keep_per_state_order_across_flushes(
    factory: Factory, store_kind: str
) -> None:
    # The wrapper buffers records per state and flushes runs of equal ops; mixed ops on one
    # key across several flushes must replay in their original order.
    from backends import restore_into
    from backends.changelog import FLUSH_RECORDS
    from tests.backends.helpers import dump

    b = factory.logged(store_kind)
    lst = b.get_state(ListStateDescriptor("l", STR))
    m = b.get_state(MapStateDescriptor("m", STR, INT64))
    for i in range(3 * FLUSH_RECORDS + 7):
        b.set_current_key(f"k{i % 3}")
        if i % 5 == 4:
            lst.clear()
        else:
            lst.add(str(i))
        if i % 7 == 6:
            m.remove(f"u{i % 2}")
        else:
            m.put(f"u{i % 2}", i)
    handle = b.checkpoint(1).result()
    nb = factory.store(store_kind)
    restore_into(nb, factory.fileio, [handle])
    assert dump(nb) == dump(b.inner)
