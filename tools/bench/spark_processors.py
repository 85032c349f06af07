"""The count-and-sum function of the spark-pipeline benchmark, for both systems.

In a module of their own (not a benchmark: the harness skips it) so that Spark's Python
workers and our state servers import them by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from backends.serializers import INT64
from backends.state import ValueStateDescriptor
from coordinator.functions import Context, StateAccess


class CountSum:
    """Ours: per key a count and a sum; one ``(k, v, n, total)`` row per input row."""

    def open(self, state: StateAccess) -> None:
        self.n = state.get_state(ValueStateDescriptor("n", INT64))
        self.total = state.get_state(ValueStateDescriptor("total", INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        n = (self.n.value() or 0) + 1
        total = (self.total.value() or 0) + value
        self.n.update(n)
        self.total.update(total)
        ctx.emit((key, value, n, total))


def spark_count_sum(key: tuple[Any, ...], frames: Iterator[Any], state: Any) -> Iterator[Any]:
    """Spark's applyInPandasWithState: the same, vectorized per key and batch."""
    import pandas as pd

    n, total = state.get if state.exists else (0, 0)
    for frame in frames:
        counts = pd.Series(range(n + 1, n + 1 + len(frame)), index=frame.index, dtype="int64")
        totals = frame["v"].cumsum() + total
        if len(frame):
            n, total = int(counts.iloc[-1]), int(totals.iloc[-1])
        yield pd.DataFrame({"k": key[0], "v": frame["v"], "n": counts, "total": totals})
    state.update((n, total))
