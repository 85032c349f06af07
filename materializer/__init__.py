"""Background materialization of keyed backends (FLIP-158's materializer).

- :class:`Materializer`: one materialization = snapshot (task thread) + upload (any
  thread) that shares unchanged files of the backend's current base.
- :class:`MaterializationScheduler`: periodic runs driven by ``tick(now)`` / ``poll()``.
- :class:`FullSnapshotCheckpointer`: the changelog switched off (every checkpoint is a
  materialization).
"""

from materializer.errors import MaterializationError, MaterializationFailuresExceededError
from materializer.full import FullSnapshotCheckpointer, restore_full_backend
from materializer.materializer import (
    MaterializationResult,
    MaterializationSource,
    MaterializationStats,
    Materializer,
    MaterializerOptions,
)
from materializer.scheduler import MaterializationOptions, MaterializationScheduler

__all__ = [
    "FullSnapshotCheckpointer",
    "MaterializationError",
    "MaterializationFailuresExceededError",
    "MaterializationOptions",
    "MaterializationResult",
    "MaterializationScheduler",
    "MaterializationSource",
    "MaterializationStats",
    "Materializer",
    "MaterializerOptions",
    "restore_full_backend",
]
