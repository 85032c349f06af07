"""What flows between tasks, and the inbox it flows through.

Every task that has inputs has one :class:`Inbox` for all its input channels (a channel
is one upstream subtask of one input edge). An inbox has three lanes, served in this
order:

- control: mailbox messages (checkpoint notifications, stop); unbounded, never blocks.
- priority: unaligned barriers (FLIP-76). A barrier that may overtake records is put here
  together with the number of data items its sender sent on that channel before it, so
  the receiver knows which of the items still ahead of it are *in flight*. Unbounded:
  a barrier never waits for room.
- data: record batches, watermarks, in-band (aligned) barriers, end of input, in the
  order each channel's one sender put them. Bounded in *records* (not items): a sender
  blocks while the records queued reach :attr:`Inbox.capacity`, which the receiver
  lowers or raises to hold about ``target`` seconds of its measured throughput (buffer
  debloating, FLIP-183), so an aligned barrier queues behind about that much, plus at
  most one batch (a quarter of the capacity) per sender: a put is admitted while the
  records queued are below the capacity. That holds per hop; a job's barrier crosses
  every hop, so its checkpoint waits about ``target`` times the hops.

Every data item except a barrier counts as one in its channel's sequence (``sent`` on
the sender side, ``consumed`` on the receiver side); a sender that flushes to several
inboxes reserves its sequence numbers in all of them before it blocks on any, so that a
barrier sent from inside a blocked send counts every record whose effect is already in
the sender's state.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

CONTROL = -1
"""The channel index of control messages and of what the gate hands the task itself."""

MIN_CAPACITY_RECORDS = 16
"""Debloating never shrinks an inbox below this: a barrier may still overtake nothing."""


@dataclass(frozen=True, slots=True)
class Barrier:
    """A checkpoint barrier. ``triggered_at`` is the runtime clock at the trigger (start
    delay and the aligned timeout are measured from it); ``unaligned`` barriers travel on
    the priority lane and overtake queued records."""

    checkpoint_id: int
    triggered_at: float = 0.0
    unaligned: bool = False


@dataclass(frozen=True, slots=True)
class Watermark:
    """Event time: no record with a timestamp ``<= timestamp`` follows on this channel."""

    timestamp: int


@dataclass(frozen=True, slots=True)
class EndOfInput:
    """The upstream subtask of this channel will send nothing more."""


@dataclass(frozen=True, slots=True)
class CancelledBarrier:
    """Handed to the task when a checkpoint was given up at this gate (a newer barrier
    arrived before it completed here)."""

    checkpoint_id: int


@dataclass(frozen=True, slots=True)
class InFlightData:
    """The in-flight items of an unaligned checkpoint, complete: ``batches`` are the
    ``(channel, batch)`` items that were sent before the barrier on their channel and
    reached the task after it, in delivery order."""

    checkpoint_id: int
    batches: tuple[tuple[int, Any], ...]


class Lane(IntEnum):
    """Which lane :meth:`Inbox.get` took an item from."""

    CONTROL = 0
    PRIORITY = 1
    DATA = 2


def weight_of(element: Any) -> int:
    """Records an item holds: the length of a batch, 0 for events."""
    return len(element) if isinstance(element, list) else 0


class Inbox:
    """The bounded input queue of one task. Thread-safe: guarded by ``self._lock``.

    Many sender threads (one per channel) and one receiver thread. ``capacity`` (records)
    is set by the receiver; senders read it through :meth:`batch_hint`.
    """

    def __init__(self, channels: int, capacity: int, max_items: int = 4096) -> None:
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._control: deque[Any] = deque()
        self._priority: deque[tuple[int, Barrier, int]] = deque()
        self._data: deque[tuple[int, Any, int]] = deque()
        self._records = 0
        self._max_items = max_items
        self.capacity = max(1, capacity)
        self.puts = 0  # data items ever put: a capturing gate rescans when it changed
        # (checkpoint id, channel) -> records queued ahead of that in-band barrier when it
        # was put: what it waits behind (popped by the receiver when it arrives)
        self._ahead: dict[tuple[int, int], int] = {}
        # Per channel: items reserved by its one sender thread (only that thread writes
        # its slot, and reads it when it sends a priority barrier).
        self._sent = [0] * channels
        self._closed = False

    # -- senders ---------------------------------------------------------------------------
    def reserve(self, channel: int) -> None:
        """Count one data item (not a barrier) on ``channel`` before it is put."""
        self._sent[channel] += 1

    def put(
        self,
        channel: int,
        element: Any,
        on_wait: Callable[[], None] | None = None,
        poll_s: float = 0.05,
    ) -> None:
        """Put a data-lane item (already reserved unless it is a barrier).

        Blocks while the queued records reach the capacity (an item of no records, such
        as a barrier or a watermark, never waits). ``on_wait`` runs on this thread every
        ``poll_s`` while blocked: the sending task handles its own urgent input there.
        After :meth:`close` the item is dropped: the receiver is gone.
        """
        weight = weight_of(element)
        with self._not_full:
            while (
                not self._closed
                and weight
                and self._data
                and (self._records >= self.capacity or len(self._data) >= self._max_items)
            ):
                if on_wait is None:
                    self._not_full.wait(poll_s)
                    continue
                self._not_full.wait(poll_s)
                self._lock.release()
                try:
                    on_wait()
                finally:
                    self._lock.acquire()
            if self._closed:
                return
            if isinstance(element, Barrier):
                self._ahead[(element.checkpoint_id, channel)] = self._records
            self._data.append((channel, element, weight))
            self._records += weight
            self.puts += 1
            self._not_empty.notify()

    def send(self, channel: int, element: Any) -> None:
        """Reserve (unless a barrier) and put, without a wait hook: tests and events."""
        if not isinstance(element, Barrier):
            self.reserve(channel)
        self.put(channel, element)

    def put_priority(self, channel: int, barrier: Barrier) -> None:
        """An unaligned barrier of ``channel``: everything its sender reserved so far is
        before it. Never blocks. Call from the channel's sender thread only."""
        with self._lock:
            if self._closed:
                return
            self._priority.append((channel, barrier, self._sent[channel]))
            self._not_empty.notify()

    def put_control(self, message: Any) -> None:
        """A mailbox message (any thread); never blocks."""
        with self._lock:
            if self._closed:
                return
            self._control.append(message)
            self._not_empty.notify()

    def batch_hint(self) -> int:
        """How many records a sender should put in one batch (a quarter of the capacity)."""
        return max(1, self.capacity // 4)

    # -- the receiver --------------------------------------------------------------------
    def get(self, timeout: float | None) -> tuple[Lane, Any] | None:
        """The next item: control first, then priority, then data; None after ``timeout``."""
        with self._not_empty:
            if not (self._control or self._priority or self._data):
                if timeout is not None and timeout <= 0:
                    return None
                self._not_empty.wait(timeout)
            if self._control:
                return Lane.CONTROL, self._control.popleft()
            if self._priority:
                return Lane.PRIORITY, self._priority.popleft()
            if self._data:
                channel, element, weight = self._data.popleft()
                self._records -= weight
                self._not_full.notify_all()
                return Lane.DATA, (channel, element)
            return None

    def records_ahead(self, barrier: Barrier, channel: int) -> int:
        """Records that were queued ahead of in-band ``barrier`` of ``channel`` when it was
        put (receiver, once it took the barrier; 0 if unknown)."""
        with self._lock:
            return self._ahead.pop((barrier.checkpoint_id, channel), 0)

    def poll_priority(self) -> tuple[int, Barrier, int] | None:
        """The next priority barrier if one is queued (receiver, while it cannot take data)."""
        with self._lock:
            return self._priority.popleft() if self._priority else None

    def queued(self) -> list[tuple[int, Any]]:
        """A copy of the data lane, oldest first (for the capture of in-flight items)."""
        with self._lock:
            return [(c, e) for c, e, _ in self._data]

    @property
    def queued_records(self) -> int:
        """Records in the data lane now."""
        with self._lock:
            return self._records

    def set_capacity(self, records: int) -> None:
        """The receiver's new bound (records); wakes senders if it grew."""
        with self._lock:
            grew = records > self.capacity
            self.capacity = max(1, records)
            if grew:
                self._not_full.notify_all()

    def close(self) -> None:
        """The receiver stopped: release blocked senders and drop whatever comes later."""
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        with self._lock:
            return self._closed
