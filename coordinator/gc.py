"""The orphan sweep: delete files under a job's prefix that no record references.

Online reference counting releases the files of subsumed checkpoints; what it cannot see
is left here: files of checkpoints that never completed (a crash between "files written"
and "record committed", a declined or expired checkpoint, an unknown commit outcome),
segments and materializations a dead attempt uploaded, staged sink transactions that no
checkpoint will ever carry, temporary files of local writes a killed process never
finished, and the copies of a savepoint that failed half-way. A file is an orphan when no
checkpoint or savepoint of any job references it (jobs restored from this one share its
files) and it is older than a safety age: younger files may belong to in-flight work of a
running job (a checkpoint that has not completed yet, a segment persisted ahead of the
next checkpoint, a savepoint being copied).

A job's sweep covers ``jobs/<job>/`` and ``savepoints/<job>/``; a recorded savepoint's
files are referenced by its record, so only unrecorded copies are orphans there.
References are store-relative paths, and so are listings, so a store reached through a
symlink or another root compares like with like.

:func:`plan_sweep` is pure apart from listing; :func:`sweep` executes a plan and tolerates
files already gone.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from coordinator.metadata import MetadataStore
from dstl import layout
from dstl.errors import ConfigError
from dstl.fileio import FileInfo, FileIO

log = logging.getLogger(__name__)

DEFAULT_MIN_AGE_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class SweepPlan:
    """What a sweep of one job's prefix found."""

    job_id: str
    prefix: str
    min_age_s: float
    scanned: int
    referenced: int
    too_young: tuple[FileInfo, ...]
    orphans: tuple[FileInfo, ...]

    @property
    def orphan_bytes(self) -> int:
        """Total size of the orphans."""
        return sum(f.size for f in self.orphans)

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary."""
        return {
            "job": self.job_id,
            "prefix": self.prefix,
            "min_age_s": self.min_age_s,
            "scanned": self.scanned,
            "referenced": self.referenced,
            "too_young": len(self.too_young),
            "orphans": [f.path for f in self.orphans],
            "orphan_bytes": self.orphan_bytes,
        }


def plan_sweep(
    fileio: FileIO,
    store: MetadataStore,
    job_id: str,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    now: float | None = None,
) -> SweepPlan:
    """List the job's prefixes and classify every file: referenced, too young, or orphan.

    The references are read *after* the listing, so a checkpoint that completes in
    between protects its files. A file without a modification time counts as too young.
    ``min_age_s`` must be a finite number >= 0 (``nan`` would make every file old).
    """
    if not (math.isfinite(min_age_s) and min_age_s >= 0):
        raise ConfigError(f"gc min age must be a finite number >= 0 seconds, got {min_age_s}")
    now = time.time() if now is None else now
    prefix = layout.job_prefix(job_id)
    files = fileio.list(prefix) + fileio.list(layout.savepoints_of(job_id))
    referenced = store.referenced_files()
    young: list[FileInfo] = []
    orphans: list[FileInfo] = []
    n_ref = 0
    for info in files:
        if info.path in referenced:
            n_ref += 1
        elif info.mtime is None or now - info.mtime < min_age_s:
            young.append(info)
        else:
            orphans.append(info)
    return SweepPlan(job_id, prefix, min_age_s, len(files), n_ref, tuple(young), tuple(orphans))


def sweep(fileio: FileIO, store: MetadataStore, plan: SweepPlan) -> list[str]:
    """Delete the plan's orphans that are still unreferenced; returns the deleted URLs."""
    still = set(store.unreferenced([f.path for f in plan.orphans]))
    deleted: list[str] = []
    for info in plan.orphans:
        if info.path not in still:
            continue  # referenced since the plan was made
        if fileio.delete(info.path):
            deleted.append(info.path)
    log.info("orphan sweep job=%s deleted=%d", plan.job_id, len(deleted))
    return deleted
