"""Heap materialization snapshots taken by ``fork()``: the kernel copies, a child encodes.

Why: a heap materialization used to copy every state's dicts on the task thread (150 ms
at 1M keys x 2 states) and then build the Arrow columns, sort and Parquet-encode the
pieces on the upload thread: ~0.8 s of CPU at 1M keys x 2 states, most of it holding the
GIL the task thread needs, so the task slowed down while it ran and the upload waited
for the GIL (a 1 ms switch interval only traded one for the other). With ``fork()`` the
synchronous part is the fork (the page tables), the child holds the state as of the fork
(copy-on-write), and encodes the pieces (:func:`backends.tables.state_files`) with its
own interpreter on another core (columnar states it exports itself, from its copy:
:meth:`~backends.heap.HeapKeyedStateBackend.frozen_columns`); the upload thread of the
parent only reads the finished pieces from a pipe and uploads them.

:func:`materialization_snapshot` picks the way: for a heap store of at least
:data:`FORK_MIN_ENTRIES` entries on a platform with ``fork()``, the long-lived helper of
:mod:`backends.snapshot_helper` when every state is columnar (a copy of three flat
arrays per state into shared memory, and nothing shared afterwards), else a fork; below
that, the store's own snapshot (a heap store copies its dicts and columns:
:meth:`~backends.heap.HeapKeyedStateBackend.column_snapshot`). A fork that fails (no
memory for the page tables, a process limit) falls back to the copy.

The child (:func:`_child`) runs nothing but this module's loop,
:func:`~backends.tables.state_files` and, when it writes the pieces, a local disk's
:meth:`~dstl.fileio.FileIO.write_new` (one C call), with every module it needs imported before the
fork, on the system allocator (pyarrow's own may hold locks of threads that do not exist
in the child), with the garbage collector off (a collection would touch, and copy, the
whole heap), for a large state at a lower priority than the task (:data:`CHILD_NICE`,
set by the parent), and with every inherited file descriptor but its two pipes closed (so
that it holds no lock file, socket or output pipe of the parent). It always ends with
``os._exit``. It exits on its own when the parent goes away: its request read returns
end of file, or its next write fails with a broken pipe.

While a critical section of the parent is open (our own part of a checkpoint, see
:mod:`dstl.gil`) the child is stopped (:data:`~dstl.gil.PAUSE_SIGNAL`, at most
:data:`~dstl.gil.PAUSE_MAX_S`; :func:`~dstl.gil.pause_during_critical` says what it
saves). A stopped child would never see its parent go away, so it leads a process group
of its own: when the parent dies, the group is orphaned, and the kernel sends a group
with a stopped member ``SIGHUP`` (which ends the child) and ``SIGCONT`` (POSIX's rule
for orphaned process groups), and discards a stop that reaches the child afterwards.

The child can also write the pieces to the store itself (:meth:`ForkedSnapshot.write_pieces`,
a store on local disk): the parent then reads a small header per piece instead of its
bytes, and its upload thread has nothing else to do. Beside a busy task thread each of
that thread's steps waits for the GIL: at 100k keys x 2 states (4 pieces, end-to-end
worker) the child had sent its last piece 39 ms after the snapshot began (p50), and the
parent had read them all at 54 ms, written them at 69 ms and finished at 79 ms.

Wire format (private; both ends are this file): the parent writes one little-endian
int64, the piece size in rows (``-1``: ``None``), and, to have the pieces written, a JSON
object (``root``: the store's URL, ``directory``, ``skip``: ``[name, file_id]`` pairs
not to write), then closes its end of the request pipe (the child encodes pieces of the
default size while it waits, see :func:`_child`). The child answers with frames: two
little-endian int64 (header length, data length), a JSON header, then the data. The
header of a piece holds ``name``, ``state``, ``lo``, ``hi`` and ``rows``; of a written
piece also ``file_id``, ``size`` and ``path`` (``null``: skipped), with no data. The last
frame's header is ``{"end": n}`` (n pieces) or ``{"error": message}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import itertools
import json
import logging
import os
import select
import signal
import struct
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from backends.errors import SnapshotProcessError
from backends.handles import file_id_of
from backends.heap import HeapKeyedStateBackend, StateSnapshot
from backends.keygroups import KeyGroupRange
from backends.snapshot import MaterializationSnapshot, SnapshotFile
from backends.tables import DEFAULT_PIECE_ROWS, state_files
from dstl import layout
from dstl.fileio import FileIO
from dstl.gil import PAUSE_SIGNAL, forget_paused, pause_during_critical, resume_overdue
from dstl.integrity import content_hash

log = logging.getLogger(__name__)

FORK_MIN_ENTRIES = 65536
"""Below this many entries a heap store copies its dicts instead of forking: the copy
(about 150 ns per entry) is then shorter than a fork of a process of a few hundred MB
(10-20 ms of page tables), and the upload's encoding is short anyway."""

CHILD_NICE = 10
"""The child's niceness: its encoding takes a core (0.5 s of CPU at 1M keys x 2 states)
that the task thread and the worker's other threads would otherwise share, so it gets
what they leave. End-to-end worker at 1M keys on 2 cores beside other load, records/s
while a materialization runs over records/s without, two runs each: 0.37 and 0.40 at
niceness 0, 0.67 and 1.01 at 5, 0.86 (and 1.04 in an earlier run) at 10; the
materialization itself takes longer on a busy machine (max 1.8-2.4 s at 0, 2.7 s at 10).
Only a child of at least :data:`NICE_MIN_ENTRIES` entries gets it."""

NICE_MIN_ENTRIES = 1 << 19
"""A smaller state's child runs at the task's own priority. Its encoding is short (~40 ms
of CPU at 100k keys x 2 states), and at that size what bounds a checkpoint's full size is
how long a materialization takes: materializations then run back to back, so a
checkpoint's log holds about two materializations' worth of changes. End-to-end worker
at 100k uniform keys (30 checkpoints a run): materialization max 0.13 s in each of four
runs at niceness 0 against 0.17 s in two at 10; the largest full checkpoint over the
live state 1.29-1.52 (p90 1.23-1.32) against 1.44-1.49 (p90 1.26-1.39); records/s
327k-350k against 323k-334k."""

READ_TIMEOUT_S = 300.0
"""How long the upload thread waits for the child's next bytes before it gives up (and
kills it): a child that deadlocked must not hold the materialization in flight forever."""

_FRAME = struct.Struct("<qq")
_REQUEST = struct.Struct("<q")
_PIPE_BYTES = 1 << 20  # fewer reads (each a GIL hand-off on the upload thread)
_POLL_SLICE_S = 0.02  # how often a reader waiting for the child checks its stop's bound


def materialization_snapshot(backend: Any, sqn: int | None) -> MaterializationSnapshot:
    """The snapshot a materialization of ``backend`` uploads (task thread): served by the
    helper or forked for a heap store (see the module docstring), the store's own
    snapshot otherwise."""
    if isinstance(backend, HeapKeyedStateBackend):
        if hasattr(os, "fork"):
            from backends.snapshot_helper import helper_snapshot  # it imports this module

            served = helper_snapshot(backend, sqn)
            if served is not None:
                return served
            if backend.entry_count() >= FORK_MIN_ENTRIES:
                return fork_snapshot(backend, sqn)
        return backend.column_snapshot(sqn)
    snapshot: MaterializationSnapshot = backend.snapshot(sqn)
    return snapshot


def fork_snapshot(
    backend: HeapKeyedStateBackend, sqn: int | None
) -> ForkedSnapshot | StateSnapshot:
    """Fork a child that holds ``backend``'s state as of now (task thread only).

    Expired TTL entries are purged first, as :meth:`HeapKeyedStateBackend.snapshot` does.
    Falls back to that copy (and logs why) if the fork fails.
    """
    _import_lazy_modules()
    backend.purge_expired()
    view = StateSnapshot(
        backend.key_serializer,
        backend.key_group_range,
        backend.state_metas(),
        backend.live_tables(),
        sqn,
    )
    nice = CHILD_NICE if backend.entry_count() >= NICE_MIN_ENTRIES else 0
    req_r, req_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        with warnings.catch_warnings():
            # 3.12+ warns that a multi-threaded process forks: the child runs only this
            # module's code (see the module docstring), never the other threads' locks.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        for fd in (req_r, req_w, out_r, out_w):
            os.close(fd)
        log.warning("heap snapshot: fork failed (%s); copying the state instead", exc)
        return backend.column_snapshot(sqn)
    if pid == 0:  # pragma: no cover - the child; its exit ends this branch
        _child(backend, view, req_r, out_w)
    with contextlib.suppress(OSError):  # here too, so it holds when this returns
        os.setpgid(pid, pid)
    if nice:  # here, not in the child: set when this returns
        with contextlib.suppress(OSError):  # it exited already, or a policy forbids it
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    pause_during_critical(pid)
    os.close(req_r)
    os.close(out_w)
    backend.unshare_columns()
    return ForkedSnapshot(backend.key_group_range, sqn, pid, req_w, out_r, bool(nice))


_lazy_imported = False


def _import_lazy_modules() -> None:
    """Make pyarrow import what it imports on first use, once per process, before a fork.

    Its first ``pa.array`` of a Python list imports pandas (when installed): 0.7 s of CPU.
    A child's imports die with it, so without this every child encoding a column through
    ``pa.array`` (strings, lists, maps, pickled values) paid it again. The parent pays it
    once, at its first fork (the copy it replaces paid it at its first encoding).
    """
    global _lazy_imported
    if not _lazy_imported:
        pa.array([0], pa.int64())
        _lazy_imported = True


@dataclass(frozen=True, slots=True)
class WrittenPiece:
    """A piece the child wrote to the store (:meth:`ForkedSnapshot.write_pieces`): what
    :class:`~backends.snapshot.SnapshotFile` says of it, its content's ``file_id``
    (:func:`~backends.handles.file_id_of`) and size, and its ``path`` in the store
    (``None``: not written, it was to be skipped)."""

    name: str
    state: str | None
    key_group_start: int
    key_group_end: int
    rows: int
    file_id: str
    size_bytes: int
    path: str | None


@dataclass(slots=True, eq=False, weakref_slot=True)
class ForkedSnapshot:
    """A heap snapshot held by a forked child process (``pid``), read through pipes.

    Implements :class:`~backends.snapshot.MaterializationSnapshot`, kind
    ``heap-parquet``: :meth:`pieces` yields what :func:`~backends.tables.state_files`
    yields for the state as of the fork. One reader: the upload thread; :meth:`release`
    (any thread, idempotent, also run when the object is collected) closes the pipes,
    kills the child if it is still running and reaps it.
    """

    key_group_range: KeyGroupRange
    sqn: int | None
    pid: int
    _request_fd: int
    _pieces_fd: int
    background: bool = False
    """The child runs below the task's priority (a state of :data:`NICE_MIN_ENTRIES`
    entries or more): its upload should not hurry the task either."""
    end_job: Callable[[], None] | None = None
    """Set when ``pid`` is a long-lived helper that serves this snapshot among others
    (:mod:`backends.snapshot_helper`): :meth:`release` then runs it instead of ending
    the process."""
    _finalizer: weakref.finalize = field(init=False)

    def __post_init__(self) -> None:
        self._finalize([self._request_fd, self._pieces_fd])
        with contextlib.suppress(OSError):  # a lower pipe-max-size: the default works
            fcntl.fcntl(self._pieces_fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        os.set_blocking(self._pieces_fd, False)  # reads wait in poll(), with a timeout

    def _finalize(self, fds: list[int]) -> None:
        self._finalizer = weakref.finalize(self, _reap, os.getpid(), self.pid, fds, self.end_job)

    @property
    def kind(self) -> str:
        """The table format: typed Parquet state tables."""
        return "heap-parquet"

    def files(self) -> Iterator[SnapshotFile]:
        """:meth:`pieces` of the default size."""
        return self.pieces(DEFAULT_PIECE_ROWS)

    def pieces(self, piece_rows: int | None) -> Iterator[SnapshotFile]:
        """The pieces of every state (see :func:`~backends.tables.state_files`), read from
        the child as it encodes them. Once only (this or :meth:`write_pieces`). Raises
        :class:`SnapshotProcessError` if the child fails, dies, or sends nothing for
        :data:`READ_TIMEOUT_S`."""
        self._request(piece_rows, b"")
        for head, data in self._frames():
            yield SnapshotFile(
                head["name"], head["state"], head["lo"], head["hi"], head["rows"], data
            )

    def write_pieces(
        self,
        piece_rows: int | None,
        fileio: FileIO,
        directory: str,
        skip: Iterable[tuple[str, str]],
    ) -> Iterator[WrittenPiece]:
        """The child writes :meth:`pieces` to ``fileio`` (a local disk: it is a fork, with
        no thread of an S3 client), each at ``layout.state_file_path(directory, name)``,
        but a piece whose ``(name, file_id)`` is in ``skip`` (an identical file exists);
        yields each as it is written (or skipped). Once only (this or :meth:`pieces`).

        Every yielded path is a file written durably. A write that fails fails the child
        (raised here as :class:`SnapshotProcessError`); a file the child wrote but had not
        reported when it failed or died is left for the orphan sweep, like a write whose
        outcome is unknown."""
        if fileio.scheme != "file":
            raise ValueError(f"a forked snapshot writes to a local disk only, not {fileio!r}")
        spec = {"root": fileio.root_url, "directory": directory, "skip": sorted(skip)}
        self._request(piece_rows, json.dumps(spec).encode())
        for head, _ in self._frames():
            yield WrittenPiece(
                head["name"], head["state"], head["lo"], head["hi"], head["rows"],
                head["file_id"], head["size"], head["path"],
            )  # fmt: skip

    def _request(self, piece_rows: int | None, spec: bytes) -> None:
        if not self._finalizer.alive:
            raise SnapshotProcessError("the forked snapshot was released")
        self._finalizer.detach()  # from here on, the request end is closed below
        self._finalize([self._pieces_fd])
        try:
            request = _REQUEST.pack(-1 if piece_rows is None else piece_rows) + spec
            view = memoryview(request)
            while view:
                view = view[os.write(self._request_fd, view) :]
        except BrokenPipeError:
            raise SnapshotProcessError("the snapshot process ended before the request") from None
        finally:
            os.close(self._request_fd)

    def _frames(self) -> Iterator[tuple[dict[str, Any], bytes]]:
        fd = self._pieces_fd
        count = 0
        while True:
            head_len, data_len = _FRAME.unpack(_read(fd, _FRAME.size))
            head = json.loads(_read(fd, head_len))
            if "error" in head:
                raise SnapshotProcessError(f"the snapshot process failed: {head['error']}")
            if "end" in head:
                if head["end"] != count:
                    raise SnapshotProcessError(f"expected {head['end']} pieces, got {count}")
                return
            count += 1
            yield head, _read(fd, data_len)

    def release(self) -> None:
        """Close the pipes, stop the child if it still runs, reap it (a helper's job:
        :attr:`end_job`). Idempotent."""
        self._finalizer()


def _reap(owner: int, pid: int, fds: list[int], end_job: Callable[[], None] | None) -> None:
    if os.getpid() != owner:  # a fork of the owner (at its exit): neither is its own
        return
    for fd in fds:  # a helper that still works on it sees a broken pipe and gives it up
        with contextlib.suppress(OSError):
            os.close(fd)
    if end_job is not None:
        end_job()
        return
    forget_paused(pid)
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == 0:  # still encoding (released early): nobody reads it any more
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _poll(poller: select.poll) -> bool:
    """Wait up to :data:`READ_TIMEOUT_S` for the child's next bytes (False: none came),
    continuing it meanwhile should a critical section keep it stopped too long (the
    bound of :func:`~dstl.gil.pause_during_critical` holds even if nothing else runs)."""
    deadline = time.monotonic() + READ_TIMEOUT_S
    while True:
        wait_s = min(_POLL_SLICE_S, deadline - time.monotonic())
        if wait_s <= 0:
            return False
        if poller.poll(wait_s * 1e3):
            return True
        resume_overdue()


def _read(fd: int, n: int) -> bytes:
    """Exactly ``n`` bytes of the non-blocking pipe ``fd`` (each wait at most
    :data:`READ_TIMEOUT_S`)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    poller: select.poll | None = None
    while got < n:
        try:
            k = os.readv(fd, [view[got:]])
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
            if not _poll(poller):
                raise SnapshotProcessError(
                    f"the snapshot process sent nothing for {READ_TIMEOUT_S:.0f} s"
                ) from None
            continue
        if k == 0:
            raise SnapshotProcessError("the snapshot process ended before its last piece")
        got += k
    return bytes(buf)


# -- the child -----------------------------------------------------------------------------
def _child(
    backend: HeapKeyedStateBackend, view: StateSnapshot, request_fd: int, out_fd: int
) -> None:  # pragma: no cover
    """The forked child: serve one request (:func:`serve`) for ``view``, with the columnar
    states of its copy of ``backend`` exported here (the parent pays no copy), then
    ``os._exit``.

    Coverage cannot see it (the child never returns); tests check it by its output.
    """
    code = 1
    try:
        gc.disable()
        os.setpgid(0, 0)  # a group of its own: see the module docstring
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, PAUSE_SIGNAL):
            signal.signal(sig, signal.SIG_DFL)
        _close_inherited(request_fd, out_fd)
        pa.set_memory_pool(pa.system_memory_pool())
        serve(
            lambda: dataclasses.replace(view, columns=backend.frozen_columns()), request_fd, out_fd
        )
        code = 0
    finally:
        os._exit(code)


def serve(
    make_view: Callable[[], StateSnapshot], request_fd: int, out_fd: int
) -> None:  # pragma: no cover - a snapshot process
    """One snapshot's side of the wire format (see the module docstring), in a snapshot
    process (a forked child, or :mod:`backends.snapshot_helper`'s helper): encode the
    pieces of ``make_view()`` as requested on ``request_fd`` and send them on
    ``out_fd``. Pieces of :data:`~backends.tables.DEFAULT_PIECE_ROWS` are encoded
    ahead, before the request; a request for another size encodes anew. A failure to
    build the view or to encode is sent as the error frame once the request came; an
    end of file instead of a request (the parent went away, or released the snapshot)
    returns at once. Raises ``OSError`` (a broken pipe) if the parent stops reading.
    """
    # Encode ahead, in pieces of the default size, until the parent asks: it asks once
    # its upload thread runs, 11 ms after the fork at 100k keys (p50; 30 ms at p90), and
    # the child waited idle for it.
    ahead: list[SnapshotFile] = []
    files: Iterator[SnapshotFile] = iter(())
    view: StateSnapshot | None = None
    exported: Exception | None = None  # failures are reported once asked
    encoded: Exception | None = None
    try:
        view = make_view()
    except Exception as exc:
        exported = exc
    else:
        try:
            files = state_files(view, DEFAULT_PIECE_ROWS)
            for f in files:
                ahead.append(f)
                if _readable(request_fd):
                    break
        except Exception as exc:
            encoded = exc
    raw = _read_request(request_fd)
    if len(raw) < _REQUEST.size:  # the parent went away or released the snapshot
        return
    (piece_rows,) = _REQUEST.unpack_from(raw)
    spec = json.loads(raw[_REQUEST.size :]) if len(raw) > _REQUEST.size else None
    wanted = None if piece_rows < 0 else piece_rows
    count = 0
    try:
        if exported is not None:
            raise exported
        assert view is not None
        if wanted != DEFAULT_PIECE_ROWS:  # another size: encode anew
            ahead, encoded = [], None
            files = state_files(view, wanted)
        if encoded is not None:
            raise encoded
        write = _writer(spec) if spec is not None else None
        for f in itertools.chain(ahead, files):
            assert f.data is not None
            head = {
                "name": f.name, "state": f.state, "lo": f.key_group_start,
                "hi": f.key_group_end, "rows": f.rows,
            }  # fmt: skip
            if write is None:
                _send(out_fd, head, f.data)
            else:
                _send(out_fd, {**head, **write(f.name, f.data)}, b"")
            count += 1
    except BrokenPipeError:  # nobody reads any more
        raise
    except Exception as exc:  # reported to the parent, which raises it
        _send(out_fd, {"error": f"{type(exc).__name__}: {exc}"}, b"")
    else:
        _send(out_fd, {"end": count}, b"")


def _close_inherited(*keep: int) -> None:  # pragma: no cover - the child
    """Close every inherited descriptor but ``keep``; 0-2 become /dev/null."""
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        if null != std:
            os.dup2(null, std)
    lo = 3
    for fd in sorted({*keep, null} - {0, 1, 2}):
        if fd in keep:
            os.closerange(lo, fd)
            lo = fd + 1
    os.closerange(lo, os.sysconf("SC_OPEN_MAX"))


def _readable(fd: int) -> bool:  # pragma: no cover - the child
    """Whether a read of ``fd`` would not block (the request, or its end of file)."""
    return bool(select.select([fd], [], [], 0)[0])


def _read_request(fd: int) -> bytes:  # pragma: no cover - the child
    """The whole request: the parent closes its end once it is written."""
    data = b""
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    return data


def _writer(
    spec: dict[str, Any],
) -> Callable[[str, bytes], dict[str, Any]]:  # pragma: no cover - the child
    """What writes a piece for :meth:`ForkedSnapshot.write_pieces`: (name, bytes) -> the
    header fields it adds."""
    fileio = FileIO(spec["root"])
    directory: str = spec["directory"]
    skip = {(name, file_id) for name, file_id in spec["skip"]}

    def write(name: str, data: bytes) -> dict[str, Any]:
        file_id = file_id_of(content_hash(data))
        path = None
        if (name, file_id) not in skip:
            path = layout.state_file_path(directory, name)
            fileio.write_new(path, data)
        return {"file_id": file_id, "size": len(data), "path": path}

    return write


def _send(fd: int, head: dict[str, Any], data: bytes) -> None:  # pragma: no cover
    encoded = json.dumps(head).encode()
    for part in (_FRAME.pack(len(encoded), len(data)) + encoded, data):
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view) :]
