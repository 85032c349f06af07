"""Shorter GIL slices while a background thread has latency-bound work to do.

A thread that gives the GIL up (an Arrow call, a hash, a file write, a pipe exchange)
gets it back from a task thread running Python only when the task's switch interval
(default 5 ms) runs out: a background job of a few hundred such steps waits seconds
beside a busy task. :func:`short_gil_slices` lowers the process's switch interval while
such a job runs. It is process-wide, so its users are counted and the last one puts the
previous interval back.

For the few milliseconds of a checkpoint's own critical steps, shorter slices are not
enough: :func:`critical_section` makes the task threads stand aside
(:func:`yield_to_critical`, called between batches of records) until the step is done,
and stops the helper processes registered with :func:`pause_during_critical` (a heap
materialization's forked encoder) for as long, at most :data:`PAUSE_MAX_S`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
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
a materialization of 1M keys under 2 s. Those were uploads that encoded in-process; a
large state's forked heap snapshot (a background child) only has its bytes moved by the
upload, which keeps the default (``materializer.Materializer.upload_result``)."""

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


CRITICAL_WAIT_MAX_S = 0.030
"""How long task threads stand aside for one :func:`critical_section` at most, from its
start. Bounds what a slow section (a metadata store or a disk that stalls) costs the
task's throughput: past it, the tasks run beside the section as they did before."""

# Reentrant: a stopped process is forgotten by a finalizer (backends.forked), which a
# garbage collection may run inside any allocation, this module's sections included.
_critical_cond = threading.Condition(threading.RLock())
_critical: dict[int, tuple[int | None, float]] = {}  # token -> (owner thread, deadline)
_critical_tokens = itertools.count(1)
_MINE = -1  # open_critical's default owner: the calling thread


def open_critical(max_wait_s: float | None = None, owner: int | None = _MINE) -> int | None:
    """Open a critical section (see :func:`critical_section`) that :func:`close_critical`
    closes, on any thread: for one that ends on another thread than it began. ``owner``
    is the thread that does not wait for it (default: the caller; None: every task
    thread waits, the caller too). Returns its token; None (nothing opened) for a bound
    of 0."""
    wait_s = CRITICAL_WAIT_MAX_S if max_wait_s is None else max_wait_s
    if wait_s <= 0:
        return None
    token = next(_critical_tokens)
    who = threading.get_ident() if owner == _MINE else owner
    with _critical_cond:
        now = time.monotonic()
        _critical[token] = (who, now + wait_s)
        _pause_locked(now)
    return token


def close_critical(token: int | None) -> None:
    """Close the section :func:`open_critical` returned ``token`` for (None, or a token
    closed already or dropped past its bound: nothing)."""
    if token is None:
        return
    with _critical_cond:
        if _critical.pop(token, None) is not None:
            _critical_cond.notify_all()
        if not _critical:
            _resume_locked(hold_off=False)


@contextlib.contextmanager
def critical_section(max_wait_s: float | None = None) -> Iterator[None]:
    """Run the body as latency-critical work: task threads that call
    :func:`yield_to_critical` (between two batches of records) wait until it ends, for
    at most ``max_wait_s`` (default :data:`CRITICAL_WAIT_MAX_S`) from its start.

    Why: our own part of a checkpoint (the barrier's segment encoded and written, the
    metadata record) runs on background threads of the process that runs the tasks. A
    task thread running Python holds the GIL; every time such a step gives the GIL up
    (each Arrow call, SQL statement, write) it waits a switch interval and a trip
    through the OS scheduler to get it back, and on 2 cores it also shares a core with
    the task. Measured in the end-to-end benchmark, those steps took 2.5-3.5x the time
    they take alone. Standing the tasks aside for the few milliseconds the step takes
    alone costs them less than sharing the GIL with it for two or three times as long.

    Any thread; sections nest and overlap (the tasks wait while any is open). A thread
    never waits for its own section. Never hold a section while waiting for a task
    thread: the task would wait for the bound each time.
    """
    token = open_critical(max_wait_s)
    try:
        yield
    finally:
        close_critical(token)


def yield_to_critical() -> float:
    """Task threads, between batches: wait while a critical section of another thread
    is open (each for at most its bound; sections past it are dropped here). Returns
    the seconds waited; costs a dictionary's truth test when none is open (the common
    case)."""
    if not _critical:
        return 0.0
    me = threading.get_ident()
    started = now = time.monotonic()
    with _critical_cond:
        while True:
            for token in [t for t, (_, d) in _critical.items() if d <= now]:
                del _critical[token]  # past its bound: never waited for again
            if _critical:
                _resume_overdue_locked(now)
            else:
                _resume_locked(hold_off=False)
            deadline = max((d for owner, d in _critical.values() if owner != me), default=None)
            if deadline is None:
                return now - started
            _critical_cond.wait(deadline - now)
            now = time.monotonic()


PAUSE_MAX_S = CRITICAL_WAIT_MAX_S
"""How long a registered process stays stopped at most, from the opening of the section
that stopped it. Past it, it runs until every section open then has closed."""

PAUSE_SIGNAL = signal.SIGTSTP
"""The signal that stops a registered process (``SIGCONT`` continues it).

Not ``SIGSTOP``: a stop takes effect only when the process next runs. A parent killed
before then (on a busy machine, right after it sent the stop) dies while the kernel still
sees no stopped member in the orphaned group, so it sends none the ``SIGHUP`` and
``SIGCONT`` that end it; the process stops afterwards, for good, holding a fork's memory
(``test_a_stopped_child_ends_when_its_parent_is_killed`` failed so beside other tests).
The kernel discards a ``SIGTSTP`` that a member of an orphaned group takes, so that
process runs on and sees its parent gone. A registered process keeps ``SIGTSTP`` at its
default action, and leads a group whose parent is in its session (a group orphaned while
the parent lives is never stopped: harmless, only the pause's gain is lost)."""

_paused: set[int] = set()  # pids stopped while a section is open (under _critical_cond)
_stopped_since: float | None = None  # when the current stop began; None: none (they run)
_hold_off = False  # overdue: not stopped again until no section is open


def pause_during_critical(pid: int) -> None:
    """Stop process ``pid`` (:data:`PAUSE_SIGNAL`) while a critical section is open, and
    continue it (``SIGCONT``) when the last one closes or after :data:`PAUSE_MAX_S`,
    whichever comes first; until :func:`forget_paused`. Any thread.

    Why: a heap materialization's forked child encodes on the core the task threads
    leave free when they stand aside, and our own critical steps (the barrier's segment,
    the metadata commit) then share the machine's caches and memory bandwidth with it.
    End-to-end worker, heap, 1M uniform keys, 30 checkpoints a run, 14 runs with the
    child stopped against 11 without (alternated): the own part of a checkpoint p50 /
    p90 / p95 15.8 / 23.8 / 27.9 ms against 17.3 / 26.9 / 31.9 ms, 21% of checkpoints
    over 20 ms against 30%; records/s, the materializations' pace and (at 100k keys) the
    full checkpoint's size unchanged. Not the p99 (39.2 ms both): a few barrier segments
    whose encoding takes 3-4x its usual CPU set it. Only stopping it does that: at
    ``SCHED_IDLE`` it still ran on the free core (p90 26.6-30.8 ms in two runs).

    The caller must make sure the process cannot outlive it stopped: a stopped process
    never reads the end of file that tells it its parent died (see
    :func:`backends.forked.fork_snapshot`: the child leads its own process group, which
    the kernel sends ``SIGHUP`` and ``SIGCONT`` once orphaned).
    """
    with _critical_cond:
        _paused.add(pid)
        if _stopped_since is not None:
            _signal(pid, PAUSE_SIGNAL)


def forget_paused(pid: int) -> None:
    """Never stop ``pid`` again, and continue it if it is stopped now. Any thread."""
    with _critical_cond:
        if pid in _paused:
            _paused.discard(pid)
            if _stopped_since is not None:
                _signal(pid, signal.SIGCONT)


def resume_overdue() -> None:
    """Continue the registered processes if they have been stopped for :data:`PAUSE_MAX_S`.
    For threads that wait on them (a reader of their output) or tick anyway (a
    coordinator): the bound holds even when no section closes and no task yields."""
    if _stopped_since is None:
        return
    with _critical_cond:
        _resume_overdue_locked(time.monotonic())


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended meanwhile
        os.kill(pid, sig)


def _pause_locked(now: float) -> None:
    global _stopped_since
    _resume_overdue_locked(now)
    if _stopped_since is None and not _hold_off:  # a stop begins (for those to come too)
        for pid in tuple(_paused):  # a copy: see _critical_cond
            _signal(pid, PAUSE_SIGNAL)
        _stopped_since = now


def _resume_locked(hold_off: bool) -> None:
    global _stopped_since, _hold_off
    _hold_off = hold_off
    if _stopped_since is not None:
        _stopped_since = None
        for pid in tuple(_paused):
            _signal(pid, signal.SIGCONT)


def _resume_overdue_locked(now: float) -> None:
    if _stopped_since is not None and now - _stopped_since >= PAUSE_MAX_S:
        _resume_locked(hold_off=True)
