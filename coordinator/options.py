"""The options of a job run, shared by both hosts: where state goes, how it is checkpointed.

Typed and frozen; validated once on construction. The barrier handling options
(``barrier_mode`` and what follows it) are read by the embedded runtime's channels only; a
host that checkpoints per micro-batch (Spark) has no barriers in flight and ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from coordinator.checkpoint import CheckpointOptions
from coordinator.metadata import MetadataStore
from dstl.changelog import ChangelogOptions
from dstl.errors import ConfigError
from dstl.fileio import FileIO


class BarrierMode(StrEnum):
    """How a multi-input task handles barriers (``RuntimeOptions.barrier_mode``)."""

    ALIGNED = "aligned"
    UNALIGNED = "unaligned"
    AT_LEAST_ONCE = "at-least-once"


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """Where state goes and how often it is checkpointed and materialized."""

    store_url: str
    metadata_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    changelog: ChangelogOptions = field(default_factory=ChangelogOptions)
    materialization_interval_s: float = 5.0
    changelog_enabled: bool = True  # False: every checkpoint is a full (shared-file) snapshot
    state_backend: str = "heap"  # "heap" (dicts) or "rocksdb" (rocksdict, under local_dir)
    local_dir: str | None = None  # working directories of RocksDB stores (default: temp)
    source_batch: int = 256
    worker: str = "w0"
    barrier_mode: BarrierMode = BarrierMode.ALIGNED  # dotted key: checkpoint.barrier-mode

    def __post_init__(self) -> None:
        if self.materialization_interval_s <= 0 or self.source_batch < 1:
            raise ConfigError("materialization interval and source batch must be positive")
        if self.state_backend not in ("heap", "rocksdb"):
            raise ConfigError(f"state.backend must be heap or rocksdb, not {self.state_backend!r}")
        try:
            BarrierMode(self.barrier_mode)
        except ValueError as exc:
            modes = ", ".join(m.value for m in BarrierMode)
            raise ConfigError(f"checkpoint.barrier-mode must be one of {modes}") from exc

    def metadata_store(self, create: bool = True) -> MetadataStore:
        """The metadata store: ``metadata_url``, else SQLite inside a local store."""
        if self.metadata_url:
            return MetadataStore(self.metadata_url, create=create)
        fileio = FileIO(self.store_url, self.storage_options)
        if fileio.scheme != "file":
            raise ConfigError(f"store {self.store_url} is not local: give a metadata URL")
        return MetadataStore.for_local_store(fileio.root_url[len("file://") :], create=create)
