"""Materialization of a changelog backend: snapshot on the task thread, upload anywhere.

A materialization has two parts, as in FLIP-158: :meth:`Materializer.snapshot` runs on
the task thread (it closes the log's change set and copies the state, which is short);
:meth:`Materializer.upload` writes the state tables through the FileIO on any thread and
returns a :class:`~backends.handles.MaterializationHandle`; the task thread then hands
that to :meth:`~backends.changelog.ChangelogKeyedStateBackend.materialization_done`, which
lets later checkpoints drop the log before it.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import MaterializationHandle, StateFileHandle
from backends.snapshot import MaterializationSnapshot
from dstl import layout
from dstl.errors import ConfigError
from dstl.fileio import FileIO

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MaterializationStats:
    """What one materialization cost."""

    duration_s: float
    files_new: int
    files_shared: int
    bytes_new: int
    bytes_total: int


class Materializer:
    """Materializes one backend instance of operator ``operator``, subtask ``subtask``.

    :meth:`snapshot` is task thread only; :meth:`upload` may run on any thread and touches
    no backend state. Thread-safe otherwise: it holds no mutable state but a counter that
    only the task thread advances.
    """

    def __init__(
        self,
        backend: ChangelogKeyedStateBackend,
        fileio: FileIO,
        job: str,
        operator: str,
        subtask: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.fileio = fileio
        self.job = job
        self.operator = operator
        self.subtask = subtask
        self._clock = clock
        self._next_id = 1
        self.last_stats: MaterializationStats | None = None

    def snapshot(self) -> tuple[int, MaterializationSnapshot]:
        """The synchronous part: a materialization id and a consistent state copy."""
        mat_id = self._next_id
        self._next_id += 1
        return mat_id, self.backend.snapshot_for_materialization()

    def upload(self, mat_id: int, snapshot: MaterializationSnapshot) -> MaterializationHandle:
        """The asynchronous part: write every state table; the handle lists them all."""
        if snapshot.sqn is None:
            raise ConfigError("a materialization snapshot needs a changelog sqn")
        started = self._clock()
        directory = layout.materialization_dir(
            self.job, self.operator, self.subtask, mat_id, uuid.uuid4().hex[:8]
        )
        files: list[StateFileHandle] = []
        try:
            for f in snapshot.files():
                data = f.data if f.data is not None else _read_local(f.local_path)
                path = layout.state_file_path(directory, f.name)
                self.fileio.write_new(path, data)
                files.append(
                    StateFileHandle(
                        location=self.fileio.url(path),
                        size_bytes=len(data),
                        file_id=hashlib.blake2b(data, digest_size=16).hexdigest(),
                        state=f.state,
                        key_group_start=f.key_group_start,
                        key_group_end=f.key_group_end,
                        rows=f.rows,
                    )
                )
        finally:
            snapshot.release()
        rng = snapshot.key_group_range
        handle = MaterializationHandle(
            writer_id=self.backend.backend_id,
            sqn=snapshot.sqn,
            key_group_start=rng.start,
            key_group_end=rng.end,
            kind=snapshot.kind,
            state_files=tuple(files),
            materialization_id=mat_id,
        )
        total = sum(f.size_bytes for f in files)
        self.last_stats = MaterializationStats(self._clock() - started, len(files), 0, total, total)
        log.info(
            "materialized writer=%s id=%d sqn=%d files=%d bytes=%d",
            handle.writer_id,
            mat_id,
            handle.sqn,
            len(files),
            total,
        )
        return handle

    def materialize_now(self) -> MaterializationHandle:
        """Snapshot, upload and apply on the calling (task) thread. For tests and tools."""
        mat_id, snap = self.snapshot()
        handle = self.upload(mat_id, snap)
        self.backend.materialization_done(handle)
        return handle


def _read_local(path: str | None) -> bytes:
    assert path is not None
    with open(path, "rb") as fh:
        return fh.read()
