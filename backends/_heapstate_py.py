"""The heap store's per-record writes in pure Python: the fallback of
:mod:`backends._heapstate_c`, with the same API, behaviour and errors (types).

``KeyContext``
    Base class of :class:`~backends.heap.HeapKeyedStateBackend`: ``current_key``,
    ``current_key_bytes`` and ``current_key_group``, all None until set.
``HeapValue(backend, table, records=None, op=None, flush=None).update(value)``,
``HeapList(...).add(value)``, ``.replace(items)``, ``HeapMap(...).put(user_key, value)``
    ``table`` is the state's dict ``{key_group: {key: entry}}``; the entry is the value,
    a list of elements, or a dict of map entries. With ``records`` (a
    :class:`dstl._records.RecordColumns`), each write first appends one change record
    (``op``, key bytes, key group, user key or None, value) converted by the buffer's
    kinds, after checking that the keys hash, so a value or key the write would refuse
    changes nothing; when the buffer reports full, ``flush()`` is called after the write.
    ``replace(items)`` makes the list ``items`` (stored as it is) the current key's
    list, logged as one record framing every element. ``_backend`` and ``_table`` are
    read-only; a second ``__init__`` raises RuntimeError and changes nothing.
``key_group_for(key_bytes, max_parallelism)``
    The key group of a serialized key (:func:`backends.keygroups.key_group_for`).
``ColumnStore(backend, kind)``, ``ColumnWriter(store, records, op, flush)``
    A plain value state of int64 (``"q"``) or float64 (``"d"``) values kept columnar
    (documented at the ColumnStore section of ``backends/_heapstate_c.c``).
``pack_text(dicts, values, kind)``
    The keys or values of ``dicts`` as an Arrow string (``kind`` ``"s"``, exact ``str``
    items) or binary (``"b"``, exact ``bytes``) column: ``(offsets, data)``, the int32
    offsets and the bytes; ``None`` if an item is of another type, a str does not encode
    as UTF-8, or the data pass 2 GiB (the caller then converts the list as Arrow does).
``pack(dicts, values, kind)``
    The keys (``values`` false) or values of every dict of ``dicts``, in order, packed as
    native int64 (``kind`` ``"q"``) or float64 (``"d"``) bytes exactly as
    :class:`array.array` packs them (its refusals too): a heap materialization's columns.

Not thread-safe: owned by the backend's task thread.
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from dstl import _records_py
from dstl._records import RecordColumns

# The buffers these states append to: the Python one, and the C one when this module is
# the fallback of a C heap state that did not import while the C buffer did.
_BUFFERS = (_records_py.RecordColumns, RecordColumns)


def key_group_for(key_bytes: bytes, max_parallelism: int) -> int:
    """crc32, MurmurHash3's finalizer, modulo ``max_parallelism`` (see
    :data:`backends.keygroups.key_group_for`)."""
    if max_parallelism < 1:
        raise ValueError("max_parallelism must be >= 1")
    h = zlib.crc32(key_bytes)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h % max_parallelism


class KeyContext:
    """The current key of a keyed backend. Task thread only."""

    __slots__ = ("current_key", "current_key_bytes", "current_key_group")

    current_key: Any
    current_key_bytes: Any
    current_key_group: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> KeyContext:
        self = super().__new__(cls)
        self.current_key = self.current_key_bytes = self.current_key_group = None
        return self

    def set_current_key_raw(self, key: Any, key_bytes: Any, key_group: Any) -> None:
        """Make ``key`` current, its bytes and key group already known (the C twin also
        prefetches the key's index entries of the column stores)."""
        self.current_key = key
        self.current_key_bytes = key_bytes
        self.current_key_group = key_group


_VALUE, _LIST, _MAP, _REPLACE = range(4)
_MISSING = object()


def _checked(obj: Any, want: type, what: str) -> Any:
    if not isinstance(obj, want):
        raise TypeError(f"heap state: {what} is a {type(obj).__name__}, not a {want.__name__}")
    return obj


class _HeapState:
    """The write shared by the three states (see the module doc). Task thread only."""

    __slots__ = ("_hs_backend", "_hs_flush", "_hs_op", "_hs_records", "_hs_table")
    _hs_backend: KeyContext
    _hs_table: dict[Any, Any]
    _hs_records: RecordColumns | _records_py.RecordColumns | None
    _hs_op: Any  # an int when _hs_records is set
    _hs_flush: Any  # a callable when _hs_records is set

    def __init__(
        self,
        backend: KeyContext,
        table: dict[Any, Any],
        records: RecordColumns | _records_py.RecordColumns | None = None,
        op: int | None = None,
        flush: Callable[[], object] | None = None,
    ) -> None:
        if not isinstance(backend, KeyContext):
            raise TypeError(f"backend must be a KeyContext, not {type(backend).__name__}")
        if not isinstance(table, dict):
            raise TypeError(f"table must be a dict, not {type(table).__name__}")
        if hasattr(self, "_hs_backend"):
            raise RuntimeError("a heap state is initialized once")
        if records is not None:
            if not isinstance(records, _BUFFERS):
                raise TypeError("records must be a dstl._records.RecordColumns")
            if not isinstance(op, int) or not callable(flush):
                raise TypeError("a logged heap state needs an int op and flush()")
        self._hs_records = records
        self._hs_op = op
        self._hs_flush = flush
        self._hs_backend = backend
        self._hs_table = table

    @property
    def _backend(self) -> Any:
        """The backend (KeyContext); AttributeError before __init__."""
        return self._hs_backend

    @property
    def _table(self) -> dict[Any, Any]:
        """``{key_group: {key: entry}}``; AttributeError before __init__."""
        return self._hs_table

    def _write(self, user_key: Any, value: Any, shape: int) -> None:
        try:
            b = self._hs_backend
        except AttributeError:
            raise RuntimeError("heap state used before __init__") from None
        group, key, key_bytes = b.current_key_group, b.current_key, b.current_key_bytes
        records, full = self._hs_records, False
        if records is not None:
            hash(group)  # a key the dict write would refuse is not logged
            hash(key)
            if user_key is not None:
                hash(user_key)
            if shape == _REPLACE:
                full = records.append_typed_list(self._hs_op, key_bytes, group, user_key, value)
            else:
                full = records.append_typed(self._hs_op, key_bytes, group, user_key, value)
        table = self._hs_table
        d = dict.get(table, group, _MISSING)
        if d is _MISSING:
            d = {}
            dict.__setitem__(table, group, d)
        else:
            _checked(d, dict, "a key group's entry")
        if shape in (_VALUE, _REPLACE):
            dict.__setitem__(d, key, value)
        else:
            entry = dict.get(d, key, _MISSING)
            if entry is _MISSING:
                entry = [value] if shape == _LIST else {user_key: value}
                dict.__setitem__(d, key, entry)
            elif shape == _LIST:
                list.append(_checked(entry, list, "a list state's value"), value)
            else:
                dict.__setitem__(_checked(entry, dict, "a map state's value"), user_key, value)
        if full:
            self._hs_flush()


class HeapValue(_HeapState):
    """The heap store's value-state write. Task thread only."""

    __slots__ = ()

    def update(self, value: Any) -> None:
        """Set the current key's value."""
        self._write(None, value, _VALUE)


class HeapList(_HeapState):
    """The heap store's list-state writes. Task thread only."""

    __slots__ = ()

    def add(self, value: Any) -> None:
        """Append to the current key's list."""
        self._write(None, value, _LIST)

    def replace(self, items: list[Any], /) -> None:
        """Make the list ``items`` (stored as it is) the current key's list."""
        if type(items) is not list:
            raise TypeError(f"replace: expected a list, got {type(items).__name__}")
        self._write(None, items, _REPLACE)


class HeapMap(_HeapState):
    """The heap store's map-state put. Task thread only."""

    __slots__ = ()

    def put(self, user_key: Any, value: Any) -> None:
        """Set an entry of the current key's map."""
        self._write(user_key, value, _MAP)


def pack(dicts: Iterable[dict[Any, Any]], values: bool, kind: str, /) -> bytes:
    """The keys or values of ``dicts`` packed as ``kind`` (see the module doc)."""
    if kind not in ("q", "d"):
        raise ValueError("pack: kind must be 'q' or 'd'")
    parts = list(dicts)
    items = chain.from_iterable(d.values() for d in parts) if values else chain.from_iterable(parts)
    return array.array(kind, items).tobytes()


def pack_text(
    dicts: Iterable[dict[Any, Any]], values: bool, kind: str, /
) -> tuple[bytes, bytes] | None:
    """The keys or values of ``dicts`` as a string or binary column (see the module doc)."""
    if kind not in ("s", "b"):
        raise ValueError("pack_text: kind must be 's' or 'b'")
    parts = list(dicts)
    items = chain.from_iterable(d.values() for d in parts) if values else chain.from_iterable(parts)
    chunks: list[bytes] = []
    offsets = array.array("i", [0])
    total = 0
    for item in items:
        if kind == "b" and type(item) is bytes:
            chunk = item
        elif kind == "s" and type(item) is str:
            try:
                chunk = item.encode()
            except UnicodeEncodeError:
                return None
        else:
            return None
        total += len(chunk)
        if total > 0x7FFFFFFF:
            return None
        chunks.append(chunk)
        offsets.append(total)
    return offsets.tobytes(), b"".join(chunks)


class ColumnStore:
    """A value state's entries stored columnar (see ``backends/_heapstate_c.c``): keys to
    slots in a dict, key groups and 8-byte values in arrays. Task thread only."""

    __slots__ = ("_backend", "_free", "_keys", "_kgs", "_slots", "_vals", "deletes", "live")

    def __init__(self, backend: KeyContext, kind: str) -> None:
        if not isinstance(backend, KeyContext):
            raise TypeError(f"backend must be a KeyContext, not {type(backend).__name__}")
        if hasattr(self, "_backend"):
            raise RuntimeError("a column store is initialized once")
        if kind not in ("q", "d"):
            raise ValueError("ColumnStore: kind must be 'q' or 'd'")
        self._slots: dict[Any, int] = {}
        self._keys: list[Any] = []
        self._kgs = array.array("i")
        self._vals = array.array(kind)
        self._free: list[int] = []
        self.deletes = 0
        self.live = 0
        self._backend = backend

    @property
    def used(self) -> int:
        """Slots in use or free (the columns' length)."""
        return len(self._keys)

    def __len__(self) -> int:
        return self.live

    def _convert(self, value: Any) -> Any:
        if self._vals.typecode == "q" and isinstance(value, float):
            raise TypeError("an int64 state's value must be an integer")
        array.array(self._vals.typecode, [value])  # its refusals
        return value

    def _slot(self, key: Any, group: Any) -> int:
        i = self._slots.get(key)
        if i is not None:
            return i
        kg = int(group)
        if not 0 <= kg <= 0x7FFFFFFF:
            raise ValueError(f"key group {kg} out of range")
        if self._free:
            i = self._free[-1]
            self._slots[key] = i
            self._free.pop()
            self.deletes += 1  # a key below ``used`` changed (see export)
            self._keys[i] = key
            self._kgs[i] = kg
        else:
            i = len(self._keys)
            self._kgs.append(kg)  # first: refused (BufferError) while viewed, nothing changed
            self._vals.append(0)
            self._slots[key] = i
            self._keys.append(key)
        self.live += 1
        return i

    def get(self, default: Any) -> Any:
        """The current key's value, or ``default``."""
        i = self._slots.get(self._backend.current_key)
        return default if i is None else self._vals[i]

    def _write(self, value: Any, records: Any, op: Any, flush: Any) -> None:
        b = self._backend
        group, key, key_bytes = b.current_key_group, b.current_key, b.current_key_bytes
        value = self._convert(value)
        full = False
        if records is not None:
            hash(group)
            hash(key)
            full = records.append_typed(op, key_bytes, group, None, value)
        self._vals[self._slot(key, group)] = value
        if full:
            flush()

    def update(self, value: Any) -> None:
        """Set the current key's value."""
        self._write(value, None, None, None)

    def clear(self) -> None:
        """Remove the current key's value."""
        key = self._backend.current_key
        i = self._slots.pop(key, None)
        if i is None:
            return
        self._keys[i] = None
        self._kgs[i] = -1
        self._free.append(i)
        self.live -= 1
        self.deletes += 1

    def export(
        self, since_used: int, since_deletes: int
    ) -> tuple[int, int, int, bytes, bytes, list[Any], bool, bytes | None]:
        """``(used, deletes, live, kgs, vals, keys, full, ikeys)`` (see the C module
        source; ``ikeys`` is always None here: the keys are converted from ``keys``)."""
        used = len(self._keys)
        full = since_deletes != self.deletes or not 0 <= since_used <= used
        keys = self._keys[0 if full else since_used : used]
        kgs, vals = self._kgs.tobytes(), self._vals.tobytes()
        return used, self.deletes, self.live, kgs, vals, keys, full, None

    def views(self) -> tuple[int, int, memoryview, memoryview, None]:
        """``(used, live, kgs, vals, ikeys)``: :meth:`export`'s columns as read-only views
        of the arrays (see the C module source; while one is alive, an array refuses to
        grow, as the C store does)."""
        kgs, vals = memoryview(self._kgs).cast("B"), memoryview(self._vals).cast("B")
        return len(self._keys), self.live, kgs.toreadonly(), vals.toreadonly(), None

    def load(self, kg: int, keys: Iterable[Any], values: Iterable[Any]) -> None:
        """Set many keys of key group ``kg``."""
        ks, vs = list(keys), list(values)
        if len(ks) != len(vs):
            raise ValueError("load: keys and values differ in length")
        for k, v in zip(ks, vs, strict=True):
            self._vals[self._slot(k, kg)] = self._convert(v)

    def entries(self) -> tuple[list[int], list[Any], list[Any]]:
        """``(kgs, keys, values)`` of the live keys, in slot order."""
        live = [i for i, kg in enumerate(self._kgs) if kg >= 0]
        return (
            [self._kgs[i] for i in live],
            [self._keys[i] for i in live],
            [self._vals[i] for i in live],
        )

    def unshare(self) -> bool:
        """After a fork, move the values to memory the child does not share (the C store;
        see its source). False here: this store lets the copy-on-write faults come."""
        return False


class ColumnWriter:
    """The logged write of a :class:`ColumnStore`. Task thread only."""

    __slots__ = ("_flush", "_op", "_records", "_store")

    def __init__(self, store: ColumnStore, records: Any, op: int, flush: Callable[[], object]):
        if not isinstance(store, ColumnStore):
            raise TypeError("store must be a ColumnStore")
        if not isinstance(records, _BUFFERS):
            raise TypeError("records must be a dstl._records.RecordColumns")
        if not isinstance(op, int) or not callable(flush):
            raise TypeError("a column writer needs an int op and flush()")
        self._store = store
        self._records = records
        self._op = op
        self._flush = flush

    def update(self, value: Any) -> None:
        """Log and set the current key's value."""
        self._store._write(value, self._records, self._op, self._flush)
