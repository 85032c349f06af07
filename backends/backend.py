"""The seam every keyed-state store implements (heap, RocksDB).

:class:`~backends.changelog.ChangelogKeyedStateBackend`, restore and the timer service
work against this Protocol, so a new store inherits them (and the contract tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from backends.batch import PreparedBatch
from backends.keygroups import KeyGroupRange
from backends.serializers import Serializer
from backends.snapshot import MaterializationSnapshot
from backends.state import StateDescriptor, StateMeta


def wall_clock_ms() -> int:
    """The default TTL clock: wall time in milliseconds."""
    return time.time_ns() // 1_000_000


class KeyedStateBackend(Protocol):
    """Keyed state for the key groups in ``key_group_range``. Task thread only.

    Invariants: every stored entry's key hashes into ``key_group_range``; state calls act
    on the current key; ``internal_state(meta)`` gives the *raw* state (values as stored:
    ``(ts, value)`` with TTL; the accumulator for reducing/aggregating; ``{ts: True}`` for
    timers) that replay and the changelog use; ``entries`` yields raw values too.
    """

    key_serializer: Serializer
    key_group_range: KeyGroupRange
    max_parallelism: int
    current_key: Any
    current_key_bytes: bytes
    current_key_group: int
    clock: Callable[[], int]

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key every state call acts on."""
        ...

    def set_current_key_raw(self, key: Any, key_bytes: bytes, key_group: int) -> None:
        """Set the current key when its bytes and group are already known."""
        ...

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The user-facing state of ``descriptor`` (same object on every call)."""
        ...

    def register_restored(self, meta: StateMeta) -> None:
        """Declare a state known from a checkpoint."""
        ...

    def state_metas(self) -> dict[str, StateMeta]:
        """Every state declared or restored, by name."""
        ...

    def internal_state(self, meta: StateMeta) -> Any:
        """The raw state of ``meta`` (registers it if needed)."""
        ...

    def snapshot(self, sqn: int | None = None) -> MaterializationSnapshot:
        """A consistent snapshot for materialization (short; task thread)."""
        ...

    def load_entries(
        self,
        meta: StateMeta,
        runs: Iterable[tuple[int, list[Any], list[Any]]],
        only: KeyGroupRange | None = None,
    ) -> None:
        """Bulk-insert raw entries (values, lists or dicts), one ``(key_group, keys,
        values)`` run per key group, skipping groups not in ``only``."""
        ...

    def entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """``(key_group, key, raw value)`` of every entry of state ``name``, by key group."""
        ...

    def entry_count(self) -> int:
        """How many (state, key) entries exist (RocksDB: an estimate)."""
        ...

    def apply_batch(
        self, descriptor: StateDescriptor, keys: Any, values: Any, user_keys: Any = None
    ) -> None:
        """Columnar update: value set / list add / map put for many keys at once."""
        ...

    def apply_prepared(self, meta: StateMeta, batch: PreparedBatch) -> None:
        """Apply a batch prepared by :func:`~backends.batch.prepare_batch`."""
        ...

    def close(self) -> None:
        """Release local resources (idempotent)."""
        ...
