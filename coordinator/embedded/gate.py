"""The input gate: barrier handling across a task's input channels, watermarks, debloating.

The gate reads the task's :class:`~coordinator.embedded.channels.Inbox` and hands the task
records, the combined watermark, and the checkpoint events of the barrier mode:

- Aligned (exactly once; seed 002, Flink's ``CheckpointBarrierAligner``): once a barrier
  arrived on a channel, that channel's later items are held back until the barrier
  arrived on every live channel; then the barrier goes to the task and the held items
  follow in arrival order. With two inputs the gate spans both (seed 004: the input whose
  barrier came first is blocked until the other's arrives).
- Aligned with a timeout (FLIP-76, ``checkpoint.aligned-timeout-s``): when the alignment
  is still running ``timeout`` after the checkpoint was triggered (or an upstream task
  already switched and sent its barrier unaligned), the checkpoint becomes unaligned at
  this gate for the rest of it: the barrier goes to the task at once, the held items
  follow (they are after the barrier), and the items of the channels whose barrier is
  still ahead are captured as in flight.
- Unaligned (exactly once, FLIP-76): barriers arrive on the priority lane and overtake
  every queued item; the first one starts the checkpoint at once, with capture as above.
  The same code as a timeout of zero.
- At-least-once (Flink's ``CheckpointBarrierTracker``): nothing is blocked; the barrier
  goes to the task once it arrived on every live channel.

A capture ends when every live channel delivered all its items before the barrier; then
the task gets :class:`~coordinator.embedded.channels.InFlightData`. When the barrier of
every channel still owing items is already queued (or its position is known from a
priority barrier), the in-flight items are copied from the inbox at once instead of
waiting for the task to work off the backlog, as FLIP-76 persists buffers directly.

Per checkpoint the gate measures (in :attr:`InputGate.stats`): start delay (trigger to
first barrier here), alignment duration (first barrier to the task's snapshot), records
in flight (aligned: what arrived on the other channels while aligning; unaligned: what
was captured) and their bytes, and the records and bytes queued ahead of an in-band
barrier when it was sent (the most over its channels: the data it waited behind here).
Bytes are estimated from sampled serialized batch sizes.

Thread ownership: everything here belongs to the receiving task thread, except
:attr:`InputGate.inbox`, which is thread-safe.
"""

from __future__ import annotations

import math
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.embedded.channels import (
    CONTROL,
    MIN_CAPACITY_RECORDS,
    Barrier,
    CancelledBarrier,
    EndOfInput,
    Inbox,
    InFlightData,
    Lane,
    Watermark,
)
from coordinator.functions import MIN_WATERMARK
from coordinator.options import BarrierMode

DEFAULT_CAPACITY_RECORDS = 16_384
"""The bound of an inbox without debloating (64 batches of 256 records, as before)."""

INITIAL_DEBLOATED_RECORDS = 64
"""A debloated inbox's capacity before its first measurement."""

_SAMPLE_EVERY = 64  # one record batch in this many is pickled to estimate bytes per record


@dataclass(frozen=True, slots=True)
class DebloatOptions:
    """Buffer debloating (FLIP-183): keep about ``target_s`` seconds of the receiver's
    measured throughput in its inbox, re-sized every ``period_s``, never below
    :data:`MIN_CAPACITY_RECORDS` or above the fixed bound. The throughput is the ratio
    of records to busy time, both summed with an exponential decay of time constant
    ``window_s`` (so the estimate weighs periods by their length)."""

    target_s: float = 0.01
    period_s: float = 0.05
    window_s: float = 0.5


class _Debloater:
    """Measures the receiver's throughput (records per busy second) and sizes the inbox.

    Task thread only. Busy time excludes the time the task waited for input (an idle
    task's capacity follows what it could process, not what it was sent) and includes
    the time it was blocked on output: under backpressure the rate is what the task
    actually drains, so ``target_s`` of it is ``target_s`` of waiting for a barrier.

    The estimate is ``records / busy`` over decayed sums, not a smoothed average of
    per-period ratios: a task that is backpressured works in bursts (a short period that
    drains a batch at full speed, then a long one blocked), and averaging the ratios
    counted the short fast periods as much as the long slow ones (measured: 1.5x the
    real drain rate of a backpressured keyed stage, so its inbox held 1.5 s at a 1 s
    target).
    """

    def __init__(self, inbox: Inbox, options: DebloatOptions, maximum: int, now: float) -> None:
        self.inbox = inbox
        self.options = options
        self.maximum = maximum
        self._start = now
        self._records = 0
        self._idle = 0.0
        self._sum_records = 0.0
        self._sum_busy = 0.0
        self.rate: float | None = None

    def record(self, records: int) -> None:
        self._records += records

    def idle(self, seconds: float) -> None:
        self._idle += seconds

    def tick(self, now: float) -> None:
        elapsed = now - self._start
        if elapsed < self.options.period_s:
            return
        busy = max(0.0, elapsed - self._idle)
        if self._records == 0 and busy < 0.5 * elapsed:
            # Mostly idle and nothing came: no measurement. Counting it shrank an inbox
            # to its minimum while its sender was stalled, and the sender then filled
            # it in small batches when it resumed.
            self._start, self._idle = now, 0.0
            return
        decay = math.exp(-elapsed / self.options.window_s)
        self._sum_records = self._sum_records * decay + self._records
        self._sum_busy = self._sum_busy * decay + busy
        self.rate = self._sum_records / max(self._sum_busy, 1e-6)
        capacity = int(self.rate * self.options.target_s)
        self.inbox.set_capacity(min(self.maximum, max(MIN_CAPACITY_RECORDS, capacity)))
        self._start, self._records, self._idle = now, 0, 0.0


def _emitted_again(element: Any) -> bool:
    """Whether a capture leaves ``element`` out of the in-flight data: watermarks and
    end-of-input markers are not persisted (a restored source emits them again), only
    counted as overtaken (``overtaken_control`` in the subtask's stats)."""
    return isinstance(element, Watermark | EndOfInput)


class InputGate:
    """Handles barriers across ``channels`` input channels in one :class:`BarrierMode`.

    :meth:`next` returns ``(channel, batch)`` records, ``(CONTROL, x)`` for x a
    :class:`Barrier` (the task snapshots now; ``unaligned`` says whether it must wait for
    :class:`InFlightData` before it acknowledges), :class:`CancelledBarrier`,
    :class:`InFlightData`, :class:`Watermark` (the minimum over live channels, when it
    advanced) or a control message, and ``(channel, EndOfInput())`` once every channel
    ended. ``aligned_timeout_s`` (aligned mode only): ``None`` never switches; unaligned
    mode is a timeout of 0. Task thread only (the inbox is thread-safe).
    """

    def __init__(
        self,
        channels: int,
        capacity: int = DEFAULT_CAPACITY_RECORDS,
        mode: BarrierMode = BarrierMode.ALIGNED,
        aligned_timeout_s: float | None = None,
        debloat: DebloatOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        inputs: Sequence[int] | None = None,
    ) -> None:
        self.mode = BarrierMode(mode)
        self.timeout_s = 0.0 if self.mode is BarrierMode.UNALIGNED else aligned_timeout_s
        self.capacity = capacity
        self.inbox = Inbox(channels, capacity)
        self.channels = channels
        #: the input (0 or 1) of each channel: a two-input task has both in one gate
        self.inputs: tuple[int, ...] = tuple(inputs) if inputs is not None else (0,) * channels
        self._clock = clock
        self._live = set(range(channels))
        self._ready: deque[tuple[int, Any]] = deque()
        self._consumed = [0] * channels
        self._watermarks = [MIN_WATERMARK] * channels
        self.watermark = MIN_WATERMARK
        self._last_barrier = 0  # the newest checkpoint started (handed over or given up)
        # the checkpoint in progress: aligning (``_blocked``/``_held``) or capturing
        self._current: Barrier | None = None
        self._capturing = False
        self._blocked: set[int] = set()
        self._held: deque[tuple[int, Any, int]] = deque()
        # held items being accepted again after an alignment ended (see _unblock)
        self._replay: deque[tuple[int, Any, int]] = deque()
        self._replaying = False
        self._waiting: set[int] = set()
        self._until: dict[int, int] = {}
        self._captured: list[tuple[int, Any]] = []
        self._scanned_puts = -1
        # at-least-once: checkpoint id -> channels whose barrier arrived
        self._seen: dict[int, set[int]] = {}
        self._first_at: dict[int, float] = {}
        #: per checkpoint id: start_delay_ms, alignment_ms, in_flight_records,
        #: in_flight_bytes, ahead_records, ahead_bytes, unaligned (popped by the task
        #: when it acknowledges)
        self.stats: dict[int, dict[str, Any]] = {}
        self._in_flight = 0
        self._overtaken = 0  # watermarks / end-of-input markers the capture skipped
        self._delivered_batches = 0
        self._bytes_per_record = 0.0
        self._debloater = None
        if debloat is not None:
            # Start small: the measured throughput raises it within a period, while a
            # large start fills every inbox before the first measurement.
            self.inbox.set_capacity(min(capacity, INITIAL_DEBLOATED_RECORDS))
            self._debloater = _Debloater(self.inbox, debloat, capacity, clock())

    # -- senders (convenience for tests and single events) ------------------------------
    def put(self, channel: int, element: Any) -> None:
        """Send ``element`` on ``channel``: a barrier of an unaligned gate (or one marked
        unaligned) takes the priority lane, everything else the data lane (blocking)."""
        if isinstance(element, Barrier) and (
            element.unaligned or self.mode is BarrierMode.UNALIGNED
        ):
            self.inbox.put_priority(channel, element)
        else:
            self.inbox.send(channel, element)

    def put_control(self, message: Any) -> None:
        """Post a mailbox message (any thread; never blocks)."""
        self.inbox.put_control(message)

    def close(self) -> None:
        """The receiver stopped: release blocked senders, drop later input."""
        self.inbox.close()

    @property
    def finished(self) -> bool:
        """Every channel sent :class:`EndOfInput` and nothing is held back."""
        return not self._live and not self._held and not self._ready

    def input_of(self, channel: int) -> int:
        """Which input (0 or 1) ``channel`` belongs to."""
        return self.inputs[channel]

    # -- the receiving task ---------------------------------------------------------------
    def next(self, timeout: float | None = None) -> tuple[int, Any] | None:
        """The next element for the task, or None after ``timeout`` seconds."""
        while True:
            self._check_timeout()
            if self._ready:
                return self._ready.popleft()
            wait = timeout
            deadline = self._deadline()
            if deadline is not None:
                left = max(0.0, deadline - self._clock())
                wait = left if wait is None else min(wait, left)
            if self._debloater is None:
                got = self.inbox.get(wait)
            else:
                started = self._clock()
                self._debloater.tick(started)
                got = self.inbox.get(wait)
                if got is None:
                    self._debloater.idle(self._clock() - started)
            if got is None:
                self._check_timeout()
                return self._ready.popleft() if self._ready else None
            lane, payload = got
            if lane is Lane.CONTROL:
                return CONTROL, payload
            if lane is Lane.PRIORITY:
                self._on_priority(*payload)
            else:
                channel, element = payload
                index = -1
                if not isinstance(element, Barrier):
                    index = self._consumed[channel]
                    self._consumed[channel] = index + 1
                    self._accept(channel, element, index)
                else:
                    ahead = self.inbox.records_ahead(element, channel)
                    self._accept(channel, element, index)
                    self._record_ahead(element.checkpoint_id, ahead)
            self._rescan()

    def _record_ahead(self, cid: int, records: int) -> None:
        """Keep the most records any of ``cid``'s barriers waited behind in this inbox."""
        stats = self.stats.get(cid)
        if stats is not None and records >= stats.get("ahead_records", 0):
            stats["ahead_records"] = records
            stats["ahead_bytes"] = round(records * self._bytes_per_record)

    def urgent(self) -> Barrier | None:
        """A barrier the task must snapshot for now, while it cannot take records (it is
        blocked sending output): an unaligned barrier, or an alignment that timed out."""
        if self.mode is BarrierMode.AT_LEAST_ONCE:
            return None
        while not self._ready:
            self._check_timeout()
            if self._ready:
                break
            polled = self.inbox.poll_priority()
            if polled is None:
                return None
            self._on_priority(*polled)
        head = self._ready[0]
        if head[0] == CONTROL and isinstance(head[1], Barrier):
            self._ready.popleft()
            return head[1]
        return None

    # -- dispatch -----------------------------------------------------------------------------
    def _accept(self, channel: int, element: Any, index: int) -> None:
        if self.mode is BarrierMode.AT_LEAST_ONCE:
            self._accept_tracking(channel, element)
            return
        if channel in self._blocked:
            self._held.append((channel, element, index))
            return
        if isinstance(element, Barrier):
            self._on_inband_barrier(channel, element)
            return
        if self._capturing and channel in self._waiting:
            until = self._until.get(channel)
            if until is None or index < until:
                if _emitted_again(element):
                    self._overtaken += 1
                else:
                    self._captured.append((channel, element))
                    self._in_flight += len(element) if isinstance(element, list) else 0
            if until is not None and index + 1 >= until:
                self._waiting.discard(channel)
        elif self._current is not None and not self._capturing and isinstance(element, list):
            self._in_flight += len(element)  # aligning: what the barrier waits behind
        self._deliver(channel, element)
        self._finish_capture()

    def _deliver(self, channel: int, element: Any) -> None:
        if isinstance(element, Watermark):
            self._on_watermark(channel, element.timestamp)
        elif isinstance(element, EndOfInput):
            self._live.discard(channel)
            self._waiting.discard(channel)
            self._advance_watermark()
            if self._current is not None and not self._capturing and self._blocked >= self._live:
                self._release()
            if not self._live:
                self._ready.append((channel, element))
        else:
            self._sample(element)
            self._ready.append((channel, element))
            if self._debloater is not None:
                self._debloater.record(len(element) if isinstance(element, list) else 1)

    def _sample(self, batch: Any) -> None:
        self._delivered_batches += 1
        if self._delivered_batches % _SAMPLE_EVERY == 1 and isinstance(batch, list) and batch:
            size = len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)) / len(batch)
            b = self._bytes_per_record
            self._bytes_per_record = size if b == 0 else 0.8 * b + 0.2 * size

    # -- watermarks ----------------------------------------------------------------------------
    def _on_watermark(self, channel: int, timestamp: int) -> None:
        if timestamp > self._watermarks[channel]:
            self._watermarks[channel] = timestamp
            self._advance_watermark()

    def _advance_watermark(self) -> None:
        if not self._live:
            return
        low = min(self._watermarks[c] for c in self._live)
        if low > self.watermark:
            self.watermark = low
            self._ready.append((CONTROL, Watermark(low)))

    # -- aligned, with or without a timeout -----------------------------------------------
    def _on_inband_barrier(self, channel: int, barrier: Barrier) -> None:
        cid = barrier.checkpoint_id
        current = self._current
        if current is not None and cid == current.checkpoint_id:
            if self._capturing:  # everything before it on this channel was delivered
                self._waiting.discard(channel)
                self._finish_capture()
            else:
                self._blocked.add(channel)
                if self._blocked >= self._live:
                    self._release()
            return
        if not self._newer(cid):
            return  # stale: completed or given up here already
        self._start(barrier)
        if self._switch_due(barrier):
            self._start_capture(done={channel})
        else:
            self._blocked.add(channel)
            if self._blocked >= self._live:
                self._release()

    def _on_priority(self, channel: int, barrier: Barrier, seq: int) -> None:
        cid = barrier.checkpoint_id
        current = self._current
        if current is None or cid != current.checkpoint_id:
            if not self._newer(cid):
                return
            self._start(barrier)
        if not self._capturing:
            self._start_capture(done=set(self._blocked))
        self._until[channel] = seq
        if self._consumed[channel] >= seq:
            self._waiting.discard(channel)
        self._scanned_puts = -1  # a position became known: worth another scan
        self._rescan()
        self._finish_capture()

    def _newer(self, cid: int) -> bool:
        """Whether ``cid`` starts a new checkpoint here; a newer one cancels the current."""
        if cid <= self._last_barrier:
            return False
        if self._current is not None:
            self._cancel_current()
        return True

    def _start(self, barrier: Barrier) -> None:
        cid = barrier.checkpoint_id
        now = self._clock()
        self._current = barrier
        self._last_barrier = cid
        self._first_at[cid] = now
        self._in_flight = 0
        self._overtaken = 0
        self.stats[cid] = {
            "start_delay_ms": round(max(0.0, now - barrier.triggered_at) * 1e3, 3),
            "queued_records": self.inbox.queued_records,
        }

    def _switch_due(self, barrier: Barrier) -> bool:
        if barrier.unaligned or self.timeout_s is None:
            return barrier.unaligned
        return self._clock() - barrier.triggered_at >= self.timeout_s

    def _deadline(self) -> float | None:
        if self._current is None or self._capturing or self.timeout_s is None:
            return None
        return self._current.triggered_at + self.timeout_s

    def _check_timeout(self) -> None:
        deadline = self._deadline()
        if deadline is not None and self._clock() >= deadline:
            self._start_capture(done=set(self._blocked))

    def _release(self) -> None:
        """Aligned: every live channel delivered the barrier."""
        assert self._current is not None
        barrier = self._current
        self._record_stats(barrier.checkpoint_id, unaligned=False)
        self._ready.append((CONTROL, Barrier(barrier.checkpoint_id, barrier.triggered_at)))
        self._current = None
        self._unblock()

    def _unblock(self) -> None:
        """Accept the held items again, in order: they may hold the next barrier (and block
        again, or start its capture). They are ahead of everything still in the inbox on
        their channels, so a capture that starts among them must not be finished from the
        inbox alone: while they are replayed, :meth:`_rescan` waits, and it runs once they
        all went through :meth:`_accept` (which captures those owed to the checkpoint)."""
        self._blocked.clear()
        held, self._held = self._held, deque()
        held.extend(self._replay)  # held while replaying: earlier than the rest
        self._replay = held
        if self._replaying:
            return
        self._replaying = True
        try:
            while self._replay:
                self._accept(*self._replay.popleft())
        finally:
            self._replaying = False
        self._rescan()

    def _start_capture(self, done: set[int]) -> None:
        """The current checkpoint is unaligned here from now on: hand the barrier over;
        ``done`` channels delivered their barrier already, the other live ones owe items."""
        assert self._current is not None
        barrier = self._current
        self._capturing = True
        self._record_stats(barrier.checkpoint_id, unaligned=True)
        self._in_flight = 0
        self._overtaken = 0
        self._ready.append((CONTROL, Barrier(barrier.checkpoint_id, barrier.triggered_at, True)))
        self._waiting = self._live - done
        self._until = {}
        self._captured = []
        self._scanned_puts = -1
        self._unblock()  # held items are after the barrier: delivered, not captured
        self._rescan()
        self._finish_capture()

    def _record_stats(self, cid: int, unaligned: bool) -> None:
        stats = self.stats.setdefault(cid, {})
        stats["alignment_ms"] = round((self._clock() - self._first_at.pop(cid)) * 1e3, 3)
        stats["unaligned"] = unaligned
        if not unaligned:
            self._set_in_flight(stats)

    def _set_in_flight(self, stats: dict[str, Any]) -> None:
        stats["in_flight_records"] = self._in_flight
        stats["in_flight_bytes"] = round(self._in_flight * self._bytes_per_record)
        # Not persisted (a restored source emits them again), but the job's end must know:
        # a final checkpoint that overtook one was taken before every timer fired.
        stats["overtaken_control"] = self._overtaken

    def _rescan(self) -> None:
        """Capturing: copy the in-flight items from the inbox at once if every channel
        that owes items has its boundary there (its queued barrier or a known position)."""
        if not (self._capturing and self._waiting) or self._replaying:
            return
        if self.inbox.puts == self._scanned_puts:
            return  # nothing new queued since the last scan
        self._scanned_puts = self.inbox.puts
        cid = self._current.checkpoint_id if self._current is not None else -1
        position = {c: self._consumed[c] for c in self._waiting}
        found: set[int] = set()
        copied: list[tuple[int, Any]] = []
        overtaken = 0
        for channel, element in self.inbox.queued():
            if channel not in position or channel in found:
                continue
            if isinstance(element, Barrier):
                if element.checkpoint_id == cid:
                    found.add(channel)
                continue
            until = self._until.get(channel)
            if until is not None and position[channel] >= until:
                found.add(channel)
                continue
            if _emitted_again(element):
                overtaken += 1
            else:
                copied.append((channel, element))
            position[channel] += 1
        for channel, until in self._until.items():
            if channel in position and position[channel] >= until:
                found.add(channel)
        if found >= self._waiting:
            self._overtaken += overtaken
            self._captured.extend(copied)
            self._in_flight += sum(len(e) for _, e in copied if isinstance(e, list))
            self._waiting.clear()
            self._finish_capture()

    def _finish_capture(self) -> None:
        if self._capturing and not self._waiting and self._current is not None:
            cid = self._current.checkpoint_id
            self._set_in_flight(self.stats.setdefault(cid, {}))
            self._ready.append((CONTROL, InFlightData(cid, tuple(self._captured))))
            self._capturing = False
            self._current = None
            self._captured = []
            self._until = {}

    def _cancel_current(self) -> None:
        assert self._current is not None
        cid = self._current.checkpoint_id
        self._first_at.pop(cid, None)
        self.stats.pop(cid, None)
        self._ready.append((CONTROL, CancelledBarrier(cid)))
        self._current = None
        if self._capturing:
            self._capturing = False
            self._waiting.clear()
            self._captured = []
            self._until = {}
        else:
            self._unblock()

    # -- at-least-once: track, never block ---------------------------------------------------
    def _accept_tracking(self, channel: int, element: Any) -> None:
        if isinstance(element, Barrier):
            cid = element.checkpoint_id
            if cid <= self._last_barrier:
                return  # a checkpoint already handed over or given up
            if cid not in self._seen:
                self._seen[cid] = set()
                now = self._clock()
                self._first_at[cid] = now
                delay = round(max(0.0, now - element.triggered_at) * 1e3, 3)
                self.stats[cid] = {"start_delay_ms": delay}
            self._seen[cid].add(channel)
            self._complete_tracked(element.triggered_at)
        elif isinstance(element, EndOfInput):
            self._deliver(channel, element)
            self._complete_tracked(0.0)
        else:
            self._deliver(channel, element)

    def _complete_tracked(self, triggered_at: float) -> None:
        done = [cid for cid, chans in self._seen.items() if chans >= self._live]
        if not done:
            return
        cid = max(done)
        for older in sorted(c for c in self._seen if c < cid):
            self._first_at.pop(older, None)
            self.stats.pop(older, None)
            self._ready.append((CONTROL, CancelledBarrier(older)))
        self._seen = {c: chans for c, chans in self._seen.items() if c > cid}
        self._last_barrier = cid
        stats = self.stats.setdefault(cid, {})
        stats["alignment_ms"] = round((self._clock() - self._first_at.pop(cid)) * 1e3, 3)
        stats["unaligned"] = False
        self._ready.append((CONTROL, Barrier(cid, triggered_at)))
