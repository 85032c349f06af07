"""The embedded pipeline runtime: source -> keyed stateful operator -> transactional sink.

One worker process hosts every task as a named thread; the checkpoint coordinator runs on
the thread that calls :meth:`EmbeddedRuntime.run`. Records travel in batches through
bounded inboxes (backpressure); checkpoint barriers are injected at the sources and
handled at every multi-input task in the configured :class:`BarrierMode` (aligned and
unaligned: exactly once; at-least-once: duplicates after a restore). A finite input ends
with a final checkpoint, so that the sink commits everything, then every task stops.

Restore: the latest completed checkpoint of the job (or a given checkpoint or savepoint)
gives the sources' offsets, the operator's keyed state (at any parallelism), the sink's
staged transactions, which are committed again (idempotently) before anything runs, and,
after an unaligned checkpoint, the in-flight records (channel state), which each task
replays before any new input.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    KeyGroupRange,
    key_group_for,
    subtask_for_key_group,
)
from backends.restore import restore_changelog_backend
from backends.rocksdb import RocksDBKeyedStateBackend
from backends.serializers import Serializer
from backends.state import StateDescriptor
from coordinator.channel_state import (
    ChannelStateHandle,
    read_channel_state,
    write_channel_state,
)
from coordinator.channels import (
    CONTROL,
    Barrier,
    BarrierMode,
    CancelledBarrier,
    InFlightData,
    InputGate,
)
from coordinator.checkpoint import CheckpointCoordinator, CheckpointOptions
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from coordinator.sink import SinkTransactionHandle, TransactionalFileSink, commit
from dstl.changelog import ChangelogOptions, ChangelogStorage
from dstl.errors import (
    CheckpointError,
    ConfigError,
    JobFailedError,
    MetadataStoreError,
)
from dstl.fileio import FileIO
from materializer import (
    FullSnapshotCheckpointer,
    MaterializationOptions,
    MaterializationScheduler,
    Materializer,
    restore_full_backend,
)

log = logging.getLogger(__name__)


class StateAccess(Protocol):
    """What a keyed function sees of its backend."""

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``."""
        ...


class KeyedFunction(Protocol):
    """User logic of the keyed operator. Called on its task thread only."""

    def open(self, state: StateAccess) -> None:
        """Declare states (called once, after restore)."""
        ...

    def process(self, key: Any, value: Any, emit: Callable[[Any], None]) -> None:
        """Handle one record of ``key`` (the backend's current key is already ``key``)."""
        ...


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


@dataclass(frozen=True, slots=True)
class _Trigger:
    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class _Notify:
    checkpoint_id: int
    completed: bool
    known_abort: bool = False  # an abort whose record surely did not land


class _Stop:
    pass


@dataclass(slots=True)
class RunResult:
    """What a run did: checkpoints, restore, and the attempt."""

    attempt: int
    restored_from: int | None
    restore_s: float
    checkpoints: list[CompletedCheckpoint]
    state_entries: int
    materializations: int


class EmbeddedRuntime:
    """Runs one :class:`Pipeline` attempt in this process until its input ends.

    Owned by the thread calling :meth:`run` (the coordinator thread); task threads talk to
    it through the coordinator's inbox and ``_failures``. ``on_checkpoint`` listeners run
    on the coordinator thread after a checkpoint's record is committed; ``before_commit``
    runs on it right before a record is written (a fault-injection hook).
    ``_lock`` guards ``_sources_finished`` and ``_coordinator``.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        options: RuntimeOptions,
        clock: Callable[[], float] = time.monotonic,
        on_checkpoint: Callable[[CompletedCheckpoint], None] | None = None,
        before_commit: Callable[[CompletedCheckpoint], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.options = options
        self._clock = clock
        self._on_checkpoint = on_checkpoint
        self._before_commit = before_commit
        self._failures: queue.Queue[BaseException] = queue.Queue()
        self._sources_finished = 0
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._coordinator: CheckpointCoordinator | None = None

    def request_savepoint(self) -> Future[CompletedCheckpoint]:
        """Ask the running job for a savepoint (any thread); the future gets its record."""
        with self._lock:
            coordinator = self._coordinator
        if coordinator is None:
            raise CheckpointError(f"job {self.pipeline.job_id} is not running")
        fut = coordinator.request_savepoint()
        self._wakeup.set()
        return fut

    def _fail(self, exc: BaseException) -> None:
        log.error("task failed: %s", exc, exc_info=exc)
        self._failures.put(exc)
        self._wakeup.set()

    def _source_finished(self) -> None:
        with self._lock:
            self._sources_finished += 1
        self._wakeup.set()

    def run(self, restore: bool = True, restore_from: int | None = None) -> RunResult:
        """Run to the end of the input (with a final checkpoint) and return what happened.

        Restores from checkpoint or savepoint ``restore_from`` of this job if given, else
        from the latest one if ``restore``. Raises :class:`JobFailedError` if a task fails
        or too many checkpoints fail (the job's status is then ``failed``).
        """
        store = self.options.metadata_store()
        try:
            result = self._run(store, restore, restore_from)
        except BaseException:
            self._set_status(store, "failed")
            raise
        self._set_status(store, "finished")
        return result

    def _set_status(self, store: MetadataStore, status: str) -> None:
        """Record the job's end; a store failure here must not hide the run's outcome."""
        try:
            store.set_job_status(self.pipeline.job_id, status)
        except MetadataStoreError as exc:
            log.warning("job status not recorded status=%s error=%s", status, exc)
        finally:
            store.close()

    def _run(self, store: MetadataStore, restore: bool, restore_from: int | None) -> RunResult:
        p, o = self.pipeline, self.options
        fileio = FileIO(o.store_url, o.storage_options)
        output_io = FileIO(p.sink.output_url, o.storage_options)
        attempt = store.start_attempt(p.job_id)
        if restore_from is not None:
            latest: CompletedCheckpoint | None = store.get(p.job_id, restore_from)
        else:
            latest = store.latest(p.job_id) if restore else None
        storage = ChangelogStorage(fileio, p.job_id, f"{o.worker}-a{attempt:04d}", o.changelog)
        mode = BarrierMode(o.barrier_mode)
        src_gates = [
            InputGate(p.source.parallelism, mode=mode) for _ in range(p.operator.parallelism)
        ]
        sink_gate = InputGate(p.operator.parallelism, mode=mode)
        sources = [_SourceTask(self, i, src_gates, latest) for i in range(p.source.parallelism)]
        started = self._clock()
        operators = [
            _OperatorTask(self, i, src_gates[i], sink_gate, storage, fileio, attempt, latest)
            for i in range(p.operator.parallelism)
        ]
        sink = _SinkTask(self, sink_gate, fileio, output_io, latest)
        restore_s = self._clock() - started if latest is not None else 0.0
        tasks: list[tuple[str, int]] = [(p.source.name, i) for i in range(p.source.parallelism)]
        tasks += [(p.operator.name, i) for i in range(p.operator.parallelism)]
        tasks.append((p.sink.name, 0))

        def trigger(cid: int) -> None:
            for s in sources:
                s.control.put(_Trigger(cid))

        def notify(cid: int, completed: bool) -> None:
            # An abort after an unknown commit outcome may still be a recorded checkpoint:
            # writers must then keep its segments, so only known aborts reset them.
            message = _Notify(cid, completed, not completed and cid in coordinator.aborted)
            for op in operators:
                op.gate.put_control(message)
            sink.gate.put_control(message)

        coordinator = CheckpointCoordinator(
            store,
            p.job_id,
            tasks,
            trigger,
            lambda cid, _last_subsumed: notify(cid, True),
            lambda cid, _reason: notify(cid, False),
            fileio,
            o.checkpoint,
            before_commit=self._before_commit,
        )
        with self._lock:
            self._coordinator = coordinator
        if self._on_checkpoint is not None:
            coordinator.listeners.append(self._on_checkpoint)
        for s in sources:
            s.coordinator = coordinator
        for op in operators:
            op.coordinator = coordinator
        sink.coordinator = coordinator
        runnables: list[_SourceTask | _OperatorTask | _SinkTask] = [*sources, *operators, sink]
        threads = {
            t.name: threading.Thread(target=t.run, name=t.name, daemon=True) for t in runnables
        }
        for thread in threads.values():
            thread.start()
        final_id: int | None = None
        try:
            while True:
                if not self._failures.empty():
                    raise JobFailedError(f"a task failed: {self._failures.get()}")
                now = self._clock()
                with self._lock:
                    all_done = self._sources_finished == p.source.parallelism
                if all_done and final_id is None:
                    coordinator.drain(now)
                    if not coordinator.pending:
                        final_id = coordinator.trigger(now)
                elif final_id is None:
                    coordinator.tick(now)
                else:
                    coordinator.drain(now)
                    for cp in list(coordinator.pending.values()):
                        if now - cp.triggered_at >= o.checkpoint.timeout_s:
                            raise JobFailedError(f"final checkpoint {cp.checkpoint_id} timed out")
                    if final_id not in coordinator.pending:
                        if coordinator.latest_completed_id >= final_id and not _carries_in_flight(
                            coordinator.completed[-1]
                        ):
                            break
                        # aborted, or (unaligned) records were in flight: they are in no
                        # committed transaction yet, so take another final checkpoint
                        final_id = None
                self._wakeup.wait(0.005)
                self._wakeup.clear()
        finally:
            with self._lock:
                self._coordinator = None
            for s in sources:
                s.control.put(_Stop())
            for op in operators:
                _post_stop(op.gate, threads[op.name])
            _post_stop(sink.gate, threads[sink.name])
            # Downstream first: once a task is gone its gate drops input, so an upstream
            # task blocked on a full gate gets to its own stop message.
            ordered: list[_SourceTask | _OperatorTask | _SinkTask] = [sink, *operators, *sources]
            for task in ordered:
                threads[task.name].join(timeout=30)
                if isinstance(task, _OperatorTask | _SinkTask):
                    task.gate.close()
            storage.close()
            coordinator.close()
        return RunResult(
            attempt,
            latest.checkpoint_id if latest else None,
            restore_s,
            coordinator.completed,
            sum(op.final_entries for op in operators),
            sum(op.materializations for op in operators),
        )


def _post_stop(gate: InputGate, thread: threading.Thread) -> None:
    """Deliver a stop message unless the receiving thread is already gone."""
    while thread.is_alive():
        try:
            gate.inbox.put((CONTROL, _Stop()), timeout=0.05)
            return
        except queue.Full:
            continue


class _SourceTask:
    """One source subtask. Its own thread; talks to the coordinator via acks."""

    def __init__(
        self,
        rt: EmbeddedRuntime,
        subtask: int,
        outputs: list[InputGate],
        latest: CompletedCheckpoint | None,
    ) -> None:
        spec = rt.pipeline.source
        self.rt = rt
        self.subtask = subtask
        self.name = f"{spec.name}-{subtask}"
        self.outputs = outputs
        self.control: queue.Queue[Any] = queue.Queue()
        self.coordinator: CheckpointCoordinator | None = None
        self.offset = 0
        if latest is not None:
            states = latest.states_of(spec.name)
            if len(states) != spec.parallelism:
                raise ConfigError(
                    f"checkpoint {latest.checkpoint_id} has {len(states)} subtasks of source "
                    f"{spec.name!r}; the pipeline declares {spec.parallelism}"
                )
            self.offset = int(states[subtask].offset or 0)
        op = rt.pipeline.operator
        self._key_ser = op.key_serializer
        self._route = (op.parallelism, op.max_parallelism)

    def _handle(self, msg: Any) -> bool:
        if isinstance(msg, _Stop):
            return False
        if isinstance(msg, _Trigger):
            for gate in self.outputs:
                gate.put(self.subtask, Barrier(msg.checkpoint_id))
            assert self.coordinator is not None
            spec = self.rt.pipeline.source
            self.coordinator.acknowledge(
                msg.checkpoint_id, SubtaskState(spec.name, self.subtask, offset=self.offset)
            )
        return True

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.rt._fail(exc)

    def _run(self) -> None:
        spec = self.rt.pipeline.source
        batch_size = self.rt.options.source_batch
        records = spec.open(self.subtask, spec.parallelism, self.offset)
        start, start_offset = time.monotonic(), self.offset
        parallelism, max_par = self._route
        serialize = self._key_ser.serialize
        exhausted = False
        while True:
            try:
                while True:
                    if not self._handle(self.control.get(block=exhausted)):
                        return
            except queue.Empty:
                pass
            batch = list(islice(records, batch_size))
            if not batch:
                exhausted = True
                self.rt._source_finished()
                continue
            routed: dict[int, list[tuple[Any, Any]]] = {}
            for rec in batch:
                target = subtask_for_key_group(
                    key_group_for(serialize(rec[0]), max_par), parallelism, max_par
                )
                routed.setdefault(target, []).append(rec)
            for target, recs in routed.items():
                self.outputs[target].put(self.subtask, recs)
            self.offset += len(batch)
            if spec.rate_per_s:
                ahead = (self.offset - start_offset) / spec.rate_per_s - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)  # pacing a generated source, not waiting for a thread


class _OperatorTask:
    """One keyed operator subtask: its backend, materializer and user function.

    Task thread only, except ``_uploader`` (materialization uploads) and the backend's
    checkpoint future callbacks, which only talk to the coordinator's thread-safe inbox.
    """

    def __init__(
        self,
        rt: EmbeddedRuntime,
        subtask: int,
        gate: InputGate,
        sink_gate: InputGate,
        storage: ChangelogStorage,
        fileio: FileIO,
        attempt: int,
        latest: CompletedCheckpoint | None,
    ) -> None:
        spec = rt.pipeline.operator
        self.rt = rt
        self.subtask = subtask
        self.name = f"{spec.name}-{subtask}"
        self.gate = gate
        self.sink_gate = sink_gate
        self.coordinator: CheckpointCoordinator | None = None
        kgr = KeyGroupRange.for_subtask(subtask, spec.parallelism, spec.max_parallelism)
        backend_id = f"{spec.name}-{subtask}-a{attempt:04d}"
        inner: HeapKeyedStateBackend | RocksDBKeyedStateBackend
        if rt.options.state_backend == "rocksdb":
            local = rt.options.local_dir
            path = None if local is None else os.path.join(local, rt.pipeline.job_id, backend_id)
            inner = RocksDBKeyedStateBackend(
                spec.key_serializer, kgr, spec.max_parallelism, path=path
            )
        else:
            inner = HeapKeyedStateBackend(spec.key_serializer, kgr, spec.max_parallelism)
        self.inner = inner
        self.final_entries = 0
        handles = (
            []
            if latest is None
            else [
                h
                for s in latest.states_of(spec.name)
                for h in s.handles
                if isinstance(h, KeyedStateHandle)
            ]
        )
        self.backend: ChangelogKeyedStateBackend | FullSnapshotCheckpointer
        self.full: FullSnapshotCheckpointer | None = None
        if rt.options.changelog_enabled:
            self.backend = ChangelogKeyedStateBackend(inner, storage.create_writer(backend_id))
            restore_changelog_backend(self.backend, fileio, handles)
        else:  # restores changelog and full checkpoints alike
            self.backend = self.full = FullSnapshotCheckpointer(
                inner, fileio, rt.pipeline.job_id, spec.name, subtask, backend_id, rt._clock
            )
            restore_full_backend(self.full, fileio, handles)
        self._fileio = fileio
        self._replay = _in_flight_of(fileio, latest, spec.name)
        self._unaligned: dict[int, tuple[Future[KeyedStateHandle], float]] = {}
        self.materializer = (
            self.full.materializer
            if self.full is not None
            else Materializer(
                self.backend, fileio, rt.pipeline.job_id, spec.name, subtask, rt._clock
            )
        )
        self.function = spec.function()
        self.function.open(self.backend)
        # Periodic, jittered, skipped when idle or in flight; fails the task after
        # max_consecutive_failures failures in a row. Uploads on its own named thread.
        self.materialization = MaterializationScheduler(
            self.materializer,
            MaterializationOptions(interval_s=rt.options.materialization_interval_s),
            clock=rt._clock,
            name=self.name,
        )
        self.materializations = 0
        self._reported_materialization = 0  # id of the last one put into checkpoint stats
        self._materialization_stats: dict[str, Any] | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.rt._fail(exc)
        finally:
            self.materialization.close()
            if self.full is not None:
                self.full.close()
            self.final_entries = self.inner.entry_count()
            self.inner.close()

    def _replay_in_flight(self) -> None:
        """Process the restored in-flight records of this subtask's key groups first."""
        spec = self.rt.pipeline.operator
        mine = KeyGroupRange.for_subtask(self.subtask, spec.parallelism, spec.max_parallelism)
        serialize = spec.key_serializer.serialize
        out: list[Any] = []
        for batch in self._replay:
            for key, value in batch:
                if key_group_for(serialize(key), spec.max_parallelism) in mine:
                    self.backend.set_current_key(key)
                    self.function.process(key, value, out.append)
        if out:
            self.sink_gate.put(self.subtask, out)
        self._replay = []

    def _run(self) -> None:
        self._replay_in_flight()
        backend, function = self.backend, self.function
        out: list[Any] = []
        emit = out.append
        set_key = backend.set_current_key
        process = function.process
        while True:
            if self.full is None and self.materialization.run_once() is not None:
                self.materializations += 1
            item = self.gate.next(timeout=0.05)
            if item is None:
                continue
            channel, element = item
            if channel != CONTROL:
                for key, value in element:
                    set_key(key)
                    process(key, value, emit)
                if out:
                    self.sink_gate.put(self.subtask, out)
                    out = []
                    emit = out.append
                continue
            if isinstance(element, _Stop):
                return
            if isinstance(element, Barrier):
                self._checkpoint(element.checkpoint_id)
            elif isinstance(element, InFlightData):
                self._in_flight_done(element)
            elif isinstance(element, _Notify):
                self._notified(element)
            elif isinstance(element, CancelledBarrier):
                self._unaligned.pop(element.checkpoint_id, None)
                assert self.coordinator is not None
                self.coordinator.decline(
                    element.checkpoint_id,
                    (self.rt.pipeline.operator.name, self.subtask),
                    "alignment cancelled",
                )

    def _notified(self, message: _Notify) -> None:
        if self.full is not None:
            if message.completed:
                self.full.notify_checkpoint_complete(message.checkpoint_id)
            else:
                self.full.notify_checkpoint_aborted(message.checkpoint_id)
        elif isinstance(self.backend, ChangelogKeyedStateBackend):
            if message.completed:
                self.backend.writer.confirm(message.checkpoint_id)
            elif message.known_abort:
                self.backend.writer.reset(message.checkpoint_id)

    def _checkpoint(self, checkpoint_id: int) -> None:
        started = time.monotonic()
        mat = self.materialization.last_applied if self.full is None else self.full.last_stats
        if mat is not None and mat.materialization_id != self._reported_materialization:
            self._reported_materialization = mat.materialization_id
            self._materialization_stats = mat.to_dict()
        else:
            self._materialization_stats = None
        future = self.backend.checkpoint(checkpoint_id)
        self.sink_gate.put(self.subtask, Barrier(checkpoint_id))
        if self.gate.mode is BarrierMode.UNALIGNED:
            self._unaligned[checkpoint_id] = (future, started)  # acked with its in-flight data
        else:
            self._ack_when_done(checkpoint_id, future, started, ())

    def _in_flight_done(self, data: InFlightData) -> None:
        entry = self._unaligned.pop(data.checkpoint_id, None)
        if entry is None:
            return
        extra: tuple[ChannelStateHandle, ...] = ()
        if data.batches:
            name = self.rt.pipeline.operator.name
            extra = (
                write_channel_state(
                    self._fileio,
                    self.rt.pipeline.job_id,
                    name,
                    self.subtask,
                    data.checkpoint_id,
                    [batch for _, batch in data.batches],
                ),
            )
        self._ack_when_done(data.checkpoint_id, entry[0], entry[1], extra)

    def _ack_when_done(
        self,
        checkpoint_id: int,
        future: Future[KeyedStateHandle],
        started: float,
        extra: tuple[ChannelStateHandle, ...],
    ) -> None:
        assert self.coordinator is not None
        coordinator = self.coordinator
        name = self.rt.pipeline.operator.name
        mat_stats = self._materialization_stats  # read on the task thread

        def done(f: Future[KeyedStateHandle]) -> None:
            exc = f.exception()
            if exc is not None:
                coordinator.decline(checkpoint_id, (name, self.subtask), str(exc))
                return
            stats: dict[str, Any] = {"async_ms": round((time.monotonic() - started) * 1e3, 3)}
            if extra:
                stats["in_flight_records"] = sum(h.records for h in extra)
            if mat_stats is not None:  # the first checkpoint that references it
                stats["materialization"] = mat_stats
            coordinator.acknowledge(
                checkpoint_id,
                SubtaskState(name, self.subtask, (f.result(), *extra), stats=stats),
            )

        future.add_done_callback(done)


class _SinkTask:
    """The transactional sink subtask."""

    def __init__(
        self,
        rt: EmbeddedRuntime,
        gate: InputGate,
        fileio: FileIO,
        output_io: FileIO,
        latest: CompletedCheckpoint | None,
    ) -> None:
        spec = rt.pipeline.sink
        self.rt = rt
        self.name = f"{spec.name}-0"
        self.gate = gate
        self.coordinator: CheckpointCoordinator | None = None
        if latest is not None:  # commit what the restored checkpoint pre-committed
            for s in latest.states_of(spec.name):
                for h in s.handles:
                    if isinstance(h, SinkTransactionHandle):
                        commit(fileio, output_io, h)
        self.sink = TransactionalFileSink(fileio, output_io, rt.pipeline.job_id, spec.name, 0)
        self._fileio = fileio
        self._replay = _in_flight_of(fileio, latest, spec.name)
        self._unaligned: dict[int, tuple[SinkTransactionHandle, ...]] = {}

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.rt._fail(exc)

    def _run(self) -> None:
        name = self.rt.pipeline.sink.name
        for batch in self._replay:  # restored in-flight records before any new input
            self.sink.write(batch)
        self._replay = []
        while True:
            item = self.gate.next(timeout=0.1)
            if item is None:
                continue
            channel, element = item
            if channel != CONTROL:
                self.sink.write(element)
                continue
            if isinstance(element, _Stop):
                return
            assert self.coordinator is not None
            if isinstance(element, Barrier):
                staged = self.sink.pre_commit(element.checkpoint_id)
                if self.gate.mode is BarrierMode.UNALIGNED:
                    self._unaligned[element.checkpoint_id] = staged
                else:
                    self.coordinator.acknowledge(
                        element.checkpoint_id, SubtaskState(name, 0, staged)
                    )
            elif isinstance(element, InFlightData):
                staged = self._unaligned.pop(element.checkpoint_id, ())
                handles: tuple[Any, ...] = staged
                if element.batches:
                    handles += (
                        write_channel_state(
                            self._fileio,
                            self.rt.pipeline.job_id,
                            name,
                            0,
                            element.checkpoint_id,
                            [batch for _, batch in element.batches],
                        ),
                    )
                self.coordinator.acknowledge(element.checkpoint_id, SubtaskState(name, 0, handles))
            elif isinstance(element, CancelledBarrier):
                self._unaligned.pop(element.checkpoint_id, None)
                self.coordinator.decline(element.checkpoint_id, (name, 0), "alignment cancelled")
            elif isinstance(element, _Notify) and element.completed:
                self.sink.commit_up_to(element.checkpoint_id)


def _carries_in_flight(checkpoint: CompletedCheckpoint) -> bool:
    """Whether an (unaligned) checkpoint persisted in-flight records anywhere."""
    return any(isinstance(h, ChannelStateHandle) for s in checkpoint.subtasks for h in s.handles)


def _in_flight_of(
    fileio: FileIO, checkpoint: CompletedCheckpoint | None, operator: str
) -> list[Any]:
    """The in-flight batches an unaligned ``checkpoint`` persisted for ``operator``
    (every subtask's: a rescaled operator filters them by key group)."""
    if checkpoint is None:
        return []
    return [
        batch
        for s in checkpoint.states_of(operator)
        for h in s.handles
        if isinstance(h, ChannelStateHandle)
        for batch in read_channel_state(fileio, h)
    ]
