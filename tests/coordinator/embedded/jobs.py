"""A job with every shape the builder offers, and what a failure-free run must output.

::

    events (2) -filter/flat_map/map-> key_by user -> "counts" (2)   one keyed operator
        -> key_by user -> "windows" (3)    event-time tumbling windows: timers fire
        -> key_by user ----------------+
    clicks (1) -> key_by user ---------+-> "join" (2)   a two-input keyed operator with
                                                        event-time timers
        -> sink (2): a SQL table, a file directory or a collect sink

Both sources emit watermarks (bounded out-of-orderness, never violated by the data), so
every window and join result is deterministic: a run with any number of crashes and
restores must output exactly :func:`reference` (exactly-once modes), or at least it
(at-least-once). Each event source subtask owns the users ``u % 2 == subtask``, so a
user's events reach "counts" in one order.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from backends.serializers import INT64, STR
from backends.state import MapStateDescriptor, ValueStateDescriptor
from coordinator.embedded import (
    Context,
    GeneratorSource,
    PipelineBuilder,
    StateAccess,
    WatermarkStrategy,
)
from coordinator.embedded.pipeline import JobGraph
from coordinator.sink import SinkFactory

USERS = 40
STEP_MS = 10  # event time advances this much per record of a subtask
LATENESS_MS = 30  # records are at most this late: the watermark's bound
WINDOW_MS = 1_000
KINDS = ("view", "buy", "skip")
SQL_COLUMNS = (
    ("name", "text"),
    ("win", "bigint"),
    ("events", "bigint"),
    ("total", "bigint"),
    ("clicks", "bigint"),
)


@dataclass(frozen=True, slots=True)
class JobConfig:
    """Size and pace of the generated input."""

    events_per_subtask: int = 1_500
    clicks: int = 1_500
    rate_per_s: float | None = 1_000.0
    seed: int = 7
    slow_ms: float = 0.0  # "counts" spends this long per record: backpressure upstream


def event(subtask: int) -> Any:
    """The record maker of event source subtask ``subtask``."""

    def make(rng: random.Random, i: int) -> dict[str, Any]:
        user = rng.randrange(USERS // 2) * 2 + subtask
        return {
            "user": f"u{user:03d}",
            "ts": i * STEP_MS + rng.randrange(LATENESS_MS + 1),
            "amount": rng.randrange(1, 100),
            "kind": KINDS[rng.randrange(3)],
        }

    return make


def click(rng: random.Random, i: int) -> dict[str, Any]:
    """A click of a random user."""
    return {
        "user": f"u{rng.randrange(USERS):03d}",
        "ts": i * STEP_MS + rng.randrange(LATENESS_MS + 1),
    }


def _events_of(config: JobConfig, subtask: int) -> list[dict[str, Any]]:
    rng = random.Random(config.seed * 1_000_003 + subtask)
    make = event(subtask)
    return [make(rng, i) for i in range(config.events_per_subtask)]


def _clicks(config: JobConfig) -> list[dict[str, Any]]:
    rng = random.Random((config.seed + 1) * 1_000_003)
    return [click(rng, i) for i in range(config.clicks)]


def _expand(e: dict[str, Any]) -> list[dict[str, Any]]:
    return [e, e] if e["kind"] == "buy" else [e]


class Counts:
    """First keyed operator: a running count per user. Task thread only."""

    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        ctx.emit([key, n, value["amount"], value["ts"]])


class Windows:
    """Second keyed operator in a row: tumbling event-time windows. Task thread only."""

    def open(self, state: StateAccess) -> None:
        self.counts = state.get_state(MapStateDescriptor("counts", INT64, INT64))
        self.totals = state.get_state(MapStateDescriptor("totals", INT64, INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        _, _, amount, ts = value
        start = ts - ts % WINDOW_MS
        self.counts.put(start, (self.counts.get(start) or 0) + 1)
        self.totals.put(start, (self.totals.get(start) or 0) + amount)
        ctx.register_event_time_timer(start + WINDOW_MS - 1)

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> None:
        start = timestamp + 1 - WINDOW_MS
        ctx.emit([key, start, self.counts.get(start), self.totals.get(start)])
        self.counts.remove(start)
        self.totals.remove(start)


class Join:
    """Two-input keyed operator: window results (input 1) with the clicks of the same
    user and window (input 2), emitted when the watermark closes the window."""

    def open(self, state: StateAccess) -> None:
        self.windows = state.get_state(MapStateDescriptor("windows", INT64, INT64))
        self.totals = state.get_state(MapStateDescriptor("totals", INT64, INT64))
        self.clicks = state.get_state(MapStateDescriptor("clicks", INT64, INT64))

    def process1(self, key: Any, value: Any, ctx: Context) -> None:
        _, start, count, total = value
        self.windows.put(start, count)
        self.totals.put(start, total)
        ctx.register_event_time_timer(start + WINDOW_MS - 1)

    def process2(self, key: Any, value: Any, ctx: Context) -> None:
        start = value["ts"] - value["ts"] % WINDOW_MS
        self.clicks.put(start, (self.clicks.get(start) or 0) + 1)
        ctx.register_event_time_timer(start + WINDOW_MS - 1)

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> None:
        start = timestamp + 1 - WINDOW_MS
        row = [
            key,
            start,
            self.windows.get(start) or 0,
            self.totals.get(start) or 0,
            self.clicks.get(start) or 0,
        ]
        ctx.emit(row)
        for state in (self.windows, self.totals, self.clicks):
            state.remove(start)


class _PerSubtask:
    """A generator source whose record maker depends on the subtask."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config

    def open(self, subtask: int, parallelism: int, restored: Any) -> Any:
        source = GeneratorSource(event(subtask), self.config.events_per_subtask, self.config.seed)
        return source.open(subtask, parallelism, restored)


def _slow(seconds: float) -> Any:
    def identity(row: Any) -> Any:
        time.sleep(seconds)  # a slow step of the workload (an external call, say)
        return row

    return identity


def build(config: JobConfig, sink: SinkFactory, job_id: str = "shapes") -> JobGraph:
    """The job graph, writing to ``sink``."""
    strategy = WatermarkStrategy(lambda r: r["ts"], LATENESS_MS)
    job = PipelineBuilder(job_id)
    events = job.source("events", _PerSubtask(config), 2, strategy, config.rate_per_s)
    clicks = job.source(
        "clicks",
        GeneratorSource(click, config.clicks, config.seed + 1),
        1,
        strategy,
        config.rate_per_s,
    )
    counted = (
        events.filter(lambda e: e["kind"] != "skip")
        .flat_map(_expand)
        .map(lambda e: {"amount": e["amount"], "ts": e["ts"], "user": e["user"]})
        .key_by(lambda e: e["user"], STR)
        .process("counts", Counts, parallelism=2)
    )
    if config.slow_ms:
        counted = counted.map(_slow(config.slow_ms / 1e3))
    windows = counted.key_by(lambda row: row[0], STR).process("windows", Windows, parallelism=3)
    joined = (
        windows.key_by(lambda row: row[0], STR)
        .connect(clicks.key_by(lambda c: c["user"], STR))
        .process("join", Join, parallelism=2)
    )
    joined.sink("out", sink, parallelism=2)
    return job.build()


def reference(config: JobConfig) -> list[tuple[Any, ...]]:
    """The join's rows, sorted, of a failure-free run."""
    windows: dict[tuple[str, int], list[int]] = {}
    for s in range(2):
        for e in _events_of(config, s):
            if e["kind"] == "skip":
                continue
            for copy in _expand(e):
                w = windows.setdefault((copy["user"], copy["ts"] - copy["ts"] % WINDOW_MS), [0, 0])
                w[0] += 1
                w[1] += copy["amount"]
    clicks: dict[tuple[str, int], int] = {}
    for c in _clicks(config):
        key = (c["user"], c["ts"] - c["ts"] % WINDOW_MS)
        clicks[key] = clicks.get(key, 0) + 1
    rows = []
    for key in set(windows) | set(clicks):
        count, total = windows.get(key, [0, 0])
        rows.append((key[0], key[1], count, total, clicks.get(key, 0)))
    return sorted(rows)
