"""Keyed functions and reference computations shared by the Spark host's tests.

Registered with cloudpickle by value: the state server (a separate process) then gets the
classes with the step's configuration and need not import this test module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pyspark import cloudpickle

from backends.serializers import INT64
from backends.state import ListStateDescriptor, ValueStateDescriptor
from coordinator.functions import Context, StateAccess
from tools.bench.spark_processors import CountSum as Counts

__all__ = ["KEYS", "OUTPUT", "Counts", "Lists", "Sessions", "key_of", "reference"]

KEYS = 37
OUTPUT = "k string, v long, n long, total long"


class Sessions:
    """Counts per key and closes a key's session when the watermark passes its last
    event + 1000 ms (an event-time timer) and, independently, reports each key once
    the batch clock passes its first event + 1 ms (a processing-time timer)."""

    def open(self, state: StateAccess) -> None:
        self.n = state.get_state(ValueStateDescriptor("n", INT64))
        self.last = state.get_state(ValueStateDescriptor("last", INT64))
        self.reported = state.get_state(ValueStateDescriptor("reported", INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        assert ctx.timestamp is not None
        self.n.update((self.n.value() or 0) + 1)
        last = self.last.value()
        if last is not None:
            ctx.delete_event_time_timer(last + 1000)
        self.last.update(ctx.timestamp)
        ctx.register_event_time_timer(ctx.timestamp + 1000)
        if self.reported.value() is None:
            self.reported.update(0)
            ctx.register_processing_time_timer(ctx.current_processing_time() + 1)

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> None:
        if ctx.time_domain is not None and ctx.time_domain.value == "processing":
            self.reported.update(1)
            ctx.emit((key, -1, self.n.value() or 0, timestamp))
            return
        ctx.emit((key, 0, self.n.value() or 0, timestamp))
        self.n.clear()
        self.last.clear()


class Lists:
    """Appends every value to its key's list state; emits ``(k, v, len(list), 0)``: a
    block of changes replayed twice shows as a longer list (values would not show it)."""

    def open(self, state: StateAccess) -> None:
        self.items = state.get_state(ListStateDescriptor("items", INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        self.items.add(value)
        ctx.emit((key, value, len(self.items.get()), 0))


cloudpickle.register_pickle_by_value(__import__(__name__, fromlist=["_"]))


def key_of(value: int) -> str:
    """The key of value ``value`` in the tests' streams."""
    return f"k{value % KEYS:03d}"


def reference(
    values: Iterable[int],
) -> tuple[set[tuple[str, int, int, int]], dict[str, tuple[int, int]]]:
    """Output rows and final ``(n, total)`` per key of :class:`Counts` over ``values`` in order."""
    n: dict[str, int] = {}
    total: dict[str, int] = {}
    rows: set[tuple[str, int, int, int]] = set()
    for v in values:
        k = key_of(v)
        n[k] = n.get(k, 0) + 1
        total[k] = total.get(k, 0) + v
        rows.add((k, v, n[k], total[k]))
    return rows, {k: (n[k], total[k]) for k in n}
