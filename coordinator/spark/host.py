"""The state server's logic: one :class:`RangeHost` per key-group range, kept between batches.

A task of micro-batch ``b`` asks the state server of its host to process its rows on top of
the state as of checkpoint ``c`` (the latest completed one, normally ``b - 1``). The range's
host is reused only when it holds exactly that state: it applied batch ``c`` and the
acknowledgement that completed checkpoint ``c`` is the one it gave (a retried, speculative
or re-planned task may have applied a batch whose acknowledgement was not the one used).
Otherwise it is rebuilt from checkpoint ``c``'s handles (a *restore*, counted and reported).
A host is marked dirty before it touches its state, so a failure in the middle of a batch
can never leave a host that looks reusable.

Per batch: records (ordered by ``order_by`` if given), then the event-time timers the
watermark passed, then the processing-time timers due at the batch clock; then the
checkpoint: the changelog since the last materialization is persisted through the
server's one :class:`~dstl.changelog.ChangelogStorage` (so concurrent tasks share segment
uploads) and the output is staged as one Parquet file in the store. Materialization runs
in the background as in the embedded runtime; learning that checkpoint ``c`` completed
(from the next request) confirms the changelog and the materialization claims.

Threads: :class:`StateHost` is shared by the server's connection threads; ``_lock`` guards
its map of hosts. A :class:`RangeHost` (its backend, writer, materialization scheduler
and keyed function) is used by one connection thread at a time, the one holding its
``lock``: ownership passes between threads with the lock, never concurrently.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import logging
import os
import pickle
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange
from backends.restore import relevant, restore_changelog_backend
from backends.rocksdb import RocksDBKeyedStateBackend
from coordinator.functions import KeyedRunner
from coordinator.sink import SinkTransactionHandle
from coordinator.spark.config import MARKER, StepConfig
from dstl import layout
from dstl.changelog import ChangelogOptions, ChangelogStorage
from dstl.errors import CheckpointError, ConfigError
from dstl.fileio import FileIO
from dstl.integrity import content_hash
from dstl.upload import Uploader
from materializer import MaterializationOptions, MaterializationScheduler, Materializer

log = logging.getLogger(__name__)

NO_CHECKPOINT = -1
"""The base of a query's first batch: no completed checkpoint, empty state."""

PERSIST_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """What a task asks of the state server (besides its rows and the step's config).

    ``base_id`` is the latest completed checkpoint (``NO_CHECKPOINT`` before the first);
    ``base_handles`` are its keyed-state handles that intersect the task's key groups.
    ``watermark_ms`` and ``now_ms`` are the batch's event-time watermark and clock.
    """

    subtask: int
    batch_id: int
    base_id: int
    base_handles: tuple[KeyedStateHandle, ...]
    watermark_ms: int
    now_ms: int
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class BatchAck:
    """A range's acknowledgement of one batch: its state handle, staged output, statistics."""

    subtask: int
    keyed: KeyedStateHandle
    output: SinkTransactionHandle | None
    stats: dict[str, Any]


def _new_backend(
    config: StepConfig, subtask: int, writer_id: str, storage: ChangelogStorage, root: str
) -> ChangelogKeyedStateBackend[Any]:
    kgr = config.key_group_range(subtask)
    key_ser = config.key_serde()
    inner: HeapKeyedStateBackend | RocksDBKeyedStateBackend
    if config.state_backend == "rocksdb":
        path = os.path.join(root, "rocksdb", writer_id)
        inner = RocksDBKeyedStateBackend(key_ser, kgr, config.max_parallelism, path=path)
    else:
        inner = HeapKeyedStateBackend(key_ser, kgr, config.max_parallelism)
    return ChangelogKeyedStateBackend(inner, storage.create_writer(writer_id))


class RangeHost:
    """The state of one key-group range on this host, between batches.

    Owned by the connection thread holding its slot's lock. ``version`` is the batch whose
    changes the state holds last (``None`` while a batch is being applied: dirty);
    ``last_ack`` the handle this host acknowledged for it (after a restore: the base's
    handle of exactly this range, if there is one); ``confirmed`` the newest checkpoint
    known to have completed with it. ``now_ms`` is the batch clock its function sees.
    """

    def __init__(
        self,
        config: StepConfig,
        digest: str,
        subtask: int,
        backend: ChangelogKeyedStateBackend[Any],
        scheduler: MaterializationScheduler,
        function: Any,
        base_id: int,
        last_ack: KeyedStateHandle | None,
        restore_ms: float,
    ) -> None:
        self.config = config
        self.digest = digest
        self.subtask = subtask
        self.backend = backend
        self.scheduler = scheduler
        self.now_ms = 0
        self.runner = KeyedRunner(function, backend, lambda: self.now_ms)
        self.runner.open()
        self.version: int | None = base_id
        self.last_ack = last_ack
        self.confirmed = base_id
        self.restore_ms = restore_ms

    def reusable_for(self, digest: str, request: BatchRequest) -> bool:
        """Whether the state here is exactly checkpoint ``request.base_id``'s, for this range."""
        if digest != self.digest or self.version != request.base_id:
            return False
        if request.base_id == NO_CHECKPOINT:
            return self.last_ack is None
        own = [h for h in request.base_handles if h.key_group_range == self.key_group_range]
        return len(own) == 1 and own[0] == self.last_ack

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups of this range."""
        return self.backend.key_group_range

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed with this host's acknowledgement."""
        if checkpoint_id > self.confirmed:
            self.confirmed = checkpoint_id
            self.backend.writer.confirm(checkpoint_id)
            self.scheduler.on_checkpoint_complete(checkpoint_id)

    def close(self) -> None:
        """Stop materializing, close the store and the writer (deletes nothing referenced)."""
        try:
            self.scheduler.close()
        finally:
            self.backend.close()
            self.backend.writer.close()


@dataclass(eq=False, slots=True)
class _Slot:
    """A range's place in the host: its lock and its :class:`RangeHost` (guarded by it)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    host: RangeHost | None = None


class StateHost:
    """The ranges of one job on one host and the changelog storage they share.

    Thread-safe: :meth:`process` may run on several connection threads at once (for
    different ranges; a second request for the same range waits for the first).
    ``_lock`` guards ``_slots``, ``_parallelism`` and ``_configs``; each slot's lock guards
    its host. ``restores`` counts rebuilt ranges. ``uploader`` (thread-safe) writes the
    staged output and the materialized files of every range, with the embedded runtime's
    retries, hedging and byte budget. Close with :meth:`close`.
    """

    def __init__(
        self, store_url: str, storage_options: dict[str, Any], job: str, root: str
    ) -> None:
        self.fileio = FileIO(store_url, storage_options)
        self.job = job
        self.root = root
        self.worker = f"spark-{secrets.token_hex(6)}"
        # Tasks of one wave finish close together: a wider batching window than the
        # embedded runtime's lets their persists share one segment upload.
        self.storage = ChangelogStorage(
            self.fileio, job, self.worker, ChangelogOptions(batch_delay_s=0.05)
        )
        # Staged output and materialized files: the retries, hedging and byte budget of
        # the embedded runtime's worker uploader, shared by every range of this host.
        self.uploader = Uploader(self.fileio, name=f"{job}-{self.worker}")
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._parallelism: int | None = None
        self._configs: dict[str, StepConfig] = {}
        self._writer_numbers = itertools.count(1)  # next() is atomic under the GIL
        self.restores = 0

    def config_of(self, encoded: bytes) -> tuple[str, StepConfig]:
        """The step config from its bytes (the driver's, over a local socket) and its digest."""
        digest = hashlib.sha256(encoded).hexdigest()
        with self._lock:
            config = self._configs.get(digest)
            if config is None:
                # Trusted: the bytes come from this user's Spark task over a socket in a
                # 0700 directory, as Spark's own workers unpickle the driver's closures.
                config = pickle.loads(encoded)
                if not isinstance(config, StepConfig):
                    raise ConfigError("the state server received no step configuration")
                self._configs[digest] = config
        return digest, config

    def _slot(self, config: StepConfig, subtask: int) -> _Slot:
        """The range's slot; a new parallelism (a rescaled query) retires every old range."""
        with self._lock:
            stale: list[_Slot] = []
            if self._parallelism != config.parallelism:
                stale = list(self._slots.values())
                self._slots = {}
                self._parallelism = config.parallelism
            slot = self._slots.setdefault(subtask, _Slot())
        for old in stale:
            with old.lock:
                if old.host is not None:
                    old.host.close()
                    old.host = None
        return slot

    def _build(self, config: StepConfig, digest: str, request: BatchRequest) -> RangeHost:
        """A range restored from ``request.base_handles`` (empty at ``NO_CHECKPOINT``)."""
        writer_id = f"{config.operator}-{request.subtask:04d}-{self.worker}-{next(self._writer_numbers):04d}"
        backend = _new_backend(config, request.subtask, writer_id, self.storage, self.root)
        started = time.perf_counter()
        handles = relevant(request.base_handles, backend.key_group_range)
        try:
            if request.base_id != NO_CHECKPOINT:
                restore_changelog_backend(backend, self.fileio, handles)
            restore_ms = (time.perf_counter() - started) * 1e3
            materializer = Materializer(
                backend,
                self.fileio,
                config.job,
                config.operator,
                request.subtask,
                uploader=self.uploader,
            )
            scheduler = MaterializationScheduler(
                materializer,
                MaterializationOptions(interval_s=config.materialization_interval_s),
                name=writer_id,
            )
        except BaseException:
            backend.close()
            backend.writer.close()
            raise
        try:
            function = pickle.loads(config.processor)()
            own = [h for h in handles if h.key_group_range == backend.key_group_range]
            return RangeHost(
                config,
                digest,
                request.subtask,
                backend,
                scheduler,
                function,
                request.base_id,
                own[0] if len(own) == 1 and len(handles) == 1 else None,
                restore_ms,
            )
        except BaseException:
            scheduler.close()
            backend.close()
            backend.writer.close()
            raise

    def _host(self, slot: _Slot, config: StepConfig, digest: str, request: BatchRequest) -> bool:
        """Make ``slot.host`` hold checkpoint ``request.base_id``'s state (slot lock held).

        Returns whether it had to be rebuilt (a restore, unless the base is empty).
        """
        host = slot.host
        if host is not None and host.reusable_for(digest, request):
            return False
        if host is not None:
            log.info(
                "rebuilding range subtask=%d held=%s base=%d",
                request.subtask,
                host.version,
                request.base_id,
            )
            slot.host = None
            host.close()
        slot.host = self._build(config, digest, request)
        if request.base_id == NO_CHECKPOINT:
            return False
        with self._lock:
            self.restores += 1
        return True

    def process(
        self, encoded_config: bytes, request: BatchRequest, batches: Iterable[pa.RecordBatch]
    ) -> BatchAck:
        """Apply one task's rows to its range and checkpoint it as ``request.batch_id``."""
        digest, config = self.config_of(encoded_config)
        if request.batch_id <= request.base_id:
            raise CheckpointError(
                f"batch {request.batch_id} is not after its base checkpoint {request.base_id}"
            )
        slot = self._slot(config, request.subtask)
        with slot.lock:
            restored = self._host(slot, config, digest, request)
            assert slot.host is not None
            return self._apply(slot.host, config, request, batches, restored)

    def _apply(
        self,
        host: RangeHost,
        config: StepConfig,
        request: BatchRequest,
        batches: Iterable[pa.RecordBatch],
        restored: bool,
    ) -> BatchAck:
        if request.base_id != NO_CHECKPOINT and host.last_ack is not None:
            host.confirm(request.base_id)
        started = time.perf_counter()
        host.version = None  # dirty until the batch is acknowledged
        if host.scheduler.run_once() is not None:
            log.debug("materialization applied subtask=%d", host.subtask)
        host.now_ms = request.now_ms
        out: list[Any] = []
        emit = out.append
        records, max_event_ms = _process_rows(host.runner, config, batches, emit)
        fired = host.runner.advance_watermark(request.watermark_ms, emit)
        fired += host.runner.advance_processing_time(request.now_ms, emit)
        processed = time.perf_counter()
        host.scheduler.on_barrier(request.batch_id)
        keyed = host.backend.checkpoint(request.batch_id).result(PERSIST_TIMEOUT_S)
        persisted = time.perf_counter()
        output = self._stage(config, request, out)
        host.version = request.batch_id
        host.last_ack = keyed
        stats: dict[str, Any] = {
            "records": records,
            "output_rows": len(out),
            "timers_fired": fired,
            "restored": restored,
            "restore_ms": round(host.restore_ms if restored else 0.0, 3),
            "process_ms": round((processed - started) * 1e3, 3),
            "persist_ms": round((persisted - processed) * 1e3, 3),
            "stage_ms": round((time.perf_counter() - persisted) * 1e3, 3),
            "materializations": host.scheduler.applied,
            "host": self.worker,
        }
        if max_event_ms is not None:
            stats["max_event_time_ms"] = max_event_ms
        return BatchAck(request.subtask, keyed, output, stats)

    def _stage(
        self, config: StepConfig, request: BatchRequest, rows: list[Any]
    ) -> SinkTransactionHandle | None:
        """Write the batch's output as one Parquet file in the store (write-once)."""
        if not rows:
            return None
        schema = config.arrow_output_schema()
        columns = list(zip(*rows, strict=True)) if schema.names else []
        if len(columns) != len(schema.names):
            raise ConfigError(
                f"the processor emitted rows of {len(columns)} values; "
                f"the output schema has {len(schema.names)} columns"
            )
        try:
            table = pa.Table.from_arrays(
                [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)],
                schema=schema,
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise ConfigError(f"output does not match the output schema ({exc})") from exc
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue()
        path = layout.staged_output_path(
            config.job, config.operator, request.subtask, request.batch_id, secrets.token_hex(6)
        )
        path = self.uploader.upload(path, data)  # an attempt's name if a retry won
        return SinkTransactionHandle(
            path,
            request.batch_id,
            request.subtask,
            table.num_rows,
            len(data),
            content_hash(data),
            suffix="parquet",
        )

    def close(self) -> None:
        """Close every range and the changelog storage (uploads what is queued)."""
        with self._lock:
            slots = list(self._slots.values())
            self._slots = {}
        for slot in slots:
            with slot.lock:
                if slot.host is not None:
                    slot.host.close()
                    slot.host = None
        self.uploader.close()  # after the ranges: their materializations finished
        self.storage.close()


def _process_rows(
    runner: KeyedRunner,
    config: StepConfig,
    batches: Iterable[pa.RecordBatch],
    emit: Any,
) -> tuple[int, int | None]:
    """Feed every row to the keyed function; returns (rows, largest event time or None)."""
    batches = _without_markers(batches)
    if config.order_by is not None:
        tables = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
        if not tables:
            return 0, None
        table = pa.concat_tables(tables, promote_options="permissive")
        table = table.sort_by([(config.key, "ascending"), (config.order_by, "ascending")])
        chunks: Iterable[Any] = table.to_batches()
    else:
        chunks = batches
    count = 0
    max_event: int | None = None
    process = runner.process
    for batch in chunks:
        n = batch.num_rows
        if not n:
            continue
        count += n
        keys = batch.column(config.key).to_pylist()
        values = _value_column(batch, config.values)
        if config.event_time is not None:
            times = _epoch_ms(batch.column(config.event_time))
            top = pc.max(pa.array(times, pa.int64())).as_py()
            if top is not None and (max_event is None or top > max_event):
                max_event = top
            for key, value, ts in zip(keys, values, times, strict=True):
                process(key, value, ts, emit)
        else:
            for key, value in zip(keys, values, strict=True):
                process(key, value, None, emit)
    return count, max_event


def _without_markers(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """The batches without the partitions' marker rows (and without the marker column)."""
    for batch in batches:
        if MARKER in batch.schema.names:
            marker = batch.column(MARKER)
            index = batch.schema.get_field_index(MARKER)
            batch = batch.filter(pc.is_null(marker)).remove_column(index)
        yield batch


def _value_column(batch: Any, names: tuple[str, ...]) -> list[Any]:
    """The record values: one column's values, or tuples of several columns'."""
    if len(names) == 1:
        return list(batch.column(names[0]).to_pylist())
    return list(zip(*(batch.column(n).to_pylist() for n in names), strict=True))


def _epoch_ms(column: pa.Array) -> list[int | None]:
    """An event-time column (timestamp or integer milliseconds) as epoch milliseconds."""
    if pa.types.is_timestamp(column.type):
        column = pc.cast(column.cast(pa.timestamp("ms", column.type.tz)), pa.int64())
    elif not pa.types.is_integer(column.type):
        raise ConfigError(f"event-time column has type {column.type}: use a timestamp or ms")
    return list(column.to_pylist())
