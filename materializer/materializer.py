"""Materialization of a backend: snapshot on the task thread, upload anywhere, share files.

A materialization has two parts, as in FLIP-158: :meth:`Materializer.snapshot` runs on
the task thread (it closes the log's change set and copies the state, which is short);
:meth:`Materializer.upload` writes the state files through the FileIO on any thread and
returns a :class:`~backends.handles.MaterializationHandle`; the task thread then hands
that to the backend's ``materialization_done``, which lets later checkpoints drop the log
before it (the writer truncates; the segments are released by reference counting in the
metadata store once no retained checkpoint references them).

Shared files
------------
A materialization uploads only files it cannot *share*, and its handle lists every file
it needs (shared and new). A file is shared when a file of the same name and identity
(``StateFileHandle.file_id``) is in the backend's **current base** (``backend.base``) at
the time of :meth:`Materializer.snapshot`. Identity is the content hash (SHA-256, see
:mod:`dstl.integrity`) of heap tables and SSTs alike, so the name + identity pair is
name + size + checksum; restore checks every file against it.

Why only the current base: the base's files are referenced by every checkpoint taken
since it was applied, and keep being referenced until a newer materialization replaces
the base; the new materialization references them itself before any checkpoint can stop
referencing the base. A checkpoint is only released when a newer one completes, and the
newest completed checkpoint always references either the base or its successor, so a
shared file is never released while it is in use (before the first checkpoint with the
base completes, the base's files are referenced by no checkpoint at all, and reference
counting never deletes a file it never counted). Sharing a file of an *older*
materialization would race with that deletion: its last referencing checkpoint may be
subsumed between our decision to share and our checkpoint's commit, and the bytes go away
under us (Spark's SPARK-55892). The orphan sweep must use a safety age longer than the
materialization interval plus checkpoint interval, since an in-flight base is "in-flight
work", not yet a reference.

Failures
--------
Each file is written by an :class:`~dstl.upload.Uploader` (the changelog's retries,
hedging and byte budget). New files of a materialization that failed are deleted before
the error propagates, a file whose write had an unknown outcome too (no handle can
reference it; if it lands after its delete, it is the orphan sweep's). A result that will
never be applied (see :meth:`discard`) deletes its new files, never shared ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import posixpath
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from backends.forked import ForkedSnapshot, WrittenPiece
from backends.handles import MaterializationHandle, StateFileHandle, extent, file_id_of
from backends.heap import StateSnapshot
from backends.snapshot import MaterializationSnapshot, SnapshotFile
from backends.tables import DEFAULT_PIECE_ROWS, state_files
from dstl import layout
from dstl.errors import ConfigError
from dstl.fileio import FileIO
from dstl.gil import short_gil_slices
from dstl.handles import ChangelogHandle
from dstl.integrity import content_hash
from dstl.upload import Uploader
from materializer.errors import MaterializationError

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20
_WRITERS = 4  # concurrent file writes of one materialization
_IN_FLIGHT = 16  # files encoded and not yet written, at most


class MaterializationSource(Protocol):
    """What the materializer needs of a backend (the changelog backend implements it).

    Every member is called on the backend's task thread only.
    """

    @property
    def backend_id(self) -> str:
        """The writer id: unique per backend instance and attempt."""
        ...

    @property
    def base(self) -> tuple[MaterializationHandle, ...]:
        """The materializations current checkpoints reference (the only shareable files)."""
        ...

    @property
    def restored_log(self) -> tuple[ChangelogHandle, ...]:
        """Other writers' log blocks the state holds beyond :attr:`base` (restored and
        not yet materialized); a snapshot holds their changes of its key groups."""
        ...

    def snapshot_for_materialization(self) -> MaterializationSnapshot:
        """Close the change set and copy the state (the synchronous part)."""
        ...

    def materialization_done(self, handle: MaterializationHandle) -> None:
        """Make ``handle`` the base: later checkpoints reference it instead of the log."""
        ...

    def changed_since_materialization(self) -> bool:
        """Whether anything changed since the current base."""
        ...

    def log_bytes(self) -> int:
        """About how many bytes of log a checkpoint now would reference beside the base."""
        ...


@dataclass(frozen=True, slots=True)
class MaterializerOptions:
    """How state files are cut.

    ``heap_piece_rows``: about how many keys a piece of a heap state table holds (pieces
    are aligned key-group ranges, see :mod:`backends.tables`;
    ``materializer.heap.piece-rows``); ``None``: fixed 16-key-group pieces.
    """

    heap_piece_rows: int | None = DEFAULT_PIECE_ROWS

    def __post_init__(self) -> None:
        if self.heap_piece_rows is not None and self.heap_piece_rows < 1:
            raise ConfigError("materializer.heap.piece-rows must be >= 1")


@dataclass(frozen=True, slots=True)
class MaterializationStats:
    """What one materialization cost (``*_s`` in seconds, bytes as uploaded).

    ``duration_s`` is the upload part, ``sync_duration_s`` the task-thread snapshot.
    ``bytes_total`` is every byte the handle references, shared included.
    """

    duration_s: float
    files_new: int
    files_shared: int
    bytes_new: int
    bytes_total: int
    materialization_id: int = 0
    sqn: int = 0
    sync_duration_s: float = 0.0

    def to_dict(self) -> dict[str, int | float]:
        """JSON-ready fields for checkpoint statistics (durations in milliseconds)."""
        return {
            "materialization_id": self.materialization_id,
            "sqn": self.sqn,
            "duration_ms": round(self.duration_s * 1e3, 3),
            "sync_duration_ms": round(self.sync_duration_s * 1e3, 3),
            "files_new": self.files_new,
            "files_shared": self.files_shared,
            "bytes_new": self.bytes_new,
            "bytes_total": self.bytes_total,
        }


@dataclass(frozen=True, slots=True)
class MaterializationResult:
    """An uploaded materialization: its handle, the files it uploaded, its cost."""

    handle: MaterializationHandle
    new_files: tuple[str, ...]
    stats: MaterializationStats


@dataclass(frozen=True, slots=True)
class _Pending:
    shareable: dict[tuple[str, str], StateFileHandle]
    sync_duration_s: float
    covers: tuple[tuple[str, int], ...]


def share_key(name: str, file_id: str) -> tuple[str, str]:
    """The identity under which a file is shared: its name and its ``file_id``."""
    return name, file_id


def shareable_files(
    base: tuple[MaterializationHandle, ...],
) -> dict[tuple[str, str], StateFileHandle]:
    """Every file of ``base`` by :func:`share_key` (its snapshot name, else the last
    path component of its location)."""
    return {
        share_key(f.name or posixpath.basename(f.location), f.file_id): f
        for m in base
        for f in m.state_files
    }


def restored_coverage(source: MaterializationSource) -> tuple[tuple[str, int], ...]:
    """The other writers whose changes a snapshot of ``source`` holds, each with the first
    sqn it does not (its :attr:`~MaterializationSource.base` and restored log): the
    ``covers`` of its materialization. Without them, a later state that lists this
    materialization beside those writers' logs (a rescale that merged ranges) would
    replay their changes over it, and older values would win."""
    reach = extent(source.base, source.restored_log)
    reach.pop(source.backend_id, None)
    return tuple(sorted(reach.items()))


class Materializer:
    """Materializes one backend instance of operator ``operator``, subtask ``subtask``.

    :meth:`snapshot` is task thread only; :meth:`upload` may run on any thread and touches
    no backend state (the shareable files were captured by :meth:`snapshot`).
    Thread-safe otherwise: the id counter is advanced by the task thread only; the
    per-materialization bookkeeping and :attr:`last_stats` are guarded by ``self._lock``.
    """

    def __init__(
        self,
        backend: MaterializationSource,
        fileio: FileIO,
        job: str,
        operator: str,
        subtask: int,
        clock: Callable[[], float] = time.monotonic,
        options: MaterializerOptions | None = None,
        uploader: Uploader | None = None,
    ) -> None:
        self.backend = backend
        self.fileio = fileio
        self.job = job
        self.operator = operator
        self.subtask = subtask
        self.options = options or MaterializerOptions()
        self._clock = clock
        self._next_id = 1
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self.last_stats: MaterializationStats | None = None
        self._uploader = uploader
        self._owned_uploader: Uploader | None = None

    def snapshot(self) -> tuple[int, MaterializationSnapshot]:
        """The synchronous part: a materialization id and a consistent state copy.

        Also captures the files of the backend's current base, the only ones the upload
        may share (see the module docstring).
        """
        started = self._clock()
        mat_id = self._next_id
        self._next_id += 1
        shareable = shareable_files(self.backend.base)
        covers = restored_coverage(self.backend)
        snap = self.backend.snapshot_for_materialization()
        with self._lock:
            self._pending[mat_id] = _Pending(shareable, self._clock() - started, covers)
        return mat_id, snap

    def upload(self, mat_id: int, snapshot: MaterializationSnapshot) -> MaterializationHandle:
        """The asynchronous part: upload new files, share the rest; the handle lists all."""
        return self.upload_result(mat_id, snapshot).handle

    def upload_result(
        self, mat_id: int, snapshot: MaterializationSnapshot
    ) -> MaterializationResult:
        """Like :meth:`upload`, also saying which files were new and what it cost.

        Raises :class:`MaterializationError` (its cause is the storage or read error);
        new files are deleted first unless their write outcome is unknown. Runs with
        :func:`short_gil_slices`, but for a large forked snapshot (a child in the
        background, :attr:`~backends.forked.ForkedSnapshot.background`): this thread then
        only reads the child's pieces and writes them, at the task's own switch interval.

        A short interval makes the task thread hand the GIL over at each of the upload's
        steps, and the faster the upload, the closer together those hand-offs fall. At 1M
        keys x 2 states (end-to-end worker, heap uniform, four alternated pairs), a forked
        upload at 1 ms: records/s while it ran over records/s without 0.865-0.887; at the
        default 5 ms: 0.867-0.929 (three of four pairs 0.92 or more), whole-run records/s
        the same (224k at 1 ms, 226k at 5 ms, on average), materialization p50 0.56-0.61 s
        against 0.45-0.51 s. A small state keeps 1 ms: how long its materialization takes
        bounds its full size (100k keys at 5 ms: 0.158 s p50 against 0.09 s, the largest
        full checkpoint 1.66x the live state against 1.19-1.28x).
        """
        if isinstance(snapshot, ForkedSnapshot) and snapshot.background:
            return self._upload_result(mat_id, snapshot)
        with short_gil_slices():
            return self._upload_result(mat_id, snapshot)

    def _upload_result(
        self, mat_id: int, snapshot: MaterializationSnapshot
    ) -> MaterializationResult:
        with self._lock:
            pending = self._pending.pop(mat_id, None)
        shareable = pending.shareable if pending is not None else {}
        sync_s = pending.sync_duration_s if pending is not None else 0.0
        started = self._clock()
        directory = layout.materialization_dir(
            self.job, self.operator, self.subtask, mat_id, uuid.uuid4().hex[:8]
        )
        slots: list[StateFileHandle | Future[StateFileHandle]] = []
        writes: list[Future[StateFileHandle]] = []  # new files, in order
        new_bytes = 0
        # Writes run on a few threads (a local write waits for fsync, an S3 PUT for the
        # network; both release the GIL) while this thread encodes the next piece; each is
        # retried and hedged by the uploader, which returns the path that holds it. A
        # forked child writes to a local disk itself (see _pieces).
        with ThreadPoolExecutor(_WRITERS, thread_name_prefix="materialize-write") as pool:
            try:
                if snapshot.sqn is None:
                    raise MaterializationError("a materialization snapshot needs a changelog sqn")
                for f in self._pieces(snapshot, directory, shareable):
                    if isinstance(f, WrittenPiece):
                        data, file_id = b"", f.file_id
                    else:
                        data, file_id = _content(f)
                    hit = shareable.get(share_key(f.name, file_id))
                    if hit is not None:
                        slots.append(
                            dataclasses.replace(
                                hit,
                                state=f.state,
                                key_group_start=f.key_group_start,
                                key_group_end=f.key_group_end,
                                rows=f.rows,
                                name=f.name,
                            )
                        )
                        continue
                    if isinstance(f, WrittenPiece):
                        if f.path is None:
                            raise MaterializationError(f"piece {f.name!r} skipped, not shared")
                        fut: Future[StateFileHandle] = Future()
                        fut.set_result(_handle(f.path, f.size_bytes, file_id, f))
                        new_bytes += f.size_bytes
                    else:
                        if len(writes) >= _IN_FLIGHT:  # bounded memory: wait for older writes
                            writes[-_IN_FLIGHT].result()
                        fut = pool.submit(
                            self._upload_file,
                            layout.state_file_path(directory, f.name),
                            data,
                            file_id,
                            f,
                        )
                        new_bytes += len(data)
                    writes.append(fut)
                    slots.append(fut)
                for fut in writes:
                    fut.result()
            except Exception as exc:
                wait(writes)
                # The uploader deleted every file of a failed write (an unknown outcome
                # too: nothing references it); these are the writes that succeeded.
                self.delete_files(
                    [fut.result().location for fut in writes if fut.exception() is None]
                )
                if isinstance(exc, MaterializationError):
                    raise
                raise MaterializationError(
                    f"materialization {mat_id} of {self.backend.backend_id} failed: "
                    f"{exc.__class__.__name__}: {exc}"
                ) from exc
            finally:
                snapshot.release()
        new = [fut.result().location for fut in writes]
        files = [f.result() if isinstance(f, Future) else f for f in slots]
        assert snapshot.sqn is not None
        rng = snapshot.key_group_range
        handle = MaterializationHandle(
            writer_id=self.backend.backend_id,
            sqn=snapshot.sqn,
            key_group_start=rng.start,
            key_group_end=rng.end,
            kind=snapshot.kind,
            state_files=tuple(files),
            materialization_id=mat_id,
            covers=pending.covers if pending is not None else (),
        )
        stats = MaterializationStats(
            duration_s=self._clock() - started,
            files_new=len(new),
            files_shared=len(files) - len(new),
            bytes_new=new_bytes,
            bytes_total=sum(f.size_bytes for f in files),
            materialization_id=mat_id,
            sqn=snapshot.sqn,
            sync_duration_s=sync_s,
        )
        with self._lock:
            self.last_stats = stats
        log.info(
            "materialized writer=%s id=%d sqn=%d files_new=%d files_shared=%d bytes_new=%d "
            "bytes_total=%d duration_ms=%.1f sync_ms=%.1f",
            handle.writer_id,
            mat_id,
            handle.sqn,
            stats.files_new,
            stats.files_shared,
            stats.bytes_new,
            stats.bytes_total,
            stats.duration_s * 1e3,
            stats.sync_duration_s * 1e3,
        )
        return MaterializationResult(handle, tuple(new), stats)

    def discard(self, result: MaterializationResult) -> None:
        """Delete the new files of a result that is known never to be applied.

        Only for results no checkpoint can reference (never handed to the backend, or
        ignored by it as older than its base); shared files are never touched.
        """
        self.delete_files(list(result.new_files))

    def forget(self, mat_id: int) -> None:
        """Drop the bookkeeping of a snapshot that will never be uploaded."""
        with self._lock:
            self._pending.pop(mat_id, None)

    def delete_files(self, urls: list[str]) -> None:
        """Best-effort delete of files this materializer uploaded and nothing references
        (a failed one is logged; the orphan sweep gets what is left). Any thread."""
        for url, exc in self.fileio.delete_many(urls):
            log.warning("materialization cleanup failed file=%s error=%s", url, exc)

    def _upload_file(
        self, path: str, data: bytes, file_id: str, f: SnapshotFile
    ) -> StateFileHandle:
        """Write one new file (retried, hedged, under the byte budget); its handle."""
        return _handle(self.uploader.upload(path, data), len(data), file_id, f)

    def _pieces(
        self,
        snapshot: MaterializationSnapshot,
        directory: str,
        shareable: dict[tuple[str, str], StateFileHandle],
    ) -> Iterator[SnapshotFile | WrittenPiece]:
        """The files of ``snapshot`` to upload (:func:`snapshot_files`), or, for a forked
        snapshot and a store on local disk, the pieces its child writes there itself
        (:meth:`~backends.forked.ForkedSnapshot.write_pieces`; not those it may share):
        then this thread only reads their headers. Each step of this thread waits for
        a busy task thread's GIL. End-to-end worker, heap uniform, alternated pairs, this
        thread writing against the child: upload p50 55-57 ms against 42-46 ms at 100k
        keys (the largest full checkpoint 1.16-1.22 MB against 1.05-1.12 MB), 0.40-0.42 s
        against 0.36-0.38 s at 1M keys (records/s 483-500k against 520-528k)."""
        fileio = self.uploader.fileio
        if isinstance(snapshot, ForkedSnapshot) and fileio.scheme == "file" and not fileio.hedged:
            rows = self.options.heap_piece_rows
            return snapshot.write_pieces(rows, fileio, directory, shareable.keys())
        return snapshot_files(snapshot, self.options.heap_piece_rows)

    @property
    def uploader(self) -> Uploader:
        """The uploader of this materializer's files (its own unless one was given)."""
        with self._lock:
            if self._uploader is None:
                self._uploader = self._owned_uploader = Uploader(
                    self.fileio, name=f"{self.operator}-{self.subtask}"
                )
            return self._uploader

    def close(self) -> None:
        """Stop the uploader this materializer made (a given one is its owner's). Idempotent."""
        with self._lock:
            owned, self._owned_uploader = self._owned_uploader, None
            if owned is not None:
                self._uploader = None
        if owned is not None:
            owned.close()

    def materialize_now(self) -> MaterializationHandle:
        """Snapshot, upload and apply on the calling (task) thread. For tests and tools."""
        mat_id, snap = self.snapshot()
        handle = self.upload(mat_id, snap)
        self.backend.materialization_done(handle)
        return handle


def snapshot_files(
    snapshot: MaterializationSnapshot, piece_rows: int | None
) -> Iterator[SnapshotFile]:
    """The files to upload: key-group pieces of about ``piece_rows`` keys for heap
    snapshots (copied or forked), the snapshot's own files otherwise (RocksDB SSTs)."""
    if isinstance(snapshot, StateSnapshot):
        return state_files(snapshot, piece_rows)
    if isinstance(snapshot, ForkedSnapshot):
        return snapshot.pieces(piece_rows)
    return snapshot.files()


def _handle(
    location: str, size: int, file_id: str, f: SnapshotFile | WrittenPiece
) -> StateFileHandle:
    """The handle of the new file of ``f`` written at ``location``."""
    return StateFileHandle(
        location=location,
        size_bytes=size,
        file_id=file_id,
        state=f.state,
        key_group_start=f.key_group_start,
        key_group_end=f.key_group_end,
        rows=f.rows,
        name=f.name,
    )


def _content(f: SnapshotFile) -> tuple[bytes, str]:
    """The bytes of ``f`` and its identity (its content hash, see :mod:`dstl.integrity`)."""
    if f.data is not None:
        return f.data, file_id_of(content_hash(f.data))
    assert f.local_path is not None
    digest = hashlib.sha256()
    chunks: list[bytes] = []
    try:
        with open(f.local_path, "rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                digest.update(chunk)
                chunks.append(chunk)
    except OSError as exc:
        raise MaterializationError(f"cannot read local state file {f.local_path}: {exc}") from exc
    return b"".join(chunks), file_id_of(digest.hexdigest())
