"""Timers: event-time and processing-time timers as keyed, key-group partitioned state.

A timer is ``(timestamp, key)`` in one time domain. Timers are stored as a timer state
(``__timers__.<domain>``: per key a set of timestamps) in the backend, so they are
snapshotted, logged (``TIMER_REGISTER``/``TIMER_DELETE`` through the changelog wrapper),
restored and rescaled like any other state. The service keeps an in-memory priority queue
over them (rebuilt from the state when created, so create it after restore) to fire all
timers ``<= t`` in timestamp order: that is what windows are built on.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable
from typing import Any

from backends.backend import KeyedStateBackend
from backends.state import TimerStateDescriptor


class TimeDomain(enum.StrEnum):
    """Which clock a timer follows: the watermark (event) or the machine (processing)."""

    EVENT = "event"
    PROCESSING = "processing"


def timer_descriptor(domain: TimeDomain) -> TimerStateDescriptor:
    """The descriptor of the timer state of ``domain``."""
    return TimerStateDescriptor(f"__timers__.{domain.value}")


class TimerService:
    """Timers of one time domain on one backend (a store or its changelog wrapper).

    Task thread only. Invariants: the queue holds every registered timer (and possibly
    deleted ones, skipped lazily); a timer fires at most once; firing removes it from the
    state (a logged change) before the callback runs with its key as the current key.
    """

    def __init__(self, backend: Any, domain: TimeDomain = TimeDomain.EVENT) -> None:
        self._backend: KeyedStateBackend = backend
        self.domain = domain
        self._name = timer_descriptor(domain).name
        self._state = backend.get_state(timer_descriptor(domain))
        self._queue: list[tuple[int, bytes, int, Any]] = []
        self._key_serializer = backend.key_serializer
        for kg, key, timestamps in backend.entries(self._name):
            key_bytes = self._key_serializer.serialize(key)
            for ts in timestamps:
                self._queue.append((ts, key_bytes, kg, key))
        heapq.heapify(self._queue)

    def register(self, timestamp: int) -> None:
        """Register a timer at ``timestamp`` for the current key (idempotent)."""
        if self._state.contains(timestamp):
            return
        self._state.put(timestamp, True)
        b = self._backend
        heapq.heappush(
            self._queue, (timestamp, b.current_key_bytes, b.current_key_group, b.current_key)
        )

    def delete(self, timestamp: int) -> None:
        """Delete the current key's timer at ``timestamp`` (no error if absent)."""
        if self._state.contains(timestamp):
            self._state.remove(timestamp)

    def timers(self) -> list[int]:
        """The current key's registered timestamps, ascending."""
        return sorted(ts for ts, _ in self._state.items())

    def next_timestamp(self) -> int | None:
        """The earliest registered timer's timestamp, or None."""
        b = self._backend
        q = self._queue
        while q:
            ts, key_bytes, kg, key = q[0]
            b.set_current_key_raw(key, key_bytes, kg)
            if self._state.contains(ts):
                return ts
            heapq.heappop(q)
        return None

    def fire_until(self, timestamp: int, on_timer: Callable[[int, Any], None]) -> int:
        """Fire every timer ``<= timestamp`` in (timestamp, key bytes) order.

        ``on_timer(ts, key)`` runs with ``key`` as the backend's current key and may
        register new timers (those ``<= timestamp`` fire in the same call). Returns the
        number fired.
        """
        b = self._backend
        q = self._queue
        state = self._state
        fired = 0
        while q and q[0][0] <= timestamp:
            ts, key_bytes, kg, key = heapq.heappop(q)
            b.set_current_key_raw(key, key_bytes, kg)
            if not state.contains(ts):
                continue  # deleted, or a duplicate queue entry
            state.remove(ts)
            fired += 1
            on_timer(ts, key)
        return fired
