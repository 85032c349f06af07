"""Periodic background materialization, driven by the task thread in small steps.

The scheduler is a thin shell around two synchronous steps the owning task thread calls
from its loop (or a test calls directly, with an injected clock and random source):

- :meth:`MaterializationScheduler.tick` ``(now)``: if a materialization is due, nothing is
  in flight, and the backend changed since its base, take the snapshot (the short,
  synchronous part, on the task thread) and hand the upload to the scheduler's executor;
  a backend with ``prepare_materialization`` (the changelog backend over RocksDB: a
  background memtable flush) is asked first, and the snapshot waits for a later tick
  until it says it is ready;
- :meth:`MaterializationScheduler.poll`: take a finished upload back and apply it to the
  backend (``materialization_done``: later checkpoints reference it and the writer
  truncates its log), or count the failure.

:meth:`~MaterializationScheduler.run_once` does both. Results travel from the upload
thread to the task thread through a queue; ``on_ready`` (optional) is called on the
upload thread after a result is queued, so a runtime can wake its task (e.g. put a
control message into its mailbox) instead of waiting for its next loop turn.

Policy (Flink's ``PeriodicMaterializationManager``, plus a size bound): the first run is
at a random point in ``[interval/2, interval)`` from start (spreads subtasks apart); later
runs every ``interval_s``; a run is skipped (and the next one scheduled an interval later)
while the previous materialization is in flight or not yet applied, and when nothing
changed since the base. Besides, a run starts as soon as nothing is in flight and the log a
checkpoint would reference beside the base (``backend.log_bytes()``, looked at every
:data:`SIZE_CHECK_S` at most) has reached ``max_log_ratio`` of the base's bytes: a
checkpoint's full size is its base plus that log, so the interval alone lets it grow with
the update rate (at 100k keys and ~200k updates/s, 5 s of log are ~10x the state), while
the ratio keeps it near ``(1 + max_log_ratio) * base`` plus the log written while one
materialization runs. Counted in :attr:`MaterializationScheduler.size_triggered`. Unless
the option sets one, the ratio is the backend's own (``max_log_ratio``: the RocksDB
store's 0.2, whose compacted SSTs take ~0.9x the live state at 100k keys where the heap's
tables take ~0.6x, so at 0.4 its full checkpoint passed 1.5x the live state), else
:data:`DEFAULT_MAX_LOG_RATIO`. The default 0.4 starts one at about the log it started
at when it was 0.25 and the heap's tables took ~1.45x the bytes they take now (before
their keys were delta-encoded): each materialization costs the task (a fork's
copy-on-write faults), and at 0.25 the smaller tables made it materialize ~45% more
often (100k uniform keys: 320 instead of 220 in 30 s, 22% fewer records/s).
``max_consecutive_failures`` failures in a row raise
:class:`~materializer.errors.MaterializationFailuresExceededError`, which fails the task;
a success resets the count. Until then a failure only means checkpoints keep referencing
the older base and a longer log.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from backends.snapshot import MaterializationSnapshot
from dstl.errors import ConfigError
from dstl.options import Converter, parse_dotted
from materializer.errors import MaterializationFailuresExceededError
from materializer.materializer import MaterializationResult, MaterializationStats, Materializer

log = logging.getLogger(__name__)

MIN_BASE_BYTES = 64 << 10
"""The size bound treats a smaller base (or none) as this big: a new state is materialized
early too (its whole log is its size), but a tiny one is not materialized over and over."""

DEFAULT_MAX_LOG_RATIO = 0.4
"""The size bound's ratio for a backend that names none of its own (``max_log_ratio``)."""

SIZE_CHECK_S = 0.01
"""The size bound's look at the log happens at most this often (it flushes the record
buffers and walks the writer's uploads: cheap, but not per record). At 100k keys a
materialization takes ~80 ms; when the log it left was still under the bound, the next
started up to this long after the log crossed it: at 0.05 s, 51 ms after the last was
applied at p90, at 0.01 s, 10 ms."""


@dataclass(frozen=True, slots=True)
class MaterializationOptions:
    """Options of periodic materialization.

    Dotted keys (see :meth:`from_dict`): ``materialization.interval-s``,
    ``materialization.max-log-ratio`` (start a materialization once the log since the base
    reaches this fraction of the base's bytes; 0: by interval only; default None: the
    store's own, see the module docstring), ``materialization.max-consecutive-failures``.
    """

    interval_s: float = 5.0
    max_consecutive_failures: int = 3
    max_log_ratio: float | None = None

    KEYS: ClassVar[dict[str, tuple[str, Converter]]] = {
        "materialization.interval-s": ("interval_s", float),
        "materialization.max-log-ratio": ("max_log_ratio", float),
        "materialization.max-consecutive-failures": ("max_consecutive_failures", int),
    }

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ConfigError("materialization.interval-s must be > 0")
        if self.max_log_ratio is not None and not self.max_log_ratio >= 0:
            raise ConfigError("materialization.max-log-ratio must be >= 0")
        if self.max_consecutive_failures < 1:
            raise ConfigError("materialization.max-consecutive-failures must be >= 1")

    @classmethod
    def from_dict(cls, values: dict[str, str | int | float]) -> MaterializationOptions:
        """Parse documented dotted keys; unknown keys are a :class:`ConfigError`."""
        return cls(**parse_dotted(cls.KEYS, values, "materialization"))


@dataclass(frozen=True, slots=True)
class _Outcome:
    mat_id: int
    result: MaterializationResult | None
    error: BaseException | None


class MaterializationScheduler:
    """Runs a :class:`Materializer` periodically for its backend's task thread.

    Task thread only: :meth:`tick`, :meth:`poll`, :meth:`run_once`, :meth:`close` and every
    counter. The upload and the deletes of released files run on the executor (by default
    one it owns: a single named thread ``materialize-<name>``, joined by :meth:`close`);
    they only touch the materializer's upload and delete paths and the result queue.
    Invariant: at most one materialization is in flight, from the snapshot until
    :meth:`poll` applied or counted it.
    """

    def __init__(
        self,
        materializer: Materializer,
        options: MaterializationOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
        name: str = "materializer",
        executor: Executor | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.materializer = materializer
        self.options = options or MaterializationOptions()
        self._clock = clock
        self._owned = executor is None
        self._executor: Executor = executor or ThreadPoolExecutor(
            1, thread_name_prefix=f"materialize-{name}"
        )
        self._on_ready = on_ready
        self._results: queue.Queue[_Outcome] = queue.Queue()
        self._in_flight: Future[None] | None = None
        self._failed: MaterializationFailuresExceededError | None = None
        self._closed = False
        self.next_due = clock() + self.options.interval_s * (0.5 + 0.5 * rng())
        self.consecutive_failures = 0
        self.started = 0
        self.applied = 0
        self.failed = 0
        self.skipped_unchanged = 0
        self.skipped_in_flight = 0
        self.size_triggered = 0
        self.max_log_ratio = self._resolve_ratio()
        self._next_size_check = clock()
        self.last_applied: MaterializationStats | None = None
        # Release of bases no checkpoint will ever reference (see on_barrier).
        self._base: MaterializationResult | None = None
        self._claims: dict[int, MaterializationResult] = {}  # pending checkpoint -> its base
        # Files uploaded by applied bases that no completed checkpoint referenced yet: ours
        # to delete once neither the base nor a pending checkpoint's base lists them (a
        # later base may share them, so ownership is per file, not per materialization).
        self._unowned: set[str] = set()
        self.released_files = 0

    def __enter__(self) -> MaterializationScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def in_flight(self) -> bool:
        """Whether a materialization was started and not yet applied or counted."""
        return self._in_flight is not None

    # -- the steps ----------------------------------------------------------------------
    def tick(self, now: float) -> bool:
        """Start a materialization if one is due; True if it started.

        Raises :class:`MaterializationFailuresExceededError` once the budget is spent.
        """
        self._check()
        timed = now >= self.next_due
        if not timed and (self._in_flight is not None or not self._log_over_bound(now)):
            return False
        if not self._backend_ready():
            return False  # still due: the next tick takes the snapshot
        self.next_due = now + self.options.interval_s
        if self._in_flight is not None:
            self.skipped_in_flight += 1
            log.debug("materialization skipped: previous one in flight")
            return False
        if not self.materializer.backend.changed_since_materialization():
            self.skipped_unchanged += 1
            log.debug("materialization skipped: nothing changed")
            return False
        try:
            mat_id, snapshot = self.materializer.snapshot()
        except Exception as exc:  # the synchronous part failed: counts like a failed upload
            self._count_failure(exc)
            return False
        self.started += 1
        if not timed:
            self.size_triggered += 1
        self._in_flight = self._executor.submit(self._upload, mat_id, snapshot)
        return True

    def _resolve_ratio(self) -> float:
        """The size bound's ratio: the option if set, else the backend's own
        (``max_log_ratio``, e.g. the RocksDB store's), else :data:`DEFAULT_MAX_LOG_RATIO`."""
        if self.options.max_log_ratio is not None:
            return self.options.max_log_ratio
        own: float | None = getattr(self.materializer.backend, "max_log_ratio", None)
        return DEFAULT_MAX_LOG_RATIO if own is None else own

    def _log_over_bound(self, now: float) -> bool:
        """Whether the log since the base reached :attr:`max_log_ratio` of the base's bytes
        (at least :data:`MIN_BASE_BYTES`; looked at every :data:`SIZE_CHECK_S` at most)."""
        ratio = self.max_log_ratio
        if not ratio or now < self._next_size_check:
            return False
        self._next_size_check = now + SIZE_CHECK_S
        backend = self.materializer.backend
        base = sum(f.size_bytes for m in backend.base for f in m.state_files)
        return backend.log_bytes() >= ratio * max(base, MIN_BASE_BYTES)

    def _backend_ready(self) -> bool:
        """False while the backend prepares a due snapshot off the task thread (RocksDB
        flushes its memtable in the background first, so the snapshot's own flush on
        the task thread is short); only asked when a snapshot would be taken."""
        backend = self.materializer.backend
        prepare: Callable[[], bool] | None = getattr(backend, "prepare_materialization", None)
        if prepare is None or self._in_flight is not None:
            return True
        if not backend.changed_since_materialization():
            return True
        return prepare()

    def poll(self) -> MaterializationResult | None:
        """Apply a finished materialization to the backend; None if none finished.

        Raises :class:`MaterializationFailuresExceededError` once the budget is spent.
        """
        self._check()
        try:
            outcome = self._results.get_nowait()
        except queue.Empty:
            return None
        self._in_flight = None
        if outcome.error is not None or outcome.result is None:
            assert outcome.error is not None
            self._count_failure(outcome.error)
            return None
        result = outcome.result
        backend = self.materializer.backend
        backend.materialization_done(result.handle)
        if result.handle not in backend.base:  # ignored as older than the base
            self._executor.submit(self.materializer.discard, result)  # see _release_garbage
            return None
        self.consecutive_failures = 0
        self.applied += 1
        self.last_applied = result.stats
        self._unowned.update(result.new_files)
        self._base = result
        # The log written while this one ran may already be over the bound (they then
        # run back to back): the next tick looks at once, not up to SIZE_CHECK_S later.
        self._next_size_check = -math.inf
        self._release_garbage()
        return result

    # -- which bases a checkpoint references (task thread) ---------------------------------
    def on_barrier(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` references the current base from now on.

        Call at the barrier, before the backend's checkpoint. Together with
        :meth:`on_checkpoint_complete` / :meth:`on_checkpoint_aborted` this lets a base that
        was replaced before any completed checkpoint referenced it be deleted at once,
        instead of waiting for the orphan sweep: once a completed checkpoint references a
        base, the metadata store's reference counts own its files.
        """
        if self._base is not None:
            self._claims[checkpoint_id] = self._base

    def on_checkpoint_complete(self, checkpoint_id: int) -> None:
        """A checkpoint's record committed: its base belongs to the metadata store now.

        Pending checkpoints older than it are subsumed: they will never complete.
        """
        for cid in [c for c in self._claims if c <= checkpoint_id]:
            result = self._claims.pop(cid)
            if cid == checkpoint_id:
                self._unowned.difference_update(result.handle.files())  # the store's now
        self._release_garbage()

    def on_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """A checkpoint surely did not commit (never call this on an unknown outcome)."""
        self._claims.pop(checkpoint_id, None)
        self._release_garbage()

    def _release_garbage(self) -> None:
        """Delete the unowned files that neither the base nor a pending claim lists, on the
        executor, after the upload in flight if any: never on the task thread, which held
        its records and checkpoints meanwhile. The 32 files of one materialization at 1M
        keys took 3 ms on a local disk, 125-140 ms on S3 (moto on 127.0.0.1) with a request
        per file and 9-12 ms in one (:meth:`~dstl.fileio.FileIO.delete_many`). Best effort,
        as before: a failed delete is logged and left to the orphan sweep."""
        garbage = self._take_garbage()
        if garbage:
            self._executor.submit(self.materializer.delete_files, garbage)

    def _take_garbage(self) -> list[str]:
        """The unowned files that neither the base nor a pending claim lists, now released."""
        live: set[str] = set(self._base.handle.files()) if self._base is not None else set()
        for claimed in self._claims.values():
            live.update(claimed.handle.files())
        garbage = sorted(self._unowned - live)
        self._unowned.difference_update(garbage)
        self.released_files += len(garbage)
        return garbage

    def run_once(self) -> MaterializationResult | None:
        """:meth:`poll`, then :meth:`tick` at the clock's now: one turn of the task loop."""
        result = self.poll()
        self.tick(self._clock())
        return result

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight upload finished (its result is then ready for
        :meth:`poll`); True if nothing is left running. For tests and shutdown."""
        fut = self._in_flight
        if fut is None:
            return True
        try:
            fut.result(timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Wait for the in-flight upload, stop the owned executor, discard unapplied results.

        A result that was uploaded but not applied is referenced by nothing: its new files
        are deleted. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._executor.shutdown(wait=True)  # the upload in flight and the deletes
        elif self._in_flight is not None:
            self.wait()
        while True:
            try:
                outcome = self._results.get_nowait()
            except queue.Empty:
                break
            if outcome.result is not None:
                self.materializer.discard(outcome.result)
        self._in_flight = None
        # A base applied after the last barrier is referenced by nothing and never will be
        # (unless a pending checkpoint claims it: its outcome is unknown here, so keep it).
        # Deleted here: the executor is shut down (or its owner's), and closing may wait.
        self._base = None
        self.materializer.delete_files(self._take_garbage())
        self.materializer.close()

    # -- internals ----------------------------------------------------------------------
    def _upload(self, mat_id: int, snapshot: MaterializationSnapshot) -> None:
        """Upload thread: never raises; the outcome goes to the task thread's queue."""
        try:
            result = self.materializer.upload_result(mat_id, snapshot)
        except BaseException as exc:
            self._results.put(_Outcome(mat_id, None, exc))
        else:
            self._results.put(_Outcome(mat_id, result, None))
        if self._on_ready is not None:
            self._on_ready()

    def _count_failure(self, exc: BaseException) -> None:
        self.failed += 1
        self.consecutive_failures += 1
        log.warning(
            "materialization failed consecutive=%d budget=%d error=%s",
            self.consecutive_failures,
            self.options.max_consecutive_failures,
            exc,
        )
        if self.consecutive_failures >= self.options.max_consecutive_failures:
            self._failed = MaterializationFailuresExceededError(self.consecutive_failures, exc)
            self._failed.__cause__ = exc
            raise self._failed

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise ConfigError("the materialization scheduler is closed")
