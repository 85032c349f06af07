"""The changelog writer, the per-worker changelog storage and its upload scheduler.

Sequence numbers (``sqn``) number *change sets*, not records: every record appended gets
the writer's active sqn, and the active sqn is bumped only when a boundary is needed
(:meth:`ChangelogWriter.next_sqn`, called by persist and by materialization). So a boundary
``S`` splits the log exactly: records appended before have ``sqn < S``, after ``sqn >= S``.

Threads: a :class:`ChangelogWriter` is owned by one task thread. The
:class:`ChangelogStorage` owns one named upload thread that batches the persist requests
of all its writers into one segment file per upload and completes their futures. Results
reach the task thread through those futures; no lock is held across I/O.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from dstl import layout
from dstl.errors import ConfigError, StateBackendError, StorageError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle
from dstl.segment import SCHEMA, Block, SegmentReader, encode_segment

log = logging.getLogger(__name__)

BLOCK_SCHEMA = pa.schema([f for f in SCHEMA if f.name != "writer"])
META_KEY_GROUP = -1


@dataclass(frozen=True, slots=True)
class ChangelogOptions:
    """Options of a changelog storage.

    Dotted keys (see :meth:`from_dict`): ``dstl.batch.delay-s``, ``dstl.batch.max-bytes``,
    ``dstl.preemptive-persist-bytes``, ``dstl.in-flight.max-bytes``.
    """

    batch_delay_s: float = 0.010
    batch_max_bytes: int = 16 * 1024 * 1024
    preemptive_persist_bytes: int = 5 * 1024 * 1024
    in_flight_max_bytes: int = 100 * 1024 * 1024

    KEYS = {
        "dstl.batch.delay-s": ("batch_delay_s", float),
        "dstl.batch.max-bytes": ("batch_max_bytes", int),
        "dstl.preemptive-persist-bytes": ("preemptive_persist_bytes", int),
        "dstl.in-flight.max-bytes": ("in_flight_max_bytes", int),
    }

    def __post_init__(self) -> None:
        if self.batch_delay_s < 0:
            raise ConfigError("dstl.batch.delay-s must be >= 0")
        for name in ("batch_max_bytes", "preemptive_persist_bytes", "in_flight_max_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")

    @classmethod
    def from_dict(cls, values: dict[str, str | int | float]) -> ChangelogOptions:
        """Parse documented dotted keys; unknown keys are a :class:`ConfigError`."""
        kwargs: dict[str, int | float] = {}
        for key, raw in values.items():
            if key not in cls.KEYS:
                raise ConfigError(f"unknown changelog option {key!r}; known: {sorted(cls.KEYS)}")
            name, typ = cls.KEYS[key]
            try:
                kwargs[name] = typ(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"option {key!r}: cannot parse {raw!r}") from exc
        return cls(**kwargs)  # type: ignore[arg-type]


class ChangeBuffer:
    """Columnar buffer of change records of one writer. Task thread only."""

    __slots__ = ("key", "key_group", "nbytes", "op", "sqn", "state", "user_key", "value")

    def __init__(self) -> None:
        self.key_group: list[int] = []
        self.sqn: list[int] = []
        self.state: list[str] = []
        self.op: list[int] = []
        self.key: list[bytes] = []
        self.user_key: list[bytes | None] = []
        self.value: list[bytes | None] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.sqn)

    def append(
        self,
        key_group: int,
        sqn: int,
        state: str,
        op: int,
        key: bytes,
        user_key: bytes | None,
        value: bytes | None,
    ) -> None:
        """Add one record."""
        self.key_group.append(key_group)
        self.sqn.append(sqn)
        self.state.append(state)
        self.op.append(op)
        self.key.append(key)
        self.user_key.append(user_key)
        self.value.append(value)
        self.nbytes += (
            24 + len(key) + (len(user_key) if user_key else 0) + (len(value) if value else 0)
        )

    def to_table(self) -> pa.Table:
        """The records as an Arrow table of :data:`BLOCK_SCHEMA`."""
        return pa.Table.from_arrays(
            [
                pa.array(self.key_group, pa.int32()),
                pa.array(self.sqn, pa.int64()),
                pa.array(self.state, pa.string()),
                pa.array(self.op, pa.int8()),
                pa.array(self.key, pa.binary()),
                pa.array(self.user_key, pa.binary()),
                pa.array(self.value, pa.binary()),
            ],
            schema=BLOCK_SCHEMA,
        )


@dataclass(slots=True)
class _Upload:
    """A range of a writer's log handed to the scheduler. Task thread owns the fields."""

    sqn_start: int
    sqn_end: int
    table: pa.Table | None
    future: Future[ChangelogHandle]


@dataclass(slots=True)
class _Request:
    writer_id: str
    sqn_start: int
    sqn_end: int
    table: pa.Table
    future: Future[ChangelogHandle]
    nbytes: int = field(default=0)


class ChangelogWriter:
    """Appends state changes of one backend instance and persists them on request.

    Task thread only. Invariants: records carry the active sqn; handles returned by
    :meth:`persist` cover ``[from_sqn, boundary)`` without gaps, in sqn order; changes
    whose upload failed are kept and uploaded again by the next persist.
    """

    def __init__(self, storage: ChangelogStorage, writer_id: str, initial_sqn: int = 0) -> None:
        self._storage = storage
        self.writer_id = layout.check_name("writer", writer_id)
        self._active_sqn = initial_sqn
        self._buffer = ChangeBuffer()
        self._buffer_start = initial_sqn  # lowest sqn the buffer may hold
        self._uploads: list[_Upload] = []
        self._closed = False

    # -- appending --------------------------------------------------------------------
    def append(
        self,
        key_group: int,
        state: str,
        op: int,
        key: bytes,
        user_key: bytes | None = None,
        value: bytes | None = None,
    ) -> None:
        """Log one change of ``key`` in ``key_group``. Blocks only under backpressure."""
        buffer = self._buffer
        buffer.append(key_group, self._active_sqn, state, op, key, user_key, value)
        if buffer.nbytes >= self._storage.options.preemptive_persist_bytes:
            self._submit_buffer()

    def append_meta(self, state: str, op: int, value: bytes) -> None:
        """Log a metadata record (state registration etc.); it belongs to no key group."""
        self.append(META_KEY_GROUP, state, op, b"", None, value)

    def append_columns(
        self,
        key_groups: Sequence[int],
        state: str,
        op: int,
        keys: Sequence[bytes],
        values: Sequence[bytes | None],
        user_keys: Sequence[bytes | None] | None = None,
    ) -> None:
        """Log many changes of one state and operation at once (the batch path)."""
        n = len(keys)
        buffer = self._buffer
        buffer.key_group.extend(key_groups)
        buffer.sqn.extend([self._active_sqn] * n)
        buffer.state.extend([state] * n)
        buffer.op.extend([op] * n)
        buffer.key.extend(keys)
        buffer.user_key.extend(user_keys if user_keys is not None else [None] * n)
        buffer.value.extend(values)
        buffer.nbytes += sum(map(len, keys)) + sum(len(v) for v in values if v) + 24 * n
        if buffer.nbytes >= self._storage.options.preemptive_persist_bytes:
            self._submit_buffer()

    def last_appended_sqn(self) -> int | None:
        """The sqn of the newest record appended (None if none since ``initial_sqn``).

        Derived, not tracked per append, so the hot path pays nothing for it.
        """
        if len(self._buffer):
            return self._buffer.sqn[-1]
        if self._uploads:
            return self._uploads[-1].sqn_end - 1
        return None

    def next_sqn(self) -> int:
        """Close the active change set and return the boundary sqn.

        Every record appended before has ``sqn <`` the result; every later one ``>=`` it.
        """
        if len(self._buffer) and self._buffer.sqn[-1] == self._active_sqn:
            self._active_sqn += 1
        elif self._uploads and self._uploads[-1].sqn_end > self._active_sqn:
            self._active_sqn = self._uploads[-1].sqn_end
        return self._active_sqn

    # -- persisting -------------------------------------------------------------------
    def _submit_buffer(self) -> None:
        boundary = self.next_sqn()
        if not len(self._buffer):
            return
        table = self._buffer.to_table()
        self._buffer = ChangeBuffer()
        upload = _Upload(self._buffer_start, boundary, table, Future())
        self._buffer_start = boundary
        self._uploads.append(upload)
        self._storage._submit(self.writer_id, upload)

    def persist(self, from_sqn: int, checkpoint_id: int) -> Future[tuple[ChangelogHandle, ...]]:
        """Make every change with ``sqn >= from_sqn`` durable.

        Returns a future of the handles covering ``[from_sqn, boundary)``, in order. Uploads
        that failed before are retried here. ``checkpoint_id`` is for logging and tracking.
        """
        self._check_open()
        self._submit_buffer()
        wanted: list[_Upload] = []
        for upload in self._uploads:
            if upload.sqn_end <= from_sqn:
                continue
            if upload.future.done() and upload.future.exception() is not None:
                if upload.table is None:  # pragma: no cover - tables are kept until success
                    raise StateBackendError("lost the changes of a failed upload")
                upload.future = Future()
                self._storage._submit(self.writer_id, upload)
            wanted.append(upload)
        for upload in self._uploads:  # drop tables already durable: no need to keep them
            if upload.future.done() and upload.future.exception() is None:
                upload.table = None
        log.debug(
            "persist writer=%s from=%d checkpoint=%d uploads=%d",
            self.writer_id,
            from_sqn,
            checkpoint_id,
            len(wanted),
        )
        return _all_of([u.future for u in wanted])

    def truncate(self, to_sqn: int) -> None:
        """Forget uploads entirely below ``to_sqn`` (materialized and no longer needed).

        The segment files themselves are released by the checkpoints referencing them.
        """
        self._uploads = [u for u in self._uploads if u.sqn_end > to_sqn or not u.future.done()]

    def confirm(self, checkpoint_id: int) -> None:
        """The checkpoint completed (nothing to do yet: tracking is in the coordinator)."""

    def reset(self, checkpoint_id: int) -> None:
        """The checkpoint was aborted; its uploads stay usable by later checkpoints."""

    def close(self) -> None:
        """Stop accepting changes. Futures already returned still complete."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise StateBackendError(f"changelog writer {self.writer_id} is closed")


def _all_of(futures: list[Future[ChangelogHandle]]) -> Future[tuple[ChangelogHandle, ...]]:
    """A future of all results in order; fails with the first failure."""
    result: Future[tuple[ChangelogHandle, ...]] = Future()
    if not futures:
        result.set_result(())
        return result
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_f: Future[ChangelogHandle]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            for f in futures:
                exc = f.exception()
                if exc is not None:
                    result.set_exception(exc)
                    return
            result.set_result(tuple(f.result() for f in futures))

    for f in futures:
        f.add_done_callback(done)
    return result


class ChangelogStorage:
    """One per worker process: creates writers and uploads their changes in batches.

    Thread-safe: writers (on their task threads) submit through a queue; the upload thread
    (named ``dstl-upload-<worker>``) owns the batching. In-flight bytes are bounded by
    ``options.in_flight_max_bytes``: submitting blocks (backpressure) instead of failing.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        fileio: FileIO,
        job: str,
        worker: str,
        options: ChangelogOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_thread: bool = True,
    ) -> None:
        self.fileio = fileio
        self.job = layout.check_name("job", job)
        self.worker = layout.check_name("worker", worker)
        self.options = options or ChangelogOptions()
        self._clock = clock
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._lock = threading.Lock()
        self._budget = threading.Condition(self._lock)
        self._in_flight_bytes = 0
        self._counter = 0
        self._closed = False
        self.segments_written = 0
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(
                target=self._run, name=f"dstl-upload-{worker}", daemon=True
            )
            self._thread.start()

    def __enter__(self) -> ChangelogStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_writer(self, writer_id: str, initial_sqn: int = 0) -> ChangelogWriter:
        """A new writer for one backend instance; ``writer_id`` must be unique in the job."""
        return ChangelogWriter(self, writer_id, initial_sqn)

    def _submit(self, writer_id: str, upload: _Upload) -> None:
        assert upload.table is not None
        nbytes = int(upload.table.nbytes)
        with self._budget:
            while (
                self._in_flight_bytes > 0
                and self._in_flight_bytes + nbytes > self.options.in_flight_max_bytes
            ):
                self._budget.wait()
            self._in_flight_bytes += nbytes
        self._queue.put(
            _Request(
                writer_id, upload.sqn_start, upload.sqn_end, upload.table, upload.future, nbytes
            )
        )

    # -- the upload loop: a thin shell around drain_once -----------------------------------
    def _run(self) -> None:
        while True:
            if not self.drain_once(block=True):
                return

    def drain_once(self, block: bool = False) -> bool:
        """Take the waiting requests (batching for ``batch_delay_s``), write one segment.

        Returns False once the storage is closed and the queue is empty.
        """
        try:
            first = self._queue.get(block=block)
        except queue.Empty:
            return True
        if first is None:
            return False
        batch = [first]
        size = first.nbytes
        deadline = self._clock() + self.options.batch_delay_s
        stop = False
        while size < self.options.batch_max_bytes:
            remaining = deadline - self._clock()
            try:
                nxt = self._queue.get(
                    block=block and remaining > 0, timeout=max(remaining, 0) if block else None
                )
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            batch.append(nxt)
            size += nxt.nbytes
        self._upload(batch)
        return not stop

    def _upload(self, batch: list[_Request]) -> None:
        with self._lock:
            self._counter += 1
            counter = self._counter
        path = layout.segment_path(self.job, self.worker, counter, uuid.uuid4().hex[:12])
        try:
            data = encode_segment(
                [Block(r.writer_id, r.sqn_start, r.sqn_end, r.table) for r in batch]
            )
            self.fileio.write_new(path, data)
        except (StorageError, OSError, ValueError, pa.ArrowException) as exc:
            log.warning("segment upload failed path=%s error=%s", path, exc)
            err = (
                exc
                if isinstance(exc, StorageError)
                else StorageError(f"segment upload failed ({exc})", path)
            )
            self._release(batch)
            for r in batch:
                r.future.set_exception(err)
            return
        self.segments_written += 1
        url = self.fileio.url(path)
        log.debug("segment uploaded key=%s bytes=%d blocks=%d", path, len(data), len(batch))
        self._release(batch)
        for i, r in enumerate(batch):
            r.future.set_result(
                ChangelogHandle(
                    url, i, r.writer_id, r.sqn_start, r.sqn_end, r.table.num_rows, len(data)
                )
            )

    def _release(self, batch: list[_Request]) -> None:
        with self._budget:
            self._in_flight_bytes -= sum(r.nbytes for r in batch)
            self._budget.notify_all()

    def close(self) -> None:
        """Upload what is queued, then stop and join the upload thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()


def read_changes(
    fileio: FileIO,
    handles: Iterable[ChangelogHandle],
    from_sqn: int = 0,
    key_groups: tuple[int, int] | None = None,
) -> Iterator[pa.Table]:
    """Yield the changes of ``handles`` in order, as tables of :data:`BLOCK_SCHEMA`.

    Keeps records with ``sqn >= from_sqn`` and, if ``key_groups=(start, end)`` is given,
    only those in that half-open key-group range (metadata records always pass). Reads
    each segment file once even when several handles point into it.
    """
    readers: dict[str, SegmentReader] = {}
    for handle in handles:
        reader = readers.get(handle.location)
        if reader is None:
            readers.clear()  # handles of one file are usually adjacent; keep memory flat
            data = fileio.read(fileio.relative(handle.location))
            reader = SegmentReader(data, handle.location)
            readers[handle.location] = reader
        table = reader.read_block(handle.block, handle.writer_id).drop_columns(["writer"])
        mask = pc.greater_equal(table["sqn"], from_sqn)
        if key_groups is not None:
            kg = table["key_group"]
            in_range = pc.and_(pc.greater_equal(kg, key_groups[0]), pc.less(kg, key_groups[1]))
            mask = pc.and_(mask, pc.or_(in_range, pc.equal(kg, META_KEY_GROUP)))
        yield table.filter(mask)
