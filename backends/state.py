"""The keyed-state API: descriptors, the state interfaces, and change operation codes.

A pipeline author declares state with a descriptor and gets a state object from the
backend; every call acts on the backend's *current key* (``set_current_key``), as in
Flink. State objects are owned by the task thread that owns their backend.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from backends.serializers import PICKLE, Serializer
from dstl.errors import CorruptionError, SchemaMismatchError

K = TypeVar("K")
V = TypeVar("V")
UK = TypeVar("UK")


class StateKind(enum.StrEnum):
    """The kinds of keyed state."""

    VALUE = "value"
    LIST = "list"
    MAP = "map"


class Op(enum.IntEnum):
    """Change operation codes written to the DSTL (stable: part of the segment format)."""

    META = 0  # a state's metadata (value: StateMeta JSON); key group -1
    VALUE_SET = 1  # value: serialized value
    CLEAR = 2  # the current key's entry of this state is gone
    LIST_ADD = 3  # value: one serialized element
    LIST_SET = 4  # value: pack_list of serialized elements
    MAP_PUT = 5  # user_key, value
    MAP_REMOVE = 6  # user_key


@dataclass(frozen=True, slots=True)
class StateMeta:
    """What a restore needs to rebuild a state without the user's descriptor."""

    name: str
    kind: StateKind
    value_serializer: str
    user_key_serializer: str | None = None

    def to_json(self) -> bytes:
        """Self-describing JSON bytes (META records, table footers)."""
        return json.dumps(
            {
                "name": self.name,
                "kind": self.kind.value,
                "value": self.value_serializer,
                "user_key": self.user_key_serializer,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StateMeta:
        """Inverse of :meth:`to_json`."""
        try:
            raw = json.loads(data)
            return cls(raw["name"], StateKind(raw["kind"]), raw["value"], raw.get("user_key"))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"invalid state metadata {data[:200]!r}") from exc

    def check_compatible(self, other: StateMeta) -> None:
        """Raise :class:`SchemaMismatchError` unless ``other`` declares the same state."""
        if self != other:
            raise SchemaMismatchError(
                f"state {self.name!r} was written as {self.kind.value}"
                f"<{self.user_key_serializer or ''}{',' if self.user_key_serializer else ''}{self.value_serializer}> "
                f"but is declared as {other.kind.value}"
                f"<{other.user_key_serializer or ''}{',' if other.user_key_serializer else ''}{other.value_serializer}>"
            )


@dataclass(frozen=True, slots=True)
class ValueStateDescriptor(Generic[V]):
    """A single value per key."""

    name: str
    serializer: Serializer = PICKLE
    default: V | None = None

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state."""
        return StateMeta(self.name, StateKind.VALUE, self.serializer.name)


@dataclass(frozen=True, slots=True)
class ListStateDescriptor(Generic[V]):
    """A list of elements per key."""

    name: str
    serializer: Serializer = PICKLE

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state."""
        return StateMeta(self.name, StateKind.LIST, self.serializer.name)


@dataclass(frozen=True, slots=True)
class MapStateDescriptor(Generic[UK, V]):
    """A map of user keys to values per key."""

    name: str
    user_key_serializer: Serializer = PICKLE
    value_serializer: Serializer = PICKLE

    @property
    def meta(self) -> StateMeta:
        """The recorded shape of this state."""
        return StateMeta(
            self.name, StateKind.MAP, self.value_serializer.name, self.user_key_serializer.name
        )


StateDescriptor = (
    ValueStateDescriptor[Any] | ListStateDescriptor[Any] | MapStateDescriptor[Any, Any]
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
