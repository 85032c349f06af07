"""Keyed state: the state API, key groups, serializers, stores and the changelog wrapper."""

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from backends.heap import HeapKeyedStateBackend, StateSnapshot
from backends.keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, key_group_for
from backends.restore import restore_changelog_backend, restore_into
from backends.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    Op,
    StateKind,
    StateMeta,
    ValueStateDescriptor,
)

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "ChangelogKeyedStateBackend",
    "HeapKeyedStateBackend",
    "KeyGroupRange",
    "KeyedStateHandle",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "MaterializationHandle",
    "Op",
    "StateFileHandle",
    "StateKind",
    "StateMeta",
    "StateSnapshot",
    "ValueStateDescriptor",
    "key_group_for",
    "restore_changelog_backend",
    "restore_into",
]
