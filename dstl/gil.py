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

CHECKPOINT_GIL_SLICE_S = 0.0002
"""The switch interval while a checkpoint is in flight (trigger to recorded). Its own part
is a chain of short steps on other threads (the metadata commit gives the GIL up at each
of its dozen statements), each waiting for a busy task thread's slice. A record beside a
busy Python thread, p50 over 30 (when it still ran 40-odd statements): 68 ms at 5 ms,
48 ms at 1 ms, 32 ms at 0.5 ms, 21 ms at 0.2 ms, 17 ms at 0.1 ms; the busy thread did
not run slower. Held ~5% of the time at one checkpoint a second."""

_slices_lock = threading.Lock()
_slices_users: list[float] = []  # the slice each current user asked for
_slices_saved = 0.0


@contextlib.contextmanager
def short_gil_slices(slice_s: float = GIL_SLICE_S) -> Iterator[None]:
    """Run the body with the switch interval at most ``slice_s`` (process-wide, so
    counted: the interval is the shortest any current user asked for, and the last of
    them puts the previous interval back)."""
    global _slices_saved
    with _slices_lock:
        if not _slices_users:
            _slices_saved = sys.getswitchinterval()
        _slices_users.append(slice_s)
        sys.setswitchinterval(min([_slices_saved, *_slices_users]))
    try:
        yield
    finally:
        with _slices_lock:
            _slices_users.remove(slice_s)
            sys.setswitchinterval(min([_slices_saved, *_slices_users]))
