"""RocksDB store specifics: row layout, short snapshots with stable SST names, restore."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

import backends.rocksdb as rocksdb
from backends import (
    KeyGroupRange,
    ListStateDescriptor,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
    key_group_for,
    restore_into,
)
from backends.errors import LocalStoreError
from backends.handles import KeyedStateHandle
from backends.rocksdb import META_FILE, iter_rows, open_raw_db
from backends.serializers import INT64, STR
from dstl.errors import CorruptionError, SchemaMismatchError
from materializer import Materializer
from tests.backends.conftest import MAX_PAR, Factory
from tests.backends.helpers import dump, opened_with_level, workload


def test_rows_are_prefixed_by_key_group_then_state(factory: Factory) -> None:
    b = factory.store("rocksdb")
    s = b.get_state(ValueStateDescriptor("v", INT64))
    keys = [f"k{i}" for i in range(50)]
    for i, k in enumerate(keys):
        b.set_current_key(k)
        s.update(i)
    rows = list(iter_rows(b._db, b"", b"\xff\xff\xff"))
    assert len(rows) == 50
    for k, _ in rows:
        kg = int.from_bytes(k[:2], "big")
        klen = int.from_bytes(k[4:8], "big")
        assert kg == key_group_for(k[8 : 8 + klen], MAX_PAR)
    # a key-group range is one contiguous scan
    lo, hi = (10).to_bytes(2, "big"), (20).to_bytes(2, "big")
    in_range = {k for k, _ in iter_rows(b._db, lo, hi)}
    assert in_range == {k for k, _ in rows if 10 <= int.from_bytes(k[:2], "big") < 20}


def test_snapshot_is_a_checkpoint_with_stable_sst_names(factory: Factory) -> None:
    b = factory.logged("rocksdb")
    workload(b, 1, 300, factory.clock)
    s1 = b.snapshot_for_materialization()
    s2 = b.snapshot_for_materialization()  # nothing changed in between
    try:
        assert s1.kind == s2.kind == "rocksdb-sst"
        f1, f2 = list(s1.files()), list(s2.files())
        assert f1[0].name == META_FILE and f1[0].data == f2[0].data  # content-stable
        ssts1 = {f.name: os.path.getsize(f.local_path or "") for f in f1 if f.name.endswith(".sst")}
        ssts2 = {f.name: os.path.getsize(f.local_path or "") for f in f2 if f.name.endswith(".sst")}
        assert ssts1 and ssts1 == ssts2
        # later writes do not change a taken snapshot
        b.set_current_key("k1")
        b.get_state(ValueStateDescriptor("late", INT64)).update(1)
        s3 = b.snapshot_for_materialization()
        f3 = list(s3.files())
        assert f3[0].data != f1[0].data
        assert set(ssts1) <= {f.name for f in f3}  # old SSTs are still shared
        s3.release()
    finally:
        s1.release()
        s2.release()
    assert not os.path.exists(s1.directory)
    s1.release()  # idempotent


def test_closed_backend_raises_our_error(factory: Factory) -> None:
    b = RocksDBKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    path = b.path
    b.close()
    assert not os.path.exists(path)  # a backend-created directory is deleted
    with pytest.raises(LocalStoreError):
        b.snapshot()
    given = factory.tmp_path / "given"
    RocksDBKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR, path=str(given)).close()
    assert not given.exists()  # created by the backend: deleted with it (no leak per attempt)
    used = factory.tmp_path / "used"
    (used / "db").mkdir(parents=True)  # somebody's database
    with pytest.raises(LocalStoreError, match="fresh"):
        RocksDBKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR, path=str(used))
    assert (used / "db").is_dir()  # not ours: left alone
    live = RocksDBKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    with pytest.raises(LocalStoreError, match="cannot take"):  # its lock is held
        RocksDBKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR, path=live.path)
    live.close()


def test_sst_restore_schema_mismatch_names_the_state(factory: Factory) -> None:
    b = factory.logged("rocksdb")
    workload(b, 2, 200, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    handle = b.checkpoint(1).result()
    for kind in ("heap", "rocksdb"):
        nb = factory.store(kind)
        nb.get_state(ListStateDescriptor("count", INT64))
        with pytest.raises(SchemaMismatchError, match="'count'"):
            restore_into(nb, factory.fileio, [handle])
    wrong_keys = factory.store("rocksdb", key_serializer=INT64)
    with pytest.raises(SchemaMismatchError, match="keys"):
        restore_into(wrong_keys, factory.fileio, [handle])


def test_missing_meta_file_is_corruption(factory: Factory) -> None:
    import dataclasses

    b = factory.logged("rocksdb")
    workload(b, 3, 100, factory.clock)
    mat = Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    handle = b.checkpoint(1).result()
    files = tuple(f for f in mat.state_files if not f.location.endswith(META_FILE))
    broken = dataclasses.replace(
        handle, materialized=(dataclasses.replace(mat, state_files=files),)
    )
    with pytest.raises(CorruptionError, match=META_FILE):
        restore_into(factory.store("heap"), factory.fileio, [broken])


def test_restore_drops_key_groups_outside_the_range(factory: Factory) -> None:
    b = factory.logged("rocksdb")
    workload(b, 4, 400, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    handle = b.checkpoint(1).result()
    rng = KeyGroupRange(0, 40)
    nb: Any = factory.store("rocksdb", rng)
    restore_into(nb, factory.fileio, [handle])
    rows = list(iter_rows(nb._db, b"", b"\xff\xff\xff"))
    assert rows and all(int.from_bytes(k[:2], "big") < 40 for k, _ in rows)
    full = dump(b.inner)
    expected = {
        n: {k: v for k, v in e.items() if key_group_for(STR.serialize(k), MAX_PAR) in rng}
        for n, e in full.items()
    }
    assert dump(nb) == {n: e for n, e in expected.items() if e}


def test_second_materialization_shares_unchanged_ssts(factory: Factory) -> None:
    b = factory.logged("rocksdb")
    workload(b, 7, 300, factory.clock)
    m = Materializer(b, factory.fileio, "job", "op", 0)
    first = m.materialize_now()
    workload(b, 8, 50, factory.clock)
    second = m.materialize_now()
    old_ssts = {f.location for f in first.state_files if f.location.endswith(".sst")}
    assert old_ssts & {f.location for f in second.state_files}  # the old SST is reused
    handle = b.checkpoint(1).result()
    for kind in ("heap", "rocksdb"):
        nb = factory.store(kind)
        restore_into(nb, factory.fileio, [handle])
        assert dump(nb) == dump(b.inner)


def _list_workload(b: Any, keys: range, rounds: int, base: int) -> None:
    """Appends (not idempotent: replayed twice they double) and value updates."""
    events = b.get_state(ListStateDescriptor("events", INT64))
    count = b.get_state(ValueStateDescriptor("count", INT64))
    for r in range(rounds):
        for k in keys:
            b.set_current_key(f"k{k}")
            events.add(base + r)
            count.update(base + r * 1000 + k)


def test_materialization_while_the_task_keeps_writing_restores_the_snapshot(
    factory: Factory,
) -> None:
    """The snapshot is exactly the state at its log boundary, though the task writes on
    before the upload reads its files: restored alone it is the state at the snapshot,
    and with the log after it the final state (a change in both would double an append)."""
    b = factory.logged("rocksdb")
    _list_workload(b, range(2000), 3, 0)  # in the memtable: the snapshot must flush it
    m = Materializer(b, factory.fileio, "job", "op", 0)
    at_snapshot = dump(b.inner)
    mat_id, snap = m.snapshot()
    _list_workload(b, range(1000, 3000), 2, 100)  # the task writes on, then RocksDB flushes
    b.inner._flush_memtable()
    handle = m.upload(mat_id, snap)
    only_snapshot = factory.store("rocksdb")
    alone = KeyedStateHandle(b.backend_id, 0, MAX_PAR, STR.name, MAX_PAR, (handle,))
    restore_into(only_snapshot, factory.fileio, [alone])
    assert dump(only_snapshot) == at_snapshot
    b.materialization_done(handle)
    _list_workload(b, range(500, 600), 1, 200)
    final = b.checkpoint(2).result()
    for kind in ("heap", "rocksdb"):
        nb = factory.store(kind)
        restore_into(nb, factory.fileio, [final])
        assert dump(nb) == dump(b.inner)


def test_snapshot_flushes_the_memtable_without_holding_the_gil(factory: Factory) -> None:
    """While the snapshot waits for RocksDB to flush the memtable, the other threads of
    the process run: rocksdict's checkpoint holds the GIL for its whole flush, which
    stopped them all (the source, the uploads) for the flush.

    Up to three snapshots, each of a fresh memtable: the old way leaves one gap as long as
    the whole flush in every one of them, while on a loaded machine the kernel alone may
    keep the spinning thread off a core for most of one snapshot (seen once in CI: a gap of
    0.47 s in 0.66 s)."""
    import threading

    b = factory.store("rocksdb")
    s = b.get_state(ValueStateDescriptor("v", STR))
    tries: list[tuple[float, float]] = []  # (longest gap, snapshot's duration)
    for attempt in range(3):
        for i in range(150_000):
            b.set_current_key(f"key-{i:08d}")
            s.update(f"value {i} {attempt} " * 4)
        seen: list[float] = []
        stop = threading.Event()

        def spin(seen: list[float] = seen, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                seen.append(time.perf_counter())

        t = threading.Thread(target=spin)
        t.start()
        try:
            while not seen:  # the spinner is running
                time.sleep(0.001)
            start = time.perf_counter()
            snap = b.snapshot()
            end = time.perf_counter()
        finally:
            stop.set()
            t.join()
        snap.release()
        assert b._db.property_int_value("rocksdb.num-immutable-mem-table") == 0
        assert b._db.property_int_value("rocksdb.num-entries-active-mem-table") == 0
        inside = [x for x in seen if start <= x <= end]
        gaps = [b2 - a for a, b2 in zip([start, *inside], [*inside, end], strict=True)]
        tries.append((max(gaps), end - start))
        if max(gaps) < 0.5 * (end - start):
            return
    # the old way: in each snapshot one gap as long as the whole flush
    raise AssertionError(f"(longest gap, snapshot) in seconds: {tries}")


def test_prepare_snapshot_flushes_in_the_background_and_the_snapshot_stays_exact(
    factory: Factory,
) -> None:
    """prepare_snapshot starts a flush of a large memtable and says when it finished;
    only writes made meanwhile are left for the snapshot's own flush, and the snapshot
    holds them all (it is exact whatever prepare did). A small memtable is ready at
    once."""
    b = factory.store("rocksdb")
    s = b.get_state(ValueStateDescriptor("v", INT64))
    for i in range(50_000):  # more than SNAPSHOT_FLUSH_ENTRIES
        b.set_current_key(f"k{i}")
        s.update(i)
    assert not b.prepare_snapshot()  # started
    for i in range(5):  # the task writes on while RocksDB flushes
        b.set_current_key(f"late{i}")
        s.update(i)
    deadline = time.monotonic() + 60
    while not b.prepare_snapshot():  # until RocksDB's flush thread finished: a turn a read
        assert time.monotonic() < deadline, "the background flush did not finish"
    assert b._db.property_int_value("rocksdb.num-entries-active-mem-table") <= 5
    snap = b.snapshot()
    try:
        copy = open_raw_db(snap.checkpoint_dir)
        rows = dict(iter_rows(copy, b"", b"\xff\xff\xff"))
        copy.close()
    finally:
        snap.release()
    assert len(rows) == 50_005
    empty = factory.store("rocksdb")
    assert empty.prepare_snapshot()  # nothing to flush: ready at once


def _sst_facts(checkpoint_dir: str) -> tuple[int, int, set[int]]:
    """(entries, bytes, levels) of the SSTs of a snapshot's checkpoint directory."""
    db = open_raw_db(checkpoint_dir)
    try:
        return _file_facts(db.live_files())
    finally:
        db.close()


def _table_properties(db: Any) -> dict[str, float]:
    """The numeric table properties of every SST of ``db``, summed (RocksDB's
    ``rocksdb.aggregated-table-properties``: ``name=value; ...``)."""
    text = db.property_value("rocksdb.aggregated-table-properties")
    out: dict[str, float] = {}
    for item in text.split(";"):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return out


def _file_facts(files: list[dict[str, Any]]) -> tuple[int, int, set[int]]:
    """(entries, bytes, levels) of RocksDB's ``live_files()``."""
    return (
        sum(f["num_entries"] for f in files),
        sum(f["size"] for f in files),
        {f["level"] for f in files},
    )


def test_a_prepared_snapshot_holds_no_overwritten_version(factory: Factory) -> None:
    """After updates flushed as checkpoints do, the SSTs hold keys several times (L0
    files over the last level); a materialization's snapshot (prepared) is compacted in
    its copy before its files are read, so they hold each key once, in fewer bytes, with
    the writes made up to the boundary and none after it. The store's own files are
    left as RocksDB keeps them (no second compaction of the whole state)."""
    b = factory.store("rocksdb")
    s = b.get_state(ValueStateDescriptor("v", INT64))
    keys, hot = 20_000, 8_000
    for r, updated in enumerate([range(keys), range(hot), range(hot)]):
        for i in updated:
            b.set_current_key(f"k{i}")
            s.update(r * keys + i)
        b.snapshot().release()  # a flush per round, as a checkpoint without changelog
        if r == 0:
            b._db.compact_range(None, None)  # the first round in the last level
    unprepared = b.snapshot()  # two L0 files over it: under L0's compaction trigger
    try:
        entries, before, _ = _sst_facts(unprepared.checkpoint_dir)
    finally:
        unprepared.release()
    assert entries >= keys + 2 * hot  # the precondition: overwritten versions in the files
    b.set_current_key("k0")
    s.update(-1)  # in the memtable: the snapshot's flush writes it
    assert b.prepare_snapshot()  # a small memtable: ready at once
    snap = b.snapshot()
    b.set_current_key("late")
    s.update(-2)  # after the boundary
    try:
        assert snap.compact
        stores_files = {f["name"].lstrip("/") for f in b._db.live_files()}
        uploaded = {f.name for f in snap.files() if f.name.endswith(".sst")}
        entries, after, levels = _sst_facts(snap.checkpoint_dir)
        copy = open_raw_db(snap.checkpoint_dir)
        rows = dict(iter_rows(copy, b"", b"\xff\xff\xff"))
        copy.close()
    finally:
        snap.release()
    assert entries == keys  # each key once
    assert after < before
    assert len(levels) == 1
    assert not uploaded & stores_files  # the copy's own files
    assert _file_facts(b._db.live_files())[0] >= keys + 2 * hot  # store not compacted
    expected = {f"k{i}": (2 * keys + i if i < hot else i) for i in range(keys)}
    expected["k0"] = -1
    assert {STR.deserialize(k[8:]): INT64.deserialize(v) for k, v in rows.items()} == expected


def test_files_above_the_last_level_have_bloom_filters_and_the_last_level_none(
    tmp_path: Any,
) -> None:
    """A read searches every level above the one holding its key: filters there spare
    the search; the last level (most keys, what a compacted snapshot uploads) has none."""

    def filtered(db: Any) -> dict[int, bool]:
        out: dict[int, bool] = {}
        for f in db.live_files():
            with open(str(tmp_path) + f["name"], "rb") as fh:
                out[f["level"]] = b"fullfilter.rocksdb.BuiltinBloomFilter" in fh.read()
        return out

    db = open_raw_db(str(tmp_path))
    try:
        for version in range(2):
            for i in range(5000):
                db[b"k%06d" % i] = b"v%d" % version
            db.flush()
        assert filtered(db) == {0: True}
        db.compact_range(None, None)
        assert filtered(db) == {6: False}
        assert db[b"k000042"] == b"v1"
    finally:
        db.close()


def test_writes_left_above_the_last_level_are_compacted_in_the_snapshots_copy(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes flushed since the last compaction into the last level sit in L0 beside it
    and repeat its keys; when they are a large part of the snapshot, its copy is
    compacted before its files are read: one level, each key once, the rows exactly the
    snapshot's (later writes excluded), the store's own files untouched, in the copy's
    larger blocks. A snapshot with only a few such writes keeps the store's files (and
    their names: shared uploads)."""
    from backends.rocksdb import BLOCK_SIZE, COPY_BLOCK_SIZE, SNAPSHOT_COMPACT_MIN_BYTES

    b = factory.store("rocksdb")
    s = b.get_state(ValueStateDescriptor("v", INT64))
    keys = 40_000
    for i in range(keys):
        b.set_current_key(f"k{i}")
        s.update(i)
    b._flush_memtable()
    b._db.compact_range(None, None)  # the precondition: all in the last level
    assert b.prepare_snapshot()
    few = b.snapshot()  # nothing above the last level
    assert not few.compact
    last_level = {f.name for f in few.files() if f.name.endswith(".sst")}
    few.release()
    for i in range(keys):  # every key again: an L0 file as large as the last level
        b.set_current_key(f"k{i}")
        s.update(-i)
    deadline = time.monotonic() + 60
    while not b.prepare_snapshot():  # a materialization's snapshot again
        assert time.monotonic() < deadline, "the background flush did not finish"
    snap = b.snapshot()
    try:
        b.set_current_key("k0")
        s.update(7)  # after the boundary: not in the snapshot
        entries, before, levels = _sst_facts(snap.checkpoint_dir)
        assert snap.compact and len(levels) > 1 and entries == 2 * keys
        assert before >= 2 * SNAPSHOT_COMPACT_MIN_BYTES
        monkeypatch.setattr(rocksdb, "BOTTOMMOST_ZSTD_LEVEL", 5)  # the copy's OPTIONS: 7
        names = [f.name for f in snap.files()]
        assert not {"LOG", "LOCK"} & set(names)
        assert opened_with_level(os.path.join(snap.checkpoint_dir, "LOG")) == 5  # today's
        entries, after, levels = _sst_facts(snap.checkpoint_dir)
        assert entries == keys and len(levels) == 1 and after < before
        assert not last_level & set(names)  # new files: the compacted copy's own
        copy = open_raw_db(snap.checkpoint_dir)
        rows = dict(iter_rows(copy, b"", b"\xff\xff\xff"))
        props = _table_properties(copy)
        copy.close()
        # raw (uncompressed, unshared) bytes per data block: ~170K at the copy's 128 KiB
        # blocks, ~85K at the store's 64 KiB
        per_block = (props["raw key size"] + props["raw value size"]) / props["# data blocks"]
        assert per_block > COPY_BLOCK_SIZE > BLOCK_SIZE
    finally:
        snap.release()
    assert {STR.deserialize(k[8:]): INT64.deserialize(v) for k, v in rows.items()} == {
        f"k{i}": -i for i in range(keys)
    }
    for key, value in (("k0", 7), ("k5", -5), (f"k{keys - 1}", 1 - keys)):  # the store's own
        b.set_current_key(key)
        assert s.value() == value


def test_an_unprepared_snapshot_keeps_the_stores_files(
    factory: Factory,
) -> None:
    """A checkpoint with the changelog off snapshots without prepare_snapshot: however
    much sits above the last level, its copy is not compacted (that would rewrite and
    upload the whole state at every checkpoint): its files are the ones the store had."""
    b = factory.store("rocksdb")
    s = b.get_state(ValueStateDescriptor("v", INT64))
    for value in (1, 2):  # every key twice: much of it above the last level
        for i in range(40_000):
            b.set_current_key(f"k{i}")
            s.update(value * i)
        b._flush_memtable()
    snap = b.snapshot()
    try:
        before = {n for n in os.listdir(snap.checkpoint_dir) if n.endswith(".sst")}
        assert len(_sst_facts(snap.checkpoint_dir)[2]) > 1  # files on several levels
        assert not snap.compact
        uploaded = {f.name for f in snap.files() if f.name.endswith(".sst")}
        assert uploaded == before  # not rewritten
    finally:
        snap.release()


def test_the_rocksdb_store_names_its_own_log_ratio(factory: Factory) -> None:
    """The changelog backend reports the inner store's size-bound ratio: the RocksDB
    store's lower one (its SSTs are larger than the heap's tables), none for the heap."""
    assert factory.logged("rocksdb").max_log_ratio == RocksDBKeyedStateBackend.MAX_LOG_RATIO
    assert factory.logged("heap").max_log_ratio is None


@pytest.mark.parametrize("key_ser", [INT64, STR], ids=["int64", "str"])
@pytest.mark.parametrize("sort", [True, False])
def test_bulk_loaded_values_are_ingested_over_older_ones(
    factory: Factory, sort: bool, key_ser: Any
) -> None:
    """load_serialized_values from INGEST_MIN_ROWS rows on writes an SST file RocksDB
    ingests (nothing in the memtable): its values replace older ones of the same keys,
    in the memtable or in files, whether the rows came sorted or not; other keys stay.
    8-byte keys (int64, negative ones too: their bytes sort unlike their numbers) are
    sorted in numpy, others in Arrow."""
    import pyarrow as pa

    from backends.rocksdb import INGEST_MIN_ROWS

    def key(i: int) -> Any:
        return i - INGEST_MIN_ROWS if key_ser is INT64 else f"k{i}"

    b = factory.store("rocksdb", key_serializer=key_ser)
    s = b.get_state(ValueStateDescriptor("v", INT64))
    n = 2 * INGEST_MIN_ROWS
    for i in range(0, 2 * n, 2):  # every second key: half of them in a file
        b.set_current_key(key(i))
        s.update(-i)
        if i == n:
            b.snapshot().release()
    ids = list(range(n, 0, -1))  # descending: the store sorts what is not ascending
    if sort:  # the store's order: key group, then key bytes
        ids.sort(
            key=lambda i: (
                key_group_for(key_ser.serialize(key(i)), MAX_PAR),
                key_ser.serialize(key(i)),
            )
        )
    b.load_serialized_values(
        b.state_metas()["v"],
        pa.array([key_group_for(key_ser.serialize(key(i)), MAX_PAR) for i in ids], pa.int32()),
        pa.array([key_ser.serialize(key(i)) for i in ids], pa.binary()),
        pa.array([INT64.serialize(10 * i) for i in ids], pa.binary()),
    )
    assert b._db.property_int_value("rocksdb.num-entries-active-mem-table") == 0
    for i in range(2 * n):
        b.set_current_key(key(i))
        expected = 10 * i if 0 < i <= n else (-i if i % 2 == 0 else None)
        assert s.value() == expected, i


def test_bulk_load_refuses_a_key_group_out_of_range(factory: Factory) -> None:
    """A bulk load of 8-byte keys checks its key groups (they become two bytes of each
    row: a larger one would land in another group's range) and writes nothing."""
    import pyarrow as pa

    from backends.rocksdb import INGEST_MIN_ROWS

    b = factory.store("rocksdb", key_serializer=INT64)
    s = b.get_state(ValueStateDescriptor("v", INT64))
    n = INGEST_MIN_ROWS
    groups = [key_group_for(INT64.serialize(k), MAX_PAR) for k in range(n)]
    groups[-1] = MAX_PAR + 256 * MAX_PAR
    with pytest.raises(ValueError, match="key groups"):
        b.load_serialized_values(
            b.state_metas()["v"],
            pa.array(groups, pa.int32()),
            pa.array([INT64.serialize(k) for k in range(n)], pa.binary()),
            pa.array([INT64.serialize(k) for k in range(n)], pa.binary()),
        )
    b.set_current_key(0)
    assert s.value() is None
