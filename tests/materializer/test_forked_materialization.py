"""A heap materialization forks: it holds exactly the state of its snapshot, whatever the
task writes while it uploads, and a checkpoint on it restores exactly once.

The state is large enough to fork (:data:`backends.forked.FORK_MIN_ENTRIES`); the child
is a real process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyedStateHandle,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
    restore_into,
)
from backends.forked import FORK_MIN_ENTRIES, ForkedSnapshot
from backends.serializers import INT64, STR
from dstl import ChangelogStorage, FileIO
from materializer import FullSnapshotCheckpointer, Materializer, MaterializerOptions
from tests.backends.helpers import snapshot_entries

MAX_PAR = 128
JOB = "job"
KEYS = FORK_MIN_ENTRIES + 1000


def _heap() -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR)


def _write(b: Any, keys: range, salt: int) -> None:
    """Every state kind: values in dicts and columnar (with deletions), lists and maps.
    The dict value state alone is large enough to fork; the columnar one the child
    reads from its copy of the store."""
    count = b.get_state(ValueStateDescriptor("count", INT64))
    label = b.get_state(ValueStateDescriptor("label", STR))
    seen = b.get_state(ListStateDescriptor("seen", STR))
    tags = b.get_state(MapStateDescriptor("tags", STR, INT64))
    for i in keys:
        b.set_current_key(i)
        count.update(i + salt)
        label.update(f"l{i + salt}")
        if i % 11 == 0:
            seen.add(f"s{i}-{salt}")
            tags.put(f"t{salt % 3}", i)
        if salt and i % 13 == 0:
            count.clear()
            label.clear()


def _restored(fileio: FileIO, handle: KeyedStateHandle) -> dict[str, dict[Any, Any]]:
    b = _heap()
    restore_into(b, fileio, [handle])
    return snapshot_entries(b)


def test_a_materialization_holds_its_snapshot_while_the_task_writes_on(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    fileio, st = storage
    inner = _heap()
    b = ChangelogKeyedStateBackend(inner, st.create_writer("op-0"))
    _write(b, range(KEYS), 0)
    mat = Materializer(b, fileio, JOB, "op", 0, options=MaterializerOptions(heap_piece_rows=4096))
    mat_id, snap = mat.snapshot()
    assert isinstance(snap, ForkedSnapshot)
    at_snapshot = snapshot_entries(inner)
    _write(b, range(0, KEYS + 500, 3), 1)  # the task goes on while the child encodes
    handle = mat.upload(mat_id, snap)
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(snap.pid, os.WNOHANG)
    assert mat.last_stats is not None and mat.last_stats.files_new > 16
    only_mat = KeyedStateHandle(b.backend_id, 0, MAX_PAR, INT64.name, MAX_PAR, (handle,), ())
    assert _restored(fileio, only_mat) == at_snapshot != snapshot_entries(inner)
    # the log from the snapshot's sqn on carries what came after: exactly once
    b.materialization_done(handle)
    _write(b, range(5, KEYS, 17), 2)
    checkpoint = b.checkpoint(1).result()
    assert checkpoint.materialized == (handle,)
    assert _restored(fileio, checkpoint) == snapshot_entries(inner)


def test_an_unchanged_state_shares_every_piece_of_its_forked_materialization(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    fileio, st = storage
    b = ChangelogKeyedStateBackend(_heap(), st.create_writer("op-0"))
    _write(b, range(KEYS), 0)
    mat = Materializer(b, fileio, JOB, "op", 0)
    first = mat.materialize_now()
    b.set_current_key(3)  # one key of one piece changes
    b.get_state(ValueStateDescriptor("count", INT64)).update(-3)
    second = mat.materialize_now()
    assert mat.last_stats is not None
    assert (mat.last_stats.files_new, mat.last_stats.files_shared) == (
        1,
        len(first.state_files) - 1,
    )
    assert len(second.state_files) == len(first.state_files)


def test_changelog_off_checkpoints_fork_too(tmp_path: Path) -> None:
    fileio = FileIO(str(tmp_path / "store"))
    with FullSnapshotCheckpointer(_heap(), fileio, JOB, "op", 0, "full-0") as full:
        _write(full, range(KEYS), 0)
        at_barrier = snapshot_entries(full.inner)
        snap = full.snapshot_for_materialization()
        assert isinstance(snap, ForkedSnapshot)
        snap.release()
        future = full.checkpoint(1)
        _write(full, range(0, KEYS, 5), 1)  # after the barrier: not in checkpoint 1
        handle = future.result()
        assert _restored(fileio, handle) == at_barrier != snapshot_entries(full.inner)


def test_only_a_background_child_s_upload_keeps_the_task_s_gil_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copied snapshot's pieces are encoded on the upload thread, and a small state's
    materialization time bounds its full size: short slices
    (:data:`dstl.gil.GIL_SLICE_S`). A large state's forked child runs in the background,
    and its upload, which only moves bytes, at the process's own switch interval.
    (The changelog runs no threads here: its pre-emptive lane uploads with short slices
    too, and the interval is the process's.)"""
    import sys

    import backends.forked as forked_mod
    import materializer.materializer as materializer_mod
    from dstl.gil import GIL_SLICE_S

    seen: list[tuple[str, float]] = []
    real = materializer_mod.Materializer._pieces

    def spy(self: Any, snapshot: Any, *args: Any) -> Any:
        seen.append((type(snapshot).__name__, sys.getswitchinterval()))
        return real(self, snapshot, *args)

    monkeypatch.setattr(materializer_mod.Materializer, "_pieces", spy)
    fileio = FileIO(str(tmp_path / "store"))
    with ChangelogStorage(fileio, "job", "w0", start_thread=False) as st:
        for keys, large in ((1000, False), (KEYS, False), (KEYS, True)):
            if large:
                monkeypatch.setattr(forked_mod, "NICE_MIN_ENTRIES", KEYS)
            b = ChangelogKeyedStateBackend(_heap(), st.create_writer(f"op-{keys}-{large}"))
            count = b.get_state(ValueStateDescriptor("count", INT64))
            for i in range(keys):
                b.set_current_key(i)
                count.update(i)
            Materializer(b, fileio, JOB, f"op-{keys}-{large}", 0).materialize_now()
    own = sys.getswitchinterval()
    assert own > GIL_SLICE_S
    assert seen == [
        ("StateSnapshot", GIL_SLICE_S),
        ("ForkedSnapshot", GIL_SLICE_S),
        ("ForkedSnapshot", own),
    ]


def test_on_a_local_disk_the_child_writes_the_files_an_object_store_gets_them_uploaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked child writes the new files to a local disk itself: the materializer's
    uploader writes none (the upload thread only reads the child's headers). To an object
    store (here the fault-injecting double, whose writes are hedged like S3's) the upload
    thread writes them, from the bytes the child sends. The same state either way."""
    from dstl.upload import Uploader
    from tests.dstl.faults import FaultyFileIO

    uploaded: list[str] = []
    real = Uploader.upload

    def spy(self: Uploader, path: str, data: bytes | memoryview) -> str:
        uploaded.append(path)
        return real(self, path, data)

    monkeypatch.setattr(Uploader, "upload", spy)
    restored = []
    for fileio in (FileIO(str(tmp_path / "local")), FaultyFileIO(str(tmp_path / "s3-like"))):
        with ChangelogStorage(fileio, JOB, "w0") as st:
            b = ChangelogKeyedStateBackend(_heap(), st.create_writer("op-0"))
            _write(b, range(KEYS), 0)
            mat = Materializer(b, fileio, JOB, "op", 0)
            mat_id, snap = mat.snapshot()
            assert isinstance(snap, ForkedSnapshot)
            handle = mat.upload(mat_id, snap)
            mat.close()
        assert mat.last_stats is not None and mat.last_stats.files_new == len(handle.state_files)
        assert len(uploaded) == (mat.last_stats.files_new if fileio.hedged else 0)
        uploaded.clear()
        only = KeyedStateHandle(b.backend_id, 0, MAX_PAR, INT64.name, MAX_PAR, (handle,), ())
        restored.append(_restored(fileio, only))
    assert restored[0] == restored[1] == snapshot_entries(b.inner)
