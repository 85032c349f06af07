"""The cyclic GC while jobs run: what a worker holds at a job's start is frozen, and the
young generation is collected only when it grows by :data:`YOUNG_THRESHOLD` objects.

Every collection holds the GIL, so every task thread stops while it runs.

The freeze. A full (generation 2) collection walks every container the GC tracks. When
a job starts, most tracked objects are the modules, classes and functions imported by
then (pyarrow, SQLAlchemy, the stores) and the job's own structures: ~100k objects,
whose full pass took 40-90 ms on this machine in the end-to-end bench (heap store, 1M
keys), once every 15-30 s of the run, at whatever moment: a record's latency and a
checkpoint's own part took all of it (issue 16; measured with ``gc.callbacks``).
:func:`job_gc_policy` moves them to the permanent generation (:func:`gc.freeze`) for the
run: a full collection then walks only what the run allocated since, 2-10 ms (1.7-5.3 ms
of CPU) in the same bench.

What it costs: a cycle among frozen objects that becomes garbage during the run is freed
only after the run, when :func:`gc.unfreeze` hands the frozen objects back to the oldest
generation; a collection right before the freeze makes sure nothing already dead is
frozen. A process that froze objects itself before (``gc.get_freeze_count()``: a pre-fork
server) is left alone.

The young threshold. CPython collects the young generation each time 700 more tracked
objects were allocated than freed. A running job always holds thousands of young ones
that live a little while: the records of the batches in flight between its tasks (a tuple
each). Its live set goes up and down by more than 700 all the time, so each young
collection walked the batches in flight again, and every tenth one the middle
generation as well. End-to-end worker, heap store, 1M uniform keys, 40 s after the load:
11-12k young collections (3.1 s), ~1k middle ones (0.76 s) and 80 full ones (0.31 s):
8% of the run holding the GIL. With the threshold at 20000: 8, 1 and 1 (0.1 s in all),
and records/s 599k / 582k / 559k against 539k / 564k / 549k (three alternated pairs,
``gc.set_threshold`` in the worker). Our own part of a checkpoint did not change beyond
the noise. Garbage cycles are still collected: they count towards the threshold, as the
live set's growth does. A process whose young threshold is higher already is left alone,
and so is one that changed the thresholds while its jobs ran.

Process-wide, counted: the first job to start applies both, every later one freezes what
was allocated since, and the last to end undoes both. Any thread.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

YOUNG_THRESHOLD = 20_000
"""The young generation's threshold while a job runs (CPython's default: 700)."""

_lock = threading.Lock()
_jobs = 0
_ours = False  # whether the freeze in place is this module's (False: none, or another's)
_thresholds: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (before, ours)


@contextlib.contextmanager
def job_gc_policy() -> Iterator[None]:
    """Apply the GC policy of a running job for the ``with`` block (see the module
    docstring)."""
    global _jobs, _ours, _thresholds
    with _lock:
        if _jobs == 0:
            _ours = gc.get_freeze_count() == 0
            if _ours:
                gc.collect()
            before = gc.get_threshold()
            if before[0] < YOUNG_THRESHOLD:
                gc.set_threshold(YOUNG_THRESHOLD, *before[1:])
                _thresholds = (before, gc.get_threshold())
        if _ours:
            gc.freeze()
        _jobs += 1
    try:
        yield
    finally:
        with _lock:
            _jobs -= 1
            if _jobs == 0:
                if _ours:
                    gc.unfreeze()
                    _ours = False
                if _thresholds is not None and gc.get_threshold() == _thresholds[1]:
                    gc.set_threshold(*_thresholds[0])
                _thresholds = None
