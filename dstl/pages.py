"""No transparent huge pages in a process while it keeps a changelog (Linux).

Why. pyarrow's default memory pool (mimalloc 3) asks the kernel for transparent huge
pages (``allow_thp``; the kernel grants them to memory advised so, this machine's
setting) and gives memory unused for a second (``purge_delay``) back to the kernel. A
barrier's segment is encoded about once a second, so its encoding often touched memory
given back since, and each first touch faulted in a whole 2 MiB page that the kernel
zeroed first. End-to-end worker, heap store, 1M uniform keys: with ``perf record`` one
barrier's encoding of 387 KB took 26.8 ms of CPU, two thirds of it ``clear_page_erms``
under ``do_huge_pmd_anonymous_page``, called from mimalloc's ``mi_page_free_list_extend``
(its usual cost: 4.5 ms). Those encodings set the p99 of our own part of a checkpoint.
With the process's huge pages off (``PR_SET_THP_DISABLE``), alternated 40 s runs at 1M
keys, two pairs of the heap store and two of RocksDB: the barrier's encoding CPU max
8.6-13.2 ms against 22.2-54.3 ms, our own part p99 over the 160 checkpoints of each
side 24.1 ms against 43.1 ms, records/s the same within the noise.

The setting is the process's: inherited by the processes it forks and spawns (the
segment encoder, a heap snapshot's child), kept across ``exec``. Memory already in huge
pages stays so. :func:`small_pages` turns it on for as long as changelog storages are
open in a process that did not have it on already, counted like
:func:`dstl.gil.short_gil_slices`; a helper process of ours that encodes segments
calls :func:`disable_huge_pages` for good. Elsewhere than on Linux both do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator

PR_SET_THP_DISABLE = 41
PR_GET_THP_DISABLE = 42

_lock = threading.Lock()
_users = 0
_ours = False  # whether this module turned huge pages off (so it turns them back on)


def _prctl(option: int, value: int = 0) -> int | None:
    """``prctl(option, value, 0, 0, 0)``; None where there is none or it failed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        result = int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0))
    except (OSError, AttributeError):
        return None
    return None if result < 0 else result


def huge_pages_disabled() -> bool | None:
    """Whether this process has transparent huge pages off; None where unknown."""
    state = _prctl(PR_GET_THP_DISABLE)
    return None if state is None else bool(state)


def disable_huge_pages() -> None:
    """Turn this process's transparent huge pages off for good (a helper process)."""
    _prctl(PR_SET_THP_DISABLE, 1)


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """Run the body with this process's transparent huge pages off; the last user of a
    process that had them on turns them back on. Any thread."""
    global _users, _ours
    with _lock:
        if _users == 0 and huge_pages_disabled() is False:
            _ours = _prctl(PR_SET_THP_DISABLE, 1) is not None
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _ours:
                _prctl(PR_SET_THP_DISABLE, 0)
                _ours = False
