"""Keep what a worker holds when its job starts out of the cyclic GC's collections.

A full (generation 2) collection walks every container the GC tracks, holding the GIL,
so every task thread stops while it runs. When a job starts, most tracked objects are
the modules, classes and functions imported by then (pyarrow, SQLAlchemy, the stores)
and the job's own structures: ~100k objects, whose full pass took 40-90 ms on this
machine in the end-to-end bench (heap store, 1M keys), once every 15-30 s of the run,
at whatever moment: a record's latency and a checkpoint's own part took all of it
(issue 16; measured with ``gc.callbacks``). :func:`frozen_heap` moves them to the
permanent generation (:func:`gc.freeze`) for the run: a full collection then walks only
what the run allocated since, 2-10 ms (1.7-5.3 ms of CPU) in the same bench. Collections
happen as before.

What it costs: a cycle among frozen objects that becomes garbage during the run is freed
only after the run, when :func:`gc.unfreeze` hands the frozen objects back to the oldest
generation; a collection right before the freeze makes sure nothing already dead is
frozen. Process-wide: the first job to start freezes, every later one freezes what was
allocated since, and the last to end unfreezes. A process that froze objects itself
before (``gc.get_freeze_count()``: a pre-fork server) is left alone. Any thread.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_jobs = 0
_ours = False  # whether the freeze in place is this module's (False: none, or another's)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze every tracked object for the ``with`` block (see the module docstring)."""
    global _jobs, _ours
    with _lock:
        if _jobs == 0:
            _ours = gc.get_freeze_count() == 0
            if _ours:
                gc.collect()
        if _ours:
            gc.freeze()
        _jobs += 1
    try:
        yield
    finally:
        with _lock:
            _jobs -= 1
            if _jobs == 0 and _ours:
                gc.unfreeze()
                _ours = False
