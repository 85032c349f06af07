"""Restore a checkpoint's keyed state into Parquet tables: plan, then execute.

:func:`plan_restore` is pure: it says which operators, handles and files a restore uses.
:func:`check_plan` verifies every file exists before anything is written. :func:`execute`
restores into a temporary directory next to the target and renames it into place at the
end, so a failed restore leaves nothing half-written.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass

import pyarrow.parquet as pq

from backends.handles import KeyedStateHandle
from backends.heap import HeapKeyedStateBackend, StateSnapshot
from backends.keygroups import KeyGroupRange
from backends.restore import restore_into
from backends.serializers import serializer_for
from backends.tables import snapshot_tables
from coordinator.metadata import CompletedCheckpoint
from dstl.errors import ConfigError, StorageNotFoundError
from dstl.fileio import FileIO


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What a restore of ``checkpoint`` reads and writes."""

    checkpoint: CompletedCheckpoint
    operators: dict[str, tuple[KeyedStateHandle, ...]]
    files: tuple[str, ...]
    output_dir: str

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary (what ``--dry-run`` prints)."""
        return {
            "job": self.checkpoint.job_id,
            "checkpoint": self.checkpoint.checkpoint_id,
            "output": self.output_dir,
            "operators": {
                op: {
                    "subtasks": len(hs),
                    "materializations": sum(len(h.materialized) for h in hs),
                    "changelog_blocks": sum(len(h.changelog) for h in hs),
                }
                for op, hs in self.operators.items()
            },
            "files": list(self.files),
        }


def plan_restore(checkpoint: CompletedCheckpoint, output_dir: str) -> RestorePlan:
    """The restore plan of every keyed operator in ``checkpoint``."""
    operators: dict[str, list[KeyedStateHandle]] = {}
    files: dict[str, None] = {}
    for s in checkpoint.subtasks:
        for h in s.handles:
            if isinstance(h, KeyedStateHandle):
                operators.setdefault(s.operator, []).append(h)
                for f in h.files():
                    files.setdefault(f)
    return RestorePlan(
        checkpoint,
        {op: tuple(hs) for op, hs in sorted(operators.items())},
        tuple(files),
        os.path.abspath(output_dir),
    )


def check_plan(plan: RestorePlan, fileio: FileIO) -> None:
    """Raise :class:`StorageNotFoundError` naming the first missing file."""
    for url in plan.files:
        if not fileio.exists(fileio.relative(url)):
            raise StorageNotFoundError(
                f"checkpoint {plan.checkpoint.checkpoint_id} references a missing file", url
            )


def restore_operator(fileio: FileIO, handles: tuple[KeyedStateHandle, ...]) -> StateSnapshot:
    """All key groups of one operator's state, restored in memory, with pickled values
    (and keys) left as their bytes: nothing of the store is unpickled."""
    first = handles[0]
    backend = HeapKeyedStateBackend(
        serializer_for(first.key_serializer, trusted=False),
        KeyGroupRange(0, first.max_parallelism),
        first.max_parallelism,
    )
    restore_into(backend, fileio, handles, trusted=False)  # a tool never runs the store's code
    return backend.snapshot()


def execute(plan: RestorePlan, fileio: FileIO, force: bool = False) -> dict[str, dict[str, int]]:
    """Write ``<output>/<operator>/<state>.parquet``; returns rows per operator and state."""
    target = plan.output_dir
    if os.path.exists(target) and not force:
        raise ConfigError(f"{target} exists: pass --force to replace it")
    check_plan(plan, fileio)
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    counts: dict[str, dict[str, int]] = {}
    try:
        for operator, handles in plan.operators.items():
            snapshot = restore_operator(fileio, handles)
            os.makedirs(os.path.join(tmp, operator))
            counts[operator] = {}
            for meta, table in snapshot_tables(snapshot):
                pq.write_table(
                    table, os.path.join(tmp, operator, f"{meta.name}.parquet"), compression="zstd"
                )
                counts[operator][meta.name] = table.num_rows
        os.makedirs(tmp, exist_ok=True)
        if os.path.exists(target):
            old = f"{target}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
        else:
            os.rename(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return counts
