"""The changelog writer, the per-worker changelog storage and its upload scheduler.

Sequence numbers (``sqn``) number *change sets*, not records: every record appended gets
the writer's active sqn, and the active sqn is bumped only when a boundary is needed
(:meth:`ChangelogWriter.next_sqn`, called by persist and by materialization). So a boundary
``S`` splits the log exactly: records appended before have ``sqn < S``, after ``sqn >= S``.

Threads: a :class:`ChangelogWriter` is owned by one task thread. The
:class:`ChangelogStorage` owns one named upload thread (``dstl-upload-<worker>``) that
batches the persist requests of all its writers into one segment file per upload and
completes their futures, a named lane thread (``dstl-preempt-<worker>``) uploading the
batches no persist waits for (pre-emptive ones) so that a barrier's batch never queues
behind them, a named deleter thread (``dstl-delete-<worker>``) deleting the segments
no checkpoint needs any more, and a small named pool (``dstl-attempt-<worker>``)
running upload attempts (retried and hedged, see :mod:`dstl.retry`). Results reach
the task thread through those futures; no lock is held across I/O. All are joined in
:meth:`ChangelogStorage.close`.
The upload thread has segments encoded by the process's helper (:mod:`dstl.encoder`),
but the small ones a persist waits for, which it encodes itself (:data:`ENCODE_HERE_BYTES`).

Backpressure: bytes handed to uploads are bounded by ``in_flight_max_bytes``; a writer's
pre-emptive upload (in ``append``) or ``persist`` blocks until they fit, and never fails
because uploads are slow.

Segment lifetime (see :mod:`dstl.tracking` for the full rule): a segment is tracked from
its upload until the coordinator confirms a checkpoint referencing it (then the
coordinator's metadata store owns it and the DSTL never deletes it), or until no pending
checkpoint claims it and every writer with a block in it has truncated past that block
(then the storage deletes it). Nothing is deleted while an in-flight persist or a
not-yet-truncated range may still need it; closing deletes nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa

from dstl import layout
from dstl._records import RecordColumns
from dstl.buffer import ChangeBuffer, as_binary, as_int32
from dstl.encoder import (
    EncodedSegment,
    PendingBlock,
    encode_here,
    shared_encoder,
    warm_up_here,
)
from dstl.errors import ConfigError, StateBackendError, StorageError, UploadFailedError
from dstl.fileio import FileIO, translate_error
from dstl.gil import GIL_SLICE_S, close_critical, critical_section, open_critical, short_gil_slices
from dstl.handles import ChangelogHandle
from dstl.pages import small_pages
from dstl.retry import Clock, HedgedWrite, InFlightBudget, RetryPolicy, as_clock
from dstl.tracking import SegmentTracker

log = logging.getLogger(__name__)

META_KEY_GROUP = -1
_MAX_WINDOW = 10  # a batch stays open at most this many batch delays
UNSEEN_BYTES_PER_ROW = 8.0  # estimate of a change record's encoded size before any upload
SMALL_COLUMNS = 32  # append_columns of fewer rows (as Python lists) adds them as single records
ENCODE_HERE_BYTES = 2 * 1024 * 1024
"""A batch a persist waits for, up to this size, is encoded on the upload thread itself
(:func:`~dstl.encoder.encode_here`); pre-emptive uploads and larger batches go to the
helper process, off this process's GIL."""


@dataclass(frozen=True, slots=True)
class ChangelogOptions:
    """Options of a changelog storage.

    Dotted keys (see :meth:`from_dict`):

    ================================  ==========================================  =======
    key                               meaning                                     default
    ================================  ==========================================  =======
    ``dstl.batch.delay-s``            batch persists arriving within this gap     0.010
    ``dstl.batch.max-bytes``          ...or until this many bytes are waiting     16 MiB
    ``dstl.preemptive-persist-bytes`` upload a writer's buffer above this size    1 MiB
    ``dstl.in-flight.max-bytes``      backpressure: bytes in uploads at most      100 MiB
    ``dstl.upload.max-attempts``      attempts per segment (hedges count)         3
    ``dstl.upload.attempt-timeout-s`` hedge an attempt slower than this ("none";  10
                                      S3 only, see ``FileIO.hedged``)
    ``dstl.upload.retry-delay-s``     first retry delay after a transient error   0.1
    ``dstl.upload.retry-max-delay-s`` cap of the exponential retry delay          2
    ================================  ==========================================  =======
    """

    batch_delay_s: float = 0.010
    batch_max_bytes: int = 16 * 1024 * 1024
    # What a persist at a barrier may have to encode and write at most: ~35k changes,
    # 5-8 ms of encoding on this VM. At 5 MiB the barrier's segment took 25-40 ms to
    # encode (~220k changes a second at 1M uniform keys), most of our own part of a
    # checkpoint; the uploads in between run beside the task, off the barrier's path.
    preemptive_persist_bytes: int = 1024 * 1024
    in_flight_max_bytes: int = 100 * 1024 * 1024
    upload_max_attempts: int = 3
    upload_attempt_timeout_s: float | None = 10.0
    upload_retry_delay_s: float = 0.1
    upload_retry_max_delay_s: float = 2.0

    KEYS = {
        "dstl.batch.delay-s": ("batch_delay_s", float),
        "dstl.batch.max-bytes": ("batch_max_bytes", int),
        "dstl.preemptive-persist-bytes": ("preemptive_persist_bytes", int),
        "dstl.in-flight.max-bytes": ("in_flight_max_bytes", int),
        "dstl.upload.max-attempts": ("upload_max_attempts", int),
        "dstl.upload.attempt-timeout-s": ("upload_attempt_timeout_s", float),
        "dstl.upload.retry-delay-s": ("upload_retry_delay_s", float),
        "dstl.upload.retry-max-delay-s": ("upload_retry_max_delay_s", float),
    }

    def __post_init__(self) -> None:
        if self.batch_delay_s < 0:
            raise ConfigError("dstl.batch.delay-s must be >= 0")
        for name in ("batch_max_bytes", "preemptive_persist_bytes", "in_flight_max_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        self.retry_policy()  # validates the upload options

    def retry_policy(self) -> RetryPolicy:
        """The :class:`RetryPolicy` these options describe."""
        return RetryPolicy(
            max_attempts=self.upload_max_attempts,
            base_delay_s=self.upload_retry_delay_s,
            max_delay_s=self.upload_retry_max_delay_s,
            attempt_timeout_s=self.upload_attempt_timeout_s,
        )

    @classmethod
    def from_dict(cls, values: dict[str, str | int | float]) -> ChangelogOptions:
        """Parse documented dotted keys; unknown keys are a :class:`ConfigError`."""
        kwargs: dict[str, int | float | None] = {}
        for key, raw in values.items():
            if key not in cls.KEYS:
                raise ConfigError(f"unknown changelog option {key!r}; known: {sorted(cls.KEYS)}")
            name, typ = cls.KEYS[key]
            if name == "upload_attempt_timeout_s" and str(raw).strip().lower() == "none":
                kwargs[name] = None
                continue
            try:
                kwargs[name] = typ(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"option {key!r}: cannot parse {raw!r}") from exc
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Upload:
    """A range of a writer's log handed to the scheduler. Task thread owns the fields but
    ``timings``, which the upload thread fills before it completes ``future``."""

    sqn_start: int
    sqn_end: int
    changes: ChangeBuffer | None  # sealed; None once uploaded
    future: Future[ChangelogHandle]
    timings: dict[str, float] = field(default_factory=dict)
    urgent: bool = False  # submitted by a persist (a barrier waits), not pre-emptively
    # the latest request submitted for it, until it succeeded (the request holds changes)
    request: _Request | None = None


@dataclass(slots=True)
class _Request:
    writer_id: str
    sqn_start: int
    sqn_end: int
    changes: ChangeBuffer
    future: Future[ChangelogHandle]
    timings: dict[str, float]
    urgent: bool
    submitted: float = 0.0  # perf_counter() when queued
    taken: float = 0.0  # perf_counter() when the upload thread took it (or the lane got it)
    critical: int | None = None  # urgent: the critical section open until it is written
    # a materialization's boundary follows: no later block shares this one's segment
    # (set by the task thread in ChangelogWriter.cut, read when a batch is split)
    ends_segment: bool = False

    @property
    def nbytes(self) -> int:
        return self.changes.nbytes


@dataclass(frozen=True, slots=True)
class _Delete:
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Expedite:
    """A persist with nothing of its own to upload waits for pre-emptive uploads: the
    upload thread takes those still waiting for the lane and uploads them as a barrier's
    (see :meth:`ChangelogStorage._dispatch`); ``critical`` is the persist's section."""

    critical: int | None


class ChangelogWriter:
    """Appends state changes of one backend instance and persists them on request.

    Task thread only. Invariants: records carry the active sqn; handles returned by
    :meth:`persist` cover ``[from_sqn, boundary)`` without gaps, in sqn order; changes
    whose upload failed are kept and uploaded again by the next persist; ``persist`` below
    the truncation point is refused (those changes may be gone).
    """

    def __init__(self, storage: ChangelogStorage, writer_id: str, initial_sqn: int = 0) -> None:
        self._storage = storage
        self.writer_id = layout.check_name("writer", writer_id)
        self._active_sqn = initial_sqn
        self._buffer = ChangeBuffer()
        self._buffer_start = initial_sqn  # lowest sqn the buffer may hold
        self._uploads: list[_Upload] = []
        self._truncated_to: int | None = None
        self._closed = False
        self._last_timings: dict[str, float] = {}

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
        key_groups: Sequence[int] | pa.Array,
        state: str,
        op: int,
        keys: Sequence[bytes] | pa.Array,
        values: Sequence[bytes | None] | pa.Array,
        user_keys: Sequence[bytes | None] | pa.Array | None = None,
    ) -> None:
        """Log many changes of one state and operation at once (the batch path).

        Columns may be Python sequences or Arrow arrays (binary, int32 key groups); an
        ``array('i')`` of key groups is taken without a copy. The arrays must not be
        changed afterwards (they are kept until uploaded).
        """
        n = len(keys)
        if not n:
            return
        if (
            len(key_groups) != n
            or len(values) != n
            or (user_keys is not None and len(user_keys) != n)
        ):
            raise ValueError("append_columns: columns differ in length")
        if n < SMALL_COLUMNS and not any(
            isinstance(c, pa.Array) for c in (key_groups, keys, values, user_keys)
        ):  # a short run: Python lists are cheaper than converting to Arrow
            append = self._buffer.append
            sqn = self._active_sqn
            uks = user_keys if user_keys is not None else [None] * n
            for kg, key, uk, value in zip(key_groups, keys, uks, values, strict=True):
                append(kg, sqn, state, op, key, uk, value)
        else:
            self._buffer.add_columns(
                self._active_sqn,
                state,
                op,
                as_int32(key_groups),
                as_binary(keys),
                None if user_keys is None else as_binary(user_keys),
                as_binary(values),
            )
        if self._buffer.nbytes >= self._storage.options.preemptive_persist_bytes:
            self._submit_buffer()

    def append_records(self, state: str, records: RecordColumns) -> None:
        """Log every record buffered in ``records`` (changes of ``state``) and empty it.

        The hot path of the changelog wrapper: the buffer's columns are already Arrow's
        layout; they are kept as they are and wrapped at the next persist (see
        :class:`ChangeBuffer` for why not here). Blocks only under backpressure.
        """
        taken = records.take()
        if taken is None:
            return
        self._buffer.add_records(self._active_sqn, state, taken)
        if self._buffer.nbytes >= self._storage.options.preemptive_persist_bytes:
            self._submit_buffer()

    def last_appended_sqn(self) -> int | None:
        """The sqn of the newest record appended (None if none since ``initial_sqn``).

        Derived, not tracked per append, so the hot path pays nothing for it.
        """
        if len(self._buffer):
            return self._buffer.last_sqn
        if self._uploads:
            return self._uploads[-1].sqn_end - 1
        return None

    def log_size(self) -> tuple[int, int]:
        """``(bytes, rows)`` of the log a persist now would reference (everything kept
        since the truncation point): uploaded blocks at their part of their segment's
        bytes (``block_bytes``: a segment shared by k blocks, of this writer or others,
        counts once, not k times), the rest (buffered or uploading) at the bytes per row
        the uploaded ones took, else at :data:`UNSEEN_BYTES_PER_ROW`. An estimate for
        materialization policy; cheap (no I/O, one step per upload kept).
        """
        done_bytes = done_rows = pending_rows = 0
        for upload in self._uploads:
            fut = upload.future
            if fut.done() and fut.exception() is None:
                handle = fut.result()
                done_bytes += int(upload.timings["block_bytes"])
                done_rows += handle.rows
            elif upload.changes is not None:
                pending_rows += upload.changes.rows
        pending_rows += len(self._buffer)
        per_row = done_bytes / done_rows if done_rows else UNSEEN_BYTES_PER_ROW
        return done_bytes + round(pending_rows * per_row), done_rows + pending_rows

    def next_sqn(self) -> int:
        """Close the active change set and return the boundary sqn.

        Every record appended before has ``sqn <`` the result; every later one ``>=`` it.
        """
        if len(self._buffer) and self._buffer.last_sqn == self._active_sqn:
            self._active_sqn += 1
        elif self._uploads and self._uploads[-1].sqn_end > self._active_sqn:
            self._active_sqn = self._uploads[-1].sqn_end
        return self._active_sqn

    def cut(self) -> int:
        """:meth:`next_sqn`, and hand what is buffered to an upload now: the log from the
        boundary on starts in a new segment.

        For a materialization's snapshot. A checkpoint references whole segments (blocks),
        so without the cut the segment being filled at the snapshot (up to
        ``dstl.preemptive-persist-bytes`` of changes from before it) went on being
        referenced by every checkpoint after the materialization, beside the base that
        holds those changes already: at 100k keys the materialized state is about the size
        of one such segment. The upload ending at the boundary also ends its segment: an
        upload batched behind it goes in a file of its own (see :func:`_segments`). Blocks
        only under backpressure, like a pre-emptive upload.
        """
        self._check_open()
        self._submit_buffer()
        last = self._uploads[-1] if self._uploads else None
        if last is not None and last.sqn_end == self._active_sqn and last.request is not None:
            # The upload ending at the boundary (just submitted, or pre-emptively before)
            # ends its segment. If the upload thread batched it already, that segment may
            # hold later blocks: a checkpoint then references some older changes, no more.
            last.request.ends_segment = True
        return self._active_sqn

    # -- persisting -------------------------------------------------------------------
    def _submit_buffer(self, urgent: bool = False) -> None:
        boundary = self.next_sqn()
        if not len(self._buffer):
            return
        changes = self._buffer
        changes.seal()
        self._buffer = ChangeBuffer()
        upload = _Upload(self._buffer_start, boundary, changes, Future(), urgent=urgent)
        self._buffer_start = boundary
        self._uploads.append(upload)
        self._storage._submit(self.writer_id, upload)
        self._drop_durable_changes()

    def _drop_durable_changes(self) -> None:
        """Let go of the changes of uploads that succeeded: only a failed one is sent again.

        Without this, a writer that uploads pre-emptively between checkpoints would keep
        every change it ever uploaded in memory until the next checkpoint.
        """
        for upload in self._uploads:
            done = upload.future.done()
            if upload.changes is not None and done and upload.future.exception() is None:
                upload.changes = upload.request = None  # the request holds them too

    def persist(self, from_sqn: int, checkpoint_id: int) -> Future[tuple[ChangelogHandle, ...]]:
        """Make every change with ``sqn >= from_sqn`` durable, for ``checkpoint_id``.

        Returns a future of the handles covering ``[from_sqn, boundary)``, in order; it
        fails with :class:`~dstl.errors.UploadFailedError` if an upload gave up. Uploads
        that failed before are retried here. The segments of the returned handles are
        claimed by ``checkpoint_id`` until :meth:`confirm` or :meth:`reset`. May block
        under backpressure.
        """
        self._check_open()
        if self._truncated_to is not None and from_sqn < self._truncated_to:
            raise StateBackendError(
                f"writer {self.writer_id}: cannot persist from sqn {from_sqn}, "
                f"the log was truncated to {self._truncated_to}"
            )
        # Failed uploads go first, so the queue stays in sqn order: a boundary's mark
        # (see cut) then ends its segment before the newer changes, retried or not.
        for upload in self._uploads:
            if upload.sqn_end <= from_sqn:
                continue
            if upload.future.done() and upload.future.exception() is not None:
                if upload.changes is None:  # pragma: no cover - kept until success
                    raise StateBackendError("lost the changes of a failed upload")
                upload.future = Future()
                self._storage._submit(self.writer_id, upload)
        self._submit_buffer(urgent=True)
        wanted = [u for u in self._uploads if u.sqn_end > from_sqn]
        if wanted and not wanted[-1].urgent and not wanted[-1].future.done():
            # nothing buffered since a pre-emptive upload (its last append, or a cut)
            self._storage._expedite()
        self._storage._tracker.claim(self.writer_id, checkpoint_id, [u.sqn_start for u in wanted])
        self._last_timings = wanted[-1].timings if wanted else {}
        self._drop_durable_changes()
        log.debug(
            "persist writer=%s from=%d checkpoint=%d uploads=%d",
            self.writer_id,
            from_sqn,
            checkpoint_id,
            len(wanted),
        )
        return _all_of([u.future for u in wanted])

    def last_persist_timings(self) -> dict[str, float]:
        """Where the last :meth:`persist`'s newest upload spent its time, in ms: waiting
        for the upload thread (``persist_queue_ms``), in the sharing window
        (``persist_window_ms``; for a pre-emptive upload, also waiting for the lane),
        encoding (``encode_ms``; ``encode_cpu_ms`` of it the upload thread's CPU), writing
        durably (``write_ms``, with the files of the same upload written before it);
        not in ms: the segment's ``segment_blocks``, this block's part of its bytes
        (``block_bytes``), and the segments and blocks of the upload it was part of
        (``upload_segments``, ``upload_blocks``: a barrier's takes along the blocks still
        waiting for the lane). The upload thread fills the dict
        before the persist's future completes; read it after that. Empty for a persist
        with nothing to upload."""
        return self._last_timings

    def truncate(self, to_sqn: int) -> None:
        """Forget changes below ``to_sqn`` (materialized; no future checkpoint needs them).

        Segments whose every block is truncated and unclaimed are deleted by the storage
        (on its upload thread); see :mod:`dstl.tracking`.
        """
        self._uploads = [u for u in self._uploads if u.sqn_end > to_sqn or not u.future.done()]
        # Buffered changes below the materialization were never uploaded: uploading them
        # with the next checkpoint would only add bytes that restore filters out again.
        self._buffer.drop_below(to_sqn)
        self._buffer_start = max(self._buffer_start, min(to_sqn, self._active_sqn))
        if self._truncated_to is None or to_sqn > self._truncated_to:
            self._truncated_to = to_sqn
        self._storage._delete_later(self._storage._tracker.truncate(self.writer_id, to_sqn))

    def confirm(self, checkpoint_id: int) -> None:
        """The checkpoint completed: its segments now belong to the coordinator's store.

        The DSTL never deletes them afterwards (the metadata store counts references).
        """
        self._storage._tracker.confirm(self.writer_id, checkpoint_id)

    def reset(self, checkpoint_id: int) -> None:
        """The checkpoint was aborted: drop its claims; its uploads stay usable later."""
        self._storage._delete_later(self._storage._tracker.reset(self.writer_id, checkpoint_id))

    def close(self) -> None:
        """Stop accepting changes, and let go of the changes held for persists.

        Futures already returned still complete (their uploads hold what they send). A
        closed writer cannot persist, so its buffer and the copies kept for re-sending
        failed uploads are dropped: up to two buffers (2 MiB by default) that would
        otherwise stay until the owner, often part of a reference cycle, is collected.
        """
        self._closed = True
        self._buffer = ChangeBuffer()
        for upload in self._uploads:
            upload.changes = upload.request = None
        self._storage._writer_closed(self.writer_id)

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
    (named ``dstl-upload-<worker>``) owns the batching and uploads the batches a persist
    waits for; pre-emptive batches upload on the lane (``dstl-preempt-<worker>``, one at a
    time, in order); segments are deleted on ``dstl-delete-<worker>``; attempts run on
    the named pool ``dstl-attempt-<worker>``. ``self._lock`` guards the segment counter
    and the set of open writers; the budget and the tracker guard themselves. In-flight
    bytes are bounded by ``options.in_flight_max_bytes``: submitting blocks
    (backpressure) instead of failing.
    ``clock`` may be a plain ``() -> float`` or a :class:`~dstl.retry.Clock` (tests pass a
    :class:`~dstl.retry.ManualClock` to drive hedging without sleeping). With
    ``start_thread=False`` there is no lane or deleter either: nothing uploads until
    :meth:`drain_once` is called, and it uploads every batch and deletes itself.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        fileio: FileIO,
        job: str,
        worker: str,
        options: ChangelogOptions | None = None,
        clock: Callable[[], float] | Clock = time.monotonic,
        start_thread: bool = True,
    ) -> None:
        self.fileio = fileio
        self.job = layout.check_name("job", job)
        self.worker = layout.check_name("worker", worker)
        self.options = options or ChangelogOptions()
        self._policy = self.options.retry_policy()
        self._clock = as_clock(clock)
        self._queue: queue.Queue[_Request | _Delete | _Expedite | None] = queue.Queue()
        self._lock = threading.Lock()
        self.budget = InFlightBudget(self.options.in_flight_max_bytes)
        self._tracker = SegmentTracker()
        self._writers: set[str] = set()  # open writers: a batch holding all of them closes
        self._counter = 0
        # segment-name nonces: seeded from the OS once; a syscall per name would cost
        # the busy task thread a GIL hand-off (see dstl/_durable.c)
        self._nonces = random.Random()
        self._closed = False
        self.segments_written = 0
        self.segments_deleted = 0
        self.upload_attempts = 0
        # no huge pages while it is open (why: dstl.pages); the helper inherits it
        self._pages = contextlib.ExitStack()
        self._pages.enter_context(small_pages())
        self._encoder = shared_encoder()  # a helper process, off this process's GIL
        self._encoder.start()
        self._attempts = ThreadPoolExecutor(
            max_workers=2 * self._policy.max_attempts, thread_name_prefix=f"dstl-attempt-{worker}"
        )
        # Pre-emptive batches upload on the lane, so the upload thread is free for a
        # barrier's batch meanwhile (see _dispatch). Without threads of our own (tests),
        # drain_once uploads them itself.
        self._lane: _Lane | None = None
        self._lane_thread: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._deletes: queue.Queue[list[str] | None] = queue.Queue()
        self._deleter: threading.Thread | None = None
        if start_thread:
            self._deleter = threading.Thread(
                target=self._run_deleter, name=f"dstl-delete-{worker}", daemon=True
            )
            self._deleter.start()
            self._lane = _Lane(self.options.batch_max_bytes)
            self._lane_thread = threading.Thread(
                target=self._run_lane, name=f"dstl-preempt-{worker}", daemon=True
            )
            self._lane_thread.start()
            self._thread = threading.Thread(
                target=self._run, name=f"dstl-upload-{worker}", daemon=True
            )
            self._thread.start()

    def __enter__(self) -> ChangelogStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_writer(self, writer_id: str, initial_sqn: int = 0) -> ChangelogWriter:
        """A new writer for one backend instance; ``writer_id`` must be unique in the job.

        Open writers are what a batch of persists waits for (see :meth:`drain_once`)."""
        writer = ChangelogWriter(self, writer_id, initial_sqn)
        with self._lock:
            self._writers.add(writer.writer_id)
        return writer

    def _writer_closed(self, writer_id: str) -> None:
        with self._lock:
            self._writers.discard(writer_id)

    def tracked_segments(self) -> dict[str, bool]:
        """Relative paths of tracked segments -> whether handed over to the coordinator."""
        return self._tracker.tracked()

    def _submit(self, writer_id: str, upload: _Upload) -> None:
        assert upload.changes is not None
        retried = upload.request is not None  # a failed upload, sent again by a persist
        keep_mark = upload.request is not None and upload.request.ends_segment
        self._tracker.submitted(writer_id, upload.sqn_start, upload.sqn_end)
        self.budget.acquire(upload.changes.nbytes)  # backpressure: blocks, never fails
        upload.request = _Request(
            writer_id,
            upload.sqn_start,
            upload.sqn_end,
            upload.changes,
            upload.future,
            upload.timings,
            upload.urgent,
            time.perf_counter(),
            # A barrier waits for it, and for the uploads queued before it: the
            # tasks (this one too) stand aside until it is written (dstl.gil).
            critical=open_critical(owner=None) if upload.urgent else None,
            # sent again (a failed upload): it keeps the mark
            ends_segment=keep_mark,
        )
        if self._lane is not None and not upload.urgent and not retried:
            # Straight to the lane, not through the upload thread: one thread fewer to
            # wake on its way, each wake-up waiting for the GIL up to a switch interval
            # beside this busy task thread. A barrier found a pre-emptive block still
            # waiting, and encoded it with its own, half as often (6 against 14 in four
            # end-to-end runs each). A retried one still goes through the queue: the
            # persist retrying it follows, and the two go out in sqn order together.
            upload.request.taken = upload.request.submitted
            self._lane.put([upload.request])
        else:
            self._queue.put(upload.request)

    def _expedite(self) -> None:
        # the tasks stand aside from now on, as for a persist's own upload
        self._queue.put(_Expedite(open_critical(owner=None)))

    def _delete_later(self, paths: list[str]) -> None:
        if paths:
            self._queue.put(_Delete(tuple(paths)))

    # -- the upload loop: a thin shell around drain_once -----------------------------------
    def _run(self) -> None:
        try:  # before the first request: see warm_up_here
            warm_up_here()
        except Exception:  # a bug; the first segment pays for the set-up instead
            log.exception("warming up the segment encoding failed worker=%s", self.worker)
        while True:
            if not self.drain_once(block=True):
                return

    def drain_once(self, block: bool = False) -> bool:
        """Take the waiting requests (batching for ``batch_delay_s``), write one segment.

        Also performs deletions queued meanwhile. Returns False once the storage is closed
        and the queue is empty. Called by the upload thread, or by tests with
        ``start_thread=False``.
        """
        try:
            first = self._queue.get(block=block)
        except queue.Empty:
            return True
        if first is None:
            return False
        if isinstance(first, _Delete):
            self._delete(first.paths)
            return True
        if isinstance(first, _Expedite):  # what it waits for was taken before
            self._dispatch([], [first.critical])
            return True
        first.taken = time.perf_counter()
        batch = [first]
        deletes: list[str] = []
        expedite: list[int | None] = []
        size = first.nbytes
        with self._lock:
            waiting = set(self._writers)
        waiting.discard(first.writer_id)
        # The batch closes once no request arrived for batch_delay_s (so the persists of
        # many writers at one checkpoint share a segment even when the task threads are
        # slow to issue them), at the latest after _MAX_WINDOW delays, or when it is full;
        # and without waiting any longer once every open writer has a request in it
        # (nobody is left to share the segment with: what is queued already still joins).
        opened = self._clock()
        deadline = opened + self.options.batch_delay_s
        stop = False
        while size < self.options.batch_max_bytes:
            remaining = deadline - self._clock() if waiting else 0.0
            try:
                nxt = self._queue.get(
                    block=block and remaining > 0, timeout=max(remaining, 0) if block else None
                )
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            if isinstance(nxt, _Delete):
                deletes.extend(nxt.paths)
                continue
            if isinstance(nxt, _Expedite):
                expedite.append(nxt.critical)
                continue
            nxt.taken = time.perf_counter()
            batch.append(nxt)
            waiting.discard(nxt.writer_id)
            size += nxt.nbytes
            deadline = min(
                self._clock() + self.options.batch_delay_s,
                opened + _MAX_WINDOW * self.options.batch_delay_s,
            )
        self._dispatch(batch, expedite)
        self._delete(deletes)
        return not stop

    def _dispatch(self, batch: list[_Request], expedite: list[int | None]) -> None:
        """Upload ``batch``: a barrier's here and now, a pre-emptive one on the lane,
        unless a persist waits for it (``expedite``: the critical sections of persists
        that had nothing of their own to upload). Pre-emptive requests come this way only
        without a lane, or sent again by a persist: the others go straight to the lane
        (see :meth:`_submit`).

        Why a lane: at 1M uniform keys a writer uploads a 1 MiB pre-emptive segment every
        ~40 ms, encoded by the helper process and written in ~5-20 ms; a barrier's persist
        taken meanwhile waited for it (persist_queue_ms spikes of 7-18 ms, the largest
        part of the operator's async p99) before its own encoding even began. Now the two
        overlap: the barrier's tail is encoded and written while the helper encodes the
        pre-emptive batch. The lane uploads what waits for it as one segment, and a
        barrier's batch takes along what still waits (as the one upload thread batched
        them), so a backlog is not written a file per request. Nothing depends on
        segments being written in sqn order (a handle names its file, and
        :mod:`dstl.tracking` tracks each block by itself).

        Why a persist with nothing of its own expedites: its barrier came right after a
        pre-emptive upload (its last append, or a materialization's cut), and it waited
        for the lane's round trip to the helper beside the busy tasks: 1-5 checkpoints
        of 40 at 1M keys, but most of the slowest (encode 10-18 ms of 0.5-0.8 ms CPU).
        """
        lane = self._lane
        if lane is not None and not expedite and not any(r.urgent for r in batch):
            lane.put(batch)
            return
        # Pre-emptive requests still waiting for the lane join the barrier's upload (the
        # persist waits for them anyway: one encoding round trip, one file, not one each;
        # more files where a materialization's boundary falls between them); the tasks
        # stand aside until the one the lane is uploading now is written too.
        waiting, running = lane.steal() if lane is not None else ([], None)
        try:
            self._upload(_segments(waiting + batch), running, expedite)
        except Exception as exc:  # a bug: the thread goes on, no persist waits forever
            _crashed(waiting + batch, exc, self.worker)

    def _run_lane(self) -> None:
        assert self._lane is not None
        while self._upload_preemptive_once(self._lane):
            pass

    def _upload_preemptive_once(self, lane: _Lane) -> bool:
        """The lane's step: upload the pre-emptive requests waiting, up to
        ``batch_max_bytes``, in as few segments as materializations' boundaries allow,
        encoded in one round trip; False once the lane is closed and empty."""
        batch = lane.take()
        if batch is None:
            return False
        try:
            # Why short slices: the step gives the GIL up at its round trip and its write,
            # and each time waited up to a switch interval (5 ms) for the busy task to
            # hand it back. At 1M uniform keys a step took ~26 ms (p50) for a block
            # arriving every ~40 ms, so the lane fell behind, and a barrier waited for its
            # backlog: own part of a checkpoint p50 / p90 / max 19.5 / 46 / 63 ms. With
            # 1 ms slices (end-to-end worker, three alternated pairs) 11-13 / 16-23 /
            # 25-30 ms, records/s the same at 1M; at 100k keys 5-10% fewer (the lane
            # shows the log to the materialization trigger sooner: ~10% more of them).
            with short_gil_slices(GIL_SLICE_S):
                self._upload_segments(_segments(batch))
        except Exception as exc:  # a bug: fail the futures, so no persist waits forever
            _crashed(batch, exc, self.worker)
        finally:
            lane.done()
        return True

    def _write_attempt(self, path: str, data: bytes | memoryview) -> None:
        with self._lock:
            self.upload_attempts += 1
        try:
            self.fileio.write_new(path, data)
        except StorageError:
            raise
        except Exception as exc:  # a FileIO wrapper may raise raw library errors
            raise translate_error(exc, self.fileio.url(path)) from exc

    def _new_path(self) -> str:
        with self._lock:
            self._counter += 1
            counter = self._counter
            nonce = f"{self._nonces.getrandbits(48):012x}"
        return layout.segment_path(self.job, self.worker, counter, nonce)

    def _upload(
        self,
        segments: list[list[_Request]],
        before: Future[None] | None = None,
        expedite: Sequence[int | None] = (),
    ) -> None:
        """Upload ``segments`` on this thread; those a persist waits for (holding an
        urgent request, or ``expedite`` given) in a critical section, whose tasks'
        stand-aside ends once ``before`` (the lane's upload) is done too."""
        urgent = [r for segment in segments for r in segment if r.urgent]
        if not urgent and not expedite:
            self._upload_segments(segments)
            return
        try:  # a barrier waits for it: the tasks stand aside (a bound of its own)
            with critical_section():
                self._upload_segments(segments, urgent=True)
        finally:
            tokens = [*expedite, *(r.critical for r in urgent)]
            if before is None:
                _close_all(tokens)
            else:  # runs at once if it is done already
                before.add_done_callback(lambda _f: _close_all(tokens))

    def _upload_segments(self, segments: list[list[_Request]], urgent: bool = False) -> None:
        """Encode ``segments`` (those that must go to the helper in one round trip), then
        write each to a file of its own and complete its requests' futures, in order;
        ``urgent``: a persist waits for them."""
        if not segments:
            return
        closed, cpu = time.perf_counter(), time.thread_time()
        encoded = self._encode(segments, urgent)
        times = _UploadTimes(
            closed,
            time.perf_counter(),
            time.thread_time() - cpu,
            len(segments),
            sum(map(len, segments)),
        )
        for segment, result in zip(segments, encoded, strict=True):
            self._write_segment(segment, result, times)

    def _encode(
        self, segments: list[list[_Request]], urgent: bool
    ) -> list[EncodedSegment | Exception]:
        """Each segment encoded, or the error that failed it (that segment alone).

        A barrier's upload is encoded here when it is small (no helper round trip while
        it waits: the helper may be busy, or still starting), its rows as appended (not
        grouped by key group: see :func:`~dstl.segment.encode_segment`); otherwise, and
        for the lane, every segment goes to the helper, all in one round trip."""
        pending = [_pending(batch) for batch in segments]
        requests = [r for batch in segments for r in batch]
        if urgent and sum(r.nbytes for r in requests) <= ENCODE_HERE_BYTES:
            return [_encoded_here(blocks, grouped=False) for blocks in pending]
        try:
            return list(self._encoder.encode_many(pending))  # typed as the union (invariant)
        except _DATA_ERRORS:  # which one? each by itself: the others still upload
            return [_encoded_here(blocks) for blocks in pending]

    def _write_segment(
        self,
        batch: list[_Request],
        encoded: EncodedSegment | Exception,
        times: _UploadTimes,
    ) -> None:
        """Write one encoded segment (or fail its requests with the error that failed its
        encoding or write); fill its requests' timings, then complete their futures."""
        if isinstance(encoded, Exception):
            self._fail_segment(batch, encoded, 0)
            return
        data = encoded.data
        write = HedgedWrite(
            self._write_attempt,
            self.fileio.delete,
            self._new_path,
            data,
            self._policy,
            self._clock,
            self._attempts if self.fileio.hedged else None,
        )
        try:
            path = write.run()
        except (StorageError, *_DATA_ERRORS) as exc:
            self._fail_segment(batch, exc, write.attempts)
            return
        written = time.perf_counter()
        with self._lock:
            self.segments_written += 1
        log.debug("segment uploaded key=%s bytes=%d blocks=%d", path, len(data), len(batch))
        rows = sum(r.changes.rows for r in batch)
        shares = itertools.accumulate(r.changes.rows * len(data) // rows for r in batch[:-1])
        bounds = [0, *shares, len(data)]
        for i, r in enumerate(batch):  # before the futures complete: their callbacks read these
            r.timings.update(
                persist_queue_ms=round((r.taken - r.submitted) * 1e3, 3),
                persist_window_ms=round((times.closed - r.taken) * 1e3, 3),
                encode_ms=round((times.encoded - times.closed) * 1e3, 3),
                # of which this thread's CPU (encoded here; ~0 when the helper encodes)
                encode_cpu_ms=round(times.encode_cpu * 1e3, 3),
                # until this segment was written (the upload's earlier segments first)
                write_ms=round((written - times.encoded) * 1e3, 3),
                segment_blocks=len(batch),
                # this block's part of the segment's bytes (by rows; they add up to its size)
                block_bytes=bounds[i + 1] - bounds[i],
                # the upload it was part of: a barrier's takes along the lane's backlog
                upload_segments=times.segments,
                upload_blocks=times.blocks,
            )
        deletable = self._tracker.uploaded(path, _block_ids(batch))
        self.budget.release(sum(r.nbytes for r in batch))
        for i, r in enumerate(batch):
            r.future.set_result(
                ChangelogHandle(
                    path,
                    i,
                    r.writer_id,
                    r.sqn_start,
                    r.sqn_end,
                    r.changes.rows,
                    len(data),
                    encoded.content_hash,
                )
            )
        self._delete(deletable)

    def _fail_segment(self, batch: list[_Request], exc: Exception, attempts: int) -> None:
        """Fail the requests of a segment that could not be encoded or written."""
        log.warning(
            "segment upload failed worker=%s attempts=%d error=%s", self.worker, attempts, exc
        )
        err = UploadFailedError(
            f"changelog segment upload failed after {attempts} attempt(s) ({exc})",
            getattr(exc, "location", None),
            attempts,
        )
        err.__cause__ = exc
        self._tracker.upload_failed(_block_ids(batch))  # before the futures: see dstl.tracking
        self.budget.release(sum(r.nbytes for r in batch))
        for r in batch:
            r.future.set_exception(err)

    def _delete(self, paths: Iterable[str]) -> None:
        """Delete ``paths`` (decided already: see :mod:`dstl.tracking`) on the deleter
        thread, or here when there is none (``start_thread=False``).

        Why not on the upload or lane thread: each file's unlink gave the GIL up and
        waited for a busy task to hand it back; after a materialization at 1M keys the
        upload thread spent 145-203 ms deleting 15-17 segments, while the pre-emptive
        requests it routes to the lane queued behind it, and the barrier that came next
        waited for the backlog (own part of a checkpoint up to 73 ms)."""
        paths = list(paths)
        if not paths:
            return
        if self._deleter is not None:
            self._deletes.put(paths)
        else:
            self._delete_now(paths)

    def _run_deleter(self) -> None:
        while True:
            paths = self._deletes.get()
            if paths is None:
                return
            try:
                self._delete_now(paths)
            except Exception:  # a bug: these are left to the orphan sweep, the rest go
                log.exception("segment delete crashed worker=%s count=%d", self.worker, len(paths))

    def _delete_now(self, paths: list[str]) -> None:
        failed = self.fileio.delete_many(paths)
        for path, exc in failed:  # nothing references it: the orphan sweep will
            log.warning("segment delete failed key=%s error=%s", path, exc)
        with self._lock:
            self.segments_deleted += len(paths) - len(failed)
        log.debug("segments deleted count=%d", len(paths) - len(failed))

    def close(self) -> None:
        """Upload what is queued, then stop and join the upload, lane and deleter threads
        and the attempt pool (the deletions queued are done by then).

        Deletes nothing that is not already decided (see :mod:`dstl.tracking`).
        """
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()
            if self._lane is not None and self._lane_thread is not None:
                self._lane.close()
                self._lane_thread.join()
            if self._deleter is not None:  # after the threads that hand it deletions
                self._deletes.put(None)
                self._deleter.join()
        else:
            while self.drain_once(block=False):
                if self._queue.empty():
                    break
        self._attempts.shutdown(wait=True)
        self._pages.close()


class _Lane:
    """Pre-emptive requests waiting for the lane thread, and the batch it is uploading.

    Thread-safe: guarded by ``self._cond``. The upload thread puts and steals; the lane
    thread takes a batch and reports it done; :meth:`close` ends the taking once empty.
    """

    def __init__(self, max_bytes: int) -> None:
        self._cond = threading.Condition()
        self._max_bytes = max_bytes
        self._waiting: list[_Request] = []
        self._running: Future[None] | None = None  # done when the taken batch is uploaded
        self._closed = False

    def put(self, batch: list[_Request]) -> None:
        with self._cond:
            self._waiting.extend(batch)
            self._cond.notify()

    def steal(self) -> tuple[list[_Request], Future[None] | None]:
        """The requests not taken yet (now the caller's), and the upload in progress."""
        with self._cond:
            waiting, self._waiting = self._waiting, []
            return waiting, self._running

    def take(self) -> list[_Request] | None:
        """The next batch (blocks while none waits): the oldest requests, at least one,
        up to ``max_bytes`` (across segment ends: :func:`_segments` splits it); None once
        closed and empty."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._waiting) or self._closed)
            if not self._waiting:
                return None
            size, n = 0, 0
            for r in self._waiting:
                if n and size + r.nbytes > self._max_bytes:
                    break
                size, n = size + r.nbytes, n + 1
            batch, self._waiting = self._waiting[:n], self._waiting[n:]
            self._running = Future()
            return batch

    def done(self) -> None:
        """The batch :meth:`take` returned is uploaded (or failed)."""
        with self._cond:
            running, self._running = self._running, None
        if running is not None:
            running.set_result(None)  # callbacks (closing critical sections) run here

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


@dataclass(frozen=True, slots=True)
class _UploadTimes:
    """When an upload's encoding began and ended (``perf_counter``), the uploading
    thread's CPU for it, and how many segments and blocks it uploads."""

    closed: float
    encoded: float
    encode_cpu: float
    segments: int
    blocks: int


_DATA_ERRORS = (ValueError, pa.ArrowException)
"""What encoding raises for changes it cannot encode (the upload fails, nothing else)."""


def _pending(batch: list[_Request]) -> list[PendingBlock]:
    """What the encoder takes of ``batch``: each request's block of changes."""
    return [PendingBlock(r.writer_id, r.sqn_start, r.sqn_end, r.changes) for r in batch]


def _block_ids(batch: list[_Request]) -> list[tuple[str, int, int]]:
    """How :mod:`dstl.tracking` names the blocks of ``batch``."""
    return [(r.writer_id, r.sqn_start, r.sqn_end) for r in batch]


def _encoded_here(blocks: list[PendingBlock], grouped: bool = True) -> EncodedSegment | Exception:
    try:
        return encode_here(blocks, grouped)
    except _DATA_ERRORS as exc:
        return exc


def _segments(batch: list[_Request]) -> list[list[_Request]]:
    """``batch`` in segments of its own, split after each request that ends its segment.

    Why: at 100k keys the materialized state is about the size of one pre-emptive block,
    and a segment of several blocks queued behind a slow upload, written with the
    materialization's boundary inside it, stayed referenced by every checkpoint until the
    next materialization for its later blocks: up to 1.7x the live state in one bench run.
    """
    out: list[list[_Request]] = [[]]
    for r in batch:
        out[-1].append(r)
        if r.ends_segment:
            out.append([])
    return [segment for segment in out if segment]


def _crashed(requests: list[_Request], exc: Exception, worker: str) -> None:
    """An upload failed with a bug (not a storage or data error): log it and fail the
    futures still open, so no persist waits forever and the thread goes on."""
    log.exception("segment upload crashed worker=%s", worker, exc_info=exc)
    for r in requests:
        if not r.future.done():
            r.future.set_exception(exc)


def _close_all(tokens: list[int | None]) -> None:
    for token in tokens:
        close_critical(token)
