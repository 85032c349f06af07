"""The change-record buffer in pure Python: the fallback of :mod:`dstl._records_c`.

Same API, same errors (types), same bytes: every ``take()`` returns what the C buffer
returns for the same appends, down to the validity bitmaps' unused bits
(tests/native/test_twins.py compares them). It is several times slower per record;
it exists so that the project runs (and its tests pass) where no compiler is available,
and as the readable statement of what the C code does.

``RecordColumns(capacity, max_bytes, user_key_kind, value_kind)``
    ``append(op, key, key_group, user_key, value) -> bool``: user key and value are
    bytes or None (already serialized). ``append_typed(...)``: they are converted by the
    buffer's kinds: ``KIND_BYTES`` (bytes), ``KIND_INT64`` (an int or ``__index__``, 8
    little-endian bytes as struct ``"<q"``), ``KIND_FLOAT64`` (a float, ``__float__`` or
    ``__index__``, as struct ``"<d"``), ``KIND_STR`` (str, UTF-8); None is refused.
    ``append_typed_list(..., values)``: ``values`` is a list whose elements are converted
    by the value kind and framed as :func:`backends.serializers.pack_list` frames them.
    Each checks and converts every part before it changes anything (a refused record
    changes nothing: TypeError, OverflowError, UnicodeEncodeError) and returns True once
    the buffer holds ``capacity`` records or ``max_bytes`` bytes. With ``user_key_kind``
    ``KIND_NONE`` there is no user-key column (the user key must be None).
    ``take()``: ``(rows, key_groups, ops, key_offsets, key_data, user_key, value)`` (the
    columns in Arrow's layout; user key and value as ``(null_count, validity | None,
    offsets, data)``, user key None without the column) and empties the buffer; None
    when empty.
``pack_int64(value)``, ``pack_float64(value)``: one part converted as the kinds convert it.

Not thread-safe: owned by one task thread, like the state that fills it.
"""

from __future__ import annotations

import operator
import struct
from array import array
from typing import Any

KIND_NONE = -1
KIND_BYTES = 0
KIND_INT64 = 1
KIND_FLOAT64 = 2
KIND_STR = 3

_INT32_MAX = (1 << 31) - 1
_INT64 = struct.Struct("<q")
_FLOAT64 = struct.Struct("<d")
_LENGTH = struct.Struct("<I")

Column = tuple[int, bytes | None, bytes, bytes]


def _ranged(obj: Any, lo: int, hi: int, what: str) -> int:
    """``obj`` (an int or ``__index__``) if it is in [lo, hi]: OverflowError if not."""
    value = operator.index(obj)
    if not lo <= value <= hi:
        raise OverflowError(f"{what}: {obj!r} is out of range [{lo}, {hi}]")
    return value


def as_double(obj: Any) -> float:
    """``obj`` as CPython's PyFloat_AsDouble converts it (what struct ``"<d"`` accepts):
    a float, ``__float__`` (which must return a float), else ``__index__``."""
    if isinstance(obj, float):
        return float.__float__(obj)
    convert = getattr(type(obj), "__float__", None)
    if convert is None:
        if getattr(type(obj), "__index__", None) is None:
            raise TypeError(f"must be real number, not {type(obj).__name__}")
        return float(operator.index(obj))  # OverflowError past a double, as in C
    result = convert(obj)
    if not isinstance(result, float):
        raise TypeError(
            f"{type(obj).__name__}.__float__ returned non-float (type {type(result).__name__})"
        )
    return float.__float__(result)


def _raw_bytes(obj: Any, what: str) -> bytes:
    """The bytes of a bytes object (a subclass's own data, not its ``__bytes__``)."""
    if type(obj) is bytes:
        return obj
    if not isinstance(obj, bytes):
        raise TypeError(f"{what}: expected bytes, got {type(obj).__name__}")
    return bytes.__getitem__(obj, slice(None))


def _typed(obj: Any, kind: int, what: str) -> bytes:
    """``obj`` converted by ``kind``; the errors the C conversion raises."""
    if obj is None:
        raise TypeError(f"{what}: None cannot be serialized")
    if kind == KIND_INT64:
        return _INT64.pack(_ranged(obj, -(1 << 63), (1 << 63) - 1, what))
    if kind == KIND_FLOAT64:
        return _FLOAT64.pack(as_double(obj))
    if kind == KIND_STR:
        if not isinstance(obj, str):
            raise TypeError(f"{what}: str expects a str, got {type(obj).__name__}")
        return str.encode(obj)
    return _raw_bytes(obj, what)


def _raw(obj: Any, what: str) -> bytes | None:
    return None if obj is None else _raw_bytes(obj, what)


def pack_int64(value: Any, /) -> bytes:
    """8 bytes, like struct ``"<q"`` (TypeError, OverflowError; never struct.error)."""
    return _typed(value, KIND_INT64, "int64")


def pack_float64(value: Any, /) -> bytes:
    """8 bytes, like struct ``"<d"`` (TypeError, OverflowError; never struct.error)."""
    return _typed(value, KIND_FLOAT64, "float64")


def _check_kind(kind: int, allow_none: bool, what: str) -> None:
    if not ((kind == KIND_NONE and allow_none) or KIND_BYTES <= kind <= KIND_STR):
        raise ValueError(f"unknown {what} kind {kind}")


class _BinColumn:
    """A binary column: int32 offsets, data, and the null rows. Task thread only."""

    __slots__ = ("data", "nulls", "offsets")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.offsets = array("i", [0])
        self.data = bytearray()
        self.nulls: list[int] = []

    def room(self, extra: int) -> None:
        """OverflowError unless ``extra`` more bytes keep the offsets within int32."""
        if extra > _INT32_MAX - len(self.data):
            raise OverflowError("change records: more than 2 GiB in one buffer (flush more often)")

    def add(self, row: int, value: bytes | None) -> None:
        if value is None:
            self.nulls.append(row)
        else:
            self.data += value
        self.offsets.append(len(self.data))

    def take(self, rows: int) -> Column:
        validity = None
        if self.nulls:
            # All bits set, then the null rows cleared: the C buffer's bitmap, whose bits
            # past the last row stay set.
            bitmap = bytearray(b"\xff" * ((rows + 7) // 8))
            for row in self.nulls:
                bitmap[row // 8] &= ~(1 << (row % 8)) & 0xFF
            validity = bytes(bitmap)
        column = (len(self.nulls), validity, self.offsets.tobytes(), bytes(self.data))
        self.clear()
        return column


class RecordColumns:
    """A columnar buffer of change records (see the module doc). Task thread only."""

    __slots__ = (
        "_capacity",
        "_key_groups",
        "_keys",
        "_max_bytes",
        "_ops",
        "_uk_kind",
        "_uks",
        "_value_kind",
        "_values",
    )
    _capacity: int
    _max_bytes: int
    _uk_kind: int
    _value_kind: int
    _key_groups: array[int]
    _ops: array[int]
    _keys: _BinColumn
    _uks: _BinColumn
    _values: _BinColumn

    # Made whole in __new__, like the C type: there is no __init__ to skip or to repeat.
    def __new__(
        cls, capacity: int, max_bytes: int, user_key_kind: int, value_kind: int
    ) -> RecordColumns:
        # As the C type's argument parsing converts them: Py_ssize_t, Py_ssize_t, int, int.
        capacity = _ranged(capacity, -(1 << 63), (1 << 63) - 1, "capacity")
        max_bytes = _ranged(max_bytes, -(1 << 63), (1 << 63) - 1, "max_bytes")
        user_key_kind = _ranged(user_key_kind, -(1 << 31), _INT32_MAX, "user_key_kind")
        value_kind = _ranged(value_kind, -(1 << 31), _INT32_MAX, "value_kind")
        if capacity < 1 or max_bytes < 1:
            raise ValueError("capacity and max_bytes must be >= 1")
        _check_kind(user_key_kind, True, "user key")
        _check_kind(value_kind, False, "value")
        self = super().__new__(cls)
        self._capacity = capacity
        self._max_bytes = max_bytes
        self._uk_kind = user_key_kind
        self._value_kind = value_kind
        self._key_groups = array("i")
        self._ops = array("b")
        self._keys = _BinColumn()
        self._uks = _BinColumn()
        self._values = _BinColumn()
        return self

    def __init_subclass__(cls) -> None:
        raise TypeError("RecordColumns is not subclassable (neither is the C type)")

    def __len__(self) -> int:
        return len(self._ops)

    def _head(self, op: Any, key: Any, key_group: Any) -> tuple[int, bytes, int]:
        op = _ranged(op, -128, 127, "op")
        if not isinstance(key, bytes):
            raise TypeError(f"key: expected bytes, got {type(key).__name__}")
        return op, _raw_bytes(key, "key"), _ranged(key_group, -(1 << 31), _INT32_MAX, "key group")

    def _user_key(self, user_key: Any, typed: bool) -> bytes | None:
        if self._uk_kind == KIND_NONE:
            if user_key is not None:
                raise TypeError("user_key: this buffer has no user-key column")
            return None
        if typed:
            return _typed(user_key, self._uk_kind, "user key")
        return _raw(user_key, "user key")

    def _commit(self, op: int, key: bytes, kg: int, uk: bytes | None, value: bytes | None) -> bool:
        self._keys.room(len(key))
        if self._uk_kind != KIND_NONE:
            self._uks.room(0 if uk is None else len(uk))
        self._values.room(0 if value is None else len(value))
        row = len(self._ops)
        self._key_groups.append(kg)
        self._ops.append(op)
        self._keys.add(row, key)
        if self._uk_kind != KIND_NONE:
            self._uks.add(row, uk)
        self._values.add(row, value)
        nbytes = len(self._keys.data) + len(self._uks.data) + len(self._values.data)
        return row + 1 >= self._capacity or nbytes >= self._max_bytes

    def append(self, op: int, key: bytes, key_group: int, user_key: Any, value: Any) -> bool:
        """One record of serialized parts (bytes or None); True when the buffer is full."""
        op, key, kg = self._head(op, key, key_group)
        uk = self._user_key(user_key, False)
        return self._commit(op, key, kg, uk, _raw(value, "value"))

    def append_typed(self, op: int, key: bytes, key_group: int, user_key: Any, value: Any) -> bool:
        """One record, its parts converted by the kinds; True when the buffer is full."""
        op, key, kg = self._head(op, key, key_group)
        uk = self._user_key(user_key, True)
        return self._commit(op, key, kg, uk, _typed(value, self._value_kind, "value"))

    def append_typed_list(
        self, op: int, key: bytes, key_group: int, user_key: Any, values: list[Any]
    ) -> bool:
        """One record whose value frames every element of the list ``values``."""
        op, key, kg = self._head(op, key, key_group)
        uk = self._user_key(user_key, True)
        if not isinstance(values, list):
            raise TypeError(f"value: expected a list, got {type(values).__name__}")
        parts: list[bytes] = []
        total = 0
        for item in list.copy(values):  # a snapshot: converting may change the list
            part = _typed(item, self._value_kind, "list element")
            if len(part) > _INT32_MAX - 4 - total:  # before copying anything
                raise OverflowError(
                    "change records: more than 2 GiB in one buffer (flush more often)"
                )
            total += 4 + len(part)
            parts += (_LENGTH.pack(len(part)), part)
        return self._commit(op, key, kg, uk, b"".join(parts))

    def take(self) -> tuple[int, bytes, bytes, bytes, bytes, Column | None, Column] | None:
        """The buffered columns (see the module doc), and the buffer emptied; None if empty."""
        rows = len(self._ops)
        if rows == 0:
            return None
        uks = self._uks.take(rows) if self._uk_kind != KIND_NONE else None
        keys = self._keys.take(rows)
        out = (
            rows,
            self._key_groups.tobytes(),
            self._ops.tobytes(),
            keys[2],
            keys[3],
            uks,
            self._values.take(rows),
        )
        self._key_groups = array("i")
        self._ops = array("b")
        return out
