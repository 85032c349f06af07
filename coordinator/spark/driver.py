"""The driver side: one micro-batch, one checkpoint, output committed only after it.

:class:`StatefulStep` is the function a query hands to ``foreachBatch``. For batch ``b``:

1. The latest completed checkpoint ``c`` of the job is read from the metadata store. If it
   is ``b`` itself, the batch already completed (the driver died after recording it and
   Spark re-planned it): its staged output is delivered again, idempotently, and nothing
   is processed. A checkpoint newer than ``b`` means Spark's checkpoint location and the
   state store disagree: an error, nothing done.
2. The rows are routed to their key-group ranges (:mod:`.partitioning`) and one Spark job
   runs a task per range (``mapInArrow``), each handing its rows to the host's state
   server on top of checkpoint ``c``; a task returns one row, its acknowledgement.
3. With every range's acknowledgement, checkpoint ``b`` is recorded (retention releases
   older checkpoints' files in the same transaction; they are deleted afterwards), and
   only then is the output committed: the staged parts are published into ``output``
   (write-once, so publishing twice is a no-op) and ``on_output(df, b)`` gets the batch's
   output as a DataFrame.

A failed task is retried by Spark; its retry starts again from checkpoint ``c``. A failed
batch records nothing: its staged files and log segments are orphans for ``statectl gc``.
Errors from tasks come back as one line of our error tree (:func:`translate_error`).

Thread: a step is called by the query's ``foreachBatch`` thread only.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.cloudpickle import dumps as cloudpickle_dumps
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import IntegerType, LongType, ShortType, StringType, StructType

import dstl.errors as errors
from backends.handles import KeyedStateHandle
from coordinator.checkpoint import checkpoint_stats
from coordinator.functions import MIN_WATERMARK
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState, one_line
from coordinator.sink import SinkTransactionHandle, commit
from coordinator.spark.config import Fault, InjectedFault, StepConfig, schema_bytes
from coordinator.spark.host import NO_CHECKPOINT, BatchAck, BatchRequest
from coordinator.spark.partitioning import partition_values, route
from coordinator.spark.server import ack_from_json, ack_to_json, call
from dstl.errors import (
    CheckpointError,
    ConfigError,
    JobFailedError,
    MetadataStoreError,
    StateBackendError,
)
from dstl.fileio import FileIO
from dstl.integrity import read_verified

log = logging.getLogger(__name__)

ACK_SCHEMA = pa.schema([("subtask", pa.int32()), ("ack", pa.string())])
_ACK_DDL = "subtask int, ack string"
_ERROR_LINE = re.compile(r"(?m)^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*Error): (.+)$")


def run_task(
    config: StepConfig,
    batch_id: int,
    base_id: int,
    base_handles: tuple[KeyedStateHandle, ...],
    watermark_ms: int,
    now_ms: int,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """One range's task (in a Spark Python worker): its rows to the state server, its ack back."""
    ctx = TaskContext.get()
    if ctx is None:
        raise ConfigError("run_task runs inside a Spark task only")
    subtask, attempt = ctx.partitionId(), ctx.attemptNumber()
    mine = config.key_group_range(subtask)
    request = BatchRequest(
        subtask,
        batch_id,
        base_id,
        tuple(h for h in base_handles if h.key_group_range.intersects(mine)),
        watermark_ms,
        now_ms,
        attempt,
    )
    fault = next((f for f in config.faults if f.fires(batch_id, subtask, attempt)), None)
    ack = call(config, request, batches, 1 if fault is not None and fault.point == "mid" else None)
    if fault is not None:
        raise InjectedFault(f"injected failure after the ack of batch {batch_id} task {subtask}")
    yield pa.RecordBatch.from_pylist(
        [{"subtask": subtask, "ack": json.dumps(ack_to_json(ack))}], schema=ACK_SCHEMA
    )


def read_staged(fileio: FileIO, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Read staged output parts (a column of handle JSON), verified, as record batches."""
    import pyarrow.parquet as pq

    from dstl.handles import handle_from_json

    for batch in batches:
        for text in batch.column(0).to_pylist():
            handle = handle_from_json(json.loads(text))
            data = read_verified(fileio, handle.file_refs()[0])
            yield from pq.read_table(pa.py_buffer(data)).to_batches()


def translate_error(exc: BaseException) -> StateBackendError:
    """A Spark job's failure as one line of our error tree (the task's own error if any)."""
    text = str(exc)
    for name, message in reversed(_ERROR_LINE.findall(text)):
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, StateBackendError):
            return cls(message.strip())
        if name == "StateServerError":
            return errors.StorageError(message.strip())
    return JobFailedError(f"the stateful step's Spark job failed: {one_line(exc)[:500]}")


def _key_serializer(df: DataFrame, key: str) -> str:
    field = df.schema[key] if key in df.columns else None
    if field is None:
        raise ConfigError(f"the input has no key column {key!r}: it has {df.columns}")
    if isinstance(field.dataType, StringType):
        return "str"
    if isinstance(field.dataType, LongType | IntegerType | ShortType):
        return "int64"
    raise ConfigError(
        f"key column {key!r} is {field.dataType.simpleString()}: use a string or integer"
    )


class StatefulStep:
    """A keyed stateful step for ``foreachBatch``: state in this backend, one checkpoint per batch.

    ``processor`` makes the keyed function (``open``, ``process(key, value, ctx)``,
    optional ``on_timer``; see :mod:`coordinator.functions`); ``value`` is the column
    ``values[0]``, or a tuple of the ``values`` columns. ``output_schema`` (DDL or
    ``StructType``) is what ``ctx.emit`` sends, as tuples. ``output`` (a URL) gets every
    committed batch as ``part-<batch>-<task>.parquet``; ``on_output(df, batch_id)`` gets it
    as a DataFrame after the checkpoint completed, possibly again for the same batch id
    after a driver crash, so it must be idempotent per batch id. ``faults`` and
    ``before_deliver`` (called after a checkpoint is recorded, before its output is
    committed) inject failures in tests and drills. Called by the query's
    ``foreachBatch`` thread only; :attr:`progress` holds one dict per batch.
    """

    def __init__(
        self,
        processor: Callable[[], Any],
        *,
        key: str,
        values: list[str] | tuple[str, ...],
        output_schema: str | StructType,
        job: str,
        store: str,
        metadata: str | None = None,
        storage_options: dict[str, Any] | None = None,
        state_backend: str = "heap",
        parallelism: int = 2,
        max_parallelism: int = StepConfig.default_max_parallelism(),
        operator: str = "stateful",
        order_by: str | None = None,
        event_time: str | None = None,
        watermark_delay_ms: int = 0,
        materialization_interval_s: float = 10.0,
        retain: int = 2,
        output: str | None = None,
        on_output: Callable[[DataFrame, int], None] | None = None,
        local_dir: str | None = None,
        server_idle_timeout_s: float = 300.0,
        faults: tuple[Fault, ...] = (),
        before_deliver: Callable[[CompletedCheckpoint], None] | None = None,
    ) -> None:
        if not values:
            raise ConfigError("a stateful step needs at least one value column")
        if retain < 1:
            raise ConfigError("retain must be >= 1")
        self._processor = processor
        self._output_schema = output_schema
        self._settings: dict[str, Any] = {
            "job": job,
            "operator": operator,
            "store_url": store,
            "storage_options": dict(storage_options or {}),
            "state_backend": state_backend,
            "parallelism": parallelism,
            "max_parallelism": max_parallelism,
            "key": key,
            "values": tuple(values),
            "order_by": order_by,
            "event_time": event_time,
            "watermark_delay_ms": watermark_delay_ms,
            "materialization_interval_s": materialization_interval_s,
            "server_idle_timeout_s": server_idle_timeout_s,
            "faults": tuple(faults),
        }
        if local_dir is not None:
            self._settings["local_dir"] = local_dir
        self.retain = retain
        self.fileio = FileIO(store, storage_options)
        self.fileio.exists("")  # an unreachable store fails here, in one line
        self.output_io = None if output is None else FileIO(output, storage_options)
        self.on_output = on_output
        self._before_deliver = before_deliver
        try:
            self.metadata = (
                MetadataStore(metadata)
                if metadata
                else MetadataStore.for_local_store(self._local_root(store))
            )
            self.metadata.start_attempt(job)
        except MetadataStoreError as exc:  # drivers' messages span lines: one line here
            raise type(exc)(one_line(exc)) from exc
        self.config: StepConfig | None = None
        self._spark_schema: StructType | None = None
        self._placement: list[int] | None = None
        self.progress: list[dict[str, Any]] = []

    def _local_root(self, store: str) -> str:
        if self.fileio.scheme != "file":
            raise ConfigError(f"store {store} is not local: give a metadata URL")
        return self.fileio.root_url[len("file://") :]

    def close(self) -> None:
        """Release the metadata store's connections."""
        self.metadata.close()

    # -- one batch ------------------------------------------------------------------
    def __call__(self, df: DataFrame, batch_id: int) -> None:
        """Process micro-batch ``batch_id`` (the ``foreachBatch`` function)."""
        started, wall = time.monotonic(), time.time()
        config = self._config(df)
        latest = self.metadata.latest(config.job)
        if latest is not None and latest.checkpoint_id >= batch_id:
            if latest.checkpoint_id > batch_id:
                raise CheckpointError(
                    f"job {config.job!r} completed checkpoint {latest.checkpoint_id} but the "
                    f"query is at batch {batch_id}: its checkpoint location is not this job's"
                )
            self._deliver(df.sparkSession, latest)
            self.progress.append({"batch_id": batch_id, "replayed": True})
            return
        self._check_compatible(config, latest)
        acks = self._run(df, config, batch_id, latest)
        processed = time.monotonic()
        checkpoint = self._record(config, batch_id, latest, acks, wall, started)
        recorded = time.monotonic()
        if self._before_deliver is not None:  # fault injection: the driver dies here
            self._before_deliver(checkpoint)
        self._deliver(df.sparkSession, checkpoint)
        self.progress.append(
            {
                "batch_id": batch_id,
                "replayed": False,
                "records": sum(int(a.stats.get("records", 0)) for a in acks),
                "restores": sum(1 for a in acks if a.stats.get("restored")),
                "restore_ms": max(float(a.stats.get("restore_ms", 0.0)) for a in acks),
                "persist_ms": round(sum(float(a.stats.get("persist_ms", 0.0)) for a in acks), 3),
                "tasks_ms": round((processed - started) * 1e3, 3),
                "commit_ms": round((recorded - processed) * 1e3, 3),
                "batch_ms": round((time.monotonic() - started) * 1e3, 3),
                "files_new": checkpoint.stats.get("files_new", 0),
            }
        )

    def _config(self, df: DataFrame) -> StepConfig:
        if self.config is not None:
            return self.config
        spark = df.sparkSession
        schema = self._output_schema
        if not isinstance(schema, StructType):
            schema = spark.createDataFrame([], schema).schema
        self._spark_schema = schema
        s = self._settings
        for column in (s["key"], *s["values"], s["order_by"], s["event_time"]):
            if column is not None and column not in df.columns:
                raise ConfigError(f"the input has no column {column!r}: it has {df.columns}")
        self.config = StepConfig(
            **s,
            key_serializer=_key_serializer(df, s["key"]),
            processor=cloudpickle_dumps(self._processor),
            output_schema=schema_bytes(to_arrow_schema(schema)),
        )
        self._placement = partition_values(self.config.parallelism)
        return self.config

    def _check_compatible(self, config: StepConfig, latest: CompletedCheckpoint | None) -> None:
        """A restarted query must keep the key type and the number of key groups."""
        for handle in _keyed_handles(config, latest):
            if handle.key_serializer != config.key_serializer:
                raise errors.SchemaMismatchError(
                    f"job {config.job!r}: key column {config.key!r} is now {config.key_serializer} "
                    f"but checkpoint {latest.checkpoint_id if latest else '?'} has "
                    f"{handle.key_serializer} keys"
                )
            if handle.max_parallelism != config.max_parallelism:
                raise errors.SchemaMismatchError(
                    f"job {config.job!r}: max parallelism is now {config.max_parallelism} but "
                    f"its checkpoints have {handle.max_parallelism} key groups"
                )

    def _run(
        self,
        df: DataFrame,
        config: StepConfig,
        batch_id: int,
        latest: CompletedCheckpoint | None,
    ) -> list[BatchAck]:
        columns = [config.key, *config.values]
        columns += [c for c in (config.order_by, config.event_time) if c and c not in columns]
        assert self._placement is not None
        routed = route(
            df.select(*columns),
            config.key,
            config.key_serializer,
            config.parallelism,
            config.max_parallelism,
            self._placement,
        )
        task = functools.partial(
            run_task,
            config,
            batch_id,
            NO_CHECKPOINT if latest is None else latest.checkpoint_id,
            tuple(_keyed_handles(config, latest)),
            _watermark(config, latest),
            int(time.time() * 1e3),
        )
        try:
            rows = routed.mapInArrow(task, _ACK_DDL).collect()
        except Exception as exc:
            raise translate_error(exc) from exc
        acks = [ack_from_json(json.loads(row["ack"])) for row in rows]
        got = sorted(a.subtask for a in acks)
        if got != list(range(config.parallelism)):
            raise CheckpointError(
                f"batch {batch_id}: acknowledged by tasks {got}, not 0..{config.parallelism - 1}"
            )
        return sorted(acks, key=lambda a: a.subtask)

    def _record(
        self,
        config: StepConfig,
        batch_id: int,
        latest: CompletedCheckpoint | None,
        acks: list[BatchAck],
        triggered_wall: float,
        started: float,
    ) -> CompletedCheckpoint:
        states = tuple(
            SubtaskState(
                config.operator,
                a.subtask,
                (a.keyed,) if a.output is None else (a.keyed, a.output),
                stats=a.stats,
            )
            for a in acks
        )
        previous = latest.stats.get("max_event_time_ms") if latest is not None else None
        tops = [int(a.stats["max_event_time_ms"]) for a in acks if "max_event_time_ms" in a.stats]
        if previous is not None:
            tops.append(int(previous))
        checkpoint = CompletedCheckpoint(
            config.job, batch_id, "checkpoint", triggered_wall, time.time(), states
        )
        stats = checkpoint_stats(
            checkpoint,
            set(latest.files()) if latest is not None else set(),
            (time.monotonic() - started) * 1e3,
        )
        stats["parallelism"] = config.parallelism
        stats["restores"] = sum(1 for a in acks if a.stats.get("restored"))
        stats["watermark_ms"] = _watermark(config, latest)
        if tops:
            stats["max_event_time_ms"] = max(tops)
        checkpoint = replace(checkpoint, stats=stats)
        retention = self.metadata.record_completed(checkpoint, self.retain)
        for location in retention.released:  # never before the record committed
            try:
                self.fileio.delete(self.fileio.relative(location))
            except StateBackendError as exc:  # left for the orphan sweep
                log.warning("release delete failed file=%s error=%s", location, exc)
        return checkpoint

    def _deliver(self, spark: SparkSession, checkpoint: CompletedCheckpoint) -> None:
        """Commit a completed checkpoint's output (idempotent: write-once parts)."""
        assert self.config is not None and self._spark_schema is not None
        staged = [
            h
            for s in checkpoint.states_of(self.config.operator)
            for h in s.handles
            if isinstance(h, SinkTransactionHandle)
        ]
        if self.output_io is not None:
            for handle in staged:
                commit(self.fileio, self.output_io, handle)
        if self.on_output is not None:
            self.on_output(self.output_frame(spark, staged), checkpoint.checkpoint_id)

    def output_frame(self, spark: SparkSession, staged: list[SinkTransactionHandle]) -> DataFrame:
        """The staged output parts as a DataFrame, read (and verified) by Spark tasks."""
        assert self._spark_schema is not None
        if not staged:
            return spark.createDataFrame([], self._spark_schema)
        from dstl.handles import handle_to_json

        parts = spark.createDataFrame(
            [(json.dumps(handle_to_json(h)),) for h in staged], "handle string"
        ).repartition(len(staged))
        return parts.mapInArrow(functools.partial(read_staged, self.fileio), self._spark_schema)


def _keyed_handles(
    config: StepConfig, checkpoint: CompletedCheckpoint | None
) -> list[KeyedStateHandle]:
    if checkpoint is None:
        return []
    return [
        h
        for s in checkpoint.states_of(config.operator)
        for h in s.handles
        if isinstance(h, KeyedStateHandle)
    ]


def _watermark(config: StepConfig, checkpoint: CompletedCheckpoint | None) -> int:
    """The batch's watermark: the largest event time of the completed batches, minus the delay."""
    if config.event_time is None or checkpoint is None:
        return MIN_WATERMARK
    top = checkpoint.stats.get("max_event_time_ms")
    return MIN_WATERMARK if top is None else int(top) - config.watermark_delay_ms


def stateful(processor: Callable[[], Any], **options: Any) -> StatefulStep:
    """A :class:`StatefulStep`: ``query = df.writeStream.foreachBatch(stateful(...)).start()``."""
    return StatefulStep(processor, **options)
