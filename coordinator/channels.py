"""Channels between tasks and the input gate that aligns checkpoint barriers.

Every task has one bounded inbox (backpressure: a full inbox blocks the sender). Items are
``(channel, element)``; ``channel`` is the upstream subtask index, or ``CONTROL`` for
mailbox messages (notifications) that bypass alignment.

Aligned mode (exactly once), as in Flink's ``CheckpointBarrierAligner``: once a barrier
arrived on a channel, that channel's later items are held back until the barrier arrived
on every live channel; then the barrier is handed to the task and the held items follow in
arrival order. A newer barrier arriving mid-alignment cancels the older one.
"""

from __future__ import annotations

import queue
from collections import deque
from dataclasses import dataclass
from typing import Any

CONTROL = -1


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


class InputGate:
    """Aligns barriers across ``channels`` input channels. Owned by the receiving task thread.

    :meth:`next` returns records (batches), :class:`Barrier` once aligned,
    :class:`CancelledBarrier`, control messages as ``(CONTROL, msg)``, and
    :class:`EndOfInput` once every channel ended.
    """

    def __init__(self, channels: int, capacity: int = 64) -> None:
        self.inbox: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=capacity)
        self._live = set(range(channels))
        self._blocked: set[int] = set()
        self._held: deque[tuple[int, Any]] = deque()
        self._aligning: int | None = None
        self._ready: deque[tuple[int, Any]] = deque()

    def put(self, channel: int, element: Any) -> None:
        """Send ``element`` on ``channel`` (any thread; blocks while the inbox is full)."""
        self.inbox.put((channel, element))

    def put_control(self, message: Any) -> None:
        """Post a mailbox message (a notification); blocks like :meth:`put` when full."""
        self.inbox.put((CONTROL, message))

    @property
    def finished(self) -> bool:
        """Every channel sent :class:`EndOfInput` and nothing is held back."""
        return not self._live and not self._held and not self._ready

    def next(self, timeout: float | None = None) -> tuple[int, Any] | None:
        """The next element for the task, or None after ``timeout`` seconds."""
        while True:
            if self._ready:
                return self._ready.popleft()
            try:
                channel, element = self.inbox.get(timeout=timeout)
            except queue.Empty:
                return None
            result = self._accept(channel, element)
            if result is not None:
                return result

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
