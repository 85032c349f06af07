"""The task threads of the embedded runtime: sources, keyed operators, the sink.

Each task owns its thread, its input gate and (operators) its state backend,
materialization scheduler and user function. Tasks talk to the coordinator only through
its thread-safe ``acknowledge``/``decline``, and receive triggers, notifications and the
stop message as control elements of their inboxes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import (
    KeyGroupRange,
    key_group_for,
    subtask_for_key_group,
)
from backends.restore import restore_changelog_backend
from backends.rocksdb import RocksDBKeyedStateBackend
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
from coordinator.checkpoint import CheckpointCoordinator
from coordinator.functions import KeyedRunner
from coordinator.metadata import CompletedCheckpoint, SubtaskState
from coordinator.sink import SinkTransactionHandle, TransactionalFileSink, commit
from dstl.changelog import ChangelogStorage
from dstl.errors import (
    ConfigError,
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

if TYPE_CHECKING:
    from coordinator.runtime import EmbeddedRuntime

log = logging.getLogger(__name__)


def _wall_ms() -> int:
    """The processing-time clock of keyed functions: epoch milliseconds."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Trigger:
    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class Notify:
    checkpoint_id: int
    completed: bool
    known_abort: bool = False  # an abort whose record surely did not land


class Stop:
    pass


def post_stop(gate: InputGate, thread: threading.Thread) -> None:
    """Deliver a stop message unless the receiving thread is already gone."""
    while thread.is_alive():
        try:
            gate.inbox.put((CONTROL, Stop()), timeout=0.05)
            return
        except queue.Full:
            continue


class SourceTask:
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
        if isinstance(msg, Stop):
            return False
        if isinstance(msg, Trigger):
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
                # Pacing a generated source: wait on the control queue, not in a sleep, so a
                # checkpoint trigger is handled at once (a sleep of a whole batch at a low
                # rate delayed every barrier by up to that long: 0.85 s at 300 records/s).
                while (
                    ahead := (self.offset - start_offset) / spec.rate_per_s
                    - (time.monotonic() - start)
                ) > 0:
                    try:
                        msg = self.control.get(timeout=ahead)
                    except queue.Empty:
                        break
                    if not self._handle(msg):
                        return


class OperatorTask:
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
        self._replay = in_flight_of(fileio, latest, spec.name)
        self._unaligned: dict[int, tuple[Future[KeyedStateHandle], float]] = {}
        self.materializer = (
            self.full.materializer
            if self.full is not None
            else Materializer(
                self.backend, fileio, rt.pipeline.job_id, spec.name, subtask, rt._clock
            )
        )
        self.function = spec.function()
        self.runner = KeyedRunner(self.function, self.backend, _wall_ms)
        self.runner.open()
        # Periodic, jittered, skipped when idle or in flight; fails the task after
        # max_consecutive_failures failures in a row. Uploads on its own named thread.
        self.materialization = MaterializationScheduler(
            self.materializer,
            MaterializationOptions(interval_s=rt.options.materialization_interval_s),
            clock=rt._clock,
            name=self.name,
        )
        self.materializations = 0
        self.compactions_adopted = 0
        self._compactions_seen = 0  # the highest registered compaction id looked at
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
            if isinstance(self.backend, ChangelogKeyedStateBackend):
                self.backend.writer.close()  # frees its change buffers now, not at a GC

    def _replay_in_flight(self) -> None:
        """Process the restored in-flight records of this subtask's key groups first."""
        spec = self.rt.pipeline.operator
        mine = KeyGroupRange.for_subtask(self.subtask, spec.parallelism, spec.max_parallelism)
        serialize = spec.key_serializer.serialize
        out: list[Any] = []
        for batch in self._replay:
            for key, value in batch:
                if key_group_for(serialize(key), spec.max_parallelism) in mine:
                    self.runner.process(key, value, None, out.append)
        if out:
            self.sink_gate.put(self.subtask, out)
        self._replay = []

    def _run(self) -> None:
        self._replay_in_flight()
        runner = self.runner
        out: list[Any] = []
        emit = out.append
        set_key = self.backend.set_current_key
        process = self.function.process
        ctx = runner.context  # set up per batch, not per record: the hot path
        ctx.timestamp, ctx.time_domain = None, None
        while True:
            if (
                self.full is None
                and self.rt.options.materialization == "online"
                and self.materialization.run_once() is not None
            ):
                self.materializations += 1
            runner.advance_processing_time(_wall_ms(), emit)
            item = self.gate.next(timeout=0.05)
            if item is None:
                if out:
                    self.sink_gate.put(self.subtask, out)
                    out = []
                    emit = out.append
                continue
            channel, element = item
            if channel != CONTROL:
                ctx.emit, ctx.timestamp, ctx.time_domain = emit, None, None
                for key, value in element:
                    set_key(key)
                    ctx.key = key
                    process(key, value, ctx)
                if out:
                    self.sink_gate.put(self.subtask, out)
                    out = []
                    emit = out.append
                continue
            if isinstance(element, Stop):
                return
            if isinstance(element, Barrier):
                self._checkpoint(element.checkpoint_id)
            elif isinstance(element, InFlightData):
                self._in_flight_done(element)
            elif isinstance(element, Notify):
                self._notified(element)
            elif isinstance(element, CancelledBarrier):
                self._unaligned.pop(element.checkpoint_id, None)
                assert self.coordinator is not None
                self.coordinator.decline(
                    element.checkpoint_id,
                    (self.rt.pipeline.operator.name, self.subtask),
                    "alignment cancelled",
                )

    def _notified(self, message: Notify) -> None:
        if self.full is not None:
            if message.completed:
                self.full.notify_checkpoint_complete(message.checkpoint_id)
            else:
                self.full.notify_checkpoint_aborted(message.checkpoint_id)
        elif isinstance(self.backend, ChangelogKeyedStateBackend):
            if message.completed:
                self.backend.writer.confirm(message.checkpoint_id)
                self.materialization.on_checkpoint_complete(message.checkpoint_id)
            elif message.known_abort:
                self.backend.writer.reset(message.checkpoint_id)
                self.materialization.on_checkpoint_aborted(message.checkpoint_id)

    def _adopt_compaction(self) -> None:
        """Rest this subtask's state on the newest offline compaction registered for it
        since the last look, if the backend accepts it (``adopt``: not older than its
        base, nothing its history lacks). At a barrier, before the checkpoint, so that
        the checkpoint references it; the metadata store decides the registration when
        the checkpoint is recorded (:mod:`coordinator.compactions`)."""
        assert self.coordinator is not None
        if not isinstance(self.backend, ChangelogKeyedStateBackend):
            return
        try:
            found = self.coordinator.store.pending_compactions(
                self.rt.pipeline.job_id,
                self.rt.pipeline.operator.name,
                self.subtask,
                self._compactions_seen,
            )
        except MetadataStoreError as exc:  # looked at again at the next barrier
            log.warning("compactions not looked up task=%s error=%s", self.name, exc)
            return
        self._compactions_seen = max([self._compactions_seen, *(c.compaction_id for c in found)])
        for c in found:  # newest source first
            if self.backend.adopt(c.handle):
                self.compactions_adopted += 1
                log.info("compaction adopted task=%s id=%d", self.name, c.compaction_id)
                return

    def _checkpoint(self, checkpoint_id: int) -> None:
        started = time.monotonic()
        self._adopt_compaction()
        mat = self.materialization.last_applied if self.full is None else self.full.last_stats
        if mat is not None and mat.materialization_id != self._reported_materialization:
            self._reported_materialization = mat.materialization_id
            self._materialization_stats = mat.to_dict()
        else:
            self._materialization_stats = None
        if self.full is None:
            self.materialization.on_barrier(checkpoint_id)
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


class SinkTask:
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
        self._replay = in_flight_of(fileio, latest, spec.name)
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
            if isinstance(element, Stop):
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
            elif isinstance(element, Notify) and element.completed:
                self.sink.commit_up_to(element.checkpoint_id)


def carries_in_flight(checkpoint: CompletedCheckpoint) -> bool:
    """Whether an (unaligned) checkpoint persisted in-flight records anywhere."""
    return any(isinstance(h, ChannelStateHandle) for s in checkpoint.subtasks for h in s.handles)


def in_flight_of(
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
