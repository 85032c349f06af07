"""Fakes at the materializer's seams: a manual executor, a backend of local files, a store
that fails on demand, and a helper that records checkpoints in a real MetadataStore."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from backends.handles import KeyedStateHandle, MaterializationHandle
from backends.keygroups import KeyGroupRange
from backends.snapshot import SnapshotFile
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl.errors import StorageError, UnknownOutcomeError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle


class ManualExecutor(Executor):
    """Runs submitted work only when the test says so (``run_all``). Test thread only."""

    def __init__(self) -> None:
        self.queue: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.queue.append((fut, lambda: fn(*args, **kwargs)))
        return fut

    def run_all(self) -> int:
        n = 0
        while self.queue:
            fut, work = self.queue.pop(0)
            try:
                fut.set_result(work())
            except BaseException as exc:
                fut.set_exception(exc)
            n += 1
        return n


@dataclass
class LocalFilesSnapshot:
    """A MaterializationSnapshot whose files are real local files (SST stand-ins)."""

    paths: list[str]
    sqn: int | None
    key_group_range: KeyGroupRange = field(default_factory=lambda: KeyGroupRange(0, 128))
    released: bool = False

    @property
    def kind(self) -> str:
        return "rocksdb-sst"

    def files(self) -> Iterator[SnapshotFile]:
        rng = self.key_group_range
        for p in self.paths:
            yield SnapshotFile(os.path.basename(p), None, rng.start, rng.end, 0, local_path=p)

    def release(self) -> None:
        self.released = True


class LocalFilesBackend:
    """A MaterializationSource over a directory of local files; ``live`` names the files of
    the next snapshot (what ``db.live_files()`` would say). Task thread only."""

    def __init__(self, directory: str, backend_id: str = "op-0-a0000") -> None:
        self.directory = directory
        self.backend_id = backend_id
        self.base: tuple[MaterializationHandle, ...] = ()
        self.restored_log: tuple[ChangelogHandle, ...] = ()
        self.live: list[str] = []
        self.sqn = 0
        self.changed = True
        self.log = 0  # what log_bytes says
        self.snapshots: list[LocalFilesSnapshot] = []

    def write(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.directory, name), "wb") as fh:
            fh.write(data)

    def snapshot_for_materialization(self) -> LocalFilesSnapshot:
        self.sqn += 1
        snap = LocalFilesSnapshot([os.path.join(self.directory, n) for n in self.live], self.sqn)
        self.snapshots.append(snap)
        return snap

    def materialization_done(self, handle: MaterializationHandle) -> None:
        if not self.base or handle.sqn >= self.base[0].sqn:
            self.base = (handle,)
        self.changed = False

    def changed_since_materialization(self) -> bool:
        return self.changed

    def log_bytes(self) -> int:
        return self.log


class FailingFileIO(FileIO):
    """A local FileIO whose ``write_new`` fails on the ``fail_on``-th call (1-based)."""

    def __init__(self, root: str, fail_on: int, unknown: bool = False) -> None:
        super().__init__(root)
        self.fail_on = fail_on
        self.unknown = unknown
        self.calls = 0
        self.in_doubt: list[str] = []

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            if self.unknown:  # the bytes landed, but the caller cannot know
                super().write_new(path, data)
                self.in_doubt.append(path)
                raise UnknownOutcomeError("timeout after send", self.url(path))
            raise StorageError("injected write failure", self.url(path))
        super().write_new(path, data)


def record(
    store: MetadataStore,
    fileio: FileIO,
    job: str,
    checkpoint_id: int,
    handles: list[KeyedStateHandle],
    retain: int,
    operator: str = "op",
) -> list[str]:
    """Record a completed checkpoint; delete and return the released files (as the
    coordinator does)."""
    cp = CompletedCheckpoint(
        job,
        checkpoint_id,
        "checkpoint",
        float(checkpoint_id),
        float(checkpoint_id),
        tuple(SubtaskState(operator, i, (h,)) for i, h in enumerate(handles)),
    )
    released = store.add_completed(cp, retain)
    for url in released:
        fileio.delete(fileio.relative(url))
    return released


def ref_counts(store: MetadataStore, job: str) -> Counter[str]:
    """How many retained checkpoints of ``job`` reference each file."""
    counts: Counter[str] = Counter()
    for cp in store.list(job):
        counts.update(store.get(job, cp.checkpoint_id).files())
    return counts


def keyed(handle: MaterializationHandle, backend_id: str = "op-0-a0000") -> KeyedStateHandle:
    """A changelog-free keyed state handle around one materialization."""
    return KeyedStateHandle(
        backend_id, handle.key_group_start, handle.key_group_end, "str", 128, (handle,), ()
    )
