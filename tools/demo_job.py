"""The demo pipeline: per-user counts, sums, recent items and per-category counts.

A seeded, replayable event stream (each source subtask owns the users with
``user % parallelism == subtask``, so every user's events arrive in one order) feeds a
keyed operator whose output, one ``[user, count, total]`` row per event, goes to the
transactional sink. :func:`reference` computes the same output and final state with plain
dicts: what a failure-free run must produce.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from backends.serializers import INT64, STR
from backends.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from coordinator.embedded import Context, OperatorSpec, Pipeline, SinkSpec, SourceSpec, StateAccess

CATEGORIES = ("books", "games", "music", "food", "tools")
RECENT = 5


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Size and shape of the generated stream."""

    events_per_source: int = 60_000
    users: int = 2_000
    seed: int = 42
    source_parallelism: int = 2
    operator_parallelism: int = 2
    rate_per_source: float | None = 12_000.0


def events(
    config: DemoConfig, subtask: int, parallelism: int, offset: int
) -> Iterator[tuple[str, tuple[str, int, str]]]:
    """The events of one source subtask from ``offset``: ``(user, (item, cents, category))``."""
    rng = random.Random(config.seed * 1_000_003 + subtask)
    per_split = max(1, config.users // parallelism)
    for i in range(config.events_per_source):
        user = rng.randrange(per_split) * parallelism + subtask
        cents = rng.randrange(1, 10_000)
        item = f"item-{rng.randrange(500)}"
        category = CATEGORIES[rng.randrange(len(CATEGORIES))]
        if i >= offset:
            yield f"user-{user:05d}", (item, cents, category)


class UserStats:
    """The keyed function. Task thread only."""

    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64))
        self.total = state.get_state(ValueStateDescriptor("total_cents", INT64))
        self.recent = state.get_state(ListStateDescriptor("recent_items", STR))
        self.by_category = state.get_state(MapStateDescriptor("by_category", STR, INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        item, cents, category = value
        count = (self.count.value() or 0) + 1
        self.count.update(count)
        total = (self.total.value() or 0) + cents
        self.total.update(total)
        recent = self.recent.get()
        if len(recent) >= RECENT:
            self.recent.update([*recent[1:], item])
        else:
            self.recent.add(item)
        self.by_category.put(category, (self.by_category.get(category) or 0) + 1)
        ctx.emit([key, count, total])


def pipeline(config: DemoConfig, output_url: str, job_id: str = "demo") -> Pipeline:
    """The demo job wired for the embedded runtime."""
    return Pipeline(
        job_id=job_id,
        source=SourceSpec(
            "events",
            config.source_parallelism,
            lambda s, p, off: events(config, s, p, off),
            config.rate_per_source,
        ),
        operator=OperatorSpec("user-stats", config.operator_parallelism, STR, UserStats),
        sink=SinkSpec("output", output_url),
    )


def reference(
    config: DemoConfig, offsets: Sequence[int] | None = None
) -> tuple[list[tuple[str, int, int]], dict[str, dict[Any, Any]]]:
    """Output rows (sorted) and final state per state name of a failure-free run; with
    ``offsets`` (events taken from each source subtask), of the run up to there: the
    state a checkpoint with those source offsets holds."""
    count: dict[str, int] = {}
    total: dict[str, int] = {}
    recent: dict[str, list[str]] = {}
    by_cat: dict[str, dict[str, int]] = {}
    rows: list[tuple[str, int, int]] = []
    for s in range(config.source_parallelism):
        stream = events(config, s, config.source_parallelism, 0)
        if offsets is not None:
            stream = islice(stream, offsets[s])
        for user, (item, cents, category) in stream:
            count[user] = count.get(user, 0) + 1
            total[user] = total.get(user, 0) + cents
            lst = recent.setdefault(user, [])
            lst.append(item)
            if len(lst) > RECENT:
                del lst[0]
            cats = by_cat.setdefault(user, {})
            cats[category] = cats.get(category, 0) + 1
            rows.append((user, count[user], total[user]))
    rows.sort()
    return rows, {
        "count": count,
        "total_cents": total,
        "recent_items": recent,
        "by_category": by_cat,
    }


def offsets_of(checkpoint_offsets: dict[str, Any], config: DemoConfig) -> list[int]:
    """The per-subtask source offsets of a checkpoint (``CompletedCheckpoint.source_offsets``)."""
    return [int(checkpoint_offsets[f"events/{s}"]) for s in range(config.source_parallelism)]
