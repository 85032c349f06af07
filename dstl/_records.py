"""The change-record buffer: :mod:`dstl._records_c` (C) or :mod:`dstl._records_py` (the
same API and bytes in Python), chosen once at import (:mod:`dstl.native`). ``NATIVE``
says which. The API is documented in ``dstl/_records_py.py``.
"""

from typing import TYPE_CHECKING

from dstl.native import load

if TYPE_CHECKING:
    from dstl._records_py import (
        KIND_BYTES,
        KIND_FLOAT64,
        KIND_INT64,
        KIND_NONE,
        KIND_STR,
        RecordColumns,
        pack_float64,
        pack_int64,
    )

    NATIVE: bool
else:
    _impl = load("dstl._records")
    KIND_NONE = _impl.KIND_NONE
    KIND_BYTES = _impl.KIND_BYTES
    KIND_INT64 = _impl.KIND_INT64
    KIND_FLOAT64 = _impl.KIND_FLOAT64
    KIND_STR = _impl.KIND_STR
    RecordColumns = _impl.RecordColumns
    pack_int64 = _impl.pack_int64
    pack_float64 = _impl.pack_float64
    NATIVE = _impl.__name__ == "dstl._records_c"

__all__ = [
    "KIND_BYTES",
    "KIND_FLOAT64",
    "KIND_INT64",
    "KIND_NONE",
    "KIND_STR",
    "NATIVE",
    "RecordColumns",
    "pack_float64",
    "pack_int64",
]
