"""Offline compaction on Spark: fold a checkpoint's log into new materialized tables.

::

    statectl compact --store URL --job J [--checkpoint ID|latest]   # a local[2] session
    python -m tools.spark.compact --store URL --job J ...           # the same
    spark-submit tools/spark/compact.py --store URL --job J ...     # on a cluster

For every keyed operator subtask of the checkpoint whose state rests on a log, the
subtask's key-group range is cut into fold tasks (:mod:`materializer.compaction`: each
restores its key groups from the checkpoint's files, verified and never unpickled, and
writes the heap store's Parquet pieces under ``jobs/<job>/compacted/...``); the tasks
run as Spark tasks, in parallel across the cluster. The driver then writes an empty table
for states without entries, builds one ``heap-parquet`` materialization per subtask
covering every writer its state was built from, and registers them all in one
transaction (:meth:`~coordinator.metadata.MetadataStore.register_compaction`).

Safe while the job runs: only new files are written (write-once, unique directory);
registration refuses (:class:`~coordinator.errors.CompactionSupersededError`) if the job's
newest record rests on newer state, and then every file written is deleted, as after any
failure before registering. The job may also move on while the tasks read: once it rests
on a newer materialization, retention removes the checkpoint and its files, a task finds
one gone, and that too is the race lost (CompactionSupersededError), not a missing file. A failure whose outcome is unknown (the metadata store went
away during the commit) deletes nothing: the orphan sweep takes what was not registered.
The running job adopts the compaction at its next checkpoint; with
``RuntimeOptions(materialization="offline")`` compactions are its only materializations.
Restore loads the tables into either store (heap, or RocksDB by bulk load).
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import SparkSession

from backends.handles import KeyedStateHandle, MaterializationHandle
from backends.tables import DEFAULT_PIECE_ROWS
from coordinator.errors import CompactionSupersededError
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from dstl import errors, layout
from dstl.errors import (
    CheckpointNotFoundError,
    StateBackendError,
    StorageError,
    StorageNotFoundError,
)
from dstl.fileio import FileIO
from materializer.compaction import (
    DEFAULT_TASK_ROWS,
    FoldResult,
    FoldTask,
    assemble,
    fold,
    log_changes,
    needs_compaction,
    plan_tasks,
)
from tools.cli.common import resolve_checkpoint

log = logging.getLogger(__name__)

Slot = tuple[str, int]


@dataclass
class CompactionReport:
    """What a compaction did (``compaction_id`` None: nothing to compact)."""

    job_id: str
    source_checkpoint_id: int
    compaction_id: int | None = None
    tasks: int = 0
    duration_s: float = 0.0
    subtasks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def changes(self) -> int:
        """Log changes folded."""
        return sum(int(s["changes"]) for s in self.subtasks)

    def describe(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "job": self.job_id,
            "checkpoint": self.source_checkpoint_id,
            "compaction": self.compaction_id,
            "tasks": self.tasks,
            "duration_s": round(self.duration_s, 3),
            "changes": self.changes,
            "subtasks": self.subtasks,
        }


def _fold_task(fileio: FileIO, piece_rows: int | None, task: FoldTask) -> FoldResult:
    """One Spark task (module level: executors import it by name)."""
    return fold(fileio, task, piece_rows)


_TASK_ERROR = re.compile(r"^(?:[\w.]+\.)?(\w+Error): (.+)$", re.MULTILINE)


def task_error(exc: BaseException) -> StateBackendError | None:
    """The error of ours a failed Spark task raised (named in the task's traceback that
    Spark's exception carries), re-created so it keeps its meaning (and exit code)."""
    found = [m for m in _TASK_ERROR.finditer(str(exc)) if hasattr(errors, m.group(1))]
    if not found:
        return None
    name, message = found[-1].group(1), found[-1].group(2)
    cls = getattr(errors, name)
    if not (isinstance(cls, type) and issubclass(cls, StateBackendError)):
        return None
    made: StateBackendError = cls(f"in a Spark task: {message}")
    return made


def _run_tasks(
    spark: SparkSession,
    fileio: FileIO,
    tasks: Sequence[FoldTask],
    piece_rows: int | None,
    on_progress: Callable[[int, int], None] | None,
) -> list[FoldResult]:
    """Run ``tasks`` as one Spark job (a task each); ``on_progress(done, total)`` on the
    calling thread while it runs (the job runs on a helper thread)."""
    sc = spark.sparkContext
    group = f"compaction-{uuid.uuid4().hex[:8]}"
    rdd = sc.parallelize(list(tasks), len(tasks)).map(
        functools.partial(_fold_task, fileio, piece_rows)
    )

    def collect() -> list[FoldResult]:
        sc.setJobGroup(group, "changelog-state offline compaction")
        return rdd.collect()

    with ThreadPoolExecutor(1, thread_name_prefix="compaction-job") as pool:
        future = pool.submit(collect)
        while not future.done():
            wait([future], timeout=0.5)
            if on_progress is not None:
                on_progress(_completed(sc, group), len(tasks))
        try:
            return future.result()
        except StateBackendError:
            raise
        except Exception as exc:
            ours = task_error(exc)
            if ours is None:
                raise
            raise ours from exc


def _fold_or_lose(
    spark: SparkSession,
    fileio: FileIO,
    store: MetadataStore,
    cp: CompletedCheckpoint,
    tasks: Sequence[FoldTask],
    piece_rows: int | None,
    on_progress: Callable[[int, int], None] | None,
) -> list[FoldResult]:
    """:func:`_run_tasks`; a file that went away because retention removed the checkpoint
    meanwhile (the job moved on to newer state) is the race lost, not a missing file."""
    try:
        return _run_tasks(spark, fileio, tasks, piece_rows, on_progress)
    except StorageNotFoundError as exc:
        try:
            store.get(cp.job_id, cp.checkpoint_id)
        except CheckpointNotFoundError:
            raise CompactionSupersededError(
                f"checkpoint {cp.checkpoint_id} of job {cp.job_id} was removed while it was "
                "compacted (the job rests on newer state): compact a newer checkpoint"
            ) from exc
        raise


def _completed(sc: Any, group: str) -> int:
    tracker = sc.statusTracker()
    done = 0
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in info.stageIds if info is not None else ():
            stage_info = tracker.getStageInfo(stage)
            done += stage_info.numCompletedTasks if stage_info is not None else 0
    return done


def _delete(fileio: FileIO, directories: Sequence[str]) -> None:
    """Remove what a compaction that registered nothing wrote (tolerates missing ones)."""
    for directory in directories:
        try:
            fileio.delete_tree(directory)
        except StorageError as exc:  # the orphan sweep will
            log.warning("compaction cleanup failed dir=%s error=%s", directory, exc)


def bytes_to_fold(store: MetadataStore, job: str | None, checkpoint: int | str) -> int:
    """The bytes of the files a compaction of ``checkpoint`` reads (for progress)."""
    cp = resolve_checkpoint(store, job, checkpoint)
    return sum(
        r.size_bytes
        for s in cp.subtasks
        for h in s.handles
        if isinstance(h, KeyedStateHandle) and needs_compaction(h)
        for r in h.file_refs()
    )


def compact(
    spark: SparkSession,
    fileio: FileIO,
    store: MetadataStore,
    job: str | None,
    checkpoint: int | str = "latest",
    piece_rows: int | None = DEFAULT_PIECE_ROWS,
    task_rows: int = DEFAULT_TASK_ROWS,
    on_progress: Callable[[int, int], None] | None = None,
    before_register: Callable[[], None] | None = None,
) -> CompactionReport:
    """Compact ``checkpoint`` of ``job`` (see the module docstring); ``before_register``
    runs between writing the files and registering them (tests make races there)."""
    started = time.monotonic()
    cp = resolve_checkpoint(store, job, checkpoint)
    work: dict[Slot, KeyedStateHandle] = {}
    for s in cp.subtasks:
        for h in s.handles:
            if isinstance(h, KeyedStateHandle) and needs_compaction(h):
                work[(layout.plain_name("operator", s.operator), s.subtask)] = h
    report = CompactionReport(cp.job_id, cp.checkpoint_id)
    if not work:
        return report
    for other in store.pending_compactions(cp.job_id):  # cheap early answer; the
        # registering transaction checks again
        if (
            other.operator,
            other.subtask,
        ) in work and other.source_checkpoint_id >= cp.checkpoint_id:
            raise CompactionSupersededError(
                f"compaction {other.compaction_id} of checkpoint {other.source_checkpoint_id} "
                f"of job {cp.job_id} is as new and not yet adopted: nothing to do"
            )
    nonce = uuid.uuid4().hex[:8]
    dirs = {
        slot: layout.compaction_dir(cp.job_id, slot[0], slot[1], cp.checkpoint_id, nonce)
        for slot in work
    }
    tasks = [
        t for slot, h in sorted(work.items()) for t in plan_tasks(*slot, h, dirs[slot], task_rows)
    ]
    report.tasks = len(tasks)
    try:
        results = _fold_or_lose(spark, fileio, store, cp, tasks, piece_rows, on_progress)
        proposals: dict[Slot, MaterializationHandle] = {}
        for slot, h in sorted(work.items()):
            mine = [r for r in results if (r.operator, r.subtask) == slot]
            proposals[slot] = assemble(fileio, h, dirs[slot], mine)
            report.subtasks.append(
                {
                    "operator": slot[0],
                    "subtask": slot[1],
                    "files": len(proposals[slot].state_files),
                    "bytes": sum(f.size_bytes for f in proposals[slot].state_files),
                    "entries": sum(r.entries for r in mine),
                    "changes": log_changes(h),
                }
            )
        if before_register is not None:
            before_register()
    except BaseException:
        _delete(fileio, list(dirs.values()))
        raise
    try:
        report.compaction_id = store.register_compaction(cp.job_id, cp.checkpoint_id, proposals)
    except CompactionSupersededError:
        _delete(fileio, list(dirs.values()))  # known: nothing registered, nothing refers
        raise
    report.duration_s = time.monotonic() - started
    log.info(
        "compaction registered job=%s checkpoint=%d id=%s tasks=%d changes=%d duration_s=%.1f",
        cp.job_id,
        cp.checkpoint_id,
        report.compaction_id,
        report.tasks,
        report.changes,
        report.duration_s,
    )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.spark.compact`` / ``spark-submit tools/spark/compact.py``: the same
    options and exit codes as ``statectl compact``."""
    from tools.cli import main as statectl

    return statectl(["compact", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
