"""What a stream task runs: a keyed operator (one or two inputs) or a transactional sink.

Both offer the same small surface to :class:`~coordinator.embedded.tasks.StreamTask`:
``process(input, batch)``, ``replay(channel_state)``, ``on_watermark``, ``tick`` (periodic
work: materialization, processing-time timers), ``snapshot(checkpoint_id)`` (a future of
the handles to acknowledge), ``notified``, ``close``; output goes to ``out`` as
``(value, timestamp)`` pairs. Task thread only, except the materializer's upload thread
and the backend's checkpoint futures, which only complete futures.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange, key_group_for
from backends.restore import restore_changelog_backend
from backends.rocksdb import RocksDBKeyedStateBackend
from coordinator.compactions import RegisteredCompaction
from coordinator.embedded.channel_state import ChannelState
from coordinator.embedded.pipeline import KeyedNode, SinkNode
from coordinator.functions import KeyedRunner
from coordinator.metadata import CompletedCheckpoint
from coordinator.options import RuntimeOptions
from coordinator.sink import Publisher, TransactionalSink
from dstl.changelog import ChangelogStorage
from dstl.fileio import FileIO
from dstl.upload import Uploader
from materializer import (
    FullSnapshotCheckpointer,
    MaterializationOptions,
    MaterializationScheduler,
    Materializer,
    restore_full_backend,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Notify:
    """Checkpoint ``checkpoint_id`` completed or was aborted (``known_abort``: its record
    surely did not land)."""

    checkpoint_id: int
    completed: bool
    known_abort: bool = False


def _mapped(future: Future[Any], fn: Callable[[Any], tuple[Any, ...]]) -> Future[tuple[Any, ...]]:
    out: Future[tuple[Any, ...]] = Future()

    def done(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(fn(f.result()))

    future.add_done_callback(done)
    return out


def done_future(value: tuple[Any, ...]) -> Future[tuple[Any, ...]]:
    """A future that already has ``value``."""
    f: Future[tuple[Any, ...]] = Future()
    f.set_result(value)
    return f


class KeyedOperator:
    """One subtask of a keyed operator: its backend (restored), materializer and function.

    Records arrive keyed (:data:`~coordinator.functions.KeyedRecord`): the key was
    serialized and hashed by the sender. A two-input operator calls ``process1`` for
    input 0 and ``process2`` for input 1.
    """

    def __init__(
        self,
        node: KeyedNode,
        subtask: int,
        job_id: str,
        options: RuntimeOptions,
        storage: ChangelogStorage,
        fileio: FileIO,
        attempt: int,
        latest: CompletedCheckpoint | None,
        clock: Callable[[], float],
        processing_ms: Callable[[], int],
        uploader: Uploader,
    ) -> None:
        self.node = node
        self._job_id = job_id
        self.slot = (node.name, subtask)
        self._subtask = subtask
        self._online = options.materialization == "online"
        self._offered: queue.SimpleQueue[list[RegisteredCompaction]] = queue.SimpleQueue()
        self._timings: dict[str, float] = {}
        self._persist_timings: dict[str, float] = {}
        self.compactions_adopted = 0
        self.key_groups = KeyGroupRange.for_subtask(subtask, node.parallelism, node.max_parallelism)
        backend_id = f"{node.name}-{subtask}-a{attempt:04d}"
        inner: HeapKeyedStateBackend | RocksDBKeyedStateBackend
        if options.state_backend == "rocksdb":
            local = options.local_dir
            path = None if local is None else os.path.join(local, job_id, backend_id)
            inner = RocksDBKeyedStateBackend(
                node.key_serializer, self.key_groups, node.max_parallelism, path=path
            )
        else:
            inner = HeapKeyedStateBackend(
                node.key_serializer, self.key_groups, node.max_parallelism
            )
        self.inner = inner
        handles = (
            []
            if latest is None
            else [
                h
                for s in latest.states_of(node.name)
                for h in s.handles
                if isinstance(h, KeyedStateHandle)
            ]
        )
        self.backend: ChangelogKeyedStateBackend | FullSnapshotCheckpointer
        self.full: FullSnapshotCheckpointer | None = None
        if options.changelog_enabled:
            self.backend = ChangelogKeyedStateBackend(inner, storage.create_writer(backend_id))
            restore_changelog_backend(self.backend, fileio, handles)
        else:  # restores changelog and full checkpoints alike
            self.backend = self.full = FullSnapshotCheckpointer(
                inner, fileio, job_id, node.name, subtask, backend_id, clock, uploader=uploader
            )
            restore_full_backend(self.full, fileio, handles)
        self.materializer = (
            self.full.materializer
            if self.full is not None
            else Materializer(
                self.backend, fileio, job_id, node.name, subtask, clock, uploader=uploader
            )
        )
        # Periodic, jittered, early when the log outgrows its bound, skipped when idle or
        # in flight; fails the task after max_consecutive_failures failures in a row.
        # Uploads on its own named thread.
        self.materialization = MaterializationScheduler(
            self.materializer,
            MaterializationOptions(
                interval_s=options.materialization_interval_s,
                max_log_ratio=options.materialization_max_log_ratio,
            ),
            clock=clock,
            name=f"{node.name}-{subtask}",
        )
        self.materializations = 0
        self._reported_materialization = 0  # id of the last one put into checkpoint stats
        self.final_entries = 0
        self.function = node.function()
        self.runner = KeyedRunner(self.function, self.backend, processing_ms)
        self.runner.open()
        self._processing_ms = processing_ms
        self.out: list[tuple[Any, int | None]] = []
        ctx = self.runner.context
        append = self.out.append

        def emit(value: Any) -> None:  # output keeps the time of what caused it
            append((value, ctx.timestamp))

        self._emit = emit
        f = self.function
        self._handlers = (f.process1, f.process2) if node.two_input else (f.process,)

    def process(self, input_: int, batch: list[Any]) -> None:
        """Records of ``input_`` (already keyed)."""
        self.runner.process_keyed(batch, self._emit, self._handlers[input_])

    def replay(self, state: ChannelState) -> None:
        """Restored in-flight records: those of this subtask's key groups."""
        mine = self.key_groups
        max_par = self.node.max_parallelism
        serialize = self.node.key_serializer.serialize
        for input_, batch in state.entries:
            if state.legacy:  # (key, value) pairs of the one-input runtime
                records = []
                for key, value in batch:
                    kb = serialize(key)
                    records.append((key, kb, key_group_for(kb, max_par), value, None))
                batch = records
            self.process(input_, [r for r in batch if r[2] in mine])

    def on_watermark(self, watermark: int) -> None:
        """Fire the event-time timers the watermark passed."""
        self.runner.advance_watermark(watermark, self._emit)

    def tick(self) -> None:
        """Materialize when due (online); fire due processing-time timers."""
        if self.full is None and self._online and self.materialization.run_once() is not None:
            self.materializations += 1
        self.runner.advance_processing_time(self._processing_ms(), self._emit)

    def snapshot(self, checkpoint_id: int) -> Future[tuple[Any, ...]]:
        """Persist the state up to now (async); the future gets the handles."""
        started = time.perf_counter()
        self._adopt_compaction()
        self._timings = {"compaction_check_ms": round((time.perf_counter() - started) * 1e3, 3)}
        if self.full is None:
            self.materialization.on_barrier(checkpoint_id)
        future = _mapped(self.backend.checkpoint(checkpoint_id), lambda h: (h,))
        if isinstance(self.backend, ChangelogKeyedStateBackend):
            self._persist_timings = self.backend.writer.last_persist_timings()
        return future

    def snapshot_timings(self) -> list[dict[str, float]]:
        """Where the last :meth:`snapshot` spent its time (ms): the compaction check and,
        with the changelog, the persist's steps (see
        :meth:`~dstl.changelog.ChangelogWriter.last_persist_timings`). The dicts are
        filled until the snapshot's future completes: merge them after that."""
        return [self._timings, self._persist_timings]

    def offer_compactions(self, found: list[RegisteredCompaction]) -> None:
        """Offline compactions of this subtask, newest source first, registered since the
        last offer: looked at at the next barrier. Any thread (the coordinator's offers
        them right before it injects that barrier)."""
        self._offered.put(found)

    def _adopt_compaction(self) -> None:
        """Rest this subtask's state on the newest offline compaction offered for it since
        the last barrier, if the backend accepts it (``adopt``: not older than its base,
        nothing its history lacks). At a barrier, before the checkpoint, so that the
        checkpoint references it; the metadata store decides the registration when the
        checkpoint is recorded (:mod:`coordinator.compactions`). No I/O: the coordinator
        looked them up when it triggered the checkpoint."""
        if self._offered.empty():
            return
        found: list[RegisteredCompaction] = []
        while not self._offered.empty():
            found = self._offered.get_nowait() + found  # the newest offer first
        if not isinstance(self.backend, ChangelogKeyedStateBackend):
            return
        name = self.node.name
        for c in found:  # newest source first
            if self.backend.adopt(c.handle):
                self.compactions_adopted += 1
                log.info(
                    "compaction adopted task=%s-%d id=%d", name, self._subtask, c.compaction_id
                )
                return

    def checkpoint_stats(self) -> dict[str, Any]:
        """A new materialization's statistics, once, for the first checkpoint using it."""
        mat = self.materialization.last_applied if self.full is None else self.full.last_stats
        if mat is None or mat.materialization_id == self._reported_materialization:
            return {}
        self._reported_materialization = mat.materialization_id
        return {"materialization": mat.to_dict()}

    def notified(self, message: Notify) -> None:
        """Confirm or reset the log and the materializer."""
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

    def close(self) -> None:
        """Stop the materializer, release the store and the log writer's buffers."""
        self.materialization.close()
        if self.full is not None:
            self.full.close()
        self.final_entries = self.inner.entry_count()
        self.inner.close()
        if isinstance(self.backend, ChangelogKeyedStateBackend):
            self.backend.writer.close()  # frees its change buffers now, not at a GC


class SinkOperator:
    """One subtask of a transactional sink."""

    def __init__(
        self,
        node: SinkNode,
        subtask: int,
        job_id: str,
        fileio: FileIO,
        publisher: Publisher,
        uploader: Uploader,
    ) -> None:
        self.node = node
        self.sink = TransactionalSink(fileio, publisher, job_id, node.name, subtask, uploader)
        self.out: list[tuple[Any, int | None]] = []  # a sink emits nothing

    def process(self, input_: int, batch: list[Any]) -> None:
        """``(value, timestamp)`` pairs into the current transaction."""
        self.sink.write([value for value, _ in batch])

    def replay(self, state: ChannelState) -> None:
        """Restored in-flight records (rows, in a file of the one-input runtime)."""
        for _, batch in state.entries:
            if state.legacy:
                self.sink.write(batch)
            else:
                self.process(0, batch)

    def on_watermark(self, watermark: int) -> None:
        """Nothing: a sink has no timers."""

    def tick(self) -> None:
        """Nothing periodic."""

    def snapshot(self, checkpoint_id: int) -> Future[tuple[Any, ...]]:
        """Stage the current transaction (durable before it returns)."""
        return done_future(self.sink.pre_commit(checkpoint_id))

    def checkpoint_stats(self) -> dict[str, Any]:
        """No statistics of its own."""
        return {}

    def snapshot_timings(self) -> list[dict[str, float]]:
        """None: staging is synchronous (the task's ``snapshot_ms``)."""
        return []

    def notified(self, message: Notify) -> None:
        """Publish the staged transactions the completed checkpoint covers."""
        if message.completed:
            self.sink.commit_up_to(message.checkpoint_id)

    def close(self) -> None:
        """Release the publisher's connections."""
        self.sink.publisher.close()


Operator = KeyedOperator | SinkOperator
