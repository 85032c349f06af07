"""Changelog off: every checkpoint is a materialization; switching works across restores."""

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
    restore_changelog_backend,
    restore_into,
)
from backends.serializers import INT64, STR
from coordinator.metadata import MetadataStore
from dstl import ChangelogStorage, FileIO
from dstl.upload import Uploader
from materializer import (
    FullSnapshotCheckpointer,
    MaterializationError,
    Materializer,
    MaterializerOptions,
    restore_full_backend,
)
from tests.backends.helpers import snapshot_entries
from tests.materializer.fakes import FailingFileIO, record

MAX_PAR = 128
JOB = "job"
OPTS = MaterializerOptions(heap_piece_rows=64)


def _heap() -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)


def _full(fileio: FileIO | None, backend_id: str, root: Path) -> FullSnapshotCheckpointer:
    return FullSnapshotCheckpointer(
        _heap(), fileio or FileIO(str(root)), JOB, "op", 0, backend_id, options=OPTS
    )


def _mutate(b: Any, start: int, n: int) -> None:
    count = b.get_state(ValueStateDescriptor("count", INT64))
    attrs = b.get_state(MapStateDescriptor("attrs", STR, INT64))
    for i in range(start, start + n):
        b.set_current_key(f"k{i % 1500}")
        count.update((count.value() or 0) + 1)
        attrs.put(f"a{i % 4}", i)


def _restore(fileio: FileIO, handle: KeyedStateHandle) -> dict[str, dict[Any, Any]]:
    nb = _heap()
    restore_into(nb, fileio, [handle])
    return snapshot_entries(nb)


def test_every_checkpoint_is_a_materialization_sharing_the_confirmed_one(
    tmp_path: Path, storage: tuple[FileIO, ChangelogStorage]
) -> None:
    fileio, _ = storage
    store = MetadataStore("sqlite:///" + str(tmp_path / "meta.db"))
    store.start_attempt(JOB)
    with _full(fileio, "op-0-a0", tmp_path) as full:
        _mutate(full, 0, 3000)
        h1 = full.checkpoint(1).result()
        assert h1.changelog == () and len(h1.materialized) == 1
        assert h1.materialized[0].sqn == 0 and h1.replay_from(full.backend_id) == 0
        assert _restore(fileio, h1) == snapshot_entries(full.inner)
        assert record(store, fileio, JOB, 1, [h1], retain=1) == []

        _mutate(full, 3000, 5)
        h2_unconfirmed = full.checkpoint(2).result()  # cp1 not confirmed: nothing shared
        stats = full.last_stats
        assert stats is not None and stats.files_shared == 0
        full.notify_checkpoint_aborted(2)

        full.notify_checkpoint_complete(1)
        h3 = full.checkpoint(3).result()
        stats = full.last_stats
        assert stats is not None
        assert 0 < stats.files_new <= 10 and stats.files_shared > 3 * stats.files_new
        assert _restore(fileio, h3) == snapshot_entries(full.inner)
        released = record(store, fileio, JOB, 3, [h3], retain=1)
        # cp1 subsumed: exactly its pieces that cp3 did not share are released
        assert set(released) == set(h1.files()) - set(h3.files())
        assert not set(released) & set(h2_unconfirmed.files())
    store.close()


def test_failed_full_checkpoint_deletes_its_new_files(tmp_path: Path) -> None:
    failing = FailingFileIO(str(tmp_path / "store"), fail_on=2)
    with _full(failing, "op-0-a0", tmp_path) as full:
        _mutate(full, 0, 1000)
        fut = full.checkpoint(1)
        with pytest.raises(MaterializationError):
            fut.result()
        assert failing.list("jobs") == []


def test_switch_changelog_on_to_off_and_back(storage: tuple[FileIO, ChangelogStorage]) -> None:
    fileio, st = storage
    # attempt 0: changelog on, one materialization plus a log
    b0 = ChangelogKeyedStateBackend(_heap(), st.create_writer("op-0-a0"))
    _mutate(b0, 0, 2000)
    Materializer(b0, fileio, JOB, "op", 0, options=OPTS).materialize_now()
    _mutate(b0, 2000, 20)
    cp1 = b0.checkpoint(1).result()
    assert cp1.changelog
    expected = snapshot_entries(b0.inner)

    # attempt 1: changelog off, restored from the changelog checkpoint
    with FullSnapshotCheckpointer(_heap(), fileio, JOB, "op", 0, "op-0-a1", options=OPTS) as b1:
        restore_full_backend(b1, fileio, [cp1])
        assert snapshot_entries(b1.inner) == expected
        cp2 = b1.checkpoint(2).result()
        stats = b1.last_stats
        assert stats is not None and stats.files_shared > 0  # the restored base is shared
        assert cp2.changelog == ()
        assert _restore(fileio, cp2) == expected
        _mutate(b1, 5000, 200)
        b1.notify_checkpoint_complete(2)
        cp3 = b1.checkpoint(3).result()
        expected = snapshot_entries(b1.inner)

    # attempt 2: changelog on again, restored from the full checkpoint
    b2 = ChangelogKeyedStateBackend(_heap(), st.create_writer("op-0-a2"))
    restore_changelog_backend(b2, fileio, [cp3])
    assert snapshot_entries(b2.inner) == expected
    _mutate(b2, 9000, 100)
    cp4 = b2.checkpoint(4).result()
    assert cp4.materialized == cp3.materialized and cp4.changelog
    assert _restore(fileio, cp4) == snapshot_entries(b2.inner)
    m = Materializer(b2, fileio, JOB, "op", 0, options=OPTS)
    m.materialize_now()
    assert m.last_stats is not None and m.last_stats.files_shared > 0
    cp5 = b2.checkpoint(5).result()
    assert _restore(fileio, cp5) == snapshot_entries(b2.inner)


def test_a_given_uploader_carries_the_files_and_stays_open(tmp_path: Path) -> None:
    # the embedded runtime shares one uploader per worker (retries, hedging, byte budget)
    fileio = FileIO(str(tmp_path / "store"))

    class Shared(Uploader):
        def __init__(self) -> None:
            super().__init__(fileio, name="worker")
            self.paths: list[str] = []
            self.closed = False

        def upload(self, path: str, data: bytes | memoryview) -> str:
            self.paths.append(path)
            return super().upload(path, data)

        def close(self) -> None:
            self.closed = True
            super().close()

    shared = Shared()
    with FullSnapshotCheckpointer(
        _heap(), fileio, JOB, "op", 0, "op-0-a0", options=OPTS, uploader=shared
    ) as full:
        _mutate(full, 0, 500)
        handle = full.checkpoint(1).result()
        assert full.materializer.uploader is shared
    assert len(shared.paths) == len(handle.files()) > 0
    assert not shared.closed  # its owner closes it, after every task
    shared.close()
