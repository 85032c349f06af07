"""The keyed-state API: descriptors, the state interfaces, and change operation codes.

A pipeline author declares state with a descriptor and gets a state object from the
backend; every call acts on the backend's *current key* (``set_current_key``), as in
Flink. State objects are owned by the task thread that owns their backend.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from backends.serializers import BOOL, INT64, PICKLE, Serializer, serializer_for
from dstl.errors import ConfigError, CorruptionError, SchemaMismatchError

K = TypeVar("K")
V = TypeVar("V")
V_in = TypeVar("V_in", contravariant=True)
OUT_co = TypeVar("OUT_co", covariant=True)
UK = TypeVar("UK")
ACC = TypeVar("ACC")
OUT = TypeVar("OUT")


class StateKind(enum.StrEnum):
    """The kinds of keyed state."""

    VALUE = "value"
    LIST = "list"
    MAP = "map"
    REDUCING = "reducing"  # stored like value state: the accumulator
    AGGREGATING = "aggregating"  # stored like value state: the accumulator
    TIMER = "timer"  # stored like map state: timestamp -> True per key


VALUE_LIKE = frozenset({StateKind.VALUE, StateKind.REDUCING, StateKind.AGGREGATING})
MAP_LIKE = frozenset({StateKind.MAP, StateKind.TIMER})


class Op(enum.IntEnum):
    """Change operation codes written to the DSTL (stable: part of the segment format)."""

    META = 0  # a state's metadata (value: StateMeta JSON); key group -1
    VALUE_SET = 1  # value: serialized value
    CLEAR = 2  # the current key's entry of this state is gone
    LIST_ADD = 3  # value: one serialized element
    LIST_SET = 4  # value: pack_list of serialized elements
    MAP_PUT = 5  # user_key, value
    MAP_REMOVE = 6  # user_key
    ACC_SET = 7  # value: the new accumulator of reducing/aggregating state (not the input)
    TIMER_REGISTER = 8  # user_key: the timer's timestamp (int64), value: serialized True
    TIMER_DELETE = 9  # user_key: the timer's timestamp (fired or deleted)


@dataclass(frozen=True, slots=True)
class StateTtlConfig:
    """Time-to-live of a state's entries (value, list element, map entry).

    An entry expires ``ttl_ms`` after it was last written (``update_on_read=False``, Flink's
    OnCreateAndWrite) or last read or written (``update_on_read=True``). Expired entries are
    never returned; they are removed on access and when the heap store snapshots. Time
    comes from the backend's injectable ``clock`` (milliseconds).
    """

    ttl_ms: int
    update_on_read: bool = False

    def __post_init__(self) -> None:
        if self.ttl_ms <= 0:
            raise ConfigError(f"ttl_ms must be > 0, got {self.ttl_ms}")


@dataclass(frozen=True, slots=True)
class StateMeta:
    """What a restore needs to rebuild a state without the user's descriptor."""

    name: str
    kind: StateKind
    value_serializer: str
    user_key_serializer: str | None = None
    ttl: StateTtlConfig | None = None
    # Not part of the state's identity: whether its serializers may run the store's code
    # (see :func:`backends.serializers.serializer_for`). False when tools read a store.
    trusted: bool = field(default=True, compare=False, repr=False)

    def untrusted(self) -> StateMeta:
        """The same state, resolved so that reading it runs none of the store's code."""
        return replace(self, trusted=False) if self.trusted else self

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of :meth:`to_json` (TTL keys only when TTL is on)."""
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind.value,
            "value": self.value_serializer,
            "user_key": self.user_key_serializer,
        }
        if self.ttl is not None:
            out["ttl_ms"] = self.ttl.ttl_ms
            out["ttl_update_on_read"] = self.ttl.update_on_read
        return out

    def to_json(self) -> bytes:
        """Self-describing JSON bytes (META records, table footers)."""
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StateMeta:
        """Inverse of :meth:`to_dict`; raises KeyError/ValueError/TypeError when invalid."""
        ttl = None
        if raw.get("ttl_ms") is not None:
            ttl = StateTtlConfig(int(raw["ttl_ms"]), bool(raw.get("ttl_update_on_read")))
        return cls(raw["name"], StateKind(raw["kind"]), raw["value"], raw.get("user_key"), ttl)

    @classmethod
    def from_json(cls, data: bytes) -> StateMeta:
        """Inverse of :meth:`to_json`."""
        try:
            return cls.from_dict(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"invalid state metadata {data[:200]!r}") from exc

    def value_ser(self) -> Serializer:
        """The user's value (element, accumulator) serializer."""
        return serializer_for(self.value_serializer, self.trusted)

    def raw_value_ser(self) -> Serializer:
        """The serializer of stored values: the user's, wrapped as ``(ts, value)`` with TTL."""
        ser = serializer_for(self.value_serializer, self.trusted)
        return ser if self.ttl is None else serializer_for(f"ttl<{ser.name}>", self.trusted)

    def user_key_ser(self) -> Serializer:
        """The user-key serializer of map-like state."""
        if self.user_key_serializer is None:
            raise ConfigError(f"state {self.name!r} ({self.kind.value}) has no user keys")
        return serializer_for(self.user_key_serializer, self.trusted)

    def check_compatible(self, other: StateMeta) -> None:
        """Raise :class:`SchemaMismatchError` unless ``other`` declares the same state."""
        if self != other:
            raise SchemaMismatchError(
                f"state {self.name!r} was written as {self.describe()} "
                f"but is declared as {other.describe()}"
            )

    def describe(self) -> str:
        """``kind<user key,value>`` plus the TTL, for error messages."""
        uk = f"{self.user_key_serializer}," if self.user_key_serializer else ""
        ttl = "" if self.ttl is None else f" ttl={self.ttl.ttl_ms}ms"
        return f"{self.kind.value}<{uk}{self.value_serializer}>{ttl}"


@dataclass(frozen=True, slots=True)
class ValueStateDescriptor(Generic[V]):
    """A single value per key."""

    name: str
    serializer: Serializer = PICKLE
    default: V | None = None
    ttl: StateTtlConfig | None = None

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state."""
        return StateMeta(self.name, StateKind.VALUE, self.serializer.name, None, self.ttl)


@dataclass(frozen=True, slots=True)
class ListStateDescriptor(Generic[V]):
    """A list of elements per key."""

    name: str
    serializer: Serializer = PICKLE
    ttl: StateTtlConfig | None = None

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state (TTL applies per element)."""
        return StateMeta(self.name, StateKind.LIST, self.serializer.name, None, self.ttl)


@dataclass(frozen=True, slots=True)
class MapStateDescriptor(Generic[UK, V]):
    """A map of user keys to values per key."""

    name: str
    user_key_serializer: Serializer = PICKLE
    value_serializer: Serializer = PICKLE
    ttl: StateTtlConfig | None = None

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state (TTL applies per entry)."""
        return StateMeta(
            self.name,
            StateKind.MAP,
            self.value_serializer.name,
            self.user_key_serializer.name,
            self.ttl,
        )


@dataclass(frozen=True, slots=True)
class ReducingStateDescriptor(Generic[V]):
    """One value per key, combined with ``reduce_function(accumulator, new)`` on add.

    The store keeps, and the changelog logs, the reduced value (never the inputs).
    """

    name: str
    reduce_function: Callable[[V, V], V]
    serializer: Serializer = PICKLE
    ttl: StateTtlConfig | None = None

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state."""
        return StateMeta(self.name, StateKind.REDUCING, self.serializer.name, None, self.ttl)


class AggregateFunction(Protocol[V_in, ACC, OUT_co]):
    """Flink's aggregate function: an accumulator of inputs ``V`` with a result ``OUT``.

    ``add`` and ``merge`` may mutate and return their accumulator argument.
    """

    def create_accumulator(self) -> ACC:
        """A fresh, empty accumulator."""
        ...

    def add(self, value: V_in, accumulator: ACC) -> ACC:
        """``accumulator`` with ``value`` added."""
        ...

    def get_result(self, accumulator: ACC) -> OUT_co:
        """The result of ``accumulator``."""
        ...

    def merge(self, a: ACC, b: ACC) -> ACC:
        """The accumulator of both ``a``'s and ``b``'s inputs."""
        ...


@dataclass(frozen=True, slots=True)
class AggregatingStateDescriptor(Generic[V, ACC, OUT]):
    """One accumulator per key, updated by ``aggregate_function``.

    ``accumulator_serializer`` serializes the accumulator; the store keeps, and the
    changelog logs, the new accumulator after every ``add``/``merge`` (never the inputs).
    """

    name: str
    aggregate_function: AggregateFunction[V, ACC, OUT]
    accumulator_serializer: Serializer = PICKLE
    ttl: StateTtlConfig | None = None

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state."""
        return StateMeta(
            self.name, StateKind.AGGREGATING, self.accumulator_serializer.name, None, self.ttl
        )


@dataclass(frozen=True, slots=True)
class TimerStateDescriptor:
    """Internal: the timers of one time domain, a set of timestamps per key.

    Use :class:`backends.timers.TimerService` rather than this directly.
    """

    name: str

    @property
    def meta(self) -> StateMeta:
        """The recorded shape: map-like, user key = timestamp (int64), value = True."""
        return StateMeta(self.name, StateKind.TIMER, BOOL.name, INT64.name)


StateDescriptor = (
    ValueStateDescriptor[Any]
    | ListStateDescriptor[Any]
    | MapStateDescriptor[Any, Any]
    | ReducingStateDescriptor[Any]
    | AggregatingStateDescriptor[Any, Any, Any]
    | TimerStateDescriptor
)


class ValueState(Protocol[V]):
    """One value for the current key."""

    def value(self) -> V | None:
        """The current key's value, or the descriptor's default."""
        ...

    def update(self, value: V) -> None:
        """Set the current key's value."""
        ...

    def clear(self) -> None:
        """Remove the current key's value."""
        ...


class ListState(Protocol[V]):
    """A list for the current key."""

    def get(self) -> list[V]:
        """A copy of the current key's list (empty if none)."""
        ...

    def add(self, value: V) -> None:
        """Append one element."""
        ...

    def update(self, values: Iterable[V]) -> None:
        """Replace the whole list."""
        ...

    def clear(self) -> None:
        """Remove the current key's list."""
        ...


class MapState(Protocol[UK, V]):
    """A map for the current key."""

    def get(self, user_key: UK) -> V | None:
        """The value of ``user_key``, or None."""
        ...

    def put(self, user_key: UK, value: V) -> None:
        """Set ``user_key`` to ``value``."""
        ...

    def remove(self, user_key: UK) -> None:
        """Remove ``user_key`` (no error if absent)."""
        ...

    def contains(self, user_key: UK) -> bool:
        """Whether ``user_key`` is present."""
        ...

    def items(self) -> Iterator[tuple[UK, V]]:
        """The entries (a snapshot: safe to mutate the state while iterating)."""
        ...

    def clear(self) -> None:
        """Remove the current key's whole map."""
        ...


class ReducingState(Protocol[V]):
    """A reduced value for the current key."""

    def get(self) -> V | None:
        """The reduced value, or None."""
        ...

    def add(self, value: V) -> None:
        """Reduce ``value`` into the current value."""
        ...

    def clear(self) -> None:
        """Remove the current key's value."""
        ...


class AggregatingState(Protocol[V_in, OUT_co]):
    """An aggregate for the current key."""

    def get(self) -> OUT_co | None:
        """The aggregate's result, or None if nothing was added."""
        ...

    def add(self, value: V_in) -> None:
        """Add ``value`` to the accumulator."""
        ...

    def merge_accumulator(self, accumulator: Any) -> None:
        """Merge a partial accumulator (e.g. a pre-aggregated batch) into the state."""
        ...

    def clear(self) -> None:
        """Remove the current key's accumulator."""
        ...
