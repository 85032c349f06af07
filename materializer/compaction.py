"""Offline compaction: fold a checkpointed state's materialization and log into new tables.

A compaction takes one operator subtask's :class:`~backends.handles.KeyedStateHandle`
from a completed checkpoint and writes the state it describes as a ``heap-parquet``
materialization (the heap store's Parquet pieces, :func:`backends.tables.state_files`),
which restore loads into either store (heap or RocksDB: the tables are typed rows, and
:func:`backends.restore.restore_into` bulk-loads them into RocksDB like any
materialization). The new :class:`~backends.handles.MaterializationHandle` covers every
writer the state was built from up to where that checkpoint reached in its log
(:meth:`KeyedStateHandle.coverage`), so restore replays only what came after.

The work splits along key groups (:class:`FoldTask`): each task restores its range from
the checkpoint's files (pieces of other ranges are not read; the log is read and filtered
by key group), never unpickling anything (``trusted=False``: pickled values stay the
bytes they were, so the tables are byte-for-byte what the job itself would write), and
writes the pieces of its range. Entries whose TTL has passed are kept (the job's own
clock decides expiry; a compaction has none). :mod:`tools.spark.compact` runs the tasks
as Spark tasks; they are plain functions of picklable values, so anything can.

Files are written once under the compaction's own directory (:func:`dstl.layout.compaction_dir`),
named by their key-group range, and their content is deterministic: a retried task finds
its file already there with the same content hash and keeps it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle, file_id_of
from backends.heap import HeapKeyedStateBackend, StateSnapshot
from backends.keygroups import KeyGroupRange
from backends.restore import restore_into
from backends.serializers import serializer_for
from backends.snapshot import SnapshotFile
from backends.state import StateMeta
from backends.tables import DEFAULT_PIECE_ROWS, state_files, table_for, table_to_parquet
from dstl import layout
from dstl.errors import CorruptionError, StorageConflictError
from dstl.fileio import FileIO
from dstl.integrity import content_hash

KIND = "heap-parquet"
DEFAULT_TASK_ROWS = 500_000
"""About how many entries (materialized rows plus log changes) one fold task restores:
its heap store holds them as Python objects (~100-200 bytes each)."""


def _never() -> int:
    """The TTL clock of a fold: time 0, so no entry counts as expired."""
    return 0


@dataclass(frozen=True, slots=True)
class FoldTask:
    """Fold key groups ``key_groups`` of one subtask's checkpointed ``state`` into pieces
    under ``directory`` (store-relative). A value: picklable, safe to run twice."""

    operator: str
    subtask: int
    state: KeyedStateHandle
    key_groups: KeyGroupRange
    directory: str


@dataclass(frozen=True, slots=True)
class FoldResult:
    """What one :class:`FoldTask` wrote: its pieces, every state it saw, its entries."""

    operator: str
    subtask: int
    files: tuple[StateFileHandle, ...]
    metas: tuple[StateMeta, ...]
    entries: int


def needs_compaction(state: KeyedStateHandle) -> bool:
    """Whether ``state`` rests on any log a compaction would fold."""
    return any(c.sqn_end > state.replay_from(c.writer_id) for c in state.changelog)


def log_changes(state: KeyedStateHandle) -> int:
    """How many changes the log of ``state`` holds (what a compaction folds; blocks
    partly below a materialization count whole)."""
    return sum(c.rows for c in state.changelog if c.sqn_end > state.replay_from(c.writer_id))


def plan_tasks(
    operator: str,
    subtask: int,
    state: KeyedStateHandle,
    directory: str,
    task_rows: int = DEFAULT_TASK_ROWS,
) -> list[FoldTask]:
    """The tasks of one subtask: its key-group range cut into equal parts of about
    ``task_rows`` estimated entries (materialized rows plus log changes)."""
    if task_rows < 1:
        raise ValueError("task_rows must be >= 1")
    rows = sum(f.rows for m in state.materialized for f in m.state_files) + log_changes(state)
    rng = state.key_group_range
    parts = max(1, min(len(rng), math.ceil(rows / task_rows)))
    bounds = [rng.start + len(rng) * i // parts for i in range(parts + 1)]
    return [
        FoldTask(operator, subtask, state, KeyGroupRange(lo, hi), directory)
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]


def write_once(fileio: FileIO, path: str, data: bytes) -> str:
    """Write ``data`` at ``path`` unless a retried attempt already did; its content hash.

    A different file at ``path`` is :class:`CorruptionError` (names are unique per
    compaction, and content depends only on the state, so that is never a retry).
    """
    digest = content_hash(data)
    try:
        fileio.write_new(path, data)
    except StorageConflictError:
        if content_hash(fileio.read(path)) != digest:
            raise CorruptionError("a different file is already there", fileio.url(path)) from None
    return digest


def _piece(fileio: FileIO, directory: str, f: SnapshotFile) -> StateFileHandle:
    assert f.data is not None
    path = layout.state_file_path(directory, f.name)
    digest = write_once(fileio, path, f.data)
    return StateFileHandle(
        location=path,
        size_bytes=len(f.data),
        file_id=file_id_of(digest),
        state=f.state,
        key_group_start=f.key_group_start,
        key_group_end=f.key_group_end,
        rows=f.rows,
        name=f.name,
    )


def fold(fileio: FileIO, task: FoldTask, piece_rows: int | None = DEFAULT_PIECE_ROWS) -> FoldResult:
    """Run one task: restore its key groups (verified reads, nothing unpickled), write
    the non-empty pieces. Empty states get no piece here (see :func:`empty_pieces`)."""
    state = task.state
    backend = HeapKeyedStateBackend(
        serializer_for(state.key_serializer, trusted=False),
        task.key_groups,
        state.max_parallelism,
        clock=_never,
    )
    restore_into(backend, fileio, [state], trusted=False)
    metas = backend.state_metas()
    # the restored dicts as they are: this backend is the task's own (no copy needed)
    snapshot = StateSnapshot(
        backend.key_serializer,
        task.key_groups,
        metas,
        {name: backend.raw_table(name) for name in metas},
    )
    files = tuple(
        _piece(fileio, task.directory, f) for f in state_files(snapshot, piece_rows) if f.rows
    )
    return FoldResult(
        task.operator,
        task.subtask,
        files,
        tuple(snapshot.metas[name] for name in sorted(snapshot.metas)),
        backend.entry_count(),
    )


def empty_pieces(
    fileio: FileIO,
    state: KeyedStateHandle,
    directory: str,
    metas: Iterable[StateMeta],
    have: set[str],
) -> list[StateFileHandle]:
    """One empty table for each of ``metas`` not in ``have`` (a state must have a file:
    its declaration travels in the table's metadata)."""
    key_ser = serializer_for(state.key_serializer, trusted=False)
    rng = state.key_group_range
    out = []
    for meta in sorted(metas, key=lambda m: m.name):
        if meta.name in have:
            continue
        data = table_to_parquet(table_for(meta.untrusted(), key_ser, {}))
        out.append(
            _piece(
                fileio,
                directory,
                SnapshotFile(f"{meta.name}.empty.parquet", meta.name, rng.start, rng.end, 0, data),
            )
        )
    return out


def compaction_handle(
    state: KeyedStateHandle, files: Sequence[StateFileHandle]
) -> MaterializationHandle:
    """The materialization that replaces ``state``'s base: ``files`` (in key-group order),
    covering each of its writers where ``state`` reached; its own writer is the one the
    state belongs to (what a running task adopts)."""
    coverage = state.coverage()
    own = coverage.pop(state.backend_id, 0)
    return MaterializationHandle(
        writer_id=state.backend_id,
        sqn=own,
        key_group_start=state.key_group_start,
        key_group_end=state.key_group_end,
        kind=KIND,
        state_files=tuple(sorted(files, key=lambda f: (f.key_group_start, f.state or "", f.name))),
        covers=tuple(sorted(coverage.items())),
    )


def fold_all(
    fileio: FileIO,
    state: KeyedStateHandle,
    directory: str,
    operator: str = "op",
    subtask: int = 0,
    piece_rows: int | None = DEFAULT_PIECE_ROWS,
    task_rows: int = DEFAULT_TASK_ROWS,
) -> MaterializationHandle:
    """Compact one subtask's state here, task after task (tests, small states)."""
    results = [
        fold(fileio, t, piece_rows)
        for t in plan_tasks(operator, subtask, state, directory, task_rows)
    ]
    return assemble(fileio, state, directory, results)


def assemble(
    fileio: FileIO, state: KeyedStateHandle, directory: str, results: Sequence[FoldResult]
) -> MaterializationHandle:
    """The handle of one subtask from its tasks' results (writes the empty tables)."""
    files = [f for r in results for f in r.files]
    metas = {m.name: m for r in results for m in r.metas}
    files += empty_pieces(fileio, state, directory, metas.values(), {f.state or "" for f in files})
    return compaction_handle(state, files)
