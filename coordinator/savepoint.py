"""Self-contained savepoints: copy every referenced file, rewrite the handles.

A savepoint's files live under ``savepoints/<job>/<checkpoint:016x>/<original path>``,
outside every job prefix, so neither retention (savepoint rows are never expired) nor the
orphan sweep (it lists only ``jobs/<job>/``) touches them, and the job's own files can go
away without breaking the savepoint. Handles are frozen dataclasses: they are rebuilt with
:func:`dataclasses.replace`, recursively, on every field named ``location``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from coordinator.errors import SavepointError
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl import layout
from dstl.errors import ConfigError, CorruptionError, StorageConflictError, StorageError
from dstl.fileio import FileIO
from dstl.integrity import read_verified


def rewrite_locations(value: Any, mapping: dict[str, str]) -> Any:
    """``value`` with every ``location`` field (nested in handles and tuples) mapped."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            old = getattr(value, f.name)
            if f.name == "location" and isinstance(old, str):
                new: Any = mapping.get(old, old)
            else:
                new = rewrite_locations(old, mapping)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, tuple):
        items = tuple(rewrite_locations(v, mapping) for v in value)
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


def make_self_contained(fileio: FileIO, checkpoint: CompletedCheckpoint) -> CompletedCheckpoint:
    """Copy every file of ``checkpoint`` under its savepoint prefix; return rewritten handles.

    Runs on the coordinator thread before the record is committed. On failure the copies
    made so far are deleted (the record was never written, so nothing references them)
    and :class:`SavepointError` is raised.
    """
    prefix = layout.savepoint_prefix(checkpoint.job_id, checkpoint.checkpoint_id)
    mapping: dict[str, str] = {}
    try:
        for ref in checkpoint.file_refs():
            target = f"{prefix}/{fileio.relative(ref.location)}"
            data = read_verified(fileio, ref)  # a damaged file must not become a savepoint
            # StorageConflictError: a retried copy of the same source: same bytes
            with contextlib.suppress(StorageConflictError):
                fileio.write_new(target, data)
            mapping[ref.location] = target
    except (StorageError, ConfigError, CorruptionError) as exc:
        # if even this fails, it is left for an operator: savepoints are never swept
        with contextlib.suppress(StorageError):
            fileio.delete_tree(prefix)
        raise SavepointError(
            f"savepoint {checkpoint.checkpoint_id} of job {checkpoint.job_id}: {exc}"
        ) from exc
    subtasks = tuple(
        SubtaskState(
            s.operator,
            s.subtask,
            tuple(rewrite_locations(h, mapping) for h in s.handles),
            s.offset,
            s.stats,
        )
        for s in checkpoint.subtasks
    )
    return dataclasses.replace(checkpoint, subtasks=subtasks)


def savepoint_from_checkpoint(
    fileio: FileIO, store: MetadataStore, checkpoint: CompletedCheckpoint, now: float
) -> CompletedCheckpoint:
    """Turn a retained checkpoint into a new, self-contained savepoint; return its record.

    For operators (``statectl savepoint``): freeze the state a job reached, e.g. before
    an upgrade, without reaching the running job. The savepoint gets a fresh id from the
    job's sequence (so a running coordinator never reuses it), copies every file under its
    own prefix and is recorded without retention. Safe while the job runs: if retention
    removes the checkpoint's files during the copy, a :class:`SavepointError` names the
    checkpoint, the partial copy is deleted and nothing is recorded. A job whose checkpoint
    ids do not come from that sequence (a Spark query's are its batch ids) gets a
    :class:`ConfigError` before anything is copied. Any thread.
    """
    if checkpoint.kind != "checkpoint":
        raise ConfigError(
            f"{checkpoint.kind} {checkpoint.checkpoint_id} of job {checkpoint.job_id} is "
            "already self-contained"
        )
    savepoint_id = store.next_checkpoint_id(checkpoint.job_id)
    newest = store.latest(checkpoint.job_id)
    if newest is not None and newest.checkpoint_id >= savepoint_id:
        # The job numbers its checkpoints itself (a Spark query records its batch ids), so
        # an id from the sequence could be taken now or by a later batch: refuse, copy nothing.
        raise ConfigError(
            f"job {checkpoint.job_id} numbers its checkpoints itself (the latest is "
            f"{newest.checkpoint_id}, as a Spark query records its batch ids): a savepoint "
            "id could clash with one of them, so no savepoint is made; read or export the "
            f"checkpoint itself (statectl restore --checkpoint {checkpoint.checkpoint_id})"
        )
    draft = dataclasses.replace(
        checkpoint,
        checkpoint_id=savepoint_id,
        kind="savepoint",
        triggered_at=now,
        completed_at=now,
        stats={**checkpoint.stats, "from_checkpoint": checkpoint.checkpoint_id},
    )
    try:
        savepoint = make_self_contained(fileio, draft)
    except SavepointError as exc:
        if isinstance(exc.__cause__, CorruptionError):  # damaged, not removed: say so
            raise CorruptionError(
                f"{exc} (copying from checkpoint {checkpoint.checkpoint_id})"
            ) from exc
        raise SavepointError(
            f"{exc} (copying from checkpoint {checkpoint.checkpoint_id}; if the job removed "
            "it meanwhile, use a newer one)"
        ) from exc
    store.record_savepoint(savepoint)
    return savepoint
