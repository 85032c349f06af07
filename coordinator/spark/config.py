"""What a stateful step is: the configuration the driver, the tasks and the state server share.

:class:`StepConfig` is a frozen, picklable value made once on the driver and shipped with
every task; the state server (:mod:`coordinator.spark.server`) receives it as pickled bytes
over its local socket and tells configurations apart by the digest of those bytes (a
restarted query with another processor or option rebuilds its ranges). Nothing here
imports pyspark.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from backends.keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange
from backends.serializers import Serializer, serializer_for
from dstl import layout
from dstl.errors import ConfigError

STATE_BACKENDS = ("heap", "rocksdb")
MARKER = "__changelog_state_marker"
"""Column that is true on the one marker row each partition gets (see :mod:`.partitioning`)."""
KEY_SERIALIZERS = ("str", "int64")
"""Key serializers whose key group Spark computes in SQL (see :mod:`.partitioning`)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A failure to inject into task ``subtask`` of batch ``batch_id`` (tests and drills).

    ``point``: ``"mid"`` aborts the task after half of its input reached the state server
    (the range's state is then half-updated); ``"after"`` fails it after the state server
    acknowledged (state applied, changelog persisted, output staged). Only attempts below
    ``attempts`` fail, so Spark's retry succeeds.
    """

    batch_id: int
    subtask: int
    point: str = "after"
    attempts: int = 1

    def __post_init__(self) -> None:
        if self.point not in ("mid", "after"):
            raise ConfigError(f"fault point must be 'mid' or 'after', not {self.point!r}")

    def fires(self, batch_id: int, subtask: int, attempt: int) -> bool:
        """Whether this fault fails that task attempt."""
        return batch_id == self.batch_id and subtask == self.subtask and attempt < self.attempts


class InjectedFault(RuntimeError):
    """The failure a :class:`Fault` raises in a task (never raised otherwise)."""


def default_local_dir() -> str:
    """Where state servers keep sockets and RocksDB directories on an executor host."""
    return os.path.join(tempfile.gettempdir(), "changelog-state-spark")


@dataclass(frozen=True, slots=True)
class StepConfig:
    """One stateful step of a query. Immutable; made on the driver, read everywhere.

    ``processor`` is the keyed function's factory pickled with PySpark's cloudpickle (so a
    class defined in the driver's ``__main__`` travels by value). ``key`` and ``values``
    name input columns; ``order_by`` (optional) orders each task's rows before they are
    processed, so the output is deterministic; ``event_time`` (optional, a timestamp or
    epoch-millisecond column) gives records their timestamp and drives the watermark,
    which trails the largest event time of the completed batches by ``watermark_delay_ms``.
    ``output_schema`` is the Arrow schema of what the processor emits (tuples in column
    order). ``storage_options`` may hold secrets: it never appears in logs or errors.
    """

    job: str
    operator: str
    store_url: str
    storage_options: dict[str, Any]
    state_backend: str
    parallelism: int
    max_parallelism: int
    key: str
    key_serializer: str
    values: tuple[str, ...]
    processor: bytes
    output_schema: bytes
    order_by: str | None = None
    event_time: str | None = None
    watermark_delay_ms: int = 0
    materialization_interval_s: float = 10.0
    local_dir: str | None = None  # None: the executor's temp dir (resolved there)
    server_idle_timeout_s: float = 300.0
    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        layout.check_name("job", self.job)
        layout.check_name("operator", self.operator)
        if self.state_backend not in STATE_BACKENDS:
            raise ConfigError(f"state backend must be heap or rocksdb, not {self.state_backend!r}")
        if self.key_serializer not in KEY_SERIALIZERS:
            raise ConfigError(
                f"key column {self.key!r} must be a string or an integer column "
                f"(key serializer str or int64), not {self.key_serializer!r}"
            )
        if not 0 < self.parallelism <= self.max_parallelism <= 1 << 15:
            raise ConfigError(
                f"parallelism {self.parallelism} must be in [1, max parallelism "
                f"{self.max_parallelism}], and that at most 32768"
            )
        if self.watermark_delay_ms < 0 or self.materialization_interval_s <= 0:
            raise ConfigError("watermark delay must be >= 0 and materialization interval > 0")
        if self.server_idle_timeout_s <= 0:
            raise ConfigError("state server idle timeout must be > 0")

    @classmethod
    def default_max_parallelism(cls) -> int:
        """The maximum parallelism (number of key groups) unless one is given."""
        return DEFAULT_MAX_PARALLELISM

    def key_group_range(self, subtask: int) -> KeyGroupRange:
        """The key groups task ``subtask`` owns."""
        return KeyGroupRange.for_subtask(subtask, self.parallelism, self.max_parallelism)

    def key_serde(self) -> Serializer:
        """The key serializer."""
        return serializer_for(self.key_serializer)

    def arrow_output_schema(self) -> pa.Schema:
        """The output schema as an Arrow schema."""
        return pa.ipc.read_schema(pa.py_buffer(self.output_schema))

    def server_dir(self) -> str:
        """This job's state-server directory on a host (socket, locks, RocksDB working dirs).

        Short (a Unix socket path holds at most 107 bytes) and distinct per job and store.
        """
        tag = hashlib.sha256(f"{self.job}\0{self.store_url}".encode()).hexdigest()[:16]
        return os.path.join(self.local_dir or default_local_dir(), tag)

    def encode(self) -> bytes:
        """The bytes the state server receives (and digests)."""
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)


def schema_bytes(schema: pa.Schema) -> bytes:
    """``schema`` as Arrow IPC bytes (for :attr:`StepConfig.output_schema`)."""
    return bytes(schema.serialize())
