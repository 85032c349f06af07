"""Channels between tasks and the input gate that aligns checkpoint barriers.

Every task has one bounded inbox (backpressure: a full inbox blocks the sender). Items are
``(channel, element)``; ``channel`` is the upstream subtask index, or ``CONTROL`` for
mailbox messages (notifications) that bypass alignment.

Aligned mode (exactly once), as in Flink's ``CheckpointBarrierAligner``: once a barrier
arrived on a channel, that channel's later items are held back until the barrier arrived
on every live channel; then the barrier is handed to the task and the held items follow in
arrival order. A newer barrier arriving mid-alignment cancels the older one.

Unaligned mode (exactly once, FLIP-76): a barrier never waits in the bounded inbox. The
sender puts it on an unbounded priority lane together with the number of items it sent on
that channel before it, so it overtakes everything queued (and never blocks on a full
inbox). The first barrier of a checkpoint goes to the task at once: the task snapshots
without waiting for any channel. Items that reach the task afterwards and were sent
before their channel's barrier are *in flight*: they are delivered normally and also
captured; once every live channel delivered all items before its barrier, the task gets
:class:`InFlightData` with those batches, to persist as channel state and replay before
new input on restore. Each channel has exactly one sending thread (the upstream subtask).

At-least-once mode (Flink's ``CheckpointBarrierTracker``): no channel is ever blocked; the
barrier goes to the task once it arrived on every live channel. Records of channels that
already passed the barrier are then in the snapshot *and* replayed after a restore.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from coordinator.options import BarrierMode

CONTROL = -1
_PUT_POLL_S = 0.05
_WAKE = object()  # unaligned: nudges a receiver blocked on an empty inbox


@dataclass(frozen=True, slots=True)
class Barrier:
    """A checkpoint barrier flowing with the data."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class EndOfInput:
    """The upstream subtask of this channel will send no more records."""


@dataclass(frozen=True, slots=True)
class CancelledBarrier:
    """Handed to the task when an alignment was abandoned for a newer barrier."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class InFlightData:
    """Unaligned mode: the barrier of ``checkpoint_id`` was consumed on every live channel;
    ``batches`` are the ``(channel, batch)`` items that were in flight, in delivery order."""

    checkpoint_id: int
    batches: tuple[tuple[int, Any], ...]


class InputGate:
    """Handles barriers across ``channels`` input channels in one :class:`BarrierMode`.

    :meth:`next` returns records (batches), :class:`Barrier` (aligned: once aligned;
    unaligned: at the first barrier; at-least-once: once seen on every channel),
    :class:`CancelledBarrier`, :class:`InFlightData` (unaligned only), control messages as
    ``(CONTROL, msg)``, and :class:`EndOfInput` once every channel ended.

    Thread ownership: :meth:`next` and everything it touches belong to the receiving task
    thread; :meth:`put`, :meth:`put_control` and :meth:`close` are thread-safe (the inbox
    is a bounded :class:`queue.Queue`, ``_closed`` an :class:`threading.Event`).
    """

    def __init__(
        self, channels: int, capacity: int = 64, mode: BarrierMode = BarrierMode.ALIGNED
    ) -> None:
        self.mode = BarrierMode(mode)
        self.capacity = capacity
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=capacity)
        self._closed = threading.Event()
        self._live = set(range(channels))
        self._blocked: set[int] = set()
        self._held: deque[tuple[int, Any]] = deque()
        self._aligning: int | None = None
        self._ready: deque[tuple[int, Any]] = deque()
        # at-least-once: checkpoint id -> channels whose barrier arrived
        self._seen: dict[int, set[int]] = {}
        self._last_barrier = 0
        # unaligned: the barrier lane (channel, barrier, items sent before it), items sent
        # (written by each channel's one sender thread) and consumed per channel, and the
        # capture in progress: channels still owing items, and where their barrier sits
        self._priority: queue.SimpleQueue[tuple[int, Barrier, int]] = queue.SimpleQueue()
        self._sent: dict[int, int] = dict.fromkeys(range(channels), 0)
        self._consumed: dict[int, int] = {}
        self._capturing: int | None = None
        self._waiting: set[int] = set()
        self._until: dict[int, int] = {}
        self._captured: list[tuple[int, Any]] = []
        self._popped: tuple[int, Any] | None = None

    def put(self, channel: int, element: Any) -> None:
        """Send ``element`` on ``channel`` (any thread; blocks while the inbox is full).

        After :meth:`close` the element is dropped instead: the receiver is gone. In
        unaligned mode a barrier never blocks: it takes the priority lane.
        """
        if self.mode is BarrierMode.UNALIGNED and channel != CONTROL:
            if isinstance(element, Barrier):
                self._put_priority(channel, element)
                return
            if not isinstance(element, EndOfInput):
                self._sent[channel] += 1
        item = (channel, element)
        while not self._closed.is_set():
            try:
                self.inbox.put(item, timeout=_PUT_POLL_S)
                return
            except queue.Full:
                continue

    def put_control(self, message: Any) -> None:
        """Post a mailbox message (a notification); blocks like :meth:`put` when full."""
        self.put(CONTROL, message)

    def close(self) -> None:
        """The receiver stopped: release blocked senders and drop whatever comes later."""
        self._closed.set()

    @property
    def finished(self) -> bool:
        """Every channel sent :class:`EndOfInput` and nothing is held back."""
        return not self._live and not self._held and not self._ready

    def next(self, timeout: float | None = None) -> tuple[int, Any] | None:
        """The next element for the task, or None after ``timeout`` seconds."""
        if self.mode is BarrierMode.UNALIGNED:
            return self._next_unaligned(timeout)
        accept = self._accept if self.mode is BarrierMode.ALIGNED else self._accept_tracking
        while True:
            if self._ready:
                return self._ready.popleft()
            try:
                channel, element = self.inbox.get(timeout=timeout)
            except queue.Empty:
                return None
            result = accept(channel, element)
            if result is not None:
                return result

    # -- at-least-once: track, never block ---------------------------------------------
    def _accept_tracking(self, channel: int, element: Any) -> tuple[int, Any] | None:
        if channel == CONTROL:
            return channel, element
        if isinstance(element, Barrier):
            cid = element.checkpoint_id
            if cid <= self._last_barrier:
                return None  # a checkpoint already handed over or given up
            self._seen.setdefault(cid, set()).add(channel)
            self._complete_tracked()
        elif isinstance(element, EndOfInput):
            self._live.discard(channel)
            self._complete_tracked()
            if not self._live:
                self._ready.append((channel, element))
        else:
            return channel, element
        return self._ready.popleft() if self._ready else None

    def _complete_tracked(self) -> None:
        done = [cid for cid, chans in self._seen.items() if chans >= self._live]
        if not done:
            return
        cid = max(done)
        for older in sorted(c for c in self._seen if c < cid):
            self._ready.append((CONTROL, CancelledBarrier(older)))
        self._seen = {c: chans for c, chans in self._seen.items() if c > cid}
        self._last_barrier = cid
        self._ready.append((CONTROL, Barrier(cid)))

    # -- unaligned: barriers take a priority lane, in-flight batches are captured ------
    def _put_priority(self, channel: int, barrier: Barrier) -> None:
        # Sender thread of ``channel``: everything it sent before is "before" the barrier.
        self._priority.put((channel, barrier, self._sent[channel]))
        with contextlib.suppress(queue.Full):  # wake a receiver blocked on an empty inbox
            self.inbox.put_nowait((CONTROL, _WAKE))

    def _next_unaligned(self, timeout: float | None) -> tuple[int, Any] | None:
        while True:
            self._drain_priority()
            if self._ready:
                return self._ready.popleft()
            try:
                channel, element = self.inbox.get(timeout=timeout)
            except queue.Empty:
                return None
            # A barrier placed before this item was sent is in the priority lane by now
            # (the sender put it there first): apply it before classifying the item.
            self._popped = (channel, element)
            self._drain_priority()
            self._popped = None
            if channel == CONTROL:
                if element is not _WAKE:
                    self._ready.append((channel, element))
            elif isinstance(element, EndOfInput):
                self._live.discard(channel)
                self._waiting.discard(channel)
                self._finish_capture()
                if not self._live:
                    self._ready.append((channel, element))
            else:
                self._deliver(channel, element)

    def _deliver(self, channel: int, element: Any) -> None:
        index = self._consumed.get(channel, 0)
        self._consumed[channel] = index + 1
        if self._capturing is not None and channel in self._waiting:
            until = self._until.get(channel)
            if until is None or index < until:
                self._captured.append((channel, element))
            if until is not None and index + 1 >= until:
                self._waiting.discard(channel)
        self._ready.append((channel, element))
        self._finish_capture()

    def _drain_priority(self) -> None:
        while True:
            try:
                channel, barrier, seq = self._priority.get_nowait()
            except queue.Empty:
                return
            self._on_priority_barrier(channel, barrier.checkpoint_id, seq)

    def _on_priority_barrier(self, channel: int, cid: int, seq: int) -> None:
        if self._capturing is not None and cid > self._capturing:
            # some channel never carried the older barrier: give that checkpoint up
            self._ready.append((CONTROL, CancelledBarrier(self._capturing)))
            self._capturing = None
        if self._capturing is None:
            if cid <= self._last_barrier:
                return  # stale: completed or given up already
            self._capturing = cid
            self._last_barrier = cid
            self._waiting = set(self._live)
            self._until = {}
            self._captured = []
            self._ready.append((CONTROL, Barrier(cid)))  # overtakes every queued item
        if cid != self._capturing:
            return
        self._until[channel] = seq
        if self._consumed.get(channel, 0) >= seq:
            self._waiting.discard(channel)
        if self._waiting and self._live <= set(self._until):
            self._capture_queued()
        self._finish_capture()

    def _capture_queued(self) -> None:
        """Every barrier arrived: the rest of the in-flight items are in the inbox already
        (each sender queued them before its barrier). Copy them now instead of waiting
        for the task to consume the backlog, as FLIP-76 persists buffers directly."""
        with self.inbox.mutex:  # Queue's own lock; held only for the copy, no I/O
            queued = list(self.inbox.queue)
        if self._popped is not None:  # taken from the inbox, not delivered yet
            queued.insert(0, self._popped)
        position = {c: self._consumed.get(c, 0) for c in self._waiting}
        for channel, element in queued:
            if channel not in self._waiting or isinstance(element, Barrier | EndOfInput):
                continue
            if position[channel] < self._until[channel]:
                self._captured.append((channel, element))
            position[channel] += 1
        self._waiting.clear()

    def _finish_capture(self) -> None:
        if self._capturing is not None and not self._waiting:
            self._ready.append((CONTROL, InFlightData(self._capturing, tuple(self._captured))))
            self._capturing = None
            self._captured = []

    # -- aligned: block barriered channels until every live channel delivered it ------
    def _accept(self, channel: int, element: Any) -> tuple[int, Any] | None:
        if channel == CONTROL:
            return channel, element
        if channel in self._blocked:
            self._held.append((channel, element))
            return None
        if isinstance(element, Barrier):
            return self._on_barrier(channel, element)
        if isinstance(element, EndOfInput):
            self._live.discard(channel)
            if self._aligning is not None and self._blocked >= self._live:
                return self._release()
            if not self._live:
                return channel, element
            return None
        return channel, element

    def _on_barrier(self, channel: int, barrier: Barrier) -> tuple[int, Any] | None:
        cancelled: CancelledBarrier | None = None
        if self._aligning is not None and barrier.checkpoint_id > self._aligning:
            cancelled = CancelledBarrier(self._aligning)
            self._unblock()
        elif self._aligning is not None and barrier.checkpoint_id < self._aligning:
            return None  # an old barrier after a newer one started: ignore
        if self._aligning is None:
            self._aligning = barrier.checkpoint_id
        self._blocked.add(channel)
        if self._blocked >= self._live:
            out = self._release()
            if cancelled is not None:
                self._ready.appendleft(out)
                return channel, cancelled
            return out
        return (channel, cancelled) if cancelled is not None else None

    def _release(self) -> tuple[int, Any]:
        assert self._aligning is not None
        barrier = Barrier(self._aligning)
        self._unblock()
        return CONTROL, barrier

    def _unblock(self) -> None:
        self._aligning = None
        self._blocked.clear()
        held, self._held = self._held, deque()
        # Held items are re-accepted in order: they may contain the next barrier.
        for channel, element in held:
            result = self._accept(channel, element)
            if result is not None:
                self._ready.append(result)
