"""Heap materialization snapshots packed into Arrow columns on the task thread.

Why not a fork (:mod:`backends.forked`) for every big heap store: after a fork every page
the task thread writes while the child lives is copied first, and a uniform update stream
writes nearly every page of the state's dicts (entries, value objects, the keys'
reference counts) within 0.1 s. On this VM a copy-on-write fault costs ~10-15 us: at 1M
keys x 2 value states, ~35k faults took 0.3-0.5 s of the task thread per
materialization, and records/s while one ran fell to 0.6-0.7 of the rate without one (a
loop of two dict updates per record fell to 0.35-0.65 of its rate while a forked child
merely slept). Packing the same state (:func:`backends._heapstate.pack`: C, no Python
object made or referenced per entry) takes ~100 ms of the task thread at that size, once,
and nothing after it.

So when every state of a heap store is value-like (value, reducing, aggregating) with a
key and a value type that pack straight from the dicts (int64, float64, str, bytes, no
TTL), :func:`packed_snapshot` builds each state's Arrow table (key group, key, value;
key groups ascending) on the task thread, and the upload thread cuts it into the same
pieces :func:`~backends.tables.state_files` makes (sorted by Arrow, Parquet-encoded by
Arrow: both release the GIL), byte for byte. Otherwise (list or map state, pickled or
TTL values) it returns None and the caller forks or copies as before.

The upload thread runs at the task's priority. At niceness 10 (the forked child's) the
encoding waited behind every other process on a loaded 2-core machine: a materialization
of 1M keys took 1.4-3.1 s instead of 0.5-0.9 s, and the log a checkpoint carries grew
with it (space_amp 1.53-1.60 instead of 1.14-1.33, load 5-7); its CPU (~0.2 s at 1M keys
x 2 states) is taken from the task either way.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange
from backends.serializers import Serializer
from backends.snapshot import SnapshotFile
from backends.state import MAP_LIKE, StateKind, StateMeta
from backends.tables import DEFAULT_PIECE_ROWS, packable, sort_rows, state_pieces, table_for


@dataclass(frozen=True, slots=True)
class _PackedState:
    """One state's rows as of the snapshot: ``table`` (key groups ascending, each key
    group's rows in the dict's order), and its non-empty key groups with their rows."""

    meta: StateMeta
    table: pa.Table
    groups: list[int]  # ascending
    starts: list[int]  # row of each group's first entry; one more: the row count

    def counts(self) -> dict[int, int]:
        return {kg: self.starts[i + 1] - self.starts[i] for i, kg in enumerate(self.groups)}

    def rows(self, key_groups: range) -> pa.Table:
        """Rows of ``key_groups``, sorted (see :func:`~backends.tables.sort_rows`)."""
        first = bisect.bisect_left(self.groups, key_groups.start)
        last = bisect.bisect_left(self.groups, key_groups.stop)
        start, end = self.starts[first], self.starts[last]
        return sort_rows(self.meta, self.table.slice(start, end - start))


@dataclass(slots=True, eq=False)
class PackedSnapshot:
    """A heap snapshot held as Arrow tables, one per state (built on the task thread).

    Implements :class:`~backends.snapshot.MaterializationSnapshot`, kind
    ``heap-parquet``: :meth:`pieces` yields what :func:`~backends.tables.state_files`
    yields for the state as of the snapshot. It references no live dict. One reader (the
    upload thread); :meth:`release` drops the columns.
    """

    key_serializer: Serializer
    key_group_range: KeyGroupRange
    sqn: int | None
    _states: dict[str, _PackedState] = field(repr=False)

    @property
    def kind(self) -> str:
        """The table format: typed Parquet state tables."""
        return "heap-parquet"

    def files(self) -> Iterator[SnapshotFile]:
        """:meth:`pieces` of the default size."""
        return self.pieces(DEFAULT_PIECE_ROWS)

    def pieces(self, piece_rows: int | None) -> Iterator[SnapshotFile]:
        """The pieces of every state (see :func:`~backends.tables.state_files`)."""
        rng = self.key_group_range
        for name, state in sorted(self._states.items()):
            yield from state_pieces(
                name, state.meta, self.key_serializer, rng, state.counts(), piece_rows, state.rows
            )

    def release(self) -> None:
        """Drop the columns. Idempotent."""
        self._states = {}


def packs(backend: HeapKeyedStateBackend) -> bool:
    """Whether :func:`packed_snapshot` takes ``backend`` (see the module docstring)."""
    return packable(backend.key_serializer) and all(
        meta.kind not in MAP_LIKE
        and meta.kind is not StateKind.LIST
        and packable(meta.raw_value_ser())
        for meta in backend.state_metas().values()
    )


def packed_snapshot(backend: HeapKeyedStateBackend, sqn: int | None) -> PackedSnapshot | None:
    """``backend``'s state as Arrow columns (task thread), or None if a state does not
    pack (see the module docstring). Expired TTL entries are purged first, as
    :meth:`HeapKeyedStateBackend.snapshot` does."""
    if not packs(backend):
        return None
    backend.purge_expired()
    rng = backend.key_group_range
    key_ser = backend.key_serializer
    tables = backend.live_tables()
    states: dict[str, _PackedState] = {}
    for name, meta in backend.state_metas().items():
        table = tables.get(name, {})
        groups = [kg for kg in sorted(table) if kg in rng and table[kg]]
        starts = [0]
        for kg in groups:
            starts.append(starts[-1] + len(table[kg]))
        arrow = table_for(meta, key_ser, table, groups)
        states[name] = _PackedState(meta, arrow, groups, starts)
    return PackedSnapshot(key_ser, rng, sqn, states)
