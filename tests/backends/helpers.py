"""Shared test helpers: a canonical dump of a backend, a workload over every state type."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from backends import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    TimeDomain,
    TimerService,
    ValueStateDescriptor,
    key_group_for,
)
from backends.serializers import FLOAT64, INT64, PICKLE, STR, tuple_of
from backends.state import MAP_LIKE, StateKind
from backends.wrappers import alive


@dataclass
class MeanAgg:
    """Mean of floats; accumulator (count, sum) as a typed tuple."""

    def create_accumulator(self) -> tuple[int, float]:
        return (0, 0.0)

    def add(self, value: float, acc: tuple[int, float]) -> tuple[int, float]:
        return (acc[0] + 1, acc[1] + value)

    def get_result(self, acc: tuple[int, float]) -> float:
        return acc[1] / acc[0] if acc[0] else 0.0

    def merge(self, a: tuple[int, float], b: tuple[int, float]) -> tuple[int, float]:
        return (a[0] + b[0], a[1] + b[1])


def _add(a: int, b: int) -> int:
    return a + b


COUNT = ValueStateDescriptor("count", INT64)
ITEMS = ListStateDescriptor("items", STR)
PRICES = MapStateDescriptor("prices", STR, FLOAT64)
BLOB = ValueStateDescriptor("blob", PICKLE)
TOTAL = ReducingStateDescriptor("total", _add, INT64)
MEAN = AggregatingStateDescriptor("mean", MeanAgg(), tuple_of(INT64, FLOAT64))
PAIR = ValueStateDescriptor("pair", tuple_of(STR, INT64))
TTL_VALUE = ValueStateDescriptor("ttl_value", INT64, ttl=StateTtlConfig(1000))
TTL_LIST = ListStateDescriptor("ttl_list", STR, ttl=StateTtlConfig(1000))
TTL_MAP = MapStateDescriptor("ttl_map", STR, INT64, ttl=StateTtlConfig(1000, update_on_read=True))
ALL = (COUNT, ITEMS, PRICES, BLOB, TOTAL, MEAN, PAIR, TTL_VALUE, TTL_LIST, TTL_MAP)


def dump(backend: Any) -> dict[str, dict[Any, Any]]:
    """Every state's live (unexpired) raw entries: ``{state: {key: value}}``."""
    now = backend.clock()
    out: dict[str, dict[Any, Any]] = {}
    for name, meta in sorted(backend.state_metas().items()):
        entries: dict[Any, Any] = {}
        for _kg, key, value in backend.entries(name):
            v = value
            if meta.ttl is not None:
                v = alive(
                    v, meta.kind is StateKind.LIST, meta.kind in MAP_LIKE, meta.ttl.ttl_ms, now
                )
            if v is None or v == [] or v == {}:
                continue
            assert key not in entries
            entries[key] = list(v) if isinstance(v, list) else v
        if entries:
            out[name] = entries
    return out


def snapshot_entries(backend: Any) -> dict[str, dict[Any, Any]]:
    """A heap store's entries as its snapshot sees them: ``{state: {key: value}}`` (raw, no
    TTL filtering; states without entries are left out)."""
    out: dict[str, dict[Any, Any]] = {}
    for name, table in backend.snapshot().tables.items():
        for entries in table.values():
            out.setdefault(name, {}).update(entries)
    return out


def merge_dumps(dumps: list[dict[str, dict[Any, Any]]]) -> dict[str, dict[Any, Any]]:
    """Union of per-subtask dumps; a key in two subtasks is a bug."""
    merged: dict[str, dict[Any, Any]] = {}
    for d in dumps:
        for name, entries in d.items():
            target = merged.setdefault(name, {})
            assert not (target.keys() & entries.keys()), "a key restored into two subtasks"
            target.update(entries)
    return merged


def owns(backend: Any, key: str) -> bool:
    return key_group_for(STR.serialize(key), backend.max_parallelism) in backend.key_group_range


def apply_op(backend: Any, key: str, op: int, i: int, clock: Any, timers: Any) -> None:
    """One operation of a workload over every state type (``op`` in ``range(N_OPS)``)."""
    backend.set_current_key(key)
    s = backend.get_state
    if op == 0:
        c = s(COUNT)
        c.update((c.value() or 0) + 1)
    elif op == 1:
        s(COUNT).clear()
    elif op == 2:
        s(ITEMS).add(f"i{i}")
    elif op == 3:
        s(ITEMS).update(s(ITEMS).get()[-2:])
    elif op == 4:
        s(ITEMS).clear()
    elif op == 5:
        s(PRICES).put(f"p{i % 5}", i * 0.5)
    elif op == 6:
        s(PRICES).remove(f"p{i % 5}")
    elif op == 7:
        s(BLOB).update({"i": i, "t": (1, "x")})
    elif op == 8:
        s(PRICES).clear()
    elif op == 9:
        s(TOTAL).add(i)
    elif op == 10:
        s(MEAN).add(i * 0.25)
    elif op == 11:
        s(PAIR).update((key, i))
    elif op == 12:
        s(TTL_VALUE).update(i)
    elif op == 13:
        s(TTL_LIST).add(f"t{i}")
    elif op == 14:
        s(TTL_MAP).put(f"m{i % 3}", i)
    elif op == 15:
        s(TTL_MAP).get(f"m{i % 3}")  # refreshes on read (logged)
    elif op == 16:
        clock.advance(300)
    elif op == 17:
        timers.register(i * 10)
    elif op == 18:
        timers.delete((i - 1) * 10)
    else:
        timers.fire_until(i * 5, lambda ts, k: s(TOTAL).add(1))


N_OPS = 20


def workload(backend: Any, seed: int, n: int, clock: Any, keys: int = 40) -> None:
    """``n`` random operations on random keys the backend owns."""
    rnd = random.Random(seed)
    timers = TimerService(backend, TimeDomain.EVENT)
    for i in range(n):
        key = f"k{rnd.randrange(keys)}"
        if owns(backend, key):
            apply_op(backend, key, rnd.randrange(N_OPS), i, clock, timers)


def opened_with_level(log: str) -> int:
    """The bottommost zstd level a RocksDB database was last opened with, from its LOG
    (RocksDB writes every option it opens with there)."""
    with open(log) as f:
        levels = [ln.split(":")[-1] for ln in f if "bottommost_compression_opts.level:" in ln]
    return int(levels[-1])
