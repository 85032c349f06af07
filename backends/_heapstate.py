"""The heap store's per-record writes: :mod:`backends._heapstate_c` (C) or
:mod:`backends._heapstate_py` (the same API in Python), chosen once at import
(:mod:`dstl.native`). The C one needs the C record buffer (it appends through its
capsule), so it is used only when :mod:`dstl._records` is the C one. ``NATIVE`` says
which. The API is documented in ``backends/_heapstate_py.py``.
"""

from typing import TYPE_CHECKING

from dstl import _records
from dstl.native import load

if TYPE_CHECKING:
    from backends._heapstate_py import (
        ColumnStore,
        ColumnWriter,
        HeapList,
        HeapMap,
        HeapValue,
        KeyContext,
        key_group_for,
        pack,
        pack_text,
    )

    NATIVE: bool
else:
    _impl = load("backends._heapstate", native_allowed=_records.NATIVE)
    KeyContext = _impl.KeyContext
    HeapValue = _impl.HeapValue
    HeapList = _impl.HeapList
    HeapMap = _impl.HeapMap
    ColumnStore = _impl.ColumnStore
    ColumnWriter = _impl.ColumnWriter
    key_group_for = _impl.key_group_for
    pack = _impl.pack
    pack_text = _impl.pack_text
    NATIVE = _impl.__name__ == "backends._heapstate_c"

__all__ = [
    "NATIVE",
    "ColumnStore",
    "ColumnWriter",
    "HeapList",
    "HeapMap",
    "HeapValue",
    "KeyContext",
    "key_group_for",
    "pack",
    "pack_text",
]
