"""The reference-counting scenario of seed 003 (section 5), end to end.

CP1 uploads sst-1, sst-2 (count 1 each); CP2 adds sst-3, sst-4 and keeps 1 and 2 (count 2);
CP3 compacts 1-3 into one file and adds sst-5, CP1 is subsumed (1 and 2 drop to 1); CP4
compacts 4-6, CP2 is subsumed, and sst-1, sst-2, sst-3 reach 0 and are deleted.

Driven through the real Materializer (sharing by name + size + checksum of real local
files) and a real MetadataStore (SQLite) with retain=2.
"""

from __future__ import annotations

import os
from pathlib import Path

from coordinator.metadata import MetadataStore
from dstl.fileio import FileIO
from materializer import Materializer
from tests.materializer.fakes import LocalFilesBackend, keyed, record, ref_counts

JOB = "job"


def test_seed_scenario(tmp_path: Path) -> None:
    local = tmp_path / "db"
    local.mkdir()
    fileio = FileIO(str(tmp_path / "store"))
    store = MetadataStore("sqlite:///" + str(tmp_path / "meta.db"))
    store.start_attempt(JOB)
    backend = LocalFilesBackend(str(local))
    mat = Materializer(backend, fileio, JOB, "op", 0)
    url: dict[str, str] = {}

    def checkpoint(cid: int, live: list[str]) -> tuple[list[str], dict[str, int]]:
        backend.live = live
        handle = mat.materialize_now()
        for f in handle.state_files:
            name = os.path.basename(f.location)
            assert url.setdefault(name, f.location) == f.location, f"{name} uploaded twice"
        released = record(store, fileio, JOB, cid, [keyed(handle)], retain=2)
        names = {v: k for k, v in url.items()}
        counts = {names[loc]: n for loc, n in ref_counts(store, JOB).items()}
        return sorted(names[r] for r in released), counts

    # CP1: two new files.
    for i in (1, 2):
        backend.write(f"sst-{i}", f"data of sst {i}".encode() * 50)
    released, counts = checkpoint(1, ["sst-1", "sst-2"])
    assert released == []
    assert counts == {"sst-1": 1, "sst-2": 1}
    assert mat.last_stats is not None and mat.last_stats.files_new == 2

    # CP2: adds sst-3 and sst-4; 1 and 2 are shared, not uploaded again.
    for i in (3, 4):
        backend.write(f"sst-{i}", f"data of sst {i}".encode() * 50)
    released, counts = checkpoint(2, ["sst-1", "sst-2", "sst-3", "sst-4"])
    assert released == []
    assert counts == {"sst-1": 2, "sst-2": 2, "sst-3": 1, "sst-4": 1}
    stats = mat.last_stats
    assert stats is not None
    assert (stats.files_new, stats.files_shared) == (2, 2)
    assert stats.bytes_new < stats.bytes_total

    # CP3: 1-3 compacted into one file, sst-5 added; CP1 subsumed: 1 and 2 drop to 1.
    backend.write("sst-123", b"".join((local / f"sst-{i}").read_bytes() for i in (1, 2, 3)))
    backend.write("sst-5", b"data of sst 5" * 50)
    released, counts = checkpoint(3, ["sst-123", "sst-4", "sst-5"])
    assert released == []
    assert counts == {
        "sst-1": 1,
        "sst-2": 1,
        "sst-3": 1,
        "sst-4": 2,
        "sst-123": 1,
        "sst-5": 1,
    }

    # CP4: sst-6 appears and 4-6 are compacted; CP2 subsumed: 1, 2, 3 reach 0 -> deleted.
    backend.write("sst-6", b"data of sst 6" * 50)
    backend.write("sst-456", b"".join((local / f"sst-{i}").read_bytes() for i in (4, 5, 6)))
    released, counts = checkpoint(4, ["sst-123", "sst-456"])
    assert released == ["sst-1", "sst-2", "sst-3"]
    assert counts == {"sst-4": 1, "sst-5": 1, "sst-123": 2, "sst-456": 1}
    for name in ("sst-1", "sst-2", "sst-3"):
        assert not fileio.exists(fileio.relative(url[name])), f"{name} should be deleted"
    for name in ("sst-4", "sst-5", "sst-123", "sst-456"):
        assert fileio.exists(fileio.relative(url[name])), f"{name} must survive"
    assert "sst-6" not in url  # created and compacted away between two materializations
    store.close()


def test_same_name_and_size_but_other_content_is_not_shared(tmp_path: Path) -> None:
    local = tmp_path / "db"
    local.mkdir()
    fileio = FileIO(str(tmp_path / "store"))
    backend = LocalFilesBackend(str(local))
    mat = Materializer(backend, fileio, JOB, "op", 0)
    backend.write("sst-1", b"a" * 100)
    backend.live = ["sst-1"]
    first = mat.materialize_now()
    backend.write("sst-1", b"b" * 100)  # same name, same size: the checksum tells them apart
    second = mat.materialize_now()
    assert first.state_files[0].location != second.state_files[0].location
    assert fileio.read(fileio.relative(second.state_files[0].location)) == b"b" * 100


def test_only_files_of_the_current_base_are_shared(tmp_path: Path) -> None:
    # Regression guard for the SPARK-55892 class of bug: a file of an *older*
    # materialization may be released by reference counting at any moment, so a later
    # materialization must upload its own copy instead of pointing at it.
    local = tmp_path / "db"
    local.mkdir()
    fileio = FileIO(str(tmp_path / "store"))
    backend = LocalFilesBackend(str(local))
    mat = Materializer(backend, fileio, JOB, "op", 0)
    backend.write("sst-1", b"one" * 10)
    backend.write("sst-2", b"two" * 10)
    backend.live = ["sst-1"]
    m1 = mat.materialize_now()
    backend.live = ["sst-2"]
    mat.materialize_now()  # the base no longer holds sst-1
    backend.live = ["sst-1", "sst-2"]
    m3 = mat.materialize_now()
    assert mat.last_stats is not None
    assert (mat.last_stats.files_new, mat.last_stats.files_shared) == (1, 1)
    assert m3.state_files[0].location != m1.state_files[0].location


def test_seed_scenario_with_real_rocksdb(tmp_path: Path) -> None:
    """The same story with real SSTs: flushes make new files, compaction replaces them.

    Changelog off (every checkpoint is a materialization: plain incremental RocksDB
    checkpoints). Unchanged SSTs are shared; compacted-away SSTs are released once the
    last retained checkpoint that references them is subsumed.
    """
    from backends import HeapKeyedStateBackend, KeyGroupRange, ValueStateDescriptor, restore_into
    from backends.rocksdb import RocksDBKeyedStateBackend
    from backends.serializers import INT64, STR
    from materializer import FullSnapshotCheckpointer

    fileio = FileIO(str(tmp_path / "store"))
    store = MetadataStore("sqlite:///" + str(tmp_path / "meta.db"))
    store.start_attempt(JOB)
    db = RocksDBKeyedStateBackend(STR, KeyGroupRange(0, 128), 128, path=str(tmp_path / "local"))
    expected: dict[str, int] = {}
    ssts: dict[int, set[str]] = {}

    with db, FullSnapshotCheckpointer(db, fileio, JOB, "op", 0, "op-0-a0") as full:
        state = full.get_state(ValueStateDescriptor("v", INT64))

        def put(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                full.set_current_key(f"key-{i:06d}")
                state.update(i)
                expected[f"key-{i:06d}"] = i

        def checkpoint(cid: int) -> list[str]:
            handle = full.checkpoint(cid).result()
            ssts[cid] = {url for url in handle.files() if url.endswith(".sst")}
            released = record(store, fileio, JOB, cid, [handle], retain=2)
            full.notify_checkpoint_complete(cid)
            return sorted(r for r in released if r.endswith(".sst"))

        put(0, 1000)  # flushed by the checkpoint into one SST
        assert checkpoint(1) == []
        assert len(ssts[1]) == 1
        put(1000, 2000)
        assert checkpoint(2) == []
        assert ssts[1] < ssts[2] and len(ssts[2]) == 2  # the first SST is shared
        stats = full.last_stats
        assert stats is not None and stats.bytes_new < stats.bytes_total

        db._db.compact_range(None, None)  # both SSTs merge into one new file
        put(2000, 3000)
        assert checkpoint(3) == []  # cp1 subsumed, but cp2 still needs its SSTs
        assert not ssts[3] & ssts[2]
        assert len(ssts[3]) == 2

        db._db.compact_range(None, None)
        put(3000, 3100)
        released = checkpoint(4)  # cp2 subsumed: its compacted-away SSTs reach 0
        assert released == sorted(ssts[2])
        for url in ssts[2]:
            assert not fileio.exists(fileio.relative(url))
        for url in ssts[3] | ssts[4]:
            assert fileio.exists(fileio.relative(url))

        latest = store.latest(JOB)
        assert latest is not None
        restored = HeapKeyedStateBackend(STR, KeyGroupRange(0, 128), 128)
        restore_into(restored, fileio, [h for s in latest.subtasks for h in s.handles])
        got = {k: v for _, k, v in restored.entries("v")}
        assert got == expected
    store.close()
