"""Heap snapshots of columnar states encoded by a long-lived helper process, not a fork.

Why: a forked snapshot (:mod:`backends.forked`) costs the task more than its fork. At 1M
int64 keys x 2 value states (end-to-end worker, heap uniform) the fork took 26 ms of the
task thread (p50) about twice a second, the values it then moved away from the child
(``unshare``) 6-10 ms more, and the parent took 17.9k copy-on-write faults a second
afterwards (323 without materializations): any buffer it reused after a fork was copied
page by page, and encoding a 28k-row log segment took 10.8 ms of CPU instead of 3.9 ms.
Even with no materialization in flight the task made 538-542k records/s against the
594-638k of the same run without materializations. A store whose every state is columnar
(:meth:`~backends.heap.HeapKeyedStateBackend.only_columns`: int64 keys, fixed-width
values) is three flat arrays per state (key groups, values, keys), 40 MB at 1M keys x 2
states: copied into a shared memory region kept for the store (already faulted in, so a
memcpy: 3.8-4.0 ms; the first copy of a fresh region took 34 ms), they are all a helper
needs, and nothing in the task's process is shared afterwards.

The helper is one process per worker process (:func:`helper_snapshot` starts it when a
store first reaches a quarter of :data:`~backends.forked.FORK_MIN_ENTRIES`, and uses it
once it has imported what it needs; until then, and for any store that is not all
columnar, the fork stays). It serves one snapshot at a time, each with the forked child's
own loop and wire format (:func:`backends.forked.serve`): the snapshot is a
:class:`~backends.forked.ForkedSnapshot` whose process outlives it
(:attr:`~backends.forked.ForkedSnapshot.end_job`), so the materializer reads and writes
it as it does a fork's. Each job runs on a thread of its own. One of
:data:`~backends.forked.NICE_MIN_ENTRIES` entries or more runs in the background: at the
fork's :data:`~backends.forked.CHILD_NICE`, and under ``SCHED_IDLE`` for its first
:data:`IDLE_MAX_S` where the helper may lift a thread out of it again (see
:data:`IDLE_MAX_S`; Linux sets a thread's niceness and policy on its own; a lower
priority needs no privilege, a higher one again may, hence the thread). The helper is stopped
during critical sections as a forked child is (:func:`~dstl.gil.pause_during_critical`,
for its whole life).

The helper ends when its parent closes its socket or dies: its next read of the socket
returns end of file, or its next write to a snapshot's pipe fails. A stopped helper
never reads: the kernel kills it when the parent dies (``PR_SET_PDEATHSIG``, see
:func:`_die_with_parent`; it is started by a thread of its own, :class:`_Starter`). It
leads a process group of its own, in its parent's session (the rule of
:data:`~dstl.gil.PAUSE_SIGNAL`). A helper that dies is replaced at the next snapshot (at most
:data:`MAX_STARTS` times a process); a snapshot it was serving fails as a forked child's
does (:class:`~backends.errors.SnapshotProcessError`).

Protocol (private; both ends are this file): a ``SOCK_SEQPACKET`` socket pair. The
helper sends ``b"ready"`` once. Each job is one message, a JSON object (``region``,
``generation``, ``size``, ``range``, ``sqn``, ``nice``, ``metas``: name -> the
:meth:`~backends.state.StateMeta.to_dict` object, ``columns``: name, kind, used, live
and the ``[offset, bytes]`` of ``kgs``, ``vals`` and ``ikeys`` in the region), carrying
three descriptors: the request pipe's read end, the pieces pipe's write end, and the
region (a memfd). ``{"forget": region}`` unmaps a region the parent freed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import logging
import mmap
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from backends.forked import (
    CHILD_NICE,
    ForkedSnapshot,
    _import_lazy_modules,
    serve,
)
from backends.heap import ColumnSnapshot, HeapKeyedStateBackend, StateSnapshot, _KeyColumn
from backends.keygroups import KeyGroupRange
from backends.serializers import serializer_for
from backends.state import StateMeta
from dstl.gil import PAUSE_SIGNAL, forget_paused, pause_during_critical

log = logging.getLogger(__name__)

IDLE_MAX_S = 0.5
"""How long a background job (:data:`~backends.forked.NICE_MIN_ENTRIES` entries or more)
runs under ``SCHED_IDLE`` at most; past it, it runs on at :data:`~backends.forked.CHILD_NICE`
alone, so a machine kept busy by other work cannot hold a materialization back for good.

Why: at niceness 10 the job's thread still keeps a core for its share of a scheduling
slice once it runs, and a task thread woken meanwhile (the GIL handed over, a batch of
records) waits for it: in the end-to-end worker (heap, 1M uniform keys, 2 cores) the
worker's threads spent 0.81-0.86 s a second waiting for a core while a materialization
ran, against 0.48-0.57 outside one, and the worker got 0.92-0.95 of a core instead of
~1.0 (a shorter slice for the job, 0.1 ms through ``sched_setattr``, did not change
that). A ``SCHED_IDLE`` thread gives way to any other at once: 0.55-0.64 s a second, 0.97-0.99
of a core. Records/s during a materialization over records/s outside one, five runs
each, alternated: 0.920 / 0.954 / 0.992 / 0.981 / 0.948 against 0.903 / 0.914 / 0.868 /
0.876 / 0.917 at niceness 10; a materialization took 308-347 ms (p50) against
268-304 ms, the largest checkpoint 2% more bytes. Over the whole run the five pairs'
records/s did not tell the two apart (545k against 550k on average; runs of one setting
differ by 5-10%).

Unprivileged, a thread cannot leave ``SCHED_IDLE`` unless ``RLIMIT_NICE`` allows its
niceness (``CAP_SYS_NICE`` does too): the helper tries it once at start
(:func:`_idle_liftable`), and where it cannot, background jobs run at
:data:`~backends.forked.CHILD_NICE` only. The bound is on the job's life, which ends when
its snapshot is released: 0.5 s is above the 0.30-0.35 s (p50) a materialization of 1M
uniform keys takes beside an idle core, so a job leaves ``SCHED_IDLE`` early only when
it is being starved. With both cores kept busy by two other processes (one run each):
materializations p50 / max 3.0 / 3.7 s niced only, 3.9 / 4.4 s with a bound of 1 s,
3.4 / 4.1 s with 0.5 s."""

MAX_STARTS = 3
"""Helpers one process starts at most: one that keeps dying (it cannot import what it
needs, say) leaves the forks to do the work rather than be started at every snapshot."""

READY_TIMEOUT_S = 60.0
"""How long :meth:`SnapshotHelper.wait_ready` waits by default (tests and tools)."""

CLOSE_WAIT_S = 2.0
"""How long :meth:`SnapshotHelper.close` waits for the helper to end before it kills it:
it ends at its next read of the socket, or at its next write to a job's pipe, but a job
whose snapshot is still open waits for its request."""

_PR_SET_PDEATHSIG = 1
_ALIGN = 64
_MIN_REGION = 1 << 20
_MAX_MESSAGE = 1 << 20


class SnapshotHelper:
    """The helper process, seen from its parent. Any thread: sends are serialized by a
    lock. Invariant: :attr:`pid` is registered with
    :func:`~dstl.gil.pause_during_critical` from its start until :meth:`close`."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str))
        args = ["-m", "backends.snapshot_helper", str(theirs.fileno()), str(os.getpid())]
        try:
            self._proc = subprocess.Popen(
                [sys.executable, *args],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                process_group=0,
                env=env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._ready = False
        self._closed = False
        self.pid = self._proc.pid
        pause_during_critical(self.pid)

    def returncode(self) -> int | None:
        """Its exit status once it has ended (negative: the signal), else None."""
        return self._proc.poll()

    def alive(self) -> bool:
        """Whether the process still runs (and was not closed)."""
        return not self._closed and self._proc.poll() is None

    def ready(self) -> bool:
        """Whether it has said it is ready (never blocks)."""
        return self.wait_ready(0.0)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        """Wait up to ``timeout_s`` for it to be ready; False if it is not (or died)."""
        with self._lock:
            if self._ready or self._closed:
                return self._ready and not self._closed
            if select.select([self._sock], [], [], timeout_s)[0]:
                with contextlib.suppress(OSError):
                    self._ready = self._sock.recv(16) == b"ready"
            return self._ready

    def submit(self, job: dict[str, Any], fds: list[int]) -> bool:
        """Send ``job`` with ``fds`` (the helper gets copies); False if it is gone."""
        payload = json.dumps(job).encode()
        with self._lock:
            if self._closed:
                return False
            try:
                socket.send_fds(self._sock, [payload], fds)
            except OSError as exc:
                log.warning("snapshot helper %d is gone (%s)", self.pid, exc)
                return False
            return True

    def close(self) -> None:
        """Close its socket (it exits at its next read) and reap it; kill it if it has not
        ended in :data:`CLOSE_WAIT_S`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close()
        forget_paused(self.pid)
        try:
            self._proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:  # a job whose snapshot is still open holds it
            self._proc.kill()
            self._proc.wait()


class _Region:
    """A shared memory region (memfd) kept for one store's snapshots
    (:attr:`~backends.heap.HeapKeyedStateBackend.snapshot_region`), so that each copy
    into it writes pages already faulted in. Leased by the task thread for one snapshot
    (:meth:`lease`); its snapshot ends the lease from the thread that releases it. Freed
    (and the helper told) once nothing refers to it."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.generation = 0
        self.size = 0
        self.fd = -1
        self.map: mmap.mmap | None = None
        self._busy = False
        self._lock = threading.Lock()
        self._free: Callable[[], object] = lambda: None  # the current generation's

    def lease(self) -> bool:
        """Take it for a snapshot; False if the last one has not ended."""
        with self._lock:
            if self._busy:
                return False
            self._busy = True
            return True

    def end(self) -> None:
        """End the lease (any thread)."""
        with self._lock:
            self._busy = False

    def fit(self, size: int) -> mmap.mmap:
        """The mapping, at least ``size`` bytes (a new region, twice as large, if not).
        Under the lease."""
        if self.map is not None and size <= self.size:
            return self.map
        self._free()
        self.size = max(_MIN_REGION, 2 * size)
        self.fd = os.memfd_create("changelog-state-snapshot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size)
        self.generation = next(self._ids)
        self._free = weakref.finalize(self, _free_region, self.id, self.map, self.fd)
        return self.map


_helper: SnapshotHelper | None = None
_helper_owner = 0
_starts = 0
_module_lock = threading.Lock()


def running_helper(start: bool = True) -> SnapshotHelper | None:
    """This process's helper, started if ``start`` and there is none (or it died, at most
    :data:`MAX_STARTS` starts in all); None if there is none. Any thread."""
    global _helper, _helper_owner, _starts
    with _module_lock:
        if _helper_owner != os.getpid():  # a fork of the process that started it
            _helper, _helper_owner = None, os.getpid()
        if _helper is not None and not _helper.alive():
            log.warning("snapshot helper %d ended (%s)", _helper.pid, _helper.returncode())
            _helper.close()
            _helper = None
        if _helper is None and start and _starts < MAX_STARTS and hasattr(os, "memfd_create"):
            _starts += 1
            try:
                _helper = _Starter.of_this_process().start()
            except OSError as exc:
                log.warning("snapshot helper: cannot start (%s); forking instead", exc)
            else:
                atexit.register(close_helper)  # reaped, so that its CPU time is counted
        return _helper


class _Starter:
    """The thread that starts the helpers of this process, and lives as long as it: the
    helper asks the kernel to kill it when the thread that started it ends
    (``PR_SET_PDEATHSIG`` names a thread, not a process), and a task thread may end
    before its process does."""

    _instance: _Starter | None = None

    def __init__(self) -> None:
        self.owner = os.getpid()
        self._requests: queue.SimpleQueue[Future[SnapshotHelper]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="snapshot-helper-starter", daemon=True).start()

    @classmethod
    def of_this_process(cls) -> _Starter:
        """This process's starter (made on first use; a fork makes its own). Under
        ``_module_lock``."""
        if cls._instance is None or cls._instance.owner != os.getpid():
            cls._instance = cls()
        return cls._instance

    def start(self) -> SnapshotHelper:
        """A new helper, started on this thread (waits for it)."""
        started: Future[SnapshotHelper] = Future()
        self._requests.put(started)
        return started.result()

    def _run(self) -> None:
        while True:
            started = self._requests.get()
            try:
                started.set_result(SnapshotHelper())
            except BaseException as exc:
                started.set_exception(exc)


def close_helper() -> None:
    """Close this process's helper, if any (it is started anew when next needed)."""
    global _helper
    with _module_lock:
        helper, _helper = _helper, None
    if helper is not None and _helper_owner == os.getpid():
        helper.close()


def helper_snapshot(backend: HeapKeyedStateBackend, sqn: int | None) -> ForkedSnapshot | None:
    """A snapshot of ``backend`` served by the helper (task thread only), or None when
    the helper cannot take it: a state that is not columnar, no helper ready yet, the
    store's last helper snapshot still in flight, or a region or pipe it cannot make.
    Starts the helper once the store has a quarter of
    :data:`~backends.forked.FORK_MIN_ENTRIES` entries."""
    from backends import forked  # its thresholds, as tests set them

    entries = backend.entry_count()
    if entries < forked.FORK_MIN_ENTRIES // 4:
        return None
    stores = backend.only_columns()
    if stores is None:
        return None
    helper = running_helper()
    if helper is None or not helper.ready() or entries < forked.FORK_MIN_ENTRIES:
        return None
    region = backend.snapshot_region
    if not isinstance(region, _Region):
        region = backend.snapshot_region = _Region()
    if not region.lease():
        return None
    snap = None
    try:
        snap = _submit(backend, stores, sqn, helper, region, entries >= forked.NICE_MIN_ENTRIES)
    except OSError as exc:  # no memory for the region, no descriptors for the pipes
        log.warning("snapshot helper: cannot hand the snapshot over (%s); forking", exc)
    finally:
        if snap is None:
            region.end()
    return snap


def _submit(
    backend: HeapKeyedStateBackend,
    stores: dict[str, tuple[str, Any]],
    sqn: int | None,
    helper: SnapshotHelper,
    region: _Region,
    nice: bool,
) -> ForkedSnapshot | None:
    views = []
    offset = 0
    columns = []
    for name, (kind, store) in sorted(stores.items()):
        used, live, kgs, vals, ikeys = store.views()
        if ikeys is None:  # a key that is not an exact int64: the fork exports the list
            return None
        spans = {}
        for part, view in (("kgs", kgs), ("vals", vals), ("ikeys", ikeys)):
            spans[part] = [offset, view.nbytes]
            views.append((offset, view))
            offset += -(-view.nbytes // _ALIGN) * _ALIGN
        columns.append({"name": name, "kind": kind, "used": used, "live": live, **spans})
    mapped = region.fit(offset)
    assert region.fd >= 0
    for at, view in views:
        mapped[at : at + view.nbytes] = view
        view.release()
    rng = backend.key_group_range
    job = {
        "region": region.id,
        "generation": region.generation,
        "size": region.size,
        "range": [rng.start, rng.end],
        "sqn": sqn,
        "nice": nice,
        "idle_max_s": IDLE_MAX_S,
        "metas": {name: meta.to_dict() for name, meta in backend.state_metas().items()},
        "columns": columns,
    }
    req_r, req_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        sent = helper.submit(job, [req_r, out_w, region.fd])
    finally:
        os.close(req_r)
        os.close(out_w)
    if not sent:
        os.close(req_w)
        os.close(out_r)
        return None
    return ForkedSnapshot(rng, sqn, helper.pid, req_w, out_r, nice, end_job=region.end)


def _free_region(region_id: int, mapped: mmap.mmap, fd: int) -> None:
    """Unmap and close a region (a generation of one), and tell the helper to unmap it."""
    mapped.close()
    os.close(fd)
    helper = _helper
    if helper is not None and _helper_owner == os.getpid():
        helper.submit({"forget": region_id}, [])


# -- the helper ----------------------------------------------------------------------------
def main(argv: list[str]) -> None:  # pragma: no cover - the helper process
    """The helper: serve jobs from the socket ``argv[1]`` until its end of file."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, PAUSE_SIGNAL):
        signal.signal(sig, signal.SIG_DFL)  # a parent under nohup ignores SIGHUP: not us
    _die_with_parent(int(argv[2]))
    sock = socket.socket(fileno=int(argv[1]))
    _import_lazy_modules()
    idle = _idle_liftable()
    maps: dict[int, tuple[int, mmap.mmap]] = {}
    sock.send(b"ready")
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except OSError:
            return
        if not msg:
            return
        job = json.loads(msg)
        if "forget" in job:
            _unmap(maps.pop(job["forget"], None))
            continue
        req_fd, out_fd, region_fd = fds
        known = maps.get(job["region"])
        if known is None or known[0] != job["generation"]:
            _unmap(known)
            known = (job["generation"], mmap.mmap(region_fd, job["size"], prot=mmap.PROT_READ))
            maps[job["region"]] = known
        os.close(region_fd)
        go = threading.Event()
        worker = threading.Thread(target=_run, args=(job, known[1], req_fd, out_fd, go))
        worker.start()
        if job["nice"]:
            _in_background(worker, go, job["idle_max_s"] if idle else None)
        else:
            go.set()
        worker.join()


def _die_with_parent(parent: int) -> None:  # pragma: no cover - the helper process
    """Have the kernel kill this process when the thread that started it ends, stopped or
    not (``PR_SET_PDEATHSIG``); exit now if the parent is gone already.

    A stopped process never reads its end of file, and the orphaned-group rule that
    continues a forked child does not cover the helper: its threads stop one by one, and
    a parent that dies before the last one has stopped leaves a group with no stopped
    process yet, so the kernel sends nothing, and the helper stops for good afterwards
    (fresh-clone CI, once, with the suite's other processes running beside it).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _idle_liftable() -> bool:  # pragma: no cover - the helper process
    """Whether a thread of this process may leave ``SCHED_IDLE`` again once it entered it
    at :data:`~backends.forked.CHILD_NICE` (tried on a thread of its own, which then
    ends): ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` that allows that niceness."""
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            _renice(tid)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except (OSError, AttributeError):  # AttributeError: not Linux
            result.append(False)
        else:
            result.append(True)

    thread = threading.Thread(target=probe, name="snapshot-helper-probe")
    thread.start()
    thread.join()
    return result[0]


def _renice(tid: int) -> None:  # pragma: no cover - the helper process
    """Lower thread ``tid``'s priority by :data:`~backends.forked.CHILD_NICE`."""
    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + CHILD_NICE)


def _in_background(
    worker: threading.Thread, go: threading.Event, idle_max_s: float | None
) -> None:  # pragma: no cover - the helper process
    """Put ``worker`` (started, waiting for ``go``) in the background, then set ``go``:
    at :data:`~backends.forked.CHILD_NICE`, and with ``idle_max_s`` under ``SCHED_IDLE``
    until it ends or for that long (see :data:`IDLE_MAX_S`)."""
    tid = worker.native_id
    assert tid is not None
    with contextlib.suppress(OSError):
        _renice(tid)
    idle = idle_max_s is not None
    if idle:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            idle = False
    go.set()
    if idle:
        worker.join(idle_max_s)
        if worker.is_alive():
            with contextlib.suppress(OSError):  # ESRCH: it ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


def _run(
    job: dict[str, Any], region: mmap.mmap, req_fd: int, out_fd: int, go: threading.Event
) -> None:  # pragma: no cover
    try:
        go.wait()  # put in the background first, if it is a large job
        with contextlib.suppress(OSError):  # the parent went away: the job with it
            serve(lambda: _view(job, region), req_fd, out_fd)
    finally:
        os.close(req_fd)
        os.close(out_fd)


def _view(job: dict[str, Any], region: mmap.mmap) -> StateSnapshot:  # pragma: no cover
    whole = memoryview(region)
    columns = {}
    for c in job["columns"]:
        kgs, vals, ikeys = (whole[a : a + n] for a, n in (c["kgs"], c["vals"], c["ikeys"]))
        columns[c["name"]] = ColumnSnapshot(
            c["kind"], c["used"], c["live"], kgs, vals, [], _KeyColumn(), ikeys
        )
    return StateSnapshot(
        serializer_for("int64"),
        KeyGroupRange(*job["range"]),
        {name: StateMeta.from_dict(raw) for name, raw in job["metas"].items()},
        {},
        job["sqn"],
        columns,
    )


def _unmap(known: tuple[int, mmap.mmap] | None) -> None:  # pragma: no cover - the helper
    if known is not None:
        with contextlib.suppress(BufferError):  # a view outlived its job: the collector
            known[1].close()


if __name__ == "__main__":  # pragma: no cover - the helper process
    main(sys.argv)
