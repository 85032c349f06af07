"""Checkpoint cost at growing state, with materialization and the record's commit included.

One heap backend holds ``S`` keys, then ``10 S`` and ``100 S`` (``--quick``: 1x and 10x),
loaded and settled as in a job that has run for a while (the load checkpointed, and with
the changelog on, materialized once). Then it runs as a task with default settings
would: every checkpoint interval (``checkpoint.interval-s``, 1 s) it applies the same
number of updates to uniformly random keys, turns its materialization scheduler
(``materialization.interval-s``, 5 s: snapshot on this thread, upload on the
scheduler's own thread, applied when done) and takes a checkpoint; the rest of the
interval it sleeps, while uploads run on. A checkpoint's latency runs from the barrier
(the backend's ``checkpoint`` call) until its record is committed to a SQLite metadata
store (:meth:`~coordinator.metadata.MetadataStore.record_completed`, one retained
checkpoint, as the coordinator does); then the writer confirms it and the released files
are deleted (outside the latency, as the coordinator deletes them after the commit).

The baseline in the same run is the changelog off: every checkpoint a snapshot through
:class:`~materializer.full.FullSnapshotCheckpointer`, sharing unchanged files.

Per case: checkpoints and materializations in the window; checkpoint latency p50/p99, its
task-thread part (``sync_p99_ms``: the ``checkpoint`` call) and its commit (``commit_p99_ms``);
the task-thread part of a materialization (``mat_sync_max_ms``); the most files a
checkpoint record referenced (``files_max``: materialized files + changelog segments,
the list that grows while a materialization is late) and its JSON size
(``record_kb_max``); bytes uploaded per checkpoint (``bytes_per_checkpoint``: every byte
written in the window, changelog segments and materialized files, over the checkpoints).

Summary fields: ``changelog_duration_ratio_largest`` (p50, largest state / smallest,
changelog on; flat means close to 1), ``changelog_p99_ratio_largest``,
``changelog_bytes_ratio_largest``, the same for the baseline (``snapshot_*``), and
``changelog_p99_ms_largest`` (the p99 at the largest state).
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from statistics import median
from typing import Any

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyGroupRange,
    ValueStateDescriptor,
)
from backends.handles import KeyedStateHandle
from backends.serializers import INT64, STR
from coordinator.checkpoint import CheckpointOptions
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl import ChangelogStorage, FileIO
from materializer import Materializer
from materializer.full import FullSnapshotCheckpointer
from materializer.scheduler import MaterializationOptions, MaterializationScheduler

COLUMNS = [
    "mode",
    "keys",
    "updates",
    "checkpoints",
    "mats",
    "p50_ms",
    "p99_ms",
    "sync_p99_ms",
    "commit_p99_ms",
    "mat_sync_max_ms",
    "files_max",
    "record_kb_max",
    "bytes_per_checkpoint",
]
MAX_PAR = 128
JOB = "bench"
OPERATOR = "op"
DESC: ValueStateDescriptor[int] = ValueStateDescriptor("v", INT64)


class _CountingFileIO(FileIO):
    """A FileIO counting the bytes it writes. Thread-safe (``self._lock``)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self._lock = threading.Lock()
        self.bytes_written = 0

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        super().write_new(path, data)
        with self._lock:
            self.bytes_written += len(data)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _fill(backend: Any, keys: int) -> None:
    state = backend.get_state(DESC)
    for i in range(keys):
        backend.set_current_key(f"k{i}")
        state.update(i)


def _update(backend: Any, keys: int, updates: int, rnd: random.Random) -> None:
    state = backend.get_state(DESC)
    for _ in range(updates):
        backend.set_current_key(f"k{rnd.randrange(keys)}")
        state.update(rnd.randrange(1 << 40))


def _files(handle: KeyedStateHandle) -> int:
    return sum(len(m.state_files) for m in handle.materialized) + len(handle.changelog)


class _Task:
    """One keyed subtask with its checkpointing as the embedded runtime wires it. Task
    thread only (the scheduler's and the storage's upload threads are their own)."""

    def __init__(self, mode: str, root: str, fileio: FileIO, seed: int) -> None:
        self.inner = HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
        self.store = MetadataStore.for_local_store(root)
        self.fileio = fileio
        self.storage: ChangelogStorage | None = None
        self.scheduler: MaterializationScheduler | None = None
        self.full: FullSnapshotCheckpointer | None = None
        self.backend: Any
        if mode == "changelog":
            self.storage = ChangelogStorage(fileio, JOB, "w0")
            self.backend = ChangelogKeyedStateBackend(self.inner, self.storage.create_writer("b0"))
            self.scheduler = MaterializationScheduler(
                Materializer(self.backend, fileio, JOB, OPERATOR, 0),
                MaterializationOptions(),
                rng=random.Random(seed).random,
                name="bench",
            )
        else:
            self.backend = self.full = FullSnapshotCheckpointer(
                self.inner, fileio, JOB, OPERATOR, 0, "b0"
            )

    def checkpoint(self, cid: int) -> dict[str, float]:
        """Barrier to committed record, then confirm and delete what retention released."""
        started = time.perf_counter()
        if self.scheduler is not None:
            self.scheduler.on_barrier(cid)
        future = self.backend.checkpoint(cid)
        synced = time.perf_counter()
        handle: KeyedStateHandle = future.result()
        uploaded = time.perf_counter()
        state = SubtaskState(OPERATOR, 0, (handle,))
        record = CompletedCheckpoint(JOB, cid, "checkpoint", time.time(), time.time(), (state,))
        retention = self.store.record_completed(record, CheckpointOptions().retain)
        committed = time.perf_counter()
        if self.scheduler is not None:
            self.backend.writer.confirm(cid)
            self.scheduler.on_checkpoint_complete(cid)
        else:
            assert self.full is not None
            self.full.notify_checkpoint_complete(cid)
        for url in retention.released:
            self.fileio.delete(self.fileio.relative(url))
        return {
            "ms": (committed - started) * 1e3,
            "sync_ms": (synced - started) * 1e3,
            "commit_ms": (committed - uploaded) * 1e3,
            "files": _files(handle),
            "record_bytes": len(state.to_json()),
        }

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.full is not None:
            self.full.close()
        if self.storage is not None:
            self.storage.close()
        self.store.close()
        self.inner.close()


def _case(mode: str, keys: int, updates: int, rounds: int) -> dict[str, Any]:
    rnd = random.Random(7)
    interval_s = CheckpointOptions().interval_s
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as root:
        fileio = _CountingFileIO(os.path.join(root, "store"))
        task = _Task(mode, root, fileio, seed=7)
        try:
            _fill(task.backend, keys)
            task.checkpoint(1)  # the load, uploaded once in both modes
            if task.scheduler is not None:  # and materialized, as in a job running a while
                task.scheduler.materializer.materialize_now()
            rows: list[dict[str, float]] = []
            mat_sync_ms: list[float] = []
            mats_before = task.scheduler.applied if task.scheduler is not None else 0
            bytes_before = fileio.bytes_written
            next_barrier = time.monotonic()
            for cid in range(2, rounds + 2):
                next_barrier += interval_s
                _update(task.backend, keys, updates, rnd)
                if task.scheduler is not None:
                    started = time.perf_counter()
                    task.scheduler.poll()
                    if task.scheduler.tick(time.monotonic()):
                        mat_sync_ms.append((time.perf_counter() - started) * 1e3)
                rows.append(task.checkpoint(cid))
                time.sleep(max(0.0, next_barrier - time.monotonic()))
            written = fileio.bytes_written - bytes_before
            mats = task.scheduler.applied - mats_before if task.scheduler is not None else 0
        finally:
            task.close()
    latencies = [r["ms"] for r in rows]
    return {
        "mode": mode,
        "keys": keys,
        "updates": updates,
        "checkpoints": rounds,
        "mats": mats,
        "p50_ms": round(median(latencies), 2),
        "p99_ms": round(_pct(latencies, 0.99), 2),
        "sync_p99_ms": round(_pct([r["sync_ms"] for r in rows], 0.99), 2),
        "commit_p99_ms": round(_pct([r["commit_ms"] for r in rows], 0.99), 2),
        "mat_sync_max_ms": round(max(mat_sync_ms), 2) if mat_sync_ms else None,
        "files_max": int(max(r["files"] for r in rows)),
        "record_kb_max": round(max(r["record_bytes"] for r in rows) / 1024, 1),
        "bytes_per_checkpoint": round(written / rounds),
    }


def run(quick: bool) -> dict[str, Any]:
    """Checkpoint latency and bytes at growing state, changelog on vs snapshots."""
    sizes = [10_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    updates = 2_000 if quick else 5_000
    # changelog: at least two materialization intervals in the window
    rounds = {"changelog": 12 if quick else 25, "snapshot": 6 if quick else 10}
    cases = [
        _case(mode, keys, updates, rounds[mode])
        for mode in ("changelog", "snapshot")
        for keys in sizes
    ]

    def ratio(mode: str, field: str) -> float:
        rows = [c for c in cases if c["mode"] == mode]
        return round(rows[-1][field] / max(rows[0][field], 1e-9), 3)

    largest = next(c for c in cases if c["mode"] == "changelog" and c["keys"] == sizes[-1])
    return {
        "cases": cases,
        "state_growth": sizes[-1] // sizes[0],
        "changelog_duration_ratio_largest": ratio("changelog", "p50_ms"),
        "changelog_p99_ratio_largest": ratio("changelog", "p99_ms"),
        "changelog_bytes_ratio_largest": ratio("changelog", "bytes_per_checkpoint"),
        "changelog_p99_ms_largest": largest["p99_ms"],
        "snapshot_duration_ratio_largest": ratio("snapshot", "p50_ms"),
        "snapshot_p99_ratio_largest": ratio("snapshot", "p99_ms"),
        "snapshot_bytes_ratio_largest": ratio("snapshot", "bytes_per_checkpoint"),
    }
