"""The checkpoint coordinator: trigger, pending, acks, completion, subsumption, retention.

It is a synchronous state machine driven by :meth:`CheckpointCoordinator.tick` with an
injected ``now``; acks, declines and savepoint requests arrive from any thread through a
queue and are applied on the next tick. Life of a checkpoint::

    trigger -> pending --(every expected ack)--> [savepoint: copy files] -> committing
            -> (committer thread) before_commit -> record committed (retention released,
               the next id reserved and compactions looked up in the same transaction)
            -> (next tick) older pending subsumed -> notify_complete(id, last_subsumed)
            -> delete released
    pending --(decline | timeout | newer completed)--> aborted -> notify_abort(id, reason)

The record is written on a thread of its own, one record at a time in completion order,
so that the next checkpoint is triggered, and its barriers and acks run, while the
previous one commits (as Flink's JobManager finalizes checkpoints off its main thread); nothing of a
checkpoint is confirmed to the tasks (the sinks publish their output on that
confirmation) before its record is committed.

Invariants:

- Ids come from the metadata store: strictly increasing, never reused, across restarts.
- A checkpoint is reported complete only after its record is committed; records are
  committed one at a time, in the order their checkpoints got their last ack, each
  after the one before was applied (its tasks notified, its listeners run).
- At most ``max_concurrent`` regular checkpoints are pending (waiting for acks: one whose
  record is being written does not count); savepoints bypass the limit.
- A new periodic checkpoint starts no earlier than ``interval_s`` after the previous trigger
  and ``min_pause_s`` after the previous completion.
- More than ``tolerable_failures`` consecutive failed regular checkpoints (declined,
  expired, not recorded) fail the job with :class:`JobFailedError`; subsumption is not a
  failure, and a completion resets the count.

File release rule (never delete on an unknown outcome): released files of checkpoints
removed by retention are deleted after the commit, on the deleter thread. Of an aborted
checkpoint (and of late acks for one) only *checkpoint-private* files are deleted: files of
handles that declare ``PRIVATE_TO_CHECKPOINT`` (channel state) for that very checkpoint id,
and only if no retained record references them. Changelog segments, materialized files and
sink transactions of an aborted checkpoint are *not* deleted: the writers reuse them in
their next checkpoint (the next persist reuses the segments; a staged sink transaction is
committed with the next completed checkpoint). Whatever is never referenced again, and
everything of a checkpoint whose commit outcome is unknown, is the orphan sweep's
(:mod:`coordinator.gc`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from coordinator.compactions import RegisteredCompaction
from coordinator.errors import (
    CheckpointTriggerRejectedError,
    RecordSupersededError,
    SavepointError,
)
from coordinator.metadata import CompletedCheckpoint, MetadataStore, Retention, SubtaskState
from coordinator.savepoint import make_self_contained
from dstl.errors import (
    CheckpointDeclinedError,
    CheckpointError,
    CheckpointTimeoutError,
    ConfigError,
    JobFailedError,
    MetadataStoreError,
)
from dstl.fileio import FileIO
from dstl.gil import (
    CHECKPOINT_GIL_SLICE_S,
    close_critical,
    critical_section,
    open_critical,
    resume_overdue,
    short_gil_slices,
)
from dstl.options import Converter, parse_dotted

log = logging.getLogger(__name__)

TaskId = tuple[str, int]
CHECKPOINT = "checkpoint"
SAVEPOINT = "savepoint"
_REMEMBERED_ABORTS = 1024


@dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """Checkpointing options. Dotted keys (see :meth:`from_dict`): ``checkpoint.interval-s``,
    ``checkpoint.timeout-s``, ``checkpoint.min-pause-s``, ``checkpoint.max-concurrent``,
    ``checkpoint.retain``, ``checkpoint.tolerable-failures``."""

    interval_s: float = 1.0
    timeout_s: float = 60.0
    min_pause_s: float = 0.0
    max_concurrent: int = 1
    retain: int = 1
    tolerable_failures: int = 3

    KEYS: ClassVar[dict[str, tuple[str, Converter]]] = {
        "checkpoint.interval-s": ("interval_s", float),
        "checkpoint.timeout-s": ("timeout_s", float),
        "checkpoint.min-pause-s": ("min_pause_s", float),
        "checkpoint.max-concurrent": ("max_concurrent", int),
        "checkpoint.retain": ("retain", int),
        "checkpoint.tolerable-failures": ("tolerable_failures", int),
    }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CheckpointOptions:
        """Parse documented dotted keys; unknown keys are a :class:`ConfigError`."""
        return cls(**parse_dotted(cls.KEYS, values, "checkpoint"))

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.min_pause_s < 0:
            raise ConfigError("checkpoint interval and timeout must be > 0, min pause >= 0")
        if self.max_concurrent < 1 or self.retain < 1 or self.tolerable_failures < 0:
            raise ConfigError(
                "checkpoint.max-concurrent and checkpoint.retain must be >= 1, "
                "checkpoint.tolerable-failures >= 0"
            )


def _barrier_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The barrier's cost over every subtask that reported it: the longest alignment and
    start delay, the bytes in flight in total, and whether any subtask went unaligned."""
    out: dict[str, Any] = {}
    for key, name, fold in (
        ("alignment_ms", "alignment_ms_max", max),
        ("start_delay_ms", "start_delay_ms_max", max),
        ("in_flight_bytes", "in_flight_bytes", sum),
        ("unaligned", "unaligned", any),
    ):
        values = [s[key] for s in stats if key in s]
        if values:
            out[name] = fold(values)
    return out


@dataclass(slots=True)
class PendingCheckpoint:
    """A triggered checkpoint waiting for acks. Coordinator thread only."""

    checkpoint_id: int
    triggered_at: float
    kind: str
    acks: dict[TaskId, SubtaskState] = field(default_factory=dict)
    triggered_wall: float = 0.0  # epoch seconds, for the record (``triggered_at`` is the clock's)
    trigger_ms: float = 0.0  # reserving the id, before the barriers were injected
    ack_delay_ms: float = 0.0  # the last ack: sent by its task until this thread took it


@dataclass(frozen=True, slots=True)
class _Ack:
    checkpoint_id: int
    state: SubtaskState
    critical: int | None  # open from its sending until the coordinator thread took it
    sent: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True)
class _Decline:
    checkpoint_id: int
    task: TaskId
    reason: str


# a record's outcome: retention, milliseconds (wall, and the committer thread's CPU),
# the next id reserved, compactions found
_Recorded = tuple[Retention, float, float, int | None, list[RegisteredCompaction]]


@dataclass(frozen=True, slots=True)
class _Committed:
    checkpoint_id: int
    result: Future[_Recorded]


@dataclass(frozen=True, slots=True)
class _SavepointRequest:
    future: Future[CompletedCheckpoint]


def checkpoint_private_files(state: SubtaskState, checkpoint_id: int) -> list[str]:
    """Files of ``state`` that no other checkpoint can ever reference (see module doc)."""
    out: list[str] = []
    for h in state.handles:
        if getattr(h, "PRIVATE_TO_CHECKPOINT", False) and (
            getattr(h, "checkpoint_id", None) == checkpoint_id
        ):
            out.extend(h.files())
    return out


class CheckpointCoordinator:
    """Coordinates the checkpoints of one job attempt.

    Owned by one coordinator thread (the one calling :meth:`tick`, :meth:`trigger`,
    :meth:`trigger_manual`); :meth:`acknowledge`, :meth:`decline` and
    :meth:`request_savepoint` are thread-safe (they only enqueue). Records are written by
    ``committer`` (default: one thread, ``coordinator-commit``, joined by :meth:`close`;
    tests pass an executor they drive), whose results are applied on the next tick.
    ``trigger_tasks(id)`` injects barriers at the sources;
    ``notify_complete(id, last_subsumed_id)`` and ``notify_abort(id, reason)`` reach every
    task. ``before_commit(cp)`` runs right before
    the record is written (a test hook: every file of ``cp`` is durable, nothing recorded).
    ``offer_compactions(found)``, if given, gets the offline compactions not offered yet,
    at each trigger before the barriers are injected, as the transaction that reserved
    the id found them (the previous record's, or the trigger's own when there is no id
    reserved): the tasks adopt them at that barrier without a lookup of their own, and a
    trigger reads nothing when the previous record reserved its id. ``wakeup()`` is
    called (on the calling thread) whenever a message for the next :meth:`tick` was
    queued. The deleter thread (``coordinator-deleter``) is joined
    by :meth:`close`.
    """

    def __init__(
        self,
        store: MetadataStore,
        job_id: str,
        tasks: Sequence[TaskId],
        trigger_tasks: Callable[[int], None],
        notify_complete: Callable[[int, int | None], None],
        notify_abort: Callable[[int, str], None],
        fileio: FileIO,
        options: CheckpointOptions | None = None,
        before_commit: Callable[[CompletedCheckpoint], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        offer_compactions: Callable[[list[RegisteredCompaction]], None] | None = None,
        wakeup: Callable[[], None] = lambda: None,
        committer: Executor | None = None,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.tasks = frozenset(tasks)
        self._trigger_tasks = trigger_tasks
        self._notify_complete = notify_complete
        self._notify_abort = notify_abort
        self._fileio = fileio
        self._before_commit = before_commit
        self._offer_compactions = offer_compactions
        self._compactions_seen = 0  # the highest compaction id offered
        self._wakeup = wakeup
        # ``now`` drives the state machine (monotonic, injectable); records get wall time.
        self._wall_clock = wall_clock
        self.options = options or CheckpointOptions()
        self.pending: dict[int, PendingCheckpoint] = {}
        self.completed: list[CompletedCheckpoint] = []
        self.latest_completed_id = 0
        self.last_triggered_id = 0
        self.aborted: dict[int, str] = {}  # recently aborted id -> reason (late acks)
        self.consecutive_failures = 0
        self._last_trigger: float | None = None
        self._last_completion: float | None = None
        self._previous_files: set[str] | None = None
        self._savepoints: dict[int, Future[CompletedCheckpoint]] = {}
        self._inbox: queue.Queue[_Ack | _Decline | _SavepointRequest | _Committed] = queue.Queue()
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="coordinator-deleter")
        self._committer = committer or ThreadPoolExecutor(
            1, thread_name_prefix="coordinator-commit"
        )
        # checkpoint id -> (pending, record): every ack arrived, the record is being (or
        # waits to be) written, in completion order; ``_recording``: the one being written
        self.committing: dict[int, tuple[PendingCheckpoint, CompletedCheckpoint]] = {}
        self._recording: int | None = None
        self._reserved_id: int | None = None  # reserved with the last record, unused
        self._reserved_found: list[RegisteredCompaction] = []  # ... compactions it found
        self.listeners: list[Callable[[CompletedCheckpoint], None]] = []
        self._slices = contextlib.ExitStack()  # short GIL slices while any is pending
        self._slices_held = False
        self._critical: dict[int, int | None] = {}  # committing id -> its critical section

    def close(self) -> None:
        """Finish outstanding deletions, join the deleter thread, fail open savepoints."""
        self._slices.close()
        self._slices_held = False
        self._committer.shutdown(wait=True)  # a record being written lands (or not)
        for token in self._critical.values():
            close_critical(token)
        self._critical.clear()
        self._deleter.shutdown(wait=True)
        stopped = CheckpointError(f"job {self.job_id} stopped before the savepoint completed")
        for fut in self._savepoints.values():
            fut.set_exception(stopped)
        self._savepoints.clear()
        while True:  # requests that never got triggered
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, _SavepointRequest) and msg.future.set_running_or_notify_cancel():
                msg.future.set_exception(stopped)
            elif isinstance(msg, _Ack):
                close_critical(msg.critical)

    # -- thread-safe entry points -----------------------------------------------------
    def acknowledge(self, checkpoint_id: int, state: SubtaskState) -> None:
        """A task finished its part of ``checkpoint_id``. Any thread.

        The tasks stand aside (:func:`~dstl.gil.critical_section`) from here until the
        coordinator thread took the ack: the barrier's upload closed its section when
        it was written, and the coordinator thread then waited for the GIL and a core
        beside the tasks it freed (ack delay p99 6.3 ms, max 8.9, at 1M keys)."""
        self._post(_Ack(checkpoint_id, state, open_critical(owner=None)))

    def decline(self, checkpoint_id: int, task: TaskId, reason: str) -> None:
        """A task cannot take ``checkpoint_id``; it will be aborted. Any thread."""
        self._post(_Decline(checkpoint_id, task, reason))

    def _post(self, msg: _Ack | _Decline | _Committed) -> None:
        self._inbox.put(msg)
        self._wakeup()

    def request_savepoint(self) -> Future[CompletedCheckpoint]:
        """Ask for a savepoint on the next tick. Any thread.

        The future gets the recorded savepoint, or a :class:`CheckpointError` if it was
        aborted (a savepoint failure does not count towards tolerable failures).
        """
        fut: Future[CompletedCheckpoint] = Future()
        self._inbox.put(_SavepointRequest(fut))
        return fut

    # -- the coordinator thread's steps -------------------------------------------------
    def tick(self, now: float) -> None:
        """Apply acks/declines, expire timed-out checkpoints, trigger if one is due."""
        resume_overdue()  # the bound of a stopped helper holds even if no task runs
        self.drain(now)
        self.expire(now)
        if self._due(now):
            self.trigger(now)

    def expire(self, now: float) -> None:
        """Abort every pending checkpoint older than the timeout."""
        for cp in list(self.pending.values()):
            if now - cp.triggered_at >= self.options.timeout_s:
                self._abort(
                    cp, CheckpointTimeoutError("expired before all tasks acknowledged"), now
                )

    def drain(self, now: float) -> None:
        """Apply every queued ack, decline and savepoint request."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _Ack):
                try:  # the checkpoint's own section is open now, if this was the last
                    self._on_ack(msg, now)
                finally:
                    close_critical(msg.critical)
            elif isinstance(msg, _Committed):
                self._on_committed(msg, now)
            elif isinstance(msg, _SavepointRequest):
                if msg.future.set_running_or_notify_cancel():
                    self._savepoints[self.trigger(now, SAVEPOINT)] = msg.future
            else:
                cp = self.pending.get(msg.checkpoint_id)
                if cp is not None:
                    who = f"{msg.task[0]}/{msg.task[1]}"
                    self._abort(
                        cp, CheckpointDeclinedError(f"declined by {who}: {msg.reason}"), now
                    )

    def _regular_pending(self) -> int:
        return sum(1 for p in self.pending.values() if p.kind == CHECKPOINT)

    def _due(self, now: float) -> bool:
        if self._regular_pending() >= self.options.max_concurrent:
            return False
        if (
            self._last_completion is not None
            and now - self._last_completion < self.options.min_pause_s
        ):
            return False
        return self._last_trigger is None or now - self._last_trigger >= self.options.interval_s

    def trigger(self, now: float, kind: str = CHECKPOINT) -> int:
        """Start a checkpoint now, without pre-checks (see :meth:`tick`, :meth:`trigger_manual`)."""
        if kind not in (CHECKPOINT, SAVEPOINT):
            raise ConfigError(f"unknown checkpoint kind {kind!r}")
        if not self._slices_held:
            # Our own part of a checkpoint is a chain of threads handing work on (the
            # coordinator's commits, the upload thread, the encoder's and the disk's
            # replies, the acks), each waiting for the GIL a busy task thread holds
            # for a whole switch interval (5 ms): short slices until it is recorded.
            self._slices.enter_context(short_gil_slices(CHECKPOINT_GIL_SLICE_S))
            self._slices_held = True
        started, triggered_wall = time.perf_counter(), self._wall_clock()
        reserved, self._reserved_id = self._reserved_id, None
        found, self._reserved_found = self._reserved_found, []
        if reserved is not None:
            # Neither a read nor a write: the commit before reserved the id and looked
            # the compactions up. Should a savepoint (``statectl``) take a higher id and
            # be recorded before this checkpoint, its record is refused (ids increase in
            # record order) and the next trigger reserves anew.
            checkpoint_id = reserved
            found = [c for c in found if c.compaction_id > self._compactions_seen]
        elif self._offer_compactions is None:
            checkpoint_id = self.store.next_checkpoint_id(self.job_id)
        else:
            checkpoint_id, found = self.store.reserve_checkpoint(
                self.job_id, self._compactions_seen
            )
        self.pending[checkpoint_id] = PendingCheckpoint(
            checkpoint_id,
            now,
            kind,
            triggered_wall=triggered_wall,  # before the lookups: they see what came before
            trigger_ms=round((time.perf_counter() - started) * 1e3, 3),
        )
        self.last_triggered_id = checkpoint_id
        if kind == CHECKPOINT:
            self._last_trigger = now
        log.debug("checkpoint triggered id=%d kind=%s", checkpoint_id, kind)
        if found and self._offer_compactions is not None:
            self._compactions_seen = max(c.compaction_id for c in found)
            self._offer_compactions(found)
        self._trigger_tasks(checkpoint_id)
        return checkpoint_id

    def trigger_manual(self, now: float) -> int:
        """A user-triggered checkpoint: ignores interval and min pause, not max concurrent."""
        if self._regular_pending() >= self.options.max_concurrent:
            raise CheckpointTriggerRejectedError(
                f"{self._regular_pending()} checkpoints pending "
                f"(checkpoint.max-concurrent={self.options.max_concurrent})"
            )
        return self.trigger(now)

    def trigger_savepoint(self, now: float) -> int:
        """Start a savepoint now (coordinator thread); see :meth:`request_savepoint`."""
        return self.trigger(now, SAVEPOINT)

    def _on_ack(self, ack: _Ack, now: float) -> None:
        cid = ack.checkpoint_id
        task = (ack.state.operator, ack.state.subtask)
        cp = self.pending.get(cid)
        if task not in self.tasks:
            log.warning("ack from unknown task ignored checkpoint=%d task=%s/%d", cid, *task)
            return
        if cp is None:
            self._on_late_ack(ack)
            return
        if task in cp.acks:
            # Keep the first: the duplicate's files may be shared with it; not deleted.
            log.info("duplicate ack ignored checkpoint=%d task=%s/%d", cid, *task)
            return
        cp.acks[task] = ack.state
        cp.ack_delay_ms = round((time.perf_counter() - ack.sent) * 1e3, 3)
        if len(cp.acks) == len(self.tasks):
            self._complete(cp, now)

    def _on_late_ack(self, ack: _Ack) -> None:
        cid = ack.checkpoint_id
        if cid in self.aborted:
            private = checkpoint_private_files(ack.state, cid)
            log.info("late ack for aborted checkpoint=%d releases %d files", cid, len(private))
            if private:
                self._deleter.submit(self._release_unreferenced, private)
        else:  # completed, or never triggered here: nothing is known to be garbage
            log.info("late or unknown ack ignored checkpoint=%d", cid)

    def _complete(self, cp: PendingCheckpoint, now: float) -> None:
        del self.pending[cp.checkpoint_id]
        states = tuple(cp.acks[t] for t in sorted(cp.acks))
        completed = CompletedCheckpoint(
            self.job_id,
            cp.checkpoint_id,
            cp.kind,
            cp.triggered_wall,
            self._wall_clock(),
            states,
            {},
        )
        try:
            if cp.kind == SAVEPOINT:
                completed = make_self_contained(self._fileio, completed)
        except SavepointError as exc:
            self._abort(cp, exc, now, known_aborted=True)
            return
        stats = self._stats(completed, cp, now)
        completed = CompletedCheckpoint(
            completed.job_id,
            completed.checkpoint_id,
            completed.kind,
            completed.triggered_at,
            completed.completed_at,
            completed.subtasks,
            stats,
        )
        self.committing[cp.checkpoint_id] = (cp, completed)
        # Every ack is in: the rest (the hand-offs to the committer and back, the record,
        # the notifications) is ours alone, and the tasks stand aside until it is done.
        self._critical[cp.checkpoint_id] = open_critical(owner=None)
        self._previous_files = set(completed.files())
        self._record_next()

    def _record_next(self) -> None:
        """Hand the oldest waiting record to the committer unless one is being written:
        one at a time, each after the one before was applied here (so a listener that
        fails the job stops every later record)."""
        if self._recording is not None or not self.committing:
            return
        cid, (_, completed) = next(iter(self.committing.items()))
        self._recording = cid
        record = self._committer.submit(self._record, completed, self._compactions_seen)
        record.add_done_callback(lambda f: self._post(_Committed(cid, f)))

    def _record(self, completed: CompletedCheckpoint, compactions_seen: int) -> _Recorded:
        """The committer thread: write the record (and, in the same transaction, reserve
        the next checkpoint's id and look up compactions registered after
        ``compactions_seen``). Returns them and the milliseconds it took: wall time, and
        this thread's CPU time (the rest is waiting: the disk's sync, the GIL, a core)."""
        if self._before_commit is not None:
            self._before_commit(completed)
        started, cpu = time.perf_counter(), time.thread_time()
        with critical_section():  # the tasks stand aside while it is written
            retention, next_id, found = self.store.record_completed_and_reserve(
                completed, self.options.retain, compactions_seen
            )
        cpu_ms = (time.thread_time() - cpu) * 1e3
        return retention, (time.perf_counter() - started) * 1e3, cpu_ms, next_id, found

    def _on_committed(self, msg: _Committed, now: float) -> None:
        """A record's commit ended: the checkpoint is complete (or its outcome unknown)."""
        cp, completed = self.committing.pop(msg.checkpoint_id)
        self._recording = None
        try:
            retention, record_ms, record_cpu_ms, next_id, found = msg.result.result()
        except RecordSupersededError as exc:  # nothing written: a known abort, no failure
            self._abort(cp, exc, now, count_failure=False)
            self._record_next()
            return
        except MetadataStoreError as exc:
            # Unknown outcome: the commit may have landed. Delete nothing; late acks of
            # this id are not "aborted" either.
            self._abort(cp, exc, now, known_aborted=False)
            self._record_next()
            return
        if next_id is not None and next_id > self.last_triggered_id:
            self._reserved_id, self._reserved_found = next_id, found
        self.completed.append(completed)
        self.latest_completed_id = max(self.latest_completed_id, cp.checkpoint_id)
        if cp.kind == CHECKPOINT:
            self._last_completion = now
            self.consecutive_failures = 0
        subsumed = [p for p in self.pending.values() if p.checkpoint_id < cp.checkpoint_id]
        for older in subsumed:
            self._abort(
                older,
                CheckpointError(f"subsumed by checkpoint {cp.checkpoint_id}"),
                now,
                count_failure=False,
            )
        candidates = [p.checkpoint_id for p in subsumed] + list(retention.removed_ids)
        last_subsumed = max(candidates) if candidates else None
        log.info(
            "checkpoint completed id=%d kind=%s duration_ms=%.1f record_ms=%.3f "
            "record_cpu_ms=%.3f released=%d",
            cp.checkpoint_id,
            cp.kind,
            (now - cp.triggered_at) * 1e3,
            record_ms,
            record_cpu_ms,
            len(retention.released),
        )
        if retention.released:
            self._deleter.submit(self._delete, retention.released)
        if cp.kind == SAVEPOINT:  # the originals of private files were copied: garbage now
            private = [
                f for s in completed.subtasks for f in checkpoint_private_files(s, cp.checkpoint_id)
            ]
            if private:
                self._deleter.submit(self._release_unreferenced, private)
        self._notify_complete(cp.checkpoint_id, last_subsumed)
        fut = self._savepoints.pop(cp.checkpoint_id, None)
        if fut is not None:
            fut.set_result(completed)
        for listener in self.listeners:
            listener(completed)
        close_critical(self._critical.pop(cp.checkpoint_id, None))
        self._record_next()
        self._settled()

    def _settled(self) -> None:
        """Back to the default switch interval once nothing is pending or committing."""
        if self._slices_held and not self.pending and not self.committing:
            self._slices.close()
            self._slices_held = False

    def _stats(
        self, completed: CompletedCheckpoint, cp: PendingCheckpoint, now: float
    ) -> dict[str, Any]:
        if self._previous_files is None:
            latest = self.store.latest(self.job_id)
            self._previous_files = set(latest.files()) if latest is not None else set()
        stats = checkpoint_stats(completed, self._previous_files, (now - cp.triggered_at) * 1e3)
        stats.update(trigger_ms=cp.trigger_ms, ack_delay_ms=cp.ack_delay_ms)
        return stats

    def _abort(
        self,
        cp: PendingCheckpoint,
        error: Exception,
        now: float,
        count_failure: bool = True,
        known_aborted: bool = True,
    ) -> None:
        reason = str(error)
        self.pending.pop(cp.checkpoint_id, None)
        close_critical(self._critical.pop(cp.checkpoint_id, None))
        self._settled()
        log.warning("checkpoint aborted id=%d reason=%s", cp.checkpoint_id, reason)
        if known_aborted:
            self.aborted[cp.checkpoint_id] = reason
            while len(self.aborted) > _REMEMBERED_ABORTS:
                del self.aborted[min(self.aborted)]
            private = [
                f for s in cp.acks.values() for f in checkpoint_private_files(s, cp.checkpoint_id)
            ]
            if private:
                self._deleter.submit(self._release_unreferenced, private)
        self._notify_abort(cp.checkpoint_id, reason)
        fut = self._savepoints.pop(cp.checkpoint_id, None)
        if fut is not None:
            fut.set_exception(
                error if isinstance(error, CheckpointError) else CheckpointError(reason)
            )
            return  # savepoint failures are not checkpoint failures
        if count_failure and cp.kind == CHECKPOINT:
            self.consecutive_failures += 1
            if self.consecutive_failures > self.options.tolerable_failures:
                raise JobFailedError(
                    f"{self.consecutive_failures} consecutive checkpoint failures "
                    f"(checkpoint.tolerable-failures={self.options.tolerable_failures}); "
                    f"last: checkpoint {cp.checkpoint_id} {reason}"
                ) from error

    # -- the deleter thread ---------------------------------------------------------------
    def _release_unreferenced(self, files: list[str]) -> None:
        try:
            garbage = self.store.unreferenced(files)
        except MetadataStoreError as exc:
            log.warning("release skipped (left to the orphan sweep) error=%s", exc)
            return
        self._delete(garbage)

    def _delete(self, files: list[str]) -> None:
        for url, exc in self._fileio.delete_many(files):
            log.warning("release delete failed file=%s error=%s", url, exc)


def checkpoint_stats(
    completed: CompletedCheckpoint, previous: set[str], duration_ms: float
) -> dict[str, Any]:
    """The statistics recorded with a checkpoint: duration, files and bytes, new or shared
    with ``previous`` (the files of the checkpoint before it), every subtask's own, and
    the barrier's cost over them (:func:`_barrier_stats`)."""
    sizes = {r.location: r.size_bytes for r in completed.file_refs()}
    new = {f: n for f, n in sizes.items() if f not in previous}
    return {
        "duration_ms": round(duration_ms, 3),
        "files_total": len(sizes),
        "files_new": len(new),
        "files_shared": len(sizes) - len(new),
        "bytes_total": sum(sizes.values()),
        "bytes_new": sum(new.values()),
        "bytes_shared": sum(sizes.values()) - sum(new.values()),
        "subtask_stats": {
            f"{s.operator}/{s.subtask}": s.stats for s in completed.subtasks if s.stats
        },
        **_barrier_stats([s.stats for s in completed.subtasks if s.stats]),
    }


def run_in_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a named daemon thread (the caller joins it)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
