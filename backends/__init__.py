"""Keyed state: the state API, key groups, serializers, stores and the changelog wrapper."""

from backends.backend import KeyedStateBackend, wall_clock_ms
from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from backends.heap import HeapKeyedStateBackend, StateSnapshot
from backends.keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, key_group_for
from backends.restore import restore_changelog_backend, restore_into
from backends.rocksdb import RocksDBKeyedStateBackend, RocksDBSnapshot
from backends.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    Op,
    ReducingStateDescriptor,
    StateKind,
    StateMeta,
    StateTtlConfig,
    ValueStateDescriptor,
)
from backends.timers import TimeDomain, TimerService

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "AggregateFunction",
    "AggregatingStateDescriptor",
    "ChangelogKeyedStateBackend",
    "HeapKeyedStateBackend",
    "KeyGroupRange",
    "KeyedStateBackend",
    "KeyedStateHandle",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "MaterializationHandle",
    "Op",
    "ReducingStateDescriptor",
    "RocksDBKeyedStateBackend",
    "RocksDBSnapshot",
    "StateFileHandle",
    "StateKind",
    "StateMeta",
    "StateSnapshot",
    "StateTtlConfig",
    "TimeDomain",
    "TimerService",
    "ValueStateDescriptor",
    "key_group_for",
    "restore_changelog_backend",
    "restore_into",
    "wall_clock_ms",
]
