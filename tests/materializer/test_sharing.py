"""Heap materializations share unchanged pieces; failures clean up what they know about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyedStateHandle,
    KeyGroupRange,
    MapStateDescriptor,
    ValueStateDescriptor,
    restore_into,
)
from backends.serializers import INT64, STR
from dstl import ChangelogStorage, FileIO
from materializer import MaterializationError, Materializer, MaterializerOptions
from tests.backends.helpers import snapshot_entries
from tests.materializer.fakes import FailingFileIO

MAX_PAR = 128


def _backend(st: ChangelogStorage, writer: str = "op-0") -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(
        HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR), st.create_writer(writer)
    )


def _fill(b: ChangelogKeyedStateBackend, n: int, offset: int = 0) -> None:
    count = b.get_state(ValueStateDescriptor("count", INT64))
    attrs = b.get_state(MapStateDescriptor("attrs", STR, INT64))
    for i in range(n):
        b.set_current_key(f"k{i}")
        count.update(i + offset)
        attrs.put(f"a{i % 3}", i)


def _restore(fileio: FileIO, handle: KeyedStateHandle) -> dict[str, dict[Any, Any]]:
    nb = HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    restore_into(nb, fileio, [handle])
    return snapshot_entries(nb)


def test_unchanged_pieces_are_shared_and_restore_is_exact(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    fileio, st = storage
    b = _backend(st)
    _fill(b, 3000)
    mat = Materializer(b, fileio, "job", "op", 0, options=MaterializerOptions(heap_piece_rows=64))
    first = mat.materialize_now()
    assert mat.last_stats is not None and mat.last_stats.files_shared == 0
    count = b.get_state(ValueStateDescriptor("count", INT64))
    b.set_current_key("k7")
    count.update(-1)
    second = mat.materialize_now()
    stats = mat.last_stats
    assert stats is not None
    # One key changed: one piece of one state is new, everything else is shared.
    assert stats.files_new == 1
    assert stats.files_shared == len(second.state_files) - 1
    assert stats.bytes_new * 20 < stats.bytes_total
    shared = {f.location for f in first.state_files} & {f.location for f in second.state_files}
    assert len(shared) == stats.files_shared
    assert _restore(fileio, b.checkpoint(1).result()) == snapshot_entries(b.inner)
    assert stats.to_dict()["files_new"] == 1


def test_piece_bytes_do_not_depend_on_insertion_order(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    # Determinism: a key removed and added again (or restored from the log in another
    # order) must not change the bytes of its piece, or nothing would ever be shared.
    fileio, st = storage
    b = _backend(st)
    _fill(b, 500)
    mat = Materializer(b, fileio, "job", "op", 0, options=MaterializerOptions(heap_piece_rows=32))
    mat.materialize_now()
    count = b.get_state(ValueStateDescriptor("count", INT64))
    attrs = b.get_state(MapStateDescriptor("attrs", STR, INT64))
    b.set_current_key("k3")
    value = count.value()
    count.clear()
    count.update(value)
    entries = dict(attrs.items())
    attrs.clear()
    for uk in sorted(entries, reverse=True):
        attrs.put(uk, entries[uk])
    mat.materialize_now()
    assert mat.last_stats is not None
    assert mat.last_stats.files_new == 0


def test_restored_base_is_shared_by_the_next_attempt(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    from backends import restore_changelog_backend

    fileio, st = storage
    b = _backend(st, "op-0-a0")
    _fill(b, 1000)
    Materializer(b, fileio, "job", "op", 0).materialize_now()
    handle = b.checkpoint(1).result()
    b2 = _backend(st, "op-0-a1")
    restore_changelog_backend(b2, fileio, [handle])
    mat = Materializer(b2, fileio, "job", "op", 0)
    m = mat.materialize_now()
    assert mat.last_stats is not None
    assert mat.last_stats.files_new == 0
    assert {f.location for f in m.state_files} == set(handle.files())


@pytest.mark.parametrize("unknown", [False, True])
def test_failed_upload_deletes_its_new_files(tmp_path: Path, unknown: bool) -> None:
    root = str(tmp_path / "store")
    with ChangelogStorage(FileIO(root), "job", "w0") as st:
        b = _backend(st)
        _fill(b, 2000)
        failing = FailingFileIO(root, fail_on=3, unknown=unknown)
        mat = Materializer(
            b, failing, "job", "op", 0, options=MaterializerOptions(heap_piece_rows=64)
        )
        mat_id, snap = mat.snapshot()
        with pytest.raises(MaterializationError) as info:
            mat.upload(mat_id, snap)
        assert info.value.__cause__ is not None
        left = [f.path for f in failing.list("jobs/job/materialized")]
        # Nothing remains, even the file whose write had an unknown outcome: no handle can
        # reference it (the uploader deletes it once its attempt returned; one that lands
        # later still is the orphan sweep's).
        assert left == []
        assert not unknown or failing.in_doubt
        assert b.base == ()


@pytest.mark.parametrize("piece_rows", [None, 1, 7, 4096])
def test_any_piece_size_restores_exactly(
    storage: tuple[FileIO, ChangelogStorage], piece_rows: int | None
) -> None:
    from backends import ListStateDescriptor

    fileio, st = storage
    b = _backend(st)
    _fill(b, 300)
    items = b.get_state(ListStateDescriptor("items", STR))
    for i in range(0, 300, 3):
        b.set_current_key(f"k{i}")
        items.add(f"x{i}")
        items.add(f"y{i}")
    mat = Materializer(
        b, fileio, "job", "op", 0, options=MaterializerOptions(heap_piece_rows=piece_rows)
    )
    handle = mat.materialize_now()
    names = [f.name for f in handle.state_files]
    if piece_rows is None:  # the backend's own 16-key-group chunks
        assert all(".kg" in n or n.endswith(".empty.parquet") for n in names)
    else:
        assert all(".kg" in n for n in names)
        # a key's map entries never straddle two pieces; every entry is in exactly one
        assert sum(f.rows for f in handle.state_files if f.state == "attrs") == 300
    assert _restore(fileio, b.checkpoint(1).result()) == snapshot_entries(b.inner)
