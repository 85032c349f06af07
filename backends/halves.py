"""A job in two halves on two cores: the upper half in a forked child.

A restore into RocksDB folds each value-like state's log changes, sorts them into
RocksDB's order and writes them as SST files (:meth:`backends.restore._Replay.finish`).
That is CPU bound and holds the GIL (``rocksdict``'s ``SstFileWriter`` does not release
it: a second thread gained nothing), so :func:`run_halves` splits it by key groups and
runs the upper half in a forked child while the calling thread runs the lower half.

Each half writes its results to files only (the child's memory dies with it). The child
runs nothing but its half, on what it inherited (read only, so the kernel copies none
of those pages), with the garbage collector off and on the system allocator (pyarrow's
own may hold locks of threads that do not exist in the child), and ends with
``os._exit``: its exit status is its answer. A child that fails, dies, or runs past
:func:`_child_deadline_s` is killed and reaped, and its half runs again in the caller:
the result is the same either way, only slower. A fork that fails (no memory for the
page tables, a process limit) runs both halves in the caller.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import time
import traceback
import warnings
from collections.abc import Callable

import pyarrow as pa

log = logging.getLogger(__name__)


def run_halves(lower: Callable[[], None], upper: Callable[[], None]) -> None:
    """Run ``upper`` in a forked child while the calling thread runs ``lower``; run
    ``upper`` here after ``lower`` if the child did not finish it (see the module
    docstring). Both write only files; ``upper`` must be safe to run again after a run
    that stopped anywhere (it starts by removing what it writes). Calling thread only;
    the child is reaped before this returns or raises. Without ``fork()``, runs both
    here."""
    pid = _fork(upper) if hasattr(os, "fork") else None
    started = time.monotonic()
    try:
        lower()
        done = pid is not None and _child_done(pid, _child_deadline_s(time.monotonic() - started))
    except BaseException:  # the child is not reaped yet (_child_done reaps it last)
        if pid is not None:
            _kill(pid)
        raise
    if not done:
        upper()


def _fork(upper: Callable[[], None]) -> int | None:
    """Fork a child that runs ``upper``; its pid, or None if the fork failed."""
    try:
        with warnings.catch_warnings():
            # 3.12+ warns that a multi-threaded process forks: the child runs only its
            # half (see the module docstring), never the other threads' locks.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        log.warning("halves: fork failed (%s); running both halves on this thread", exc)
        return None
    if pid == 0:  # pragma: no cover - the child; its exit ends this branch
        _child(upper)
    return pid


def _child(upper: Callable[[], None]) -> None:  # pragma: no cover - the child
    """The forked child: run ``upper``, then ``os._exit`` (0: done).

    Coverage cannot see it (the child never returns); tests check it by its files."""
    code = 1
    try:
        gc.disable()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        pa.set_memory_pool(pa.system_memory_pool())
        upper()
        code = 0
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)


def _child_deadline_s(own_s: float) -> float:
    """How long the caller waits for the child once its own half is done: the halves
    are about the same size, so a child still running after this (``10 s`` plus four
    times the caller's own time) is stuck, not slow."""
    return 10.0 + 4.0 * own_s


def _child_done(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for child ``pid`` and reap it; whether it exited 0.
    A child still running then is killed (and its half is the caller's again)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): wait without a bound
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)
    if not ready:
        log.warning("halves: child %d ran past %.1f s; killed, its half runs here", pid, timeout_s)
        _kill(pid)
        return False
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        log.warning("halves: child %d exited %d; its half runs here", pid, code)
    return code == 0


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
