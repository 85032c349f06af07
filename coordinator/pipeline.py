"""What a pipeline author declares: the job's operators and the runtime's options.

Plain, frozen values; the runtime (:mod:`coordinator.runtime`) turns them into tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backends.keygroups import (
    DEFAULT_MAX_PARALLELISM,
)
from backends.serializers import Serializer
from coordinator.channels import (
    BarrierMode,
)
from coordinator.checkpoint import CheckpointOptions
from coordinator.functions import KeyedFunction
from coordinator.metadata import MetadataStore
from dstl.changelog import ChangelogOptions
from dstl.errors import (
    ConfigError,
)
from dstl.fileio import FileIO


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A replayable source: ``open(subtask, parallelism, offset)`` yields ``(key, value)``
    records from ``offset`` (records already emitted by that subtask)."""

    name: str
    parallelism: int
    open: Callable[[int, int, int], Iterator[tuple[Any, Any]]]
    rate_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class OperatorSpec:
    """The keyed stateful operator."""

    name: str
    parallelism: int
    key_serializer: Serializer
    function: Callable[[], KeyedFunction]
    max_parallelism: int = DEFAULT_MAX_PARALLELISM


@dataclass(frozen=True, slots=True)
class SinkSpec:
    """The transactional file sink (parallelism 1): committed parts go to ``output_url``."""

    name: str
    output_url: str


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A linear job: source -> keyed operator -> sink."""

    job_id: str
    source: SourceSpec
    operator: OperatorSpec
    sink: SinkSpec


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """Where state goes and how often it is checkpointed and materialized."""

    store_url: str
    metadata_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    changelog: ChangelogOptions = field(default_factory=ChangelogOptions)
    materialization_interval_s: float = 5.0
    # "offline": the job only writes the log; offline compactions (statectl compact, on
    # Spark) materialize it and the tasks adopt them at a barrier
    materialization: str = "online"
    changelog_enabled: bool = True  # False: every checkpoint is a full (shared-file) snapshot
    state_backend: str = "heap"  # "heap" (dicts) or "rocksdb" (rocksdict, under local_dir)
    local_dir: str | None = None  # working directories of RocksDB stores (default: temp)
    source_batch: int = 256
    worker: str = "w0"
    barrier_mode: BarrierMode = BarrierMode.ALIGNED  # dotted key: checkpoint.barrier-mode

    def __post_init__(self) -> None:
        if self.materialization_interval_s <= 0 or self.source_batch < 1:
            raise ConfigError("materialization interval and source batch must be positive")
        if self.materialization not in ("online", "offline"):
            raise ConfigError(
                f"materialization must be online or offline, not {self.materialization!r}"
            )
        if self.materialization == "offline" and not self.changelog_enabled:
            raise ConfigError("offline materialization needs the changelog (changelog_enabled)")
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
