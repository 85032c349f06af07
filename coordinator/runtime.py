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
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import pyarrow as pa

from backends import localdirs
from coordinator.channels import (
    BarrierMode,
    InputGate,
)
from coordinator.checkpoint import CheckpointCoordinator
from coordinator.functions import Context, KeyedFunction, StateAccess
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from coordinator.pipeline import (
    OperatorSpec,
    Pipeline,
    RuntimeOptions,
    SinkSpec,
    SourceSpec,
)
from coordinator.tasks import (
    Notify,
    OperatorTask,
    SinkTask,
    SourceTask,
    Stop,
    Trigger,
    carries_in_flight,
    post_stop,
)
from dstl.changelog import ChangelogStorage
from dstl.errors import (
    CheckpointError,
    JobFailedError,
    MetadataStoreError,
)
from dstl.fileio import FileIO

log = logging.getLogger(__name__)

__all__ = [
    "Context",
    "EmbeddedRuntime",
    "KeyedFunction",
    "OperatorSpec",
    "Pipeline",
    "RunResult",
    "RuntimeOptions",
    "SinkSpec",
    "SourceSpec",
    "StateAccess",
]


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
        # pyarrow imports pandas (installed for pyspark) on its first array conversion:
        # ~0.5 s holding the GIL. Here, before any task thread runs, not in the middle of a
        # run, where it stalled barriers (tests/coordinator/test_crash_safety.py).
        pa.array([0])
        # RocksDB working directories of attempts that were killed: their locks are free
        localdirs.reclaim()
        if o.local_dir is not None:
            localdirs.reclaim(o.local_dir, recursive=True)
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
        sources = [SourceTask(self, i, src_gates, latest) for i in range(p.source.parallelism)]
        started = self._clock()
        operators = [
            OperatorTask(self, i, src_gates[i], sink_gate, storage, fileio, attempt, latest)
            for i in range(p.operator.parallelism)
        ]
        sink = SinkTask(self, sink_gate, fileio, output_io, latest)
        restore_s = self._clock() - started if latest is not None else 0.0
        tasks: list[tuple[str, int]] = [(p.source.name, i) for i in range(p.source.parallelism)]
        tasks += [(p.operator.name, i) for i in range(p.operator.parallelism)]
        tasks.append((p.sink.name, 0))

        def trigger(cid: int) -> None:
            for s in sources:
                s.control.put(Trigger(cid))

        def notify(cid: int, completed: bool) -> None:
            # An abort after an unknown commit outcome may still be a recorded checkpoint:
            # writers must then keep its segments, so only known aborts reset them.
            message = Notify(cid, completed, not completed and cid in coordinator.aborted)
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
        runnables: list[SourceTask | OperatorTask | SinkTask] = [*sources, *operators, sink]
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
                        if coordinator.latest_completed_id >= final_id and not carries_in_flight(
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
                s.control.put(Stop())
            for op in operators:
                post_stop(op.gate, threads[op.name])
            post_stop(sink.gate, threads[sink.name])
            # Downstream first: once a task is gone its gate drops input, so an upstream
            # task blocked on a full gate gets to its own stop message.
            ordered: list[SourceTask | OperatorTask | SinkTask] = [sink, *operators, *sources]
            for task in ordered:
                threads[task.name].join(timeout=30)
                if isinstance(task, OperatorTask | SinkTask):
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
