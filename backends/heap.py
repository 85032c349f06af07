"""The heap (dict) keyed-state backend.

Layout: ``tables[state][key_group][key] -> value`` with keys and values as Python objects,
so reads cost a dict lookup. Keys are serialized once per :meth:`set_current_key` (for the
key group, and reused by the changelog wrapper). Values are *raw* (see
:mod:`backends.wrappers`): value-like states hold the value or accumulator, list state a
Python list, map and timer state a dict; with TTL every value/element/entry is
``(timestamp_ms, value)``.

Columnar states: a plain value state (no TTL) whose values are int64 or float64
(:func:`column_kind`) is kept in a :class:`~backends._heapstate.ColumnStore` instead: an
index of keys to slots (an int64 hash table while every key is an int, else a dict) and
the values in one C array. An update then writes 8 bytes and no Python object: a forked
materialization costs the task thread one move of that array to fresh memory
(:meth:`HeapKeyedStateBackend.unshare_columns`), where the dicts cost a copy-on-write
fault per page written (28k at 1M keys x 2 states: every update wrote a dict entry, the
old value's refcount and the stored key's refcount, each on a random page), and a copy
costs a memcpy (:meth:`HeapKeyedStateBackend.column_snapshot`). Readers that want
the dict layout (:meth:`~HeapKeyedStateBackend.raw_table`, :meth:`~HeapKeyedStateBackend.snapshot`,
:meth:`~HeapKeyedStateBackend.entries`) get a copy in it; the materialized tables are the
same bytes (:func:`backends.tables.state_files`).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backends._heapstate import ColumnStore, HeapList, HeapMap, HeapValue, KeyContext
from backends.backend import wall_clock_ms
from backends.batch import PreparedBatch, prepare_batch
from backends.errors import KeyGroupOutOfRangeError
from backends.keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, key_group_for
from backends.serializers import Serializer
from backends.snapshot import SnapshotFile
from backends.state import (
    MAP_LIKE,
    Op,
    StateDescriptor,
    StateKind,
    StateMeta,
)
from backends.wrappers import alive, wrap

Table = dict[int, dict[Any, Any]]


KEY_GROUPS_PER_FILE = 16


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """A consistent copy of a heap backend's state, taken on the task thread.

    ``tables`` must not be shared with the live backend (the materializer reads it on
    another thread). ``sqn`` is the changelog boundary it covers (``None`` without a log).
    Implements :class:`~backends.snapshot.MaterializationSnapshot` with kind
    ``heap-parquet``: one Parquet file per state and chunk of ``KEY_GROUPS_PER_FILE``
    key groups, so that chunks that did not change can be shared.
    """

    key_serializer: Serializer
    key_group_range: KeyGroupRange
    metas: dict[str, StateMeta]
    tables: dict[str, Table]
    sqn: int | None = None
    columns: dict[str, ColumnSnapshot] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The table format: typed Parquet state tables."""
        return "heap-parquet"

    def files(self) -> Iterator[SnapshotFile]:
        """Parquet bytes per state and chunk of ``KEY_GROUPS_PER_FILE`` key groups."""
        from backends.tables import state_files  # tables imports this module

        return state_files(self, None)

    def release(self) -> None:
        """Nothing to free: the copy lives in memory."""


COLUMN_KINDS = {"int64": "q", "float64": "d"}
"""Value serializers whose states the heap store keeps columnar (:class:`ColumnStore`)."""


def column_kind(meta: StateMeta) -> str | None:
    """The :class:`ColumnStore` kind of ``meta``'s entries, None if they are kept in dicts:
    plain value state (no TTL) of a fixed-width value type."""
    if meta.kind is not StateKind.VALUE or meta.ttl is not None:
        return None
    return COLUMN_KINDS.get(meta.raw_value_ser().name)


class _KeyColumn:
    """The keys of a :class:`ColumnStore` by slot, as of some snapshot, kept between
    snapshots so that a snapshot copies only the keys added since the last one.

    :meth:`refresh` runs on the task thread; :meth:`arrow` on the upload thread (a lock
    guards its Arrow cache). A key list only ever grows at its end; a clear of a key
    makes the next refresh start a new list (the old one stays as older snapshots saw it).
    """

    def __init__(self) -> None:
        self.keys: list[Any] = []
        self.used = 0
        self.deletes = 0
        self._lock = threading.Lock()
        self._arrow_of: list[Any] | None = None
        self._arrow: Any = None

    def refresh(self, store: ColumnStore) -> tuple[int, int, bytes, bytes, list[Any], bytes | None]:
        """Export ``store`` (task thread): ``(used, live, kgs, vals, keys, ikeys)``."""
        used, deletes, live, kgs, vals, part, full, ikeys = store.export(self.used, self.deletes)
        if full:
            self.keys = part
        else:
            self.keys.extend(part)
        self.used, self.deletes = used, deletes
        return used, live, kgs, vals, self.keys, ikeys

    def arrow(self, keys: list[Any], used: int, free: bool, key_serializer: Serializer) -> Any:
        """``keys[:used]`` as an Arrow column (free slots, None in ``keys``, only if
        ``free``: any valid key)."""
        import pyarrow as pa

        with self._lock:
            done = 0
            if self._arrow_of is keys and self._arrow is not None and len(self._arrow) <= used:
                done = len(self._arrow)
            part = keys[done:used]
            new = None
            if part and not free:
                new = key_serializer.to_arrow(part)
            elif part:
                fill = next((k for k in part if k is not None), None)
                if fill is None:  # every slot of the part is free
                    new = pa.nulls(len(part), key_serializer.arrow_type)
                else:
                    new = key_serializer.to_arrow([fill if k is None else k for k in part])
            if done and new is not None:
                arr = pa.concat_arrays([self._arrow, new])
            elif done:
                arr = self._arrow.slice(0, used)
            else:
                arr = new if new is not None else pa.array([], key_serializer.arrow_type)
            self._arrow_of, self._arrow = keys, arr
            return arr


@dataclass(frozen=True, slots=True, eq=False)
class ColumnSnapshot:
    """A copy of one columnar state (:class:`ColumnStore`) taken on the task thread: key
    groups (int32, -1 for a free slot) and values (8 bytes each) of ``used`` slots, and
    the key list shared with later snapshots (read ``keys[:used]`` only). In a forked
    snapshot child, views of the store's arrays instead of copies
    (:meth:`HeapKeyedStateBackend.frozen_columns`)."""

    kind: str
    used: int
    live: int
    kgs: bytes | memoryview
    vals: bytes | memoryview
    keys: list[Any]
    key_column: _KeyColumn
    int_keys: bytes | memoryview | None = None

    def key_array(self, key_serializer: Serializer) -> Any:
        """The keys by slot as an Arrow column (upload thread): straight from
        ``int_keys`` (every key an int64, the store's own copy) for int64 keys."""
        if self.int_keys is not None and key_serializer.name == "int64":
            import pyarrow as pa

            return pa.Array.from_buffers(pa.int64(), self.used, [None, pa.py_buffer(self.int_keys)])
        return self.key_column.arrow(self.keys, self.used, self.live < self.used, key_serializer)


class _ColumnValueState:
    """A value state kept columnar: ``value``, ``update`` and ``clear`` are the
    :class:`ColumnStore`'s own C methods (no call layer). Task thread only."""

    __slots__ = ("_store", "clear", "update", "value")

    def __init__(self, store: ColumnStore, default: Any) -> None:
        self._store = store
        self.value = functools.partial(store.get, default)
        self.update = store.update
        self.clear = store.clear

    def with_default(self, default: Any) -> _ColumnValueState:
        """The same entries, read with ``default`` for an absent value."""
        return _ColumnValueState(self._store, default)


class _Entries:
    """Reads and clear of the heap states; their writes are C (:mod:`backends._heapstate`).

    ``_backend`` and ``_table`` come from the C base. Task thread only.
    """

    __slots__ = ()
    _backend: HeapKeyedStateBackend
    _table: Table

    def _entry(self) -> Any:
        """The current key's value, list or map; None if it has none."""
        b = self._backend
        m = self._table.get(b.current_key_group)
        return None if m is None else m.get(b.current_key)

    def clear(self) -> None:
        m = self._table.get(self._backend.current_key_group)
        if m is not None:
            m.pop(self._backend.current_key, None)


class _HeapValueState(_Entries, HeapValue):
    __slots__ = ("_default",)

    def __init__(self, backend: HeapKeyedStateBackend, table: Table, default: Any) -> None:
        super().__init__(backend, table)
        self._default = default

    def value(self) -> Any:
        m = self._table.get(self._backend.current_key_group)
        v = None if m is None else m.get(self._backend.current_key)
        return self._default if v is None else v

    def with_default(self, default: Any) -> _HeapValueState:
        """The same entries, read with ``default`` for an absent value (the store's own
        write, so a default costs no extra call: :func:`backends.wrappers.wrap`)."""
        return _HeapValueState(self._backend, self._table, default)


class _HeapListState(_Entries, HeapList):
    __slots__ = ()

    def get(self) -> list[Any]:
        lst = self._entry()
        return list(lst) if lst else []

    def update(self, values: Iterable[Any]) -> None:
        items = list(values)
        if not items:
            self.clear()
            return
        self.replace(items)  # the C write the changelog wrapper's LIST_SET makes too


class _HeapMapState(_Entries, HeapMap):
    __slots__ = ()

    def get(self, user_key: Any) -> Any:
        entries = self._entry()
        return None if entries is None else entries.get(user_key)

    def remove(self, user_key: Any) -> None:
        entries = self._entry()
        if entries is not None:
            entries.pop(user_key, None)
            if not entries:
                self.clear()

    def contains(self, user_key: Any) -> bool:
        entries = self._entry()
        return entries is not None and user_key in entries

    def items(self) -> Iterator[tuple[Any, Any]]:
        entries = self._entry()
        return iter(list(entries.items()) if entries else [])


class HeapKeyedStateBackend(KeyContext):
    """Keyed state in Python dicts for the key groups in ``key_group_range``.

    Task thread only. Invariant: every stored entry's key hashes into
    ``key_group_range``; setting a key outside it raises :class:`KeyGroupOutOfRangeError`.
    ``clock`` (milliseconds) drives TTL; inject a fake one in tests. The current key lives
    in the C base :class:`~backends._heapstate.KeyContext`, where the states' C writes
    read it.
    """

    # Slots: below a C base a __dict__ is a plain dict (slower attribute loads on the
    # per-record path than the inline values a plain class gets).
    __slots__ = (
        "_columns",
        "_key_columns",
        "_metas",
        "_raw",
        "_states",
        "_tables",
        "clock",
        "key_group_range",
        "key_serializer",
        "max_parallelism",
        "snapshot_region",
    )

    def __init__(
        self,
        key_serializer: Serializer,
        key_group_range: KeyGroupRange,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.key_serializer = key_serializer
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.clock = clock
        self.current_key: Any = None
        self.current_key_bytes = b""
        self.current_key_group = -1
        self._metas: dict[str, StateMeta] = {}
        self._tables: dict[str, Table] = {}
        self._raw: dict[str, Any] = {}
        self._states: dict[str, Any] = {}
        self._columns: dict[str, ColumnStore] = {}
        self._key_columns: dict[str, _KeyColumn] = {}
        self.snapshot_region: Any = None
        """What :mod:`backends.snapshot_helper` keeps for this store's snapshots (a shared
        memory region), None until its first; dropped by :meth:`close`."""

    # -- keys -------------------------------------------------------------------------
    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key every state call acts on."""
        key_bytes = self.key_serializer.serialize(key)
        kg = key_group_for(key_bytes, self.max_parallelism)
        rng = self.key_group_range
        if not rng.start <= kg < rng.end:
            raise KeyGroupOutOfRangeError(
                f"key {key!r} is in key group {kg}, outside this backend's "
                f"[{self.key_group_range.start}, {self.key_group_range.end})"
            )
        self.set_current_key_raw(key, key_bytes, kg)

    # set_current_key_raw(key, key_bytes, key_group), the key switch when the key's bytes
    # and group are known (keyed upstream, replay): KeyContext's, which also starts
    # loading the key's index entries of the columnar states (backends._heapstate_c).

    # -- states -----------------------------------------------------------------------
    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``; the same object on every call.

        Raises :class:`SchemaMismatchError` if a state of that name exists (declared or
        restored) with other serializers, another kind or another TTL.
        """
        meta = descriptor.meta
        state = self._states.get(meta.name)
        if state is not None:
            self._metas[meta.name].check_compatible(meta)
            return state
        state = wrap(descriptor, self.internal_state(meta), self.clock)
        self._states[meta.name] = state
        return state

    def _register(self, meta: StateMeta) -> Table:
        """The dicts of ``meta``'s state (registered if new); a columnar state has none
        (an empty dict is returned: see :meth:`column_store`)."""
        existing = self._metas.get(meta.name)
        if existing is not None:
            existing.check_compatible(meta)
            return self._tables.get(meta.name, {})
        self._metas[meta.name] = meta
        kind = column_kind(meta)
        if kind is not None:
            self._columns[meta.name] = ColumnStore(self, kind)
            self._key_columns[meta.name] = _KeyColumn()
            return {}
        table: Table = {}
        self._tables[meta.name] = table
        return table

    def column_store(self, name: str) -> ColumnStore | None:
        """The columnar entries of state ``name``, None if it is kept in dicts."""
        return self._columns.get(name)

    def register_restored(self, meta: StateMeta) -> None:
        """Declare a state known from a checkpoint, before the user asks for it."""
        self._register(meta)

    def state_metas(self) -> dict[str, StateMeta]:
        """Every state declared or restored, by name."""
        return dict(self._metas)

    def raw_table(self, name: str) -> Table:
        """The live dicts of a registered state: ``table[key_group][key] -> raw value``.

        For callers that write raw values themselves to save a call per record (the
        changelog wrapper's hot path). Task thread only. Writers keep the layout the raw
        states keep (see the module doc): a key group's dict exists only once it holds an
        entry; a list state's value is a Python list, a map state's a dict. Raises
        ``KeyError`` for a state never registered. A columnar state (:func:`column_kind`)
        gives a copy in that layout: write it through :meth:`column_store`.
        """
        store = self._columns.get(name)
        if store is not None:  # a copy: write a columnar state through its store
            return self._column_dicts(store)
        return self._tables[name]

    @staticmethod
    def _column_dicts(store: ColumnStore) -> Table:
        kgs, keys, values = store.entries()
        table: Table = {}
        for kg, k, v in zip(kgs, keys, values, strict=True):
            m = table.get(kg)
            if m is None:
                m = table[kg] = {}
            m[k] = v
        return table

    def internal_state(self, meta: StateMeta) -> Any:
        """The raw state of ``meta`` for replay and wrappers (no user descriptor needed)."""
        table = self._register(meta)
        raw = self._raw.get(meta.name)
        store = self._columns.get(meta.name)
        if raw is None and store is not None:
            raw = self._raw[meta.name] = _ColumnValueState(store, None)
        if raw is None:
            if meta.kind is StateKind.LIST:
                raw = _HeapListState(self, table)
            elif meta.kind in MAP_LIKE:
                raw = _HeapMapState(self, table)
            else:
                raw = _HeapValueState(self, table, None)
            self._raw[meta.name] = raw
        return raw

    # -- snapshot and bulk load -------------------------------------------------------
    def snapshot(self, sqn: int | None = None) -> StateSnapshot:
        """A copy of all state that later mutations do not affect, every state as dicts
        (columnar ones too). O(state); task thread.

        Expired TTL entries are dropped from the copy and from the live store. (A
        materialization forks, or copies columns: :func:`backends.forked.materialization_snapshot`.)
        """
        tables = self._copy_dict_tables()
        for name, store in self._columns.items():
            tables[name] = self._column_dicts(store)
        return StateSnapshot(
            self.key_serializer, self.key_group_range, dict(self._metas), tables, sqn
        )

    def column_snapshot(self, sqn: int | None = None) -> StateSnapshot:
        """:meth:`snapshot` with the columnar states copied as columns (a memcpy each, and
        the keys added since the last one), for :func:`backends.tables.state_files`.
        Task thread."""
        return StateSnapshot(
            self.key_serializer, self.key_group_range, dict(self._metas),
            self._copy_dict_tables(), sqn, self.export_columns(),
        )  # fmt: skip

    def _copy_dict_tables(self) -> dict[str, Table]:
        self.purge_expired()
        tables: dict[str, Table] = {}
        for name, table in self._tables.items():
            meta = self._metas[name]
            kind = meta.kind
            if kind is StateKind.LIST:
                tables[name] = {
                    kg: {k: list(v) for k, v in m.items()} for kg, m in table.items() if m
                }
            elif kind in MAP_LIKE:
                tables[name] = {
                    kg: {k: dict(v) for k, v in m.items()} for kg, m in table.items() if m
                }
            elif kind is StateKind.AGGREGATING:  # aggregate functions may mutate in place
                tables[name] = {kg: copy.deepcopy(m) for kg, m in table.items() if m}
            else:
                tables[name] = {kg: m.copy() for kg, m in table.items() if m}
        return tables

    def export_columns(self) -> dict[str, ColumnSnapshot]:
        """A copy of every columnar state (task thread; see :class:`ColumnSnapshot`)."""
        return {name: self._export_column(name, store) for name, store in self._columns.items()}

    def _export_column(self, name: str, store: ColumnStore) -> ColumnSnapshot:
        kind = COLUMN_KINDS[self._metas[name].raw_value_ser().name]
        kc = self._key_columns[name]
        used, live, kgs, vals, keys, ikeys = kc.refresh(store)
        return ColumnSnapshot(kind, used, live, kgs, vals, keys, kc, ikeys)

    def frozen_columns(self) -> dict[str, ColumnSnapshot]:
        """:meth:`export_columns` in a process where the store changes no more (a forked
        snapshot child), without a copy: each state's key groups and values are views
        of its own arrays (``ColumnStore.views``), and so are its keys while they are all
        int64 (with the int64 key serializer); the key list is taken only otherwise.

        The child is a copy-on-write copy of the task's process, and a copy there writes
        fresh pages: at 1M keys x 2 states, copying the arrays took 10k page faults and
        ~30 ms, and a slice of the key list (a reference taken to each key: a write to
        every key's page) 15.6k faults and 54 ms."""
        if self.key_serializer.name != "int64":
            return self.export_columns()
        out: dict[str, ColumnSnapshot] = {}
        for name, store in self._columns.items():
            used, live, kgs, vals, ikeys = store.views()
            if ikeys is None:  # a key that is not an exact int64: the key list after all
                out[name] = self._export_column(name, store)
                continue
            kind = COLUMN_KINDS[self._metas[name].raw_value_ser().name]
            kc = self._key_columns[name]
            out[name] = ColumnSnapshot(kind, used, live, kgs, vals, [], kc, ikeys)
        return out

    def only_columns(self) -> dict[str, tuple[str, ColumnStore]] | None:
        """Every state's :class:`ColumnStore` and kind, by name, if the whole state is
        columnar with int64 keys (the key serializer is int64, every state a
        :class:`ColumnStore`), else None. Task thread (the stores are the live ones)."""
        if self.key_serializer.name != "int64" or len(self._columns) != len(self._metas):
            return None
        return {
            name: (COLUMN_KINDS[self._metas[name].raw_value_ser().name], store)
            for name, store in self._columns.items()
        }

    def unshare_columns(self) -> None:
        """Right after a fork (task thread): move the columnar states' value arrays, which
        the child shares now, to fresh memory (``ColumnStore.unshare``: a populated
        mapping and a memcpy with the GIL released, 6-10 ms for 2 x 8 MB), rather than take
        a copy-on-write fault per page as updates reach them, each with the GIL held
        (~25 ms in all). Uniform updates write every page of them between two
        materializations anyway."""
        for store in self._columns.values():
            store.unshare()

    def purge_expired(self) -> None:
        """Drop expired entries of every state with TTL. Task thread."""
        clock = self.clock
        now = clock()
        for name, table in self._tables.items():
            meta = self._metas[name]
            if meta.ttl is not None:
                self._purge_expired(meta, table, now)

    def live_tables(self) -> dict[str, Table]:
        """Every dict state's live dicts, by name (the dicts themselves: for a forked
        child, whose copy no later write reaches, and for :meth:`raw_table`'s users).
        Columnar states are not here: :meth:`export_columns`."""
        return dict(self._tables)

    @staticmethod
    def _purge_expired(meta: StateMeta, table: Table, now: int) -> None:
        assert meta.ttl is not None
        is_list, is_map, ttl = meta.kind is StateKind.LIST, meta.kind in MAP_LIKE, meta.ttl.ttl_ms
        for m in table.values():
            for key in list(m):
                kept = alive(m[key], is_list, is_map, ttl, now)
                if kept is None:
                    del m[key]
                else:
                    m[key] = kept

    def load_entries(
        self,
        meta: StateMeta,
        runs: Iterable[tuple[int, list[Any], list[Any]]],
        only: KeyGroupRange | None = None,
    ) -> None:
        """Bulk-insert raw entries, one ``(key_group, keys, values)`` run per key group
        (restore from a materialized table): one ``dict.update`` per run.

        ``values`` are values (value-like state), lists (list state) or dicts (map and
        timer state). Runs outside ``only`` (default: this backend's range) are skipped.
        """
        table = self._register(meta)
        rng = only if only is not None else self.key_group_range
        store = self._columns.get(meta.name)
        if store is not None:
            for kg, keys, values in runs:
                if kg in rng and keys:
                    store.load(kg, keys, values)
            return
        for kg, keys, values in runs:
            if kg in rng and keys:
                m = table.get(kg)
                if m is None:
                    table[kg] = dict(zip(keys, values, strict=True))
                else:
                    m.update(zip(keys, values, strict=True))

    def entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """``(key_group, key, raw value)`` of state ``name`` (a copy of the key list)."""
        store = self._columns.get(name)
        table = self._tables.get(name, {}) if store is None else self._column_dicts(store)
        for kg in sorted(table):
            yield from ((kg, k, v) for k, v in list(table[kg].items()))

    def entry_count(self) -> int:
        """How many (state, key) entries exist: a cheap size measure."""
        dicts = sum(len(m) for table in self._tables.values() for m in table.values())
        return dicts + sum(len(s) for s in self._columns.values())

    # -- the batch path ---------------------------------------------------------------
    def apply_batch(
        self, descriptor: StateDescriptor, keys: Any, values: Any, user_keys: Any = None
    ) -> None:
        """Set values (value state), append elements (list) or put entries (map) for many
        keys at once; all keys are checked before anything is applied."""
        self.get_state(descriptor)
        clock = self.clock
        meta, batch = prepare_batch(
            descriptor,
            self.key_serializer,
            self.key_group_range,
            self.max_parallelism,
            clock(),
            keys,
            values,
            user_keys,
        )
        self.apply_prepared(meta, batch)

    def apply_prepared(self, meta: StateMeta, batch: PreparedBatch) -> None:
        """Apply a prepared batch to the dicts (no serialization)."""
        table = self._register(meta)
        kgs = batch.key_groups
        store = self._columns.get(meta.name)
        if store is not None:
            assert batch.op is Op.VALUE_SET
            for kg, k, v in zip(kgs, batch.keys, batch.values, strict=True):
                store.load(kg, [k], [v])
            return
        for kg in set(kgs):
            if kg not in table:
                table[kg] = {}
        if batch.op is Op.VALUE_SET:
            for kg, k, v in zip(kgs, batch.keys, batch.values, strict=True):
                table[kg][k] = v
        elif batch.op is Op.LIST_ADD:
            for kg, k, v in zip(kgs, batch.keys, batch.values, strict=True):
                m = table[kg]
                lst = m.get(k)
                if lst is None:
                    m[k] = [v]
                else:
                    lst.append(v)
        else:
            assert batch.user_keys is not None
            for kg, k, uk, v in zip(kgs, batch.keys, batch.user_keys, batch.values, strict=True):
                m = table[kg]
                d = m.get(k)
                if d is None:
                    m[k] = {uk: v}
                else:
                    d[uk] = v

    def close(self) -> None:
        """Drop :attr:`snapshot_region` (freed once no snapshot uses it)."""
        self.snapshot_region = None
