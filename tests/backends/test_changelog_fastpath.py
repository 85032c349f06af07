"""The changelog wrapper's fast paths: heap-fused states, batch columns.

The fused heap states make the heap's own C write with the record append in the same call
(backends._heapstate); these tests pin that they leave exactly the state the heap's own
methods leave, and log what replays to it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from backends import (
    HeapKeyedStateBackend,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
    restore_into,
)
from backends.changelog import (
    FLUSH_RECORDS,
    _LoggedHeapListState,
    _LoggedHeapMapState,
    _LoggedHeapValueState,
    _LoggedMapState,
)
from backends.serializers import INT64, PICKLE, STR
from tests.backends.conftest import Factory
from tests.backends.helpers import dump

DESCRIPTORS: tuple[Any, ...] = (
    ValueStateDescriptor("v", INT64),
    ListStateDescriptor("l", INT64),
    MapStateDescriptor("m", STR, INT64),
    ReducingStateDescriptor("r", lambda a, b: a + b, INT64),
    MapStateDescriptor("p", STR, PICKLE),  # the generic path: values serialized in Python
)


def _workload(backend: Any, seed: int, n: int) -> None:
    rnd = random.Random(seed)
    v, lst, m, r, p = (backend.get_state(d) for d in DESCRIPTORS)
    for i in range(n):
        backend.set_current_key(f"k{rnd.randrange(30)}")
        x = rnd.randrange(-(1 << 62), 1 << 62)
        choice = rnd.randrange(10)
        if choice < 3:
            v.update(x)
        elif choice == 3:
            v.clear()
        elif choice < 6:
            lst.add(x)
        elif choice == 6:
            lst.update([x, i]) if i % 2 else lst.clear()
        elif choice < 8:
            m.put(f"u{x % 5}", x)
        elif choice == 8:
            m.remove(f"u{x % 5}")
            p.put(f"u{x % 3}", (x, [i]))
        else:
            r.add(x % 1000)
        if i % 997 == 0:
            backend.apply_batch(DESCRIPTORS[0], [f"k{j}" for j in range(5)], list(range(5)))


def test_heap_states_use_the_fused_path(factory: Factory) -> None:
    b = factory.logged("heap")
    assert type(b.internal_state(DESCRIPTORS[0].meta)) is _LoggedHeapValueState
    assert type(b.internal_state(DESCRIPTORS[1].meta)) is _LoggedHeapListState
    assert type(b.internal_state(DESCRIPTORS[2].meta)) is _LoggedHeapMapState
    assert type(b.internal_state(DESCRIPTORS[4].meta)) is _LoggedMapState


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fused_path_leaves_the_heaps_own_state_and_replays_to_it(
    factory: Factory, store_kind: str, seed: int
) -> None:
    n = 3 * FLUSH_RECORDS + 11  # several flushes, with runs of mixed ops
    plain = factory.store(store_kind)
    _workload(plain, seed, n)
    logged = factory.logged(store_kind)
    _workload(logged, seed, n)
    assert dump(logged.inner) == dump(plain)
    handle = logged.checkpoint(1).result()
    restored = factory.store(store_kind)
    restore_into(restored, factory.fileio, [handle])
    assert dump(restored) == dump(plain)


def test_a_refused_int64_value_changes_nothing(factory: Factory, store_kind: str) -> None:
    b = factory.logged(store_kind)
    v = b.get_state(DESCRIPTORS[0])
    lst = b.get_state(DESCRIPTORS[1])
    m = b.get_state(DESCRIPTORS[2])
    b.set_current_key("a")
    v.update(1)
    lst.add(1)
    m.put("u", 1)
    # The heap's int64 states are checked by the C record buffer, RocksDB's by the INT64
    # serializer: the same conversion, so the same errors (as int() would raise them).
    for bad, refused in (
        (1 << 63, OverflowError),
        (-(1 << 63) - 1, OverflowError),
        (1.5, TypeError),
        ("x", TypeError),
        (None, TypeError),
    ):
        with pytest.raises(refused):
            v.update(bad)
        with pytest.raises(refused):
            lst.add(bad)
        with pytest.raises(refused):
            m.put("u", bad)
    with pytest.raises(TypeError):  # a user key that is not a str
        m.put(7, 2)
    assert m.get("u") == 1 and list(m.items()) == [("u", 1)]
    assert v.value() == 1 and lst.get() == [1]
    handle = b.checkpoint(1).result()
    restored = factory.store(store_kind)
    restore_into(restored, factory.fileio, [handle])
    assert dump(restored) == dump(b.inner)


def test_batch_with_arrow_columns_matches_per_record(factory: Factory) -> None:
    import pyarrow as pa

    keys = [f"k{i % 97}" for i in range(5000)]
    values = list(range(5000))
    batched = factory.logged("heap")
    batched.apply_batch(DESCRIPTORS[0], pa.array(keys), pa.array(values, pa.int64()))
    batched.apply_batch(DESCRIPTORS[1], keys, values)
    per_record = HeapKeyedStateBackend(STR, KeyGroupRange(0, 128), 128)
    v, lst = per_record.get_state(DESCRIPTORS[0]), per_record.get_state(DESCRIPTORS[1])
    for k, x in zip(keys, values, strict=True):
        per_record.set_current_key(k)
        v.update(x)
    for k, x in zip(keys, values, strict=True):
        per_record.set_current_key(k)
        lst.add(x)
    restored = factory.store("heap")
    restore_into(restored, factory.fileio, [batched.checkpoint(1).result()])
    assert dump(restored) == dump(per_record)
