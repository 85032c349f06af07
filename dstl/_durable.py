"""Durable local writes and helper-process round trips: :mod:`dstl._durable_c` (C, one GIL
release per call) or :mod:`dstl._durable_py` (the same API with ``os`` calls), chosen once
at import (:mod:`dstl.native`). ``NATIVE`` says which. The API is documented in
``dstl/_durable_py.py``.
"""

from typing import TYPE_CHECKING

from dstl.native import load

if TYPE_CHECKING:
    from dstl._durable_py import exchange, write_new

    NATIVE: bool
else:
    _impl = load("dstl._durable")
    exchange = _impl.exchange
    write_new = _impl.write_new
    NATIVE = _impl.__name__ == "dstl._durable_c"

__all__ = ["NATIVE", "exchange", "write_new"]
