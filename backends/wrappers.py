"""User-facing states built on a store's *raw* states: TTL, reducing, aggregating.

Every store (heap, RocksDB) offers three raw shapes per state (value-like, list, map);
the changelog wrapper mirrors raw mutations into the log. The behaviour above that is
store-independent and lives here, so both stores, with or without the changelog, share
it: ``user = wrap(descriptor, raw, clock)``.

With TTL a raw value is ``(timestamp_ms, value)`` (per list element, per map entry), so
the log and the materialized tables carry timestamps and a restore keeps expiry exact.
Reducing and aggregating state store (and log) the accumulator, never the inputs.
All objects here are owned by the task thread of their backend. Callables kept on
``self`` (the clock, the reduce function) are called through a local: see
tests/backends/test_call_sites.py for why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from backends.state import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateTtlConfig,
    TimerStateDescriptor,
    ValueStateDescriptor,
)
from dstl.errors import ConfigError

Clock = Callable[[], int]


class DefaultValueState:
    """A value state that returns ``default`` instead of None, over a raw state that
    cannot read with a default itself (one more Python call per read; the stores' raw
    value states can: see :func:`wrap`). Task thread only."""

    __slots__ = ("_default", "_raw")

    def __init__(self, raw: Any, default: Any) -> None:
        self._raw = raw
        self._default = default

    def value(self) -> Any:
        v = self._raw.value()
        return self._default if v is None else v

    def update(self, value: Any) -> None:
        self._raw.update(value)

    def clear(self) -> None:
        self._raw.clear()


class TtlValueState:
    """Value state whose raw value is ``(ts, value)``; expired values read as absent.

    Task thread only. An expired value is cleared (a logged mutation) when read.
    """

    __slots__ = ("_clock", "_default", "_on_read", "_raw", "_ttl")

    def __init__(self, raw: Any, clock: Clock, ttl: StateTtlConfig, default: Any = None) -> None:
        self._raw = raw
        self._clock = clock
        self._ttl = ttl.ttl_ms
        self._on_read = ttl.update_on_read
        self._default = default

    def value(self) -> Any:
        tv = self._raw.value()
        if tv is None:
            return self._default
        clock = self._clock
        now = clock()
        if now >= tv[0] + self._ttl:
            self._raw.clear()
            return self._default
        if self._on_read:
            self._raw.update((now, tv[1]))
        return tv[1]

    def update(self, value: Any) -> None:
        clock = self._clock
        self._raw.update((clock(), value))

    def clear(self) -> None:
        self._raw.clear()


class TtlListState:
    """List state with a timestamp per element; expired elements are dropped on access.

    Task thread only.
    """

    __slots__ = ("_clock", "_on_read", "_raw", "_ttl")

    def __init__(self, raw: Any, clock: Clock, ttl: StateTtlConfig) -> None:
        self._raw = raw
        self._clock = clock
        self._ttl = ttl.ttl_ms
        self._on_read = ttl.update_on_read

    def get(self) -> list[Any]:
        elements = self._raw.get()
        if not elements:
            return []
        clock = self._clock
        now = clock()
        ttl = self._ttl
        alive = [e for e in elements if now < e[0] + ttl]
        if self._on_read and alive:
            self._raw.update([(now, v) for _, v in alive])
        elif len(alive) != len(elements):
            self._raw.update(alive)
        return [v for _, v in alive]

    def add(self, value: Any) -> None:
        clock = self._clock
        self._raw.add((clock(), value))

    def update(self, values: Iterable[Any]) -> None:
        clock = self._clock
        now = clock()
        self._raw.update([(now, v) for v in values])

    def clear(self) -> None:
        self._raw.clear()


class TtlMapState:
    """Map state with a timestamp per entry; expired entries are removed on access.

    Task thread only.
    """

    __slots__ = ("_clock", "_on_read", "_raw", "_ttl")

    def __init__(self, raw: Any, clock: Clock, ttl: StateTtlConfig) -> None:
        self._raw = raw
        self._clock = clock
        self._ttl = ttl.ttl_ms
        self._on_read = ttl.update_on_read

    def _alive(self, user_key: Any) -> tuple[bool, Any]:
        tv = self._raw.get(user_key)
        if tv is None:
            return False, None
        clock = self._clock
        now = clock()
        if now >= tv[0] + self._ttl:
            self._raw.remove(user_key)
            return False, None
        if self._on_read:
            self._raw.put(user_key, (now, tv[1]))
        return True, tv[1]

    def get(self, user_key: Any) -> Any:
        return self._alive(user_key)[1]

    def contains(self, user_key: Any) -> bool:
        return self._alive(user_key)[0]

    def put(self, user_key: Any, value: Any) -> None:
        clock = self._clock
        self._raw.put(user_key, (clock(), value))

    def remove(self, user_key: Any) -> None:
        self._raw.remove(user_key)

    def items(self) -> Iterator[tuple[Any, Any]]:
        clock = self._clock
        now = clock()
        ttl = self._ttl
        out: list[tuple[Any, Any]] = []
        for uk, (ts, v) in list(self._raw.items()):
            if now >= ts + ttl:
                self._raw.remove(uk)
                continue
            if self._on_read:
                self._raw.put(uk, (now, v))
            out.append((uk, v))
        return iter(out)

    def clear(self) -> None:
        self._raw.clear()


class ReducingStateImpl:
    """Reducing state over a value-like raw state holding the reduced value.

    Task thread only. ``add`` reads, reduces and writes the accumulator, so the changelog
    logs the new accumulator (``ACC_SET``), not the input.
    """

    __slots__ = ("_fn", "_raw")

    def __init__(self, raw: Any, fn: Callable[[Any, Any], Any]) -> None:
        self._raw = raw
        self._fn = fn

    def get(self) -> Any:
        return self._raw.value()

    def add(self, value: Any) -> None:
        acc, fn = self._raw.value(), self._fn
        self._raw.update(value if acc is None else fn(acc, value))

    def clear(self) -> None:
        self._raw.clear()


class AggregatingStateImpl:
    """Aggregating state over a value-like raw state holding the accumulator.

    Task thread only. Every ``add``/``merge_accumulator`` writes the new accumulator.
    """

    __slots__ = ("_agg", "_raw")

    def __init__(self, raw: Any, agg: Any) -> None:
        self._raw = raw
        self._agg = agg

    def get(self) -> Any:
        acc = self._raw.value()
        return None if acc is None else self._agg.get_result(acc)

    def add(self, value: Any) -> None:
        acc = self._raw.value()
        if acc is None:
            acc = self._agg.create_accumulator()
        self._raw.update(self._agg.add(value, acc))

    def merge_accumulator(self, accumulator: Any) -> None:
        acc = self._raw.value()
        self._raw.update(accumulator if acc is None else self._agg.merge(acc, accumulator))

    def clear(self) -> None:
        self._raw.clear()


def wrap(descriptor: StateDescriptor, raw: Any, clock: Clock) -> Any:
    """The user-facing state of ``descriptor`` over the store's raw state ``raw``.

    Returns ``raw`` itself when no behaviour is needed (plain value/list/map state without
    TTL), so the hot path pays for no extra call. A plain value state with a default is
    ``raw.with_default(default)`` when the raw state has it and it is not None (a view over
    the same entries and log whose ``value()`` reads the default itself: no extra call
    either), else a :class:`DefaultValueState`.
    """
    ttl = getattr(descriptor, "ttl", None)
    if isinstance(descriptor, ValueStateDescriptor):
        if ttl is not None:
            return TtlValueState(raw, clock, ttl, descriptor.default)
        if descriptor.default is None:
            return raw
        with_default = getattr(raw, "with_default", None)
        view = None if with_default is None else with_default(descriptor.default)
        return DefaultValueState(raw, descriptor.default) if view is None else view
    if isinstance(descriptor, ListStateDescriptor):
        return raw if ttl is None else TtlListState(raw, clock, ttl)
    if isinstance(descriptor, MapStateDescriptor):
        return raw if ttl is None else TtlMapState(raw, clock, ttl)
    if isinstance(descriptor, ReducingStateDescriptor):
        inner = raw if ttl is None else TtlValueState(raw, clock, ttl)
        return ReducingStateImpl(inner, descriptor.reduce_function)
    if isinstance(descriptor, AggregatingStateDescriptor):
        inner = raw if ttl is None else TtlValueState(raw, clock, ttl)
        return AggregatingStateImpl(inner, descriptor.aggregate_function)
    if isinstance(descriptor, TimerStateDescriptor):
        return raw
    raise ConfigError(f"unknown state descriptor {descriptor!r}")


def alive(value: Any, kind_is_list: bool, kind_is_map: bool, ttl_ms: int, now: int) -> Any:
    """The unexpired part of a raw TTL entry (None when nothing is left).

    Used by snapshots and restores to drop expired data (value: ``(ts, v)``; list: a list
    of those; map: a dict of those).
    """
    if kind_is_list:
        kept = [e for e in value if now < e[0] + ttl_ms]
        return kept or None
    if kind_is_map:
        kept_map = {k: e for k, e in value.items() if now < e[0] + ttl_ms}
        return kept_map or None
    return value if now < value[0] + ttl_ms else None
