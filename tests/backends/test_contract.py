"""The keyed-state contract, per state type, against every store, with and without the
changelog wrapper (the ``backend`` fixture is parametrized over all four)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from backends import (
    AggregatingStateDescriptor,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TimeDomain,
    TimerService,
    ValueStateDescriptor,
)
from backends.errors import KeyGroupOutOfRangeError, UnsupportedBatchError
from backends.serializers import FLOAT64, INT64, PICKLE, STR, tuple_of
from dstl.errors import SchemaMismatchError, StateBackendError
from tests.backends.conftest import MAX_PAR, FakeClock
from tests.backends.helpers import MeanAgg, dump


def test_value_state(backend: Any) -> None:
    s = backend.get_state(ValueStateDescriptor("v", INT64))
    assert backend.get_state(ValueStateDescriptor("v", INT64)) is s
    backend.set_current_key("a")
    assert s.value() is None
    s.update(1)
    backend.set_current_key("b")
    assert s.value() is None
    s.update(2)
    backend.set_current_key("a")
    assert s.value() == 1
    s.clear()
    assert s.value() is None
    backend.set_current_key("b")
    assert s.value() == 2


def test_value_state_default_and_pickle(backend: Any) -> None:
    d = backend.get_state(ValueStateDescriptor("d", INT64, default=7))
    p = backend.get_state(ValueStateDescriptor("p", PICKLE))
    backend.set_current_key("a")
    assert d.value() == 7
    p.update({"x": [1, 2]})
    assert p.value() == {"x": [1, 2]}


def test_list_state(backend: Any) -> None:
    s = backend.get_state(ListStateDescriptor("l", STR))
    backend.set_current_key("a")
    assert s.get() == []
    s.add("x")
    s.add("y")
    assert s.get() == ["x", "y"]
    got = s.get()
    got.append("z")  # a copy
    assert s.get() == ["x", "y"]
    s.update(["q"])
    assert s.get() == ["q"]
    s.update([])
    assert s.get() == []
    s.add("r")
    backend.set_current_key("b")
    assert s.get() == []
    backend.set_current_key("a")
    s.clear()
    assert s.get() == []


def test_map_state(backend: Any) -> None:
    s = backend.get_state(MapStateDescriptor("m", STR, FLOAT64))
    backend.set_current_key("a")
    assert s.get("x") is None and not s.contains("x")
    s.put("x", 1.5)
    s.put("y", 2.5)
    assert s.get("x") == 1.5 and s.contains("y")
    assert sorted(s.items()) == [("x", 1.5), ("y", 2.5)]
    for uk, _ in s.items():  # items is a snapshot: safe to mutate while iterating
        s.remove(uk)
    assert list(s.items()) == []
    s.put("z", 0.0)
    backend.set_current_key("b")
    assert not s.contains("z")
    s.put("z", 9.0)
    backend.set_current_key("a")
    s.clear()
    assert list(s.items()) == []
    backend.set_current_key("b")
    assert s.get("z") == 9.0


def test_reducing_state(backend: Any) -> None:
    s = backend.get_state(ReducingStateDescriptor("r", lambda a, b: a + b, INT64))
    backend.set_current_key("a")
    assert s.get() is None
    for i in range(1, 5):
        s.add(i)
    assert s.get() == 10
    s.clear()
    assert s.get() is None


def test_aggregating_state(backend: Any) -> None:
    s = backend.get_state(AggregatingStateDescriptor("g", MeanAgg(), tuple_of(INT64, FLOAT64)))
    backend.set_current_key("a")
    assert s.get() is None
    s.add(1.0)
    s.add(3.0)
    assert s.get() == 2.0
    s.merge_accumulator((2, 10.0))
    assert s.get() == 14.0 / 4
    backend.set_current_key("b")
    assert s.get() is None
    backend.set_current_key("a")
    s.clear()
    assert s.get() is None


def test_ttl_value_expires_after_write(backend: Any, clock: FakeClock) -> None:
    s = backend.get_state(ValueStateDescriptor("t", INT64, ttl=StateTtlConfig(100)))
    backend.set_current_key("a")
    s.update(1)
    clock.advance(99)
    assert s.value() == 1  # a read does not refresh (OnCreateAndWrite)
    clock.advance(1)
    assert s.value() is None
    assert dump(backend) == {}  # cleaned on access


def test_ttl_refresh_on_read(backend: Any, clock: FakeClock) -> None:
    ttl = StateTtlConfig(100, update_on_read=True)
    v = backend.get_state(ValueStateDescriptor("t", INT64, ttl=ttl))
    m = backend.get_state(MapStateDescriptor("tm", STR, INT64, ttl=ttl))
    backend.set_current_key("a")
    v.update(1)
    m.put("x", 1)
    m.put("y", 2)
    for _ in range(5):
        clock.advance(60)
        assert v.value() == 1
        assert m.get("x") == 1
    assert not m.contains("y")  # y was never read: expired
    clock.advance(100)
    assert v.value() is None and list(m.items()) == []


def test_ttl_list_is_per_element(backend: Any, clock: FakeClock) -> None:
    s = backend.get_state(ListStateDescriptor("tl", STR, ttl=StateTtlConfig(100)))
    backend.set_current_key("a")
    s.add("old")
    clock.advance(60)
    s.add("new")
    clock.advance(60)
    assert s.get() == ["new"]
    clock.advance(60)
    assert s.get() == []


def test_ttl_reducing(backend: Any, clock: FakeClock) -> None:
    s = backend.get_state(
        ReducingStateDescriptor("tr", lambda a, b: a + b, INT64, ttl=StateTtlConfig(50))
    )
    backend.set_current_key("a")
    s.add(2)
    s.add(3)
    assert s.get() == 5
    clock.advance(50)
    s.add(1)  # the expired accumulator is gone: starts over
    assert s.get() == 1


def test_ttl_cleaned_during_materialization_snapshot(
    make_backend: Callable[..., Any], clock: FakeClock
) -> None:
    b = make_backend()
    inner = getattr(b, "inner", b)
    s = b.get_state(ValueStateDescriptor("t", INT64, ttl=StateTtlConfig(10)))
    for k in ("a", "b", "c"):
        b.set_current_key(k)
        s.update(1)
    clock.advance(10)
    snap = inner.snapshot(0)
    try:
        if hasattr(snap, "tables"):  # the heap copies without expired entries
            assert sum(len(m) for m in snap.tables["t"].values()) == 0
            assert inner.entry_count() == 0
        else:  # RocksDB purges explicitly (a scan), never in the short snapshot
            assert inner.purge_expired() == 3
            assert list(inner.entries("t")) == []
    finally:
        snap.release()


def test_timers_fire_in_order_and_once(backend: Any) -> None:
    timers = TimerService(backend, TimeDomain.EVENT)
    fired: list[tuple[int, Any]] = []
    for key, ts in (("a", 30), ("b", 10), ("a", 10), ("c", 20), ("b", 50)):
        backend.set_current_key(key)
        timers.register(ts)
    backend.set_current_key("a")
    timers.register(30)  # idempotent
    assert timers.timers() == [10, 30]
    backend.set_current_key("c")
    timers.delete(20)

    def on_timer(ts: int, key: Any) -> None:
        assert backend.current_key == key
        fired.append((ts, key))
        if ts == 10 and key == "a":
            timers.register(25)  # a timer registered while firing fires in the same call

    assert timers.fire_until(30, on_timer) == 4
    assert sorted(fired[:2]) == [(10, "a"), (10, "b")]
    assert fired[2:] == [(25, "a"), (30, "a")]
    assert timers.next_timestamp() == 50
    assert timers.fire_until(40, on_timer) == 0
    backend.set_current_key("a")
    assert timers.timers() == []


def test_processing_time_timers_are_separate(backend: Any) -> None:
    event = TimerService(backend, TimeDomain.EVENT)
    proc = TimerService(backend, TimeDomain.PROCESSING)
    backend.set_current_key("a")
    event.register(5)
    proc.register(7)
    seen: list[int] = []
    assert proc.fire_until(100, lambda ts, k: seen.append(ts)) == 1
    assert seen == [7]
    assert event.next_timestamp() == 5


def test_key_outside_range_raises(make_backend: Callable[..., Any]) -> None:
    b = make_backend(KeyGroupRange(0, 1))
    with pytest.raises(KeyGroupOutOfRangeError):
        for i in range(200):
            b.set_current_key(f"k{i}")
    assert issubclass(KeyGroupOutOfRangeError, StateBackendError)


def test_redeclaring_with_other_serializer_is_a_schema_mismatch(backend: Any) -> None:
    backend.get_state(ValueStateDescriptor("v", INT64))
    with pytest.raises(SchemaMismatchError, match="'v'"):
        backend.get_state(ValueStateDescriptor("v", STR))
    with pytest.raises(SchemaMismatchError, match="'v'"):
        backend.get_state(ListStateDescriptor("v", INT64))
    with pytest.raises(SchemaMismatchError, match="ttl"):
        backend.get_state(ValueStateDescriptor("v", INT64, ttl=StateTtlConfig(5)))


def test_batch_equals_per_record(make_backend: Callable[..., Any]) -> None:
    batch, single = make_backend(), make_backend()
    v, lst, m = (
        ValueStateDescriptor("v", INT64),
        ListStateDescriptor("l", STR),
        MapStateDescriptor("m", STR, INT64),
    )
    keys = [f"k{i % 37}" for i in range(300)]
    values = list(range(300))
    batch.apply_batch(v, keys, values)
    batch.apply_batch(lst, keys, [str(x) for x in values])
    batch.apply_batch(m, keys, values, user_keys=[f"u{x % 5}" for x in values])
    for k, x in zip(keys, values, strict=True):
        single.set_current_key(k)
        single.get_state(v).update(x)
        single.get_state(lst).add(str(x))
        single.get_state(m).put(f"u{x % 5}", x)
    assert dump(batch) == dump(single)
    batch.set_current_key("k3")
    assert batch.get_state(v).value() == single.get_state(v).value()


def test_batch_with_arrow_arrays_and_ttl(backend: Any, clock: FakeClock) -> None:
    import pyarrow as pa

    d = ValueStateDescriptor("tv", INT64, ttl=StateTtlConfig(10))
    backend.apply_batch(d, pa.array(["a", "b"]), pa.array([1, 2]))
    backend.set_current_key("b")
    assert backend.get_state(d).value() == 2
    clock.advance(10)
    assert backend.get_state(d).value() is None


def test_batch_out_of_range_applies_nothing(make_backend: Callable[..., Any]) -> None:
    b = make_backend(KeyGroupRange(0, MAX_PAR // 2))
    keys = [f"k{i}" for i in range(100)]
    with pytest.raises(KeyGroupOutOfRangeError):
        b.apply_batch(ValueStateDescriptor("v", INT64), keys, list(range(100)))
    assert dump(b) == {}
    with pytest.raises(UnsupportedBatchError):
        b.apply_batch(ReducingStateDescriptor("r", max, INT64), ["k1"], [1])
    with pytest.raises(UnsupportedBatchError):
        b.apply_batch(MapStateDescriptor("m", STR, INT64), ["k1"], [1])
