"""Shorter GIL slices while a background thread has latency-bound work to do.

A thread that gives the GIL up (an Arrow call, a hash, a file write, a pipe exchange)
gets it back from a task thread running Python only when the task's switch interval
(default 5 ms) runs out: a background job of a few hundred such steps waits seconds
beside a busy task. :func:`short_gil_slices` lowers the process's switch interval while
such a job runs. It is process-wide, so its users are counted and the last one puts the
previous interval back.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

GIL_SLICE_S = 0.001
"""The interpreter's switch interval while a materialization uploads (default 5 ms).

The upload thread gives the GIL up at every Arrow call, hash and file write, and a task
thread running Python keeps it for a whole switch interval before it hands it back:
measured on a 1M-key heap snapshot (2 states) against a busy Python thread, 0.9 s of
CPU took 10-15 s of wall time at 5 ms. In the end-to-end worker (1M keys, 65536-row
pieces), one materialization took 3.5-5 s at 5 ms, 2-2.8 s at 2 ms, 1.6-1.9 s at 1 ms,
1.2-1.8 s at 0.5 ms; the task's throughput while it ran fell with the interval (the
GIL the upload thread holds is taken from the task), so 1 ms: the shortest that keeps
a materialization of 1M keys under 2 s."""

_slices_lock = threading.Lock()
_slices_users = 0
_slices_saved = 0.0


@contextlib.contextmanager
def short_gil_slices() -> Iterator[None]:
    """Run the body with the switch interval at most :data:`GIL_SLICE_S` (process-wide,
    so counted: the last of concurrent users puts the previous interval back)."""
    global _slices_users, _slices_saved
    with _slices_lock:
        if _slices_users == 0:
            _slices_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_slices_saved, GIL_SLICE_S))
        _slices_users += 1
    try:
        yield
    finally:
        with _slices_lock:
            _slices_users -= 1
            if _slices_users == 0:
                sys.setswitchinterval(_slices_saved)
