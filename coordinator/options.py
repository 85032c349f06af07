"""The options of a job run, shared by both hosts: where state goes, how it is checkpointed.

Typed and frozen; validated once on construction. The barrier handling options
(``barrier_mode`` and what follows it) are read by the embedded runtime's channels only; a
host that checkpoints per micro-batch (Spark) has no barriers in flight and ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from coordinator.checkpoint import CheckpointOptions
from coordinator.metadata import MetadataStore
from dstl.changelog import ChangelogOptions
from dstl.errors import ConfigError
from dstl.fileio import FileIO
from dstl.options import Converter, boolean, optional_float, parse_dotted
from materializer import MaterializationOptions


class BarrierMode(StrEnum):
    """How a multi-input task handles barriers (``RuntimeOptions.barrier_mode``)."""

    ALIGNED = "aligned"
    UNALIGNED = "unaligned"
    AT_LEAST_ONCE = "at-least-once"


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """Where state goes and how often it is checkpointed and materialized.

    Dotted keys (:meth:`from_dict`): ``checkpoint.*`` (:class:`CheckpointOptions`),
    ``dstl.*`` (:class:`~dstl.changelog.ChangelogOptions`), and
    ``checkpoint.barrier-mode`` (aligned, unaligned, at-least-once),
    ``checkpoint.aligned-timeout-s`` (aligned: after this long since the trigger an
    alignment switches to unaligned for that checkpoint; ``none``: never),
    ``buffer-debloat.target-s`` (in-flight data per input kept to this many seconds of
    measured throughput, default 0.01; ``none``: only the fixed bound), ``buffer.max-records`` (the
    fixed bound of a task's input), ``source.batch``, ``state.backend``,
    ``state.changelog``, ``state.local-dir``, ``materialization.interval-s``,
    ``materialization.max-log-ratio`` (:class:`~materializer.MaterializationOptions`),
    ``materialization.mode`` (online; offline: only offline compactions materialize).
    """

    store_url: str
    metadata_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    changelog: ChangelogOptions = field(default_factory=ChangelogOptions)
    materialization_interval_s: float = 5.0
    # materialize early once the log since the base is this fraction of the base's bytes
    # (bounds a checkpoint's full size; see materializer.scheduler; 0: interval only;
    # None: the store's own default)
    materialization_max_log_ratio: float | None = MaterializationOptions().max_log_ratio
    # "offline": the job only writes the log; offline compactions (statectl compact, on
    # Spark) materialize it and the tasks adopt them at a barrier
    materialization: str = "online"
    changelog_enabled: bool = True  # False: every checkpoint is a full (shared-file) snapshot
    state_backend: str = "heap"  # "heap" (dicts) or "rocksdb" (rocksdict, under local_dir)
    local_dir: str | None = None  # working directories of RocksDB stores (default: temp)
    source_batch: int = 256
    worker: str = "w0"
    barrier_mode: BarrierMode = BarrierMode.ALIGNED
    aligned_timeout_s: float | None = None
    # 10 ms, not Flink's 1 s: a barrier waits behind about the target at every hop, and
    # the goal (aligned checkpoint p99 <= 100 ms under backpressure) must hold
    # at the defaults; measured by `python -m tools.bench run pipeline`
    debloat_target_s: float | None = 0.01
    buffer_max_records: int = 16_384

    KEYS: ClassVar[dict[str, tuple[str, Converter]]] = {
        "checkpoint.barrier-mode": ("barrier_mode", str),
        "checkpoint.aligned-timeout-s": ("aligned_timeout_s", optional_float),
        "buffer-debloat.target-s": ("debloat_target_s", optional_float),
        "buffer.max-records": ("buffer_max_records", int),
        "source.batch": ("source_batch", int),
        "state.backend": ("state_backend", str),
        "state.changelog": ("changelog_enabled", boolean),
        "state.local-dir": ("local_dir", str),
        "materialization.interval-s": ("materialization_interval_s", float),
        "materialization.max-log-ratio": ("materialization_max_log_ratio", float),
        "materialization.mode": ("materialization", str),
    }

    @classmethod
    def from_dict(cls, store_url: str, values: dict[str, Any], **fields: Any) -> RuntimeOptions:
        """Options for ``store_url`` from documented dotted keys (strings parse);
        ``fields`` set the rest. Unknown keys are a :class:`ConfigError`."""
        own = {k: v for k, v in values.items() if k in cls.KEYS}
        checkpoint = {
            k: v for k, v in values.items() if k.startswith("checkpoint.") and k not in own
        }
        dstl = {k: v for k, v in values.items() if k.startswith("dstl.")}
        other = set(values) - set(own) - set(checkpoint) - set(dstl)
        if other:
            raise ConfigError(
                f"unknown option(s) {sorted(other)}; known: {sorted(cls.KEYS)}, checkpoint.*, dstl.*"
            )
        parsed = parse_dotted(cls.KEYS, own, "runtime")
        if checkpoint:
            parsed["checkpoint"] = CheckpointOptions.from_dict(checkpoint)
        if dstl:
            parsed["changelog"] = ChangelogOptions.from_dict(dstl)
        return cls(store_url, **{**fields, **parsed})

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
            mode = BarrierMode(self.barrier_mode)
        except ValueError as exc:
            modes = ", ".join(m.value for m in BarrierMode)
            raise ConfigError(f"checkpoint.barrier-mode must be one of {modes}") from exc
        object.__setattr__(self, "barrier_mode", mode)  # a plain string becomes the enum
        if self.aligned_timeout_s is not None:
            if self.aligned_timeout_s < 0:
                raise ConfigError("checkpoint.aligned-timeout-s must be >= 0")
            if mode is not BarrierMode.ALIGNED:
                raise ConfigError(
                    "checkpoint.aligned-timeout-s applies to aligned checkpoints only"
                )
        if self.debloat_target_s is not None and self.debloat_target_s <= 0:
            raise ConfigError("buffer-debloat.target-s must be > 0 (or none)")
        if self.buffer_max_records < 1:
            raise ConfigError("buffer.max-records must be >= 1")

    def metadata_store(self, create: bool = True) -> MetadataStore:
        """The metadata store: ``metadata_url``, else SQLite inside a local store."""
        if self.metadata_url:
            return MetadataStore(self.metadata_url, create=create)
        fileio = FileIO(self.store_url, self.storage_options)
        if fileio.scheme != "file":
            raise ConfigError(f"store {self.store_url} is not local: give a metadata URL")
        return MetadataStore.for_local_store(fileio.root_url[len("file://") :], create=create)
