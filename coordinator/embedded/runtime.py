"""The embedded runtime: a job graph as threads of one worker process.

One worker process hosts every subtask as a named thread; the checkpoint coordinator
runs on the thread that calls :meth:`EmbeddedRuntime.run`. Records travel in batches
through inboxes bounded in records and, with buffer debloating, in time (about
``buffer-debloat.target-s`` of each receiver's measured throughput); checkpoint barriers
are injected at the sources and handled at every task in the configured barrier mode
(aligned, aligned with a timeout into unaligned, unaligned: exactly once; at-least-once:
duplicates after a restore). A finite input ends with a final checkpoint, so that every
sink commits everything, then every task stops; :meth:`EmbeddedRuntime.stop` (any
thread, e.g. a signal handler) ends an unbounded job the same way.

Restore: the latest completed checkpoint of the job (or a given checkpoint or savepoint)
gives the sources' positions, the keyed operators' state (at any parallelism), the sinks'
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
from typing import Protocol

import pyarrow as pa

from backends import localdirs
from coordinator.checkpoint import CheckpointCoordinator
from coordinator.compactions import RegisteredCompaction
from coordinator.embedded.channel_state import ChannelState, read_channel_state
from coordinator.embedded.gate import DebloatOptions, InputGate
from coordinator.embedded.gcpolicy import job_gc_policy
from coordinator.embedded.operators import KeyedOperator, Notify, Operator, SinkOperator
from coordinator.embedded.pipeline import JobGraph, KeyedNode, SinkNode, SourceNode
from coordinator.embedded.tasks import Finish, JobEnv, SourceTask, Stop, StreamTask, Trigger
from coordinator.embedded.writer import Output, RecordWriter
from coordinator.handles import ChannelStateHandle, SinkTransactionHandle
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from coordinator.options import RuntimeOptions
from coordinator.sink import publish_staged
from dstl.changelog import ChangelogStorage
from dstl.errors import CheckpointError, JobFailedError, MetadataStoreError
from dstl.fileio import FileIO
from dstl.upload import Uploader

log = logging.getLogger(__name__)

__all__ = ["EmbeddedRuntime", "RunResult", "carries_in_flight"]


class GraphSource(Protocol):
    """Anything that declares a job: a :class:`JobGraph`, a builder, a ``Pipeline``."""

    def graph(self) -> JobGraph:
        """The job graph."""
        ...


def _wall_ms() -> int:
    """The default processing-time clock of keyed functions: epoch milliseconds."""
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class RunResult:
    """What a run did: checkpoints, restore, and the attempt."""

    attempt: int
    restored_from: int | None
    restore_s: float
    checkpoints: list[CompletedCheckpoint]
    state_entries: int
    materializations: int


def carries_in_flight(checkpoint: CompletedCheckpoint) -> bool:
    """Whether an (unaligned) checkpoint overtook anything in flight anywhere: records (it
    persisted them) or watermarks and end-of-input markers (not persisted: restored sources
    emit them again). Either way a final checkpoint like it was taken before every task
    had processed all its input, so the job takes another one before it ends: a final
    watermark a barrier overtook would otherwise never fire its timers."""
    return any(
        isinstance(h, ChannelStateHandle) for s in checkpoint.subtasks for h in s.handles
    ) or any(s.stats.get("overtaken_control") for s in checkpoint.subtasks)


class EmbeddedRuntime:
    """Runs one attempt of a job in this process until its input ends or :meth:`stop`.

    Owned by the thread calling :meth:`run` (the coordinator thread); task threads talk to
    it through the coordinator's inbox and ``_failures``. ``on_checkpoint`` listeners run
    on the coordinator thread after a checkpoint's record is committed; ``before_commit``
    runs on it right before a record is written (a fault-injection hook).
    ``processing_ms`` is the keyed functions' processing-time clock (epoch ms).
    ``_lock`` guards ``_sources_finished``, ``_stopping`` and ``_coordinator``.
    """

    def __init__(
        self,
        pipeline: GraphSource,
        options: RuntimeOptions,
        clock: Callable[[], float] = time.monotonic,
        on_checkpoint: Callable[[CompletedCheckpoint], None] | None = None,
        before_commit: Callable[[CompletedCheckpoint], None] | None = None,
        processing_ms: Callable[[], int] = _wall_ms,
    ) -> None:
        self.pipeline = pipeline
        self.graph = pipeline.graph()
        self.options = options
        self._clock = clock
        self._processing_ms = processing_ms
        self._on_checkpoint = on_checkpoint
        self._before_commit = before_commit
        self._failures: queue.Queue[BaseException] = queue.Queue()
        self._sources_finished = 0
        self._stopping = False
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._coordinator: CheckpointCoordinator | None = None

    def request_savepoint(self) -> Future[CompletedCheckpoint]:
        """Ask the running job for a savepoint (any thread); the future gets its record."""
        with self._lock:
            coordinator = self._coordinator
        if coordinator is None:
            raise CheckpointError(f"job {self.graph.job_id} is not running")
        fut = coordinator.request_savepoint()
        self._wakeup.set()
        return fut

    def stop(self) -> None:
        """End the job cleanly (any thread, a signal handler too): the sources stop
        reading, a final checkpoint commits everything, then :meth:`run` returns."""
        with self._lock:
            self._stopping = True
        self._wakeup.set()

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
            store.set_job_status(self.graph.job_id, status)
        except MetadataStoreError as exc:
            log.warning("job status not recorded status=%s error=%s", status, exc)
        finally:
            store.close()

    def _run(self, store: MetadataStore, restore: bool, restore_from: int | None) -> RunResult:
        g, o = self.graph, self.options
        # pyarrow imports pandas (installed for pyspark) on its first array conversion:
        # ~0.5 s holding the GIL. Here, before any task thread runs, not in the middle of a
        # run, where it stalled barriers (tests/coordinator/embedded/test_crash_safety.py).
        pa.array([0])
        # RocksDB working directories of attempts that were killed: their locks are free
        localdirs.reclaim()
        if o.local_dir is not None:
            localdirs.reclaim(o.local_dir, recursive=True)
        fileio = FileIO(o.store_url, o.storage_options)
        attempt = store.start_attempt(g.job_id)
        latest: CompletedCheckpoint | None
        if restore_from is not None:
            latest = store.get(g.job_id, restore_from)
        else:
            latest = store.latest(g.job_id) if restore else None
        storage = ChangelogStorage(fileio, g.job_id, f"{o.worker}-a{attempt:04d}", o.changelog)
        job = _Job(self, g, fileio, store)
        started = self._clock()
        try:
            job.build(storage, attempt, latest)
        except BaseException:
            job.close_operators()
            storage.close()
            job.coordinator.close()
            raise
        restore_s = self._clock() - started if latest is not None else 0.0
        with self._lock:
            self._coordinator = job.coordinator
        try:
            with job_gc_policy():  # restored, imported: frozen; young collections rarer
                job.start()
                self._loop(job)
        finally:
            with self._lock:
                self._coordinator = None
            job.stop()
            storage.close()
            job.coordinator.close()
        return RunResult(
            attempt,
            latest.checkpoint_id if latest else None,
            restore_s,
            job.coordinator.completed,
            sum(op.final_entries for op in job.operators if isinstance(op, KeyedOperator)),
            sum(op.materializations for op in job.operators if isinstance(op, KeyedOperator)),
        )

    def _loop(self, job: _Job) -> None:
        """The coordinator thread: checkpoints until the input ended and a final one
        committed everything."""
        coordinator = job.coordinator
        sources = sum(n.parallelism for n in self.graph.nodes if isinstance(n, SourceNode))
        final_id: int | None = None
        finish_sent = False
        while True:
            if not self._failures.empty():
                raise JobFailedError(f"a task failed: {self._failures.get()}")
            now = self._clock()
            with self._lock:
                all_done = self._sources_finished == sources
                stopping = self._stopping
            if stopping and not finish_sent:
                finish_sent = True
                for s in job.sources:
                    s.control.put(Finish())
            if all_done and final_id is None:
                coordinator.drain(now)
                if not coordinator.pending:
                    final_id = coordinator.trigger(now)
            elif final_id is None:
                coordinator.tick(now)
            else:
                coordinator.drain(now)
                for cp in list(coordinator.pending.values()):
                    if now - cp.triggered_at >= self.options.checkpoint.timeout_s:
                        raise JobFailedError(f"final checkpoint {cp.checkpoint_id} timed out")
                if final_id not in coordinator.pending and final_id not in coordinator.committing:
                    if coordinator.latest_completed_id >= final_id and not carries_in_flight(
                        coordinator.completed[-1]
                    ):
                        return
                    # aborted, or (unaligned) records were in flight: they are in no
                    # committed transaction yet, so take another final checkpoint
                    final_id = None
            self._wakeup.wait(0.005)
            self._wakeup.clear()


class _Job:
    """The tasks of one run, wired: gates, writers, operators, threads. Coordinator
    thread only (the tasks' threads own what they were given)."""

    def __init__(
        self, runtime: EmbeddedRuntime, graph: JobGraph, fileio: FileIO, store: MetadataStore
    ) -> None:
        self.rt = runtime
        self.graph = graph
        self.fileio = fileio
        self.sources: list[SourceTask] = []
        self.streams: list[StreamTask] = []
        self.operators: list[Operator] = []
        self.gates: dict[tuple[str, int], InputGate] = {}
        self.threads: dict[str, threading.Thread] = {}
        o = runtime.options
        self.coordinator = CheckpointCoordinator(
            store,
            graph.job_id,
            graph.tasks(),
            self._trigger,
            lambda cid, _last_subsumed: self._notify(cid, True),
            lambda cid, _reason: self._notify(cid, False),
            fileio,
            o.checkpoint,
            before_commit=runtime._before_commit,
            offer_compactions=self._offer_compactions,
            wakeup=runtime._wakeup.set,
        )
        if runtime._on_checkpoint is not None:
            self.coordinator.listeners.append(runtime._on_checkpoint)
        # One for the worker: channel state, staged sink transactions and materialized
        # files share its retries, hedging and byte budget (closed after the tasks).
        self.uploader = Uploader(fileio, name=graph.job_id)
        self.env = JobEnv(
            graph.job_id,
            o,
            runtime._clock,
            fileio,
            self.coordinator,
            runtime._fail,
            runtime._source_finished,
            self.uploader,
        )

    def _trigger(self, cid: int) -> None:
        now = self.rt._clock()
        for s in self.sources:
            s.control.put(Trigger(cid, now))

    def _offer_compactions(self, found: list[RegisteredCompaction]) -> None:
        for op in self.operators:
            if isinstance(op, KeyedOperator):
                mine = [c for c in found if (c.operator, c.subtask) == op.slot]
                if mine:
                    op.offer_compactions(mine)

    def _notify(self, cid: int, completed: bool) -> None:
        # An abort after an unknown commit outcome may still be a recorded checkpoint:
        # writers must then keep its segments, so only known aborts reset them.
        message = Notify(cid, completed, not completed and cid in self.coordinator.aborted)
        for gate in self.gates.values():
            gate.put_control(message)

    # -- wiring ----------------------------------------------------------------------------
    def build(
        self, storage: ChangelogStorage, attempt: int, latest: CompletedCheckpoint | None
    ) -> None:
        g, o = self.graph, self.rt.options
        debloat = None if o.debloat_target_s is None else DebloatOptions(o.debloat_target_s)
        offsets: dict[tuple[str, int], int] = {}  # (target, edge index) -> first channel
        for node in g.nodes:
            if isinstance(node, SourceNode):
                continue
            channels, inputs = 0, []
            for k, e in enumerate(g.inputs_of(node.name)):
                offsets[(node.name, k)] = channels
                width = 1 if e.forward(g) else g.node(e.source).parallelism
                channels += width
                inputs += [e.input] * width
            for i in range(node.parallelism):
                self.gates[(node.name, i)] = InputGate(
                    channels,
                    o.buffer_max_records,
                    o.barrier_mode,
                    o.aligned_timeout_s,
                    debloat,
                    self.rt._clock,
                    inputs,
                )
        self._commit_restored_sinks(latest)
        for node in g.nodes:
            for i in range(node.parallelism):
                writer = RecordWriter(self._outputs(node.name, i, offsets))
                if isinstance(node, SourceNode):
                    self.sources.append(SourceTask(self.env, node, i, writer, latest))
                    continue
                op = self._operator(node, i, storage, attempt, latest)
                self.operators.append(op)
                replay = self._replay_of(node, i, latest)
                gate = self.gates[(node.name, i)]
                self.streams.append(StreamTask(self.env, node.name, i, gate, writer, op, replay))

    def _outputs(
        self, name: str, subtask: int, offsets: dict[tuple[str, int], int]
    ) -> list[Output]:
        g = self.graph
        outputs = []
        for e in g.outputs_of(name):
            target = g.node(e.target)
            k = g.inputs_of(e.target).index(e)
            base = offsets[(e.target, k)]
            if e.forward(g):
                targets = [self.gates[(e.target, subtask)].inbox]
                channel = base
            else:
                targets = [self.gates[(e.target, j)].inbox for j in range(target.parallelism)]
                channel = base + subtask
            max_par = target.max_parallelism if isinstance(target, KeyedNode) else 1
            outputs.append(Output(e, targets, channel, max_par))
        return outputs

    def _operator(
        self,
        node: KeyedNode | SinkNode,
        subtask: int,
        storage: ChangelogStorage,
        attempt: int,
        latest: CompletedCheckpoint | None,
    ) -> Operator:
        rt = self.rt
        if isinstance(node, SinkNode):
            publisher = node.sink.publisher(rt.options.storage_options)
            return SinkOperator(
                node, subtask, self.graph.job_id, self.fileio, publisher, self.uploader
            )
        return KeyedOperator(
            node,
            subtask,
            self.graph.job_id,
            rt.options,
            storage,
            self.fileio,
            attempt,
            latest,
            rt._clock,
            rt._processing_ms,
            self.uploader,
        )

    def _replay_of(
        self, node: KeyedNode | SinkNode, subtask: int, latest: CompletedCheckpoint | None
    ) -> list[ChannelState]:
        """The restored channel state this subtask replays: a keyed operator reads every
        old subtask's (it keeps its key groups), a sink subtask those of the old subtasks
        ``i`` with ``i % parallelism == subtask``."""
        if latest is None:
            return []
        out = []
        for s in latest.states_of(node.name):
            if isinstance(node, SinkNode) and s.subtask % node.parallelism != subtask:
                continue
            for h in s.handles:
                if isinstance(h, ChannelStateHandle):
                    out.append(read_channel_state(self.fileio, h))
        return out

    def _commit_restored_sinks(self, latest: CompletedCheckpoint | None) -> None:
        """Publish what the restored checkpoint pre-committed (idempotent), before any
        task runs: those records are before the checkpoint, their commit was pending."""
        if latest is None:
            return
        for node in self.graph.nodes:
            if not isinstance(node, SinkNode):
                continue
            staged = [
                h
                for s in latest.states_of(node.name)
                for h in s.handles
                if isinstance(h, SinkTransactionHandle)
            ]
            if not staged:
                continue
            publisher = node.sink.publisher(self.rt.options.storage_options)
            try:
                for h in staged:
                    publish_staged(self.fileio, publisher, h)
            finally:
                publisher.close()

    # -- running -----------------------------------------------------------------------------
    def start(self) -> None:
        tasks: list[SourceTask | StreamTask] = [*self.sources, *self.streams]
        for t in tasks:
            self.threads[t.name] = threading.Thread(target=t.run, name=t.name, daemon=True)
        for thread in self.threads.values():
            thread.start()

    def stop(self) -> None:
        """Stop every task: downstream first, so an upstream task blocked on a full inbox
        is released (a closed inbox drops what it gets) and reaches its own stop."""
        for s in self.sources:
            s.control.put(Stop())
        for t in self.streams:
            t.gate.put_control(Stop())
        for t in reversed(self.streams):
            thread = self.threads.get(t.name)
            if thread is not None:
                thread.join(timeout=30)
            t.gate.close()
        for s in self.sources:
            thread = self.threads.get(s.name)
            if thread is not None:
                thread.join(timeout=30)
        self.uploader.close()  # after the tasks: their operators closed their uploads

    def close_operators(self) -> None:
        """Release what operators built before a failed start hold."""
        for op in self.operators:
            op.close()
        self.uploader.close()
