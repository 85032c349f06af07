"""Columnar value states of the heap store (``ColumnStore``): the C type and its Python
twin behave the same, and a materialization of the columns writes the very bytes the
dicts would (so old checkpoints and shared pieces keep working)."""

from __future__ import annotations

import array
import dataclasses
import gc
import random
import weakref
from types import ModuleType
from typing import Any

import pytest

from backends import _heapstate, _heapstate_c, _heapstate_py
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange
from backends.serializers import FLOAT64, INT64, STR
from backends.state import ValueStateDescriptor
from backends.tables import state_files
from dstl import _records
from dstl._records import KIND_INT64, KIND_NONE, RecordColumns

IMPLS = [pytest.param(_heapstate_c, id="c"), pytest.param(_heapstate_py, id="py")]


def _ctx(impl: ModuleType) -> Any:
    class Ctx(impl.KeyContext):  # type: ignore[name-defined,misc]
        def at(self, key: Any, group: int) -> Any:
            self.current_key, self.current_key_group = key, group
            self.current_key_bytes = str(key).encode()
            return self

    return Ctx()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_column_store_sets_reads_clears_and_reuses_slots(impl: ModuleType) -> None:
    ctx = _ctx(impl)
    s = impl.ColumnStore(ctx, "q")
    ctx.at("a", 3)
    assert s.get(-1) == -1 and len(s) == 0
    s.update(5)
    s.update(True)  # as array("q") takes it
    assert s.get(0) == 1 and len(s) == 1
    ctx.at("b", 4)
    s.update(-(2**63))
    assert s.entries() == ([3, 4], ["a", "b"], [1, -(2**63)])
    ctx.at("a", 3)
    s.clear()
    s.clear()  # absent: nothing
    assert s.get(None) is None and len(s) == 1 and s.deletes == 1
    ctx.at("c", 9)
    s.update(7)  # takes the free slot
    assert s.used == 2 and s.entries() == ([9, 4], ["c", "b"], [7, -(2**63)])
    with pytest.raises(TypeError):
        s.update(1.5)
    with pytest.raises(OverflowError):
        s.update(2**63)
    with pytest.raises(TypeError):
        s.update("1")
    assert s.get(None) == 7  # refusals change nothing
    with pytest.raises(ValueError):
        impl.ColumnStore(ctx, "i")


@pytest.mark.parametrize("impl", IMPLS)
def test_export_hands_out_only_the_keys_added_since_unless_one_was_cleared(
    impl: ModuleType,
) -> None:
    ctx = _ctx(impl)
    s = impl.ColumnStore(ctx, "d")
    for k in range(3):
        ctx.at(k, k)
        s.update(k / 2)
    used, deletes, live, kgs, vals, keys, full, ikeys = s.export(0, 0)
    assert (used, deletes, live, keys, full) == (3, 0, 3, [0, 1, 2], False)
    # the int keys as int64 bytes (the C store's index holds them; the twin: None)
    assert ikeys == (array.array("q", [0, 1, 2]).tobytes() if impl is _heapstate_c else None)
    assert kgs == bytes([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]) and len(vals) == 24
    ctx.at(3, 1)
    s.update(1)
    assert s.export(3, 0)[5:7] == ([3], False)
    ctx.at(0, 0)
    s.clear()
    used, deletes, live, kgs, _, keys, full, _ = s.export(4, 0)
    assert (used, deletes, live, keys, full) == (4, 1, 3, [None, 1, 2, 3], True)
    assert kgs[:4] == b"\xff\xff\xff\xff"
    s.load(5, [10, 11], [1.5, 2])
    ctx.at(10, 5)
    assert s.get(None) == 1.5 and s.used == 5  # the free slot, then a new one
    ctx.at("x", 1)
    s.update(3)  # not an int key: the index becomes a dict, and no int keys are exported
    assert s.export(0, 0)[7] is None and s.get(None) == 3.0
    ctx.at(11, 5)
    assert s.get(None) == 2.0


@pytest.mark.parametrize("impl", IMPLS)
def test_views_are_the_arrays_themselves_and_hold_them_in_place(impl: ModuleType) -> None:
    """``views()``: export's columns without a copy, read-only; while a view lives the
    store does not move its arrays (growth refused with nothing changed, no unshare),
    and a view keeps its store alive."""
    ctx = _ctx(impl)
    s = impl.ColumnStore(ctx, "q")
    for k in range(1000):
        ctx.at(k, k % 7)
        s.update(k * 3)
    used, _, _, kgs, vals, _, _, ikeys = s.export(0, 0)
    views = s.views()
    assert views[:2] == (1000, 1000)
    assert (bytes(views[2]), bytes(views[3])) == (kgs, vals)
    assert (views[4] is None) == (ikeys is None) and (ikeys is None or bytes(views[4]) == ikeys)
    assert views[3].readonly and len(views[3]) == used * 8
    with pytest.raises(TypeError):
        views[3][0:1] = b"x"
    assert s.unshare() is False  # the C store keeps the array where its views see it
    with pytest.raises(BufferError):
        for k in range(1000, 3000):  # the C store grows at 1024 slots, the twin at once
            ctx.at(k, 1)
            s.update(k)
    refused = k
    ctx.at(refused, 1)
    assert s.get(None) is None and s.used == len(s) == refused  # the refused key: no trace
    kept = views[3]
    del views, s
    gc.collect()
    assert bytes(kept[8:16]) == (3).to_bytes(8, "little") and len(kept) == 8000
    del kept
    s = impl.ColumnStore(ctx, "q")
    view = s.views()
    del view
    for k in range(3000):  # no view left: grows again
        ctx.at(k, 2)
        s.update(k)
    assert len(s) == 3000


@pytest.mark.parametrize("impl", IMPLS)
def test_a_column_writer_logs_before_it_writes(impl: ModuleType) -> None:
    if impl is _heapstate_c and not _records.NATIVE:
        pytest.skip("the C writer appends to the C record buffer only")
    ctx = _ctx(impl).at("k", 2)
    s = impl.ColumnStore(ctx, "q")
    records = RecordColumns(2, 1 << 20, KIND_NONE, KIND_INT64)
    flushed: list[Any] = []
    w = impl.ColumnWriter(s, records, 1, lambda: flushed.append(records.take()))
    w.update(10)
    assert len(records) == 1 and s.get(None) == 10
    with pytest.raises(TypeError):
        w.update(1.5)
    assert len(records) == 1 and s.get(None) == 10
    w.update(11)
    assert len(flushed) == 1 and s.get(None) == 11


@pytest.mark.parametrize("impl", IMPLS)
def test_unshared_values_survive_growth_clears_and_another_unshare(impl: ModuleType) -> None:
    """The C store moves its values to a mapping of its own (the Python one keeps them);
    growing moves them back to PyMem memory, and a second move replaces the mapping."""
    ctx = _ctx(impl)
    s = impl.ColumnStore(ctx, "q")
    native = impl is _heapstate_c
    assert s.unshare() is native
    for k in range(3000):  # three growths, each after a move
        ctx.at(k, k % 7)
        s.update(k)
        if k % 1000 == 0:
            assert s.unshare() is native
    assert s.unshare() is native and s.unshare() is native
    ctx.at(5, 5)
    s.clear()
    ctx.at(3000, 1)
    s.update(-1)  # the free slot
    keys = [3000 if k == 5 else k for k in range(3000)]
    assert s.entries() == (
        [1 if k == 3000 else k % 7 for k in keys],
        keys,
        [-1 if k == 3000 else k for k in keys],
    )
    ctx.at(2999, 0)
    assert s.get(None) == 2999


def _key_list(store: Any) -> list[Any]:
    (keys,) = [r for r in gc.get_referents(store) if type(r) is list]
    return keys


@pytest.mark.parametrize("impl", IMPLS)
def test_int_keys_through_the_index_match_a_dict_across_many_stores(impl: ModuleType) -> None:
    """The C store's int64 index (open addressing, entries of key and slot side by side,
    backward-shift deletes) and the prefetch of ``set_current_key_raw`` over more stores
    than it registers (8), some dropped on the way: every read matches a dict's."""
    ctx = impl.KeyContext()
    stores = [impl.ColumnStore(ctx, "q") for _ in range(10)]
    model: list[dict[int, int]] = [{} for _ in stores]
    rnd = random.Random(7)
    keys = [rnd.randrange(-(2**63), 2**63) for _ in range(300)] + list(range(3000))
    for step in range(30000):
        if step == 15000:  # dropped stores leave the backend's prefetch list
            for i in (0, 4, 9):
                stores[i] = impl.ColumnStore(ctx, "q")
                model[i] = {}
            gc.collect()
        k = rnd.choice(keys)
        ctx.set_current_key_raw(k, b"k", 1)
        i = rnd.randrange(len(stores))
        op = rnd.random()
        if op < 0.5:
            stores[i].update(step)
            model[i][k] = step
        elif op < 0.7:
            stores[i].clear()
            model[i].pop(k, None)
        for store, m in zip(stores, model, strict=True):
            assert store.get(None) == m.get(k)
    assert [len(s) for s in stores] == [len(m) for m in model]
    for store, m in zip(stores, model, strict=True):
        _, found, values = store.entries()
        assert dict(zip(found, values, strict=True)) == m
    assert (ctx.current_key, ctx.current_key_bytes, ctx.current_key_group) == (k, b"k", 1)
    ctx.set_current_key_raw("text", b"t", 2)  # a key the index cannot hold: the dict
    stores[1].update(5)
    assert stores[1].get(None) == 5 and stores[2].get(None) is None
    with pytest.raises(TypeError):
        ctx.set_current_key_raw(1, b"k")


def test_the_key_list_stays_out_of_the_gc_until_a_key_needs_it() -> None:
    """A full collection walks every tracked container: a list of 1M int keys held the
    GIL 8-15 ms per state (issue 16). The C store keeps it untracked while no key is
    tracked, and tracks it for good once one is, so a cycle through a key is collected."""

    class Key:
        def __init__(self, n: int) -> None:
            self.n, self.store = n, None

        def __hash__(self) -> int:
            return self.n

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Key) and other.n == self.n

    ctx = _ctx(_heapstate_c)
    s = _heapstate_c.ColumnStore(ctx, "q")
    s.load(0, [1, 2**40, "text", b"bytes"], [1] * 4)
    assert not gc.is_tracked(_key_list(s))
    assert s.entries()[1] == [1, 2**40, "text", b"bytes"]
    key = Key(7)
    ctx.at(key, 1)
    s.update(3)
    assert gc.is_tracked(_key_list(s)) and s.get(None) == 3
    ctx.at(8, 1)
    s.clear()  # absent
    ctx.at(key, 1)
    s.clear()
    assert gc.is_tracked(_key_list(s))  # for good

    # a cycle through a key (key -> store -> key list -> key) is still collected
    ctx2 = _ctx(_heapstate_c)
    s2 = _heapstate_c.ColumnStore(ctx2, "q")
    cyclic = Key(9)
    cyclic.store = s2
    ctx2.at(cyclic, 2)
    s2.update(1)
    ctx2.at(None, None)
    gone = weakref.ref(cyclic)
    del cyclic, s2, ctx2
    gc.collect()
    assert gone() is None


def _filled(seed: int, keys: int, groups: int = 128) -> HeapKeyedStateBackend:
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, groups), groups)
    count = b.get_state(ValueStateDescriptor("count", INT64, default=0))
    ratio = b.get_state(ValueStateDescriptor("ratio", FLOAT64))
    label = b.get_state(ValueStateDescriptor("label", STR))  # kept in dicts
    rnd = random.Random(seed)
    for _ in range(keys * 2):
        k = rnd.randrange(keys)
        b.set_current_key(k)
        count.update(count.value() + 1)
        if k % 3 == 0:
            ratio.update(rnd.random())
            label.update(f"k{k}")
        if k % 17 == 0:
            ratio.clear()
    return b


def _files(snapshot: Any, piece_rows: int | None) -> list[tuple[str, int, bytes | None]]:
    return [(f.name, f.rows, f.data) for f in state_files(snapshot, piece_rows)]


@pytest.mark.parametrize("piece_rows", [65536, 512, None])
@pytest.mark.parametrize("groups", [128, 4])  # 39 keys a key group, and 1250 (sorted each)
def test_columns_materialize_to_the_bytes_the_dicts_give(
    piece_rows: int | None, groups: int
) -> None:
    b = _filled(1, 5000, groups)
    assert b.column_store("count") is not None and b.column_store("label") is None
    assert _files(b.column_snapshot(3), piece_rows) == _files(b.snapshot(3), piece_rows)


@pytest.mark.parametrize(
    ("start", "end", "per_group"),
    [(0, 128, 3), (0, 128, 400), (64, 96, 400), (65531, 65535, 300), (65532, 65536, 300)],
)
def test_the_column_order_is_key_group_then_key_within_the_range(
    start: int, end: int, per_group: int
) -> None:
    """Both ways of ``_key_order`` (a sort of all keys below ``GROUP_SORT_MIN_ROWS``
    keys a key group, one per key group from it), 16-bit and wider key groups: slots of
    other key groups and free ones (-1) left out, the rest in (key group, key) order."""
    import numpy as np

    from backends.tables import GROUP_SORT_MIN_ROWS, _key_order

    rnd = np.random.default_rng(start + per_group)
    n = 2 * (end - start + 4) * per_group
    kgs = rnd.integers(max(start - 2, 0), end + 2, n).astype(np.int32)
    kgs[rnd.random(n) < 0.1] = -1
    keys = rnd.permutation(n * 3)[:n].astype(np.int64) - n  # unique, some negative
    got = _key_order(kgs, keys, KeyGroupRange(start, end))
    inside = np.flatnonzero((kgs >= start) & (kgs < end))
    assert (len(inside) >= GROUP_SORT_MIN_ROWS * (end - start)) == (per_group >= 300)
    assert got.tolist() == inside[np.lexsort((keys[inside], kgs[inside]))].tolist()


def test_states_of_the_same_slots_share_one_order_and_others_sort_their_own() -> None:
    """``a`` and ``c`` hold the same keys in the same slots (``c`` takes ``a``'s order),
    ``b`` the same keys in other slots, ``d`` one key group moved: each writes the bytes
    its dicts would."""
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, 4), 4)
    states = {n: b.get_state(ValueStateDescriptor(n, INT64)) for n in "abcd"}
    keys = random.Random(5).sample(range(-(10**9), 10**9), 3000)
    for k in keys:
        b.set_current_key(k)
        states["a"].update(k)
        states["c"].update(-k)
        states["d"].update(k)
    for k in reversed(keys):
        b.set_current_key(k)
        states["b"].update(k)
    b.set_current_key(keys[7])
    states["d"].clear()
    b.set_current_key(keys[7] + 1)
    states["d"].update(1)  # reuses the cleared slot, another key
    snap = b.column_snapshot()
    if _heapstate.NATIVE:  # the twin hands out no int64 keys (None), so sorts each state
        assert snap.columns["a"].int_keys == snap.columns["c"].int_keys
        assert snap.columns["a"].int_keys != snap.columns["b"].int_keys
    assert _files(snap, 512) == _files(b.snapshot(), 512)


@pytest.mark.parametrize("key_serializer", [INT64, STR])
def test_frozen_columns_hand_out_int64_keys_without_the_key_list(key_serializer: Any) -> None:
    """A forked child's columns: the same pieces as a copy's; with int64 keys the key
    list (whose slice would write every key's reference count) is not taken."""
    b = HeapKeyedStateBackend(key_serializer, KeyGroupRange(0, 8), 8)
    count = b.get_state(ValueStateDescriptor("count", INT64, default=0))
    for i in range(2000):
        b.set_current_key(i * 7 if key_serializer is INT64 else f"k{i}")
        count.update(count.value() + i)
    frozen = b.frozen_columns()
    int64 = key_serializer is INT64 and _heapstate.NATIVE  # the twin has no int64 index
    assert (frozen["count"].keys == []) == int64
    assert (frozen["count"].int_keys is not None) == int64
    view = b.snapshot()
    want = _files(view, 256)
    assert _files(dataclasses.replace(view, columns=frozen), 256) == want


def test_a_column_snapshot_keeps_its_state_while_the_store_changes() -> None:
    b = _filled(2, 3000)
    expected = [_files(b.snapshot(), 512)]
    snaps = [b.column_snapshot()]
    count = b.get_state(ValueStateDescriptor("count", INT64, default=0))
    ratio = b.get_state(ValueStateDescriptor("ratio", FLOAT64))
    for step, keys in enumerate([range(2000, 4000), range(0, 300, 7), range(100, 5000, 3)]):
        for k in keys:
            b.set_current_key(k)
            count.update(count.value() + step)
            if step == 1:
                ratio.clear()
                count.clear()
        expected.append(_files(b.snapshot(), 512))
        snaps.append(b.column_snapshot())
    # encoded after every change (and out of order): each as of its own snapshot
    for snap, want in reversed(list(zip(snaps, expected, strict=True))):
        assert _files(snap, 512) == want


def test_an_empty_columnar_state_still_writes_its_declaration() -> None:
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, 8), 8)
    b.get_state(ValueStateDescriptor("count", INT64))
    files = _files(b.column_snapshot(), None)
    assert [(n, r) for n, r, _ in files] == [("count.empty.parquet", 0)]
    assert files == _files(b.snapshot(), None)
