"""Restore = load materialized tables + replay the log, filtered by key group.

Works for any parallelism change: a backend restores from every handle whose key-group
range intersects its own and keeps only its own key groups. Nothing is applied partially:
every file is read and decoded before the first entry is loaded, so a corrupt or missing
file raises before the backend is touched (then it is discarded by the caller anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from backends.changelog import ChangelogKeyedStateBackend
from backends.handles import KeyedStateHandle, MaterializationHandle
from backends.heap import HeapKeyedStateBackend
from backends.keygroups import KeyGroupRange
from backends.serializers import Serializer, serializer_for, unpack_list
from backends.state import Op, StateKind, StateMeta
from backends.tables import parquet_to_table, table_entries, table_meta
from dstl.changelog import read_changes
from dstl.errors import CorruptionError, SchemaMismatchError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle


def relevant(
    handles: Sequence[KeyedStateHandle], key_groups: KeyGroupRange
) -> list[KeyedStateHandle]:
    """The handles that hold any of ``key_groups``."""
    return [h for h in handles if h.key_group_range.intersects(key_groups)]


def _load_materialization(
    backend: HeapKeyedStateBackend,
    fileio: FileIO,
    handle: MaterializationHandle,
    key_groups: KeyGroupRange,
) -> None:
    if handle.kind != "heap-parquet":
        raise CorruptionError(f"unknown materialization kind {handle.kind!r} of {handle.writer_id}")
    decoded: list[tuple[StateMeta, tuple[list[int], list[Any], list[Any]]]] = []
    for f in handle.state_files:
        table = parquet_to_table(fileio.read(fileio.relative(f.location)), f.location)
        meta, key_ser = table_meta(table, f.location)
        if key_ser.name != backend.key_serializer.name:
            raise SchemaMismatchError(
                f"state {meta.name!r} was written with key serializer {key_ser.name!r}, "
                f"the backend declares {backend.key_serializer.name!r}"
            )
        decoded.append((meta, table_entries(meta, key_ser, table)))
    for meta, (kgs, keys, values) in decoded:
        backend.load_entries(meta, kgs, keys, values, key_groups)


def _replay_table(backend: HeapKeyedStateBackend, table: pa.Table, location: str) -> None:
    states: dict[str, tuple[StateMeta, Any]] = {}
    key_ser: Serializer = backend.key_serializer
    cols = [table[c].to_pylist() for c in ("key_group", "state", "op", "key", "user_key", "value")]
    for kg, name, op, key, user_key, value in zip(*cols, strict=True):
        if op == Op.META:
            meta = StateMeta.from_json(value)
            known = backend.state_metas().get(name)
            if known is not None:
                known.check_compatible(meta)
            else:
                backend.register_restored(meta)
            continue
        entry = states.get(name)
        if entry is None:
            meta_opt = backend.state_metas().get(name)
            if meta_opt is None:
                raise CorruptionError(f"change of undeclared state {name!r}", location)
            entry = states[name] = (meta_opt, backend.internal_state(meta_opt))
        meta, state = entry
        backend.set_current_key_raw(key_ser.deserialize(key), key, kg)
        vser = serializer_for(meta.value_serializer)
        if op == Op.VALUE_SET:
            state.update(vser.deserialize(value))
        elif op == Op.CLEAR:
            state.clear()
        elif op == Op.LIST_ADD:
            state.add(vser.deserialize(value))
        elif op == Op.LIST_SET:
            state.update([vser.deserialize(v) for v in unpack_list(value)])
        elif op == Op.MAP_PUT and meta.kind is StateKind.MAP:
            assert meta.user_key_serializer is not None
            state.put(
                serializer_for(meta.user_key_serializer).deserialize(user_key),
                vser.deserialize(value),
            )
        elif op == Op.MAP_REMOVE and meta.kind is StateKind.MAP:
            assert meta.user_key_serializer is not None
            state.remove(serializer_for(meta.user_key_serializer).deserialize(user_key))
        else:
            raise CorruptionError(
                f"unknown change op {op} for {meta.kind.value} state {name!r}", location
            )


def restore_into(
    backend: HeapKeyedStateBackend, fileio: FileIO, handles: Sequence[KeyedStateHandle]
) -> None:
    """Load ``handles`` into an empty ``backend`` (no changelog is written)."""
    for h in handles:
        if (
            h.key_serializer != backend.key_serializer.name
            or h.max_parallelism != backend.max_parallelism
        ):
            raise SchemaMismatchError(
                f"checkpointed state of {h.backend_id} has keys {h.key_serializer!r} with max parallelism "
                f"{h.max_parallelism}; the backend declares {backend.key_serializer.name!r} with "
                f"{backend.max_parallelism}"
            )
    # Each key group is restored from the one handle whose range owns it: handles of one
    # checkpoint have disjoint ranges, but their files may hold other groups too (after a
    # rescale, several handles reference the same old files).
    for h in relevant(handles, backend.key_group_range):
        rng = _intersect(backend.key_group_range, h.key_group_range)
        for m in h.materialized:
            _load_materialization(backend, fileio, m, rng)
        by_writer: dict[str, list[ChangelogHandle]] = {}
        for c in h.changelog:
            by_writer.setdefault(c.writer_id, []).append(c)
        for writer_id, logs in by_writer.items():
            for table in read_changes(fileio, logs, h.replay_from(writer_id), (rng.start, rng.end)):
                _replay_table(backend, table, logs[0].location)


def _intersect(a: KeyGroupRange, b: KeyGroupRange) -> KeyGroupRange:
    return KeyGroupRange(max(a.start, b.start), max(max(a.start, b.start), min(a.end, b.end)))


def restore_changelog_backend(
    backend: ChangelogKeyedStateBackend, fileio: FileIO, handles: Sequence[KeyedStateHandle]
) -> None:
    """Restore a changelog backend: its inner store, plus what its checkpoints reference.

    Until this backend materializes, its checkpoints reference the restored
    materializations and logs (files stay owned by the checkpoint they came from).
    """
    restore_into(backend.inner, fileio, handles)
    wanted = relevant(handles, backend.key_group_range)
    backend.base = tuple(m for h in wanted for m in h.materialized)
    backend.restored_log = tuple(c for h in wanted for c in h.changelog)
