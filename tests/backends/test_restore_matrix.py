"""Checkpoint / materialize / restore across stores and parallelisms gives the same state.

Every combination of source store (heap, RocksDB) and target store, with the log alone,
with a materialization plus log, and rescaled p -> q.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from backends import KeyedStateHandle, KeyGroupRange
from backends.restore import restore_changelog_backend
from materializer import Materializer
from tests.backends.conftest import MAX_PAR, STORES, Factory
from tests.backends.helpers import dump, merge_dumps, workload


def _restore(
    factory: Factory, kind: str, handles: list[KeyedStateHandle], q: int
) -> dict[str, Any]:
    return factory.restored(kind, handles, q)


@pytest.mark.parametrize("source", STORES)
@pytest.mark.parametrize("target", STORES)
def test_log_only_round_trip(factory: Factory, source: str, target: str) -> None:
    b = factory.logged(source)
    workload(b, 1, 600, factory.clock)
    handle = b.checkpoint(1).result()
    assert handle.materialized == ()
    assert _restore(factory, target, [handle], 1) == dump(b.inner)


@pytest.mark.parametrize("source", STORES)
@pytest.mark.parametrize("target", STORES)
def test_materialization_plus_log_round_trip(factory: Factory, source: str, target: str) -> None:
    b = factory.logged(source)
    workload(b, 2, 500, factory.clock)
    b.checkpoint(1).result()
    mat = Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    assert mat.kind == ("heap-parquet" if source == "heap" else "rocksdb-sst")
    workload(b, 3, 500, factory.clock)
    handle = b.checkpoint(2).result()
    assert handle.materialized == (mat,)
    assert all(c.sqn_end > mat.sqn for c in handle.changelog)
    assert _restore(factory, target, [handle], 1) == dump(b.inner)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(("p", "q"), [(1, 3), (2, 1), (3, 2), (4, 4), (2, 7)])
def test_rescale(factory: Factory, store: str, p: int, q: int) -> None:
    backends = [factory.logged(store, KeyGroupRange.for_subtask(i, p, MAX_PAR)) for i in range(p)]
    for i, b in enumerate(backends):
        workload(b, 10 + i, 500, factory.clock)
        if i % 2 == 0:
            Materializer(b, factory.fileio, "job", "op", i).materialize_now()
        workload(b, 20 + i, 250, factory.clock)
    handles = [b.checkpoint(7).result() for b in backends]
    expected = merge_dumps([dump(b.inner) for b in backends])
    other = "rocksdb" if store == "heap" else "heap"
    assert _restore(factory, store, handles, q) == expected
    assert _restore(factory, other, handles, q) == expected


@pytest.mark.parametrize("store", STORES)
def test_restored_changelog_backend_keeps_working(factory: Factory, store: str) -> None:
    # Restore into a changelog backend, continue, checkpoint again: the second restore
    # must see both the restored base and the new changes (including timers).
    b = factory.logged(store)
    workload(b, 5, 400, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    workload(b, 6, 200, factory.clock)
    h1 = b.checkpoint(1).result()
    halves = []
    for s in range(2):
        nb = factory.logged(store, KeyGroupRange.for_subtask(s, 2, MAX_PAR))
        restore_changelog_backend(nb, factory.fileio, [h1])
        workload(nb, 30 + s, 300, factory.clock)
        halves.append((nb, nb.checkpoint(2).result()))
    expected = merge_dumps([dump(nb.inner) for nb, _ in halves])
    assert _restore(factory, store, [h for _, h in halves], 1) == expected


@pytest.mark.parametrize("key_serializer", ["int64", "str"])
def test_folded_values_load_as_the_logged_bytes(factory: Factory, key_serializer: str) -> None:
    """RocksDB takes the folded log's key and value bytes as they are (rows built in
    Arrow; fixed- and variable-width keys): the same rows a change-by-change replay
    writes, so heap and RocksDB restores agree."""
    from backends import ChangelogKeyedStateBackend, ValueStateDescriptor, restore_into
    from backends.serializers import INT64, serializer_for

    ks = serializer_for(key_serializer)
    b = ChangelogKeyedStateBackend(
        factory.store("heap", key_serializer=ks), factory.storage.create_writer("kb")
    )
    v = b.get_state(ValueStateDescriptor("v", INT64))
    for i in range(500):
        b.set_current_key(i % 37 if key_serializer == "int64" else "k" * (i % 5) + str(i % 37))
        if i % 11 == 10:
            v.clear()
        else:
            v.update(i * 1_000_003)
    handle = b.checkpoint(1).result(timeout=30)
    restored = {}
    for kind in ("heap", "rocksdb"):
        target = factory.store(kind, key_serializer=ks)
        restore_into(target, factory.fileio, [handle])
        restored[kind] = dump(target)
    assert restored["rocksdb"] == restored["heap"] == dump(b.inner)


@pytest.mark.parametrize("store", STORES)
def test_rescales_around_a_materialization_keep_the_latest_state(
    factory: Factory, store: str
) -> None:
    # 2 -> 3, where one new range materializes (its state holds the old writers' changes
    # of its key groups) -> 2, which merges that range with one resting on the old logs
    # alone -> 3 again. The merged states list the materialization beside logs of the
    # old writers that span both: a key group's changes the materialization already
    # holds must not be replayed over it (older values would win).
    handles: list[KeyedStateHandle] = []
    backends: list[Any] = []
    for generation, (q, materialize) in enumerate([(2, ()), (3, (0,)), (2, ()), (3, ())]):
        backends = []
        for s in range(q):
            b = factory.logged(store, KeyGroupRange.for_subtask(s, q, MAX_PAR))
            if handles:
                restore_changelog_backend(b, factory.fileio, handles)
            workload(b, 100 * generation + s, 800, factory.clock)
            if s in materialize:
                mat = Materializer(b, factory.fileio, "job", "op", s).materialize_now()
                assert mat.covers, "the materialization covers the restored writers"
                workload(b, 100 * generation + 50 + s, 800, factory.clock)
            backends.append(b)
        handles = [b.checkpoint(generation + 1).result() for b in backends]
        expected = merge_dumps([dump(b.inner) for b in backends])
        for target in STORES:
            for q_restore in (1, 2, 3):
                assert _restore(factory, target, handles, q_restore) == expected, (
                    f"generation {generation} restored into {q_restore} {target}"
                )


@pytest.mark.parametrize("source", STORES)
@pytest.mark.parametrize("halves", [False, True], ids=["one-by-one", "halves"])
def test_a_long_log_of_value_changes_loads_into_rocksdb_exactly(
    factory: Factory,
    source: str,
    halves: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A log long enough that RocksDB ingests the folded value changes as an SST file
    (INGEST_MIN_ROWS) over a loaded materialization: newer values, clears and sets after
    clears all come out as the source has them, list changes beside them too.
    ``halves``: the states folded and written in two halves of the key groups, the upper
    one in a forked child (:meth:`backends.restore._Replay._finish_in_halves`; the real
    threshold is far larger): its clears and files count as the caller's do."""
    from backends import ListStateDescriptor, ValueStateDescriptor, restore
    from backends.restore import restore_into
    from backends.rocksdb import INGEST_MIN_ROWS
    from backends.serializers import INT64

    monkeypatch.setattr(restore, "HALVES_MIN_ROWS", 1024 if halves else 1 << 40)
    keys = 2 * INGEST_MIN_ROWS
    b = factory.logged(source)
    v = b.get_state(ValueStateDescriptor("v", INT64))
    lst = b.get_state(ListStateDescriptor("l", INT64))

    def round_(r: int) -> None:
        for i in range(keys):
            b.set_current_key(f"k{i}")
            v.update(r * keys + i)
            if i % 7 == r % 7:
                lst.add(r)
            if i % 11 == r:
                v.clear()

    round_(1)
    b.checkpoint(1).result()
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    for r in (2, 3, 4):
        round_(r)
    for i in range(0, keys, 13):  # cleared last; some keys never set again
        b.set_current_key(f"k{i}")
        v.clear()
    b.set_current_key("new")
    v.update(-1)
    handle = b.checkpoint(2).result()
    target = factory.store("rocksdb")
    with caplog.at_level(logging.WARNING, logger="backends.halves"):
        restore_into(target, factory.fileio, [handle])
    assert "halves:" not in caplog.text  # the child did its half
    assert dump(target) == dump(b.inner)
    # ingested: not one memtable insert per key
    assert target._db.property_int_value("rocksdb.num-entries-active-mem-table") < keys


def test_a_state_with_more_keys_than_a_fold_holds_folds_a_bounded_number_of_times(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay folds a value state's gathered changes once they pass FOLD_ROWS, and
    again only once they have doubled since: a state with more keys than FOLD_ROWS keeps
    more rows than that after each fold, and must not fold again at every next block
    (which made replay time quadratic in the log). The state comes out exact."""
    from backends import ValueStateDescriptor, restore
    from backends.serializers import INT64

    monkeypatch.setattr(restore, "FOLD_ROWS", 256)
    folds = []
    last_per_key = restore._last_per_key

    def counted(part: Any) -> Any:
        folds.append(part.num_rows)
        return last_per_key(part)

    monkeypatch.setattr(restore, "_last_per_key", counted)
    b = factory.logged("heap")
    v = b.get_state(ValueStateDescriptor("v", INT64))
    handle = None
    for block in range(24):  # a block per checkpoint: 500 changes over 2000 keys
        for i in range(500):
            b.set_current_key(f"k{(block * 500 + i * 7) % 2000}")
            v.update(block * 1000 + i)
        handle = b.checkpoint(block + 1).result()
    assert handle is not None
    target = factory.store("heap")
    restore.restore_into(target, factory.fileio, [handle])
    assert dump(target) == dump(b.inner)
    # 12k changes in 24 blocks: a fold each time the rows double (then each 2k new rows,
    # the state's key count), not one per block; each change folded about twice at most
    assert len(folds) <= 12 and sum(folds) <= 3 * 12_000, folds


@pytest.mark.parametrize("width", [8, 5])  # 8-byte keys hash as integers, others by codes
def test_the_last_change_per_key_of_a_key_group_range(width: int) -> None:
    """A replay's fold keeps each key's last change, in log order; a restore's half
    keeps those of its key groups only, from rows gathered in many chunks (some empty)."""
    import random

    import pyarrow as pa

    from backends.restore import _last_per_key

    rnd = random.Random(width)
    keys = [rnd.randrange(40) for _ in range(3000)]
    rows = [(key % 8, key, i) for i, key in enumerate(keys)]  # a key decides its group
    chunks = []
    for start in range(0, len(rows), 250):
        part = rows[start : start + 250]
        chunks.append(
            pa.table(
                {
                    "key_group": pa.array([g for g, _, _ in part], pa.int32()),
                    "key": pa.array([k.to_bytes(width, "big") for _, k, _ in part], pa.binary()),
                    "value": pa.array([i for _, _, i in part], pa.int64()),
                }
            )
        )
        chunks.append(chunks[-1].slice(0, 0))
    table = pa.concat_tables(chunks)
    for groups in (None, (0, 3), (3, 8), (8, 9)):
        lo, hi = groups or (0, 8)
        last = {k: (g, k, i) for g, k, i in rows if lo <= g < hi}
        expected = sorted(last.values(), key=lambda r: r[2])  # in log order
        got = _last_per_key(table, groups)
        assert got["value"].to_pylist() == [i for _, _, i in expected]
        assert got["key_group"].to_pylist() == [g for g, _, _ in expected]


@pytest.mark.parametrize("target", STORES)
def test_a_block_grouped_by_key_group_is_gathered_in_one_slice_a_state(
    factory: Factory, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-emptive segment groups a block's rows by key group, which cuts the runs of
    each state's rows the writer handed over into runs of a few rows. The replay puts
    such a block in state order first: one slice a state and block, not one a run (a log
    of 12.7M changes replayed at 1.35M/s that way), and the same state."""
    from backends import restore as restore_mod
    from backends.serializers import INT64
    from backends.state import ValueStateDescriptor
    from dstl import changelog as changelog_mod

    encoded_here = changelog_mod._encoded_here

    def always_grouped(blocks: Any, grouped: bool = True) -> Any:  # as the lane's are
        return encoded_here(blocks)

    monkeypatch.setattr(changelog_mod, "_encoded_here", always_grouped)
    b = factory.logged("heap")
    a = b.get_state(ValueStateDescriptor("a", INT64))
    c = b.get_state(ValueStateDescriptor("c", INT64))
    rnd = random.Random(5)
    for i in range(5000):
        b.set_current_key(f"k{rnd.randrange(1000)}")
        a.update(i)
        c.update(-i)
    handle = b.checkpoint(1).result()
    gathered: list[str] = []
    gather = restore_mod._Replay._gather

    def counted(self: Any, name: str, part: Any) -> None:
        gathered.append(name)
        gather(self, name, part)

    monkeypatch.setattr(restore_mod._Replay, "_gather", counted)
    assert _restore(factory, target, [handle], 1) == dump(b.inner)
    blocks = {(ch.location, ch.block) for ch in handle.changelog}
    assert 0 < len(gathered) <= 2 * len(blocks)
