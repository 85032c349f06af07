"""The task threads of the embedded runtime: sources and stream tasks.

A :class:`SourceTask` reads a replayable source, stamps event time, emits watermarks and
injects barriers when the coordinator triggers a checkpoint. A :class:`StreamTask` reads
its input gate and runs an operator (keyed, two-input keyed, or a sink), forwards
watermarks and barriers, snapshots, and acknowledges. Each task owns its thread, its
reader or gate, its operator and its :class:`~coordinator.embedded.writer.RecordWriter`;
tasks talk to the coordinator only through its thread-safe ``acknowledge``/``decline``,
and receive triggers, notifications and the stop message as control messages.

A task blocked on a full downstream inbox still takes a checkpoint that need not wait for
its input (an unaligned barrier, an alignment that timed out): the writer's wait hook
asks the gate (:meth:`~coordinator.embedded.gate.InputGate.urgent`), or a source its
control queue, and snapshots right there, between two sends of a flush.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from coordinator.checkpoint import CheckpointCoordinator
from coordinator.embedded.channel_state import ChannelState, write_channel_state
from coordinator.embedded.channels import (
    CONTROL,
    Barrier,
    CancelledBarrier,
    EndOfInput,
    InFlightData,
    Watermark,
)
from coordinator.embedded.gate import InputGate
from coordinator.embedded.operators import Notify, Operator
from coordinator.embedded.pipeline import SourceNode
from coordinator.embedded.sources import MAX_WATERMARK, SourceReader
from coordinator.embedded.writer import RecordWriter
from coordinator.handles import ChannelStateHandle
from coordinator.metadata import CompletedCheckpoint, SubtaskState
from coordinator.options import BarrierMode, RuntimeOptions
from dstl.fileio import FileIO
from dstl.gil import yield_to_critical
from dstl.upload import Uploader

URGENT_POLL_S = 0.002
"""How often a task blocked on output checks for an urgent checkpoint."""


@dataclass(frozen=True, slots=True)
class JobEnv:
    """What every task of one run shares: the job, its options, the clocks, the store,
    the coordinator and the runtime's callbacks (``fail``, ``source_finished``: any
    thread)."""

    job_id: str
    options: RuntimeOptions
    clock: Callable[[], float]
    fileio: FileIO
    coordinator: CheckpointCoordinator
    fail: Callable[[BaseException], None]
    source_finished: Callable[[], None]
    uploader: Uploader

    def urgent_capable(self) -> bool:
        """Whether a checkpoint may have to start while a task is blocked on output."""
        o = self.options
        return o.barrier_mode is BarrierMode.UNALIGNED or (
            o.barrier_mode is BarrierMode.ALIGNED and o.aligned_timeout_s is not None
        )


@dataclass(frozen=True, slots=True)
class Trigger:
    """Start checkpoint ``checkpoint_id`` (triggered at ``triggered_at``, runtime clock)."""

    checkpoint_id: int
    triggered_at: float


class Stop:
    """End the task now."""


class Finish:
    """A source stops reading (a graceful stop); the job then takes its final checkpoint."""


class SourceTask:
    """One source subtask. Its own thread; ``control`` is its mailbox (any thread puts)."""

    def __init__(
        self,
        env: JobEnv,
        node: SourceNode,
        subtask: int,
        writer: RecordWriter,
        latest: CompletedCheckpoint | None,
    ) -> None:
        self.env = env
        self.node = node
        self.subtask = subtask
        self.name = f"{node.name}-{subtask}"
        self.writer = writer
        self.control: queue.Queue[Any] = queue.Queue()
        states = latest.states_of(node.name) if latest is not None else []
        restored = [s.offset for s in states] if states else None
        self.reader: SourceReader = node.source.open(subtask, node.parallelism, restored)
        self._unaligned = env.options.barrier_mode is BarrierMode.UNALIGNED
        if self._unaligned:
            writer.on_wait, writer.poll_s = self._while_blocked, URGENT_POLL_S
        self._stash: deque[Any] = deque()
        self._done = False
        self._max_ts: int | None = None
        self._watermark: int | None = None
        self._emitted = 0

    def run(self) -> None:
        """The thread's body."""
        try:
            self._run()
        except BaseException as exc:
            self.env.fail(exc)
        finally:
            self.reader.close()

    def _run(self) -> None:
        batch_size = self.env.options.source_batch
        started = time.monotonic()
        while True:
            if not self._poll(None if self._done else 0):
                return
            if self._done:
                continue
            yield_to_critical()
            batch = self.reader.read(min(batch_size, self.writer.batch_hint()))
            if batch is None:
                self._finish(final_watermark=True)
            elif not batch:  # an unbounded source with nothing right now
                if not self._poll(0.01):
                    return
            else:
                self._emit(batch)
                if self.node.rate_per_s and not self._pace(started):
                    return

    def _poll(self, timeout: float | None) -> bool:
        """Handle mailbox messages (waiting up to ``timeout`` for the first); False: stop."""
        while True:
            if self._stash:
                msg = self._stash.popleft()
            else:
                try:
                    msg = (
                        self.control.get(timeout=timeout)
                        if timeout != 0
                        else self.control.get_nowait()
                    )
                except queue.Empty:
                    return True
            timeout = 0
            if isinstance(msg, Stop):
                return False
            if isinstance(msg, Trigger):
                self._trigger(msg)
            elif isinstance(msg, Finish):
                self._finish(final_watermark=False)

    def _pace(self, started: float) -> bool:
        # Pacing a generated source: wait on the mailbox, not in a sleep, so a checkpoint
        # trigger is handled at once (a sleep of a whole batch at a low rate delayed every
        # barrier by up to that long: 0.85 s at 300 records/s).
        assert self.node.rate_per_s
        while (ahead := self._emitted / self.node.rate_per_s - (time.monotonic() - started)) > 0:
            try:
                msg = self.control.get(timeout=ahead)
            except queue.Empty:
                return True
            self._stash.append(msg)
            if not self._poll(0):
                return False
            if self._done:
                return True
        return True

    def _emit(self, batch: list[Any]) -> None:
        strategy = self.node.watermarks
        if strategy is None:
            self.writer.write([(r, None) for r in batch])
            self.writer.flush()
        else:
            stamp = strategy.timestamp
            pairs = [(r, stamp(r)) for r in batch]
            self.writer.write(pairs)
            self.writer.flush()
            high = max(ts for _, ts in pairs)
            if self._max_ts is None or high > self._max_ts:
                self._max_ts = high
                self._broadcast_watermark(strategy.watermark(high))
        self._emitted += len(batch)

    def _broadcast_watermark(self, watermark: int) -> None:
        if self._watermark is None or watermark > self._watermark:
            self._watermark = watermark
            self.writer.broadcast(Watermark(watermark))

    def _finish(self, final_watermark: bool) -> None:
        if self._done:
            return
        self._done = True
        if final_watermark:  # a bounded input ended: every event-time timer is due
            self._broadcast_watermark(MAX_WATERMARK)
        self.writer.flush()
        self.env.source_finished()

    def _trigger(self, msg: Trigger) -> None:
        barrier = Barrier(msg.checkpoint_id, msg.triggered_at, self._unaligned)
        position = self.reader.position()
        if self._unaligned:
            self.writer.broadcast_priority(barrier)
        else:
            self.writer.broadcast(barrier)
        self.env.coordinator.acknowledge(
            msg.checkpoint_id, SubtaskState(self.node.name, self.subtask, offset=position)
        )

    def _while_blocked(self) -> None:
        """Wait hook (unaligned): a trigger starts its checkpoint now, the records read so
        far (the blocked batch too) before its barrier; other messages wait."""
        while True:
            try:
                msg = self.control.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Trigger):
                self._trigger(msg)
            else:
                self._stash.append(msg)


class StreamTask:
    """One subtask of a keyed operator or a sink: its gate, operator and writer.

    Task thread only, except the operator's asynchronous snapshot, whose completion only
    calls the coordinator's thread-safe ``acknowledge``/``decline``.
    """

    def __init__(
        self,
        env: JobEnv,
        name: str,
        subtask: int,
        gate: InputGate,
        writer: RecordWriter,
        operator: Operator,
        replay: list[ChannelState],
    ) -> None:
        self.env = env
        self.node_name = name
        self.subtask = subtask
        self.name = f"{name}-{subtask}"
        self.gate = gate
        self.writer = writer
        self.operator = operator
        self._replay = replay
        self._unaligned: dict[int, tuple[Future[tuple[Any, ...]], float, dict[str, Any]]] = {}
        if env.urgent_capable():
            writer.on_wait, writer.poll_s = self._while_blocked, URGENT_POLL_S

    def run(self) -> None:
        """The thread's body."""
        try:
            self._run()
        except BaseException as exc:
            self.env.fail(exc)
        finally:
            self.operator.close()

    def _flush_output(self) -> None:
        out = self.operator.out
        if out:
            self.writer.write(out)
            out.clear()
        self.writer.flush()

    def _run(self) -> None:
        op, gate = self.operator, self.gate
        for state in self._replay:  # restored in-flight records before any new input
            op.replay(state)
            self._flush_output()
        self._replay = []
        inputs = gate.inputs
        while True:
            op.tick()
            if op.out:
                self._flush_output()
            item = gate.next(timeout=0.05)
            if item is None:
                continue
            channel, element = item
            if channel != CONTROL:
                if not isinstance(element, EndOfInput):
                    yield_to_critical()
                    op.process(inputs[channel], element)
                    self._flush_output()
                continue
            if isinstance(element, Stop):
                return
            self._control(element)

    def _control(self, element: Any) -> None:
        if isinstance(element, Watermark):
            self.operator.on_watermark(element.timestamp)
            self._flush_output()
            self.writer.broadcast(element)
        elif isinstance(element, Barrier):
            self._checkpoint(element)
        elif isinstance(element, InFlightData):
            self._in_flight_done(element)
        elif isinstance(element, Notify):
            self.operator.notified(element)
        elif isinstance(element, CancelledBarrier):
            self._unaligned.pop(element.checkpoint_id, None)
            self.gate.stats.pop(element.checkpoint_id, None)
            self.env.coordinator.decline(
                element.checkpoint_id, (self.node_name, self.subtask), "alignment cancelled"
            )

    def _while_blocked(self) -> None:
        """Wait hook: snapshot for an urgent barrier while the output is blocked."""
        barrier = self.gate.urgent()
        if barrier is not None:
            self._checkpoint(barrier)

    def _checkpoint(self, barrier: Barrier) -> None:
        cid = barrier.checkpoint_id
        started = self.env.clock()
        stats = {**self.gate.stats.pop(cid, {}), **self.operator.checkpoint_stats()}
        future = self.operator.snapshot(cid)
        stats["snapshot_ms"] = round((self.env.clock() - started) * 1e3, 3)
        stats["timings"] = self.operator.snapshot_timings()
        if barrier.unaligned:
            self.writer.broadcast_priority(barrier)
            self._unaligned[cid] = (future, started, stats)  # acked with its in-flight data
        else:
            self.writer.broadcast(barrier)
            self._ack_when_done(cid, future, started, stats, ())

    def _in_flight_done(self, data: InFlightData) -> None:
        entry = self._unaligned.pop(data.checkpoint_id, None)
        if entry is None:
            return
        future, started, stats = entry
        stats.update(self.gate.stats.pop(data.checkpoint_id, {}))
        inputs = self.gate.inputs
        entries = [(inputs[c], batch) for c, batch in data.batches if isinstance(batch, list)]
        extra: tuple[ChannelStateHandle, ...] = ()
        if entries:
            handle = write_channel_state(
                self.env.uploader,
                self.env.job_id,
                self.node_name,
                self.subtask,
                data.checkpoint_id,
                entries,
            )
            stats["channel_state_bytes"] = handle.size_bytes
            extra = (handle,)
        self._ack_when_done(data.checkpoint_id, future, started, stats, extra)

    def _ack_when_done(
        self,
        checkpoint_id: int,
        future: Future[tuple[Any, ...]],
        started: float,
        stats: dict[str, Any],
        extra: tuple[ChannelStateHandle, ...],
    ) -> None:
        env, name, subtask = self.env, self.node_name, self.subtask

        def done(f: Future[tuple[Any, ...]]) -> None:
            exc = f.exception()
            if exc is not None:
                env.coordinator.decline(checkpoint_id, (name, subtask), str(exc))
                return
            stats["async_ms"] = round((env.clock() - started) * 1e3, 3)
            for timings in stats.pop("timings", ()):  # complete now (see snapshot_timings)
                stats.update(timings)
            if extra:
                stats["in_flight_records"] = sum(h.records for h in extra)
            env.coordinator.acknowledge(
                checkpoint_id, SubtaskState(name, subtask, (*f.result(), *extra), stats=stats)
            )

        future.add_done_callback(done)


def post_stop(gate: InputGate, thread: threading.Thread) -> None:
    """Deliver a stop message unless the receiving thread is already gone."""
    if thread.is_alive():
        gate.put_control(Stop())
