"""The checkpoint coordinator: trigger, pending, acks, completion, subsumption, retention.

It is a thin, synchronous state machine driven by :meth:`CheckpointCoordinator.tick` with
an injected ``now``; acks and declines arrive from any thread through a queue and are
applied on the next tick. A checkpoint completes only when every expected task acked and
its record is committed in the metadata store; then tasks are notified. Files released by
retention are deleted afterwards on a background thread, tolerating "already gone".
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl.errors import ConfigError, JobFailedError, StorageError
from dstl.fileio import FileIO

log = logging.getLogger(__name__)

TaskId = tuple[str, int]


@dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """Checkpointing options. Dotted keys: ``checkpoint.interval-s``, ``checkpoint.timeout-s``,
    ``checkpoint.min-pause-s``, ``checkpoint.max-concurrent``, ``checkpoint.retain``,
    ``checkpoint.tolerable-failures``."""

    interval_s: float = 1.0
    timeout_s: float = 60.0
    min_pause_s: float = 0.0
    max_concurrent: int = 1
    retain: int = 1
    tolerable_failures: int = 3

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.min_pause_s < 0:
            raise ConfigError("checkpoint interval and timeout must be > 0, min pause >= 0")
        if self.max_concurrent < 1 or self.retain < 1 or self.tolerable_failures < 0:
            raise ConfigError("checkpoint.max-concurrent and checkpoint.retain must be >= 1")


@dataclass(slots=True)
class PendingCheckpoint:
    """A triggered checkpoint waiting for acks. Coordinator thread only."""

    checkpoint_id: int
    triggered_at: float
    kind: str
    acks: dict[TaskId, SubtaskState] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Ack:
    checkpoint_id: int
    state: SubtaskState


@dataclass(frozen=True, slots=True)
class _Decline:
    checkpoint_id: int
    task: TaskId
    reason: str


class CheckpointCoordinator:
    """Coordinates the checkpoints of one job attempt.

    Owned by one coordinator thread (the one calling :meth:`tick` / :meth:`trigger`);
    :meth:`acknowledge` and :meth:`decline` are thread-safe. ``trigger_tasks(id)`` injects
    barriers at the sources; ``notify_complete(id)`` / ``notify_abort(id, reason)`` reach
    every task. Ids come from the metadata store, so they increase across restarts.
    """

    def __init__(
        self,
        store: MetadataStore,
        job_id: str,
        tasks: Sequence[TaskId],
        trigger_tasks: Callable[[int], None],
        notify_complete: Callable[[int], None],
        notify_abort: Callable[[int, str], None],
        fileio: FileIO,
        options: CheckpointOptions | None = None,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.tasks = frozenset(tasks)
        self._trigger_tasks = trigger_tasks
        self._notify_complete = notify_complete
        self._notify_abort = notify_abort
        self._fileio = fileio
        self.options = options or CheckpointOptions()
        self.pending: dict[int, PendingCheckpoint] = {}
        self.completed: list[CompletedCheckpoint] = []
        self.latest_completed_id = 0
        self._last_trigger: float | None = None
        self._last_completion: float | None = None
        self._consecutive_failures = 0
        self._inbox: queue.Queue[_Ack | _Decline] = queue.Queue()
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="coordinator-deleter")
        self.listeners: list[Callable[[CompletedCheckpoint], None]] = []

    def close(self) -> None:
        """Finish outstanding deletions and stop the deleter thread."""
        self._deleter.shutdown(wait=True)

    # -- thread-safe entry points -----------------------------------------------------
    def acknowledge(self, checkpoint_id: int, state: SubtaskState) -> None:
        """A task finished its part of ``checkpoint_id``. Any thread."""
        self._inbox.put(_Ack(checkpoint_id, state))

    def decline(self, checkpoint_id: int, task: TaskId, reason: str) -> None:
        """A task cannot take ``checkpoint_id``; it will be aborted. Any thread."""
        self._inbox.put(_Decline(checkpoint_id, task, reason))

    # -- the coordinator thread's steps -------------------------------------------------
    def tick(self, now: float) -> None:
        """Apply acks/declines, expire timed-out checkpoints, trigger if one is due."""
        self.drain(now)
        for cp in list(self.pending.values()):
            if now - cp.triggered_at >= self.options.timeout_s:
                self._abort(cp, "expired before all tasks acknowledged", now)
        if self._due(now):
            self.trigger(now)

    def drain(self, now: float) -> None:
        """Apply every queued ack and decline."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, _Ack):
                self._on_ack(msg, now)
            else:
                cp = self.pending.get(msg.checkpoint_id)
                if cp is not None:
                    self._abort(cp, f"declined by {msg.task[0]}/{msg.task[1]}: {msg.reason}", now)

    def _due(self, now: float) -> bool:
        if len(self.pending) >= self.options.max_concurrent:
            return False
        if (
            self._last_completion is not None
            and now - self._last_completion < self.options.min_pause_s
        ):
            return False
        return self._last_trigger is None or now - self._last_trigger >= self.options.interval_s

    def trigger(self, now: float, kind: str = "checkpoint") -> int:
        """Start a checkpoint now (pre-checks are the caller's: see :meth:`tick`)."""
        checkpoint_id = self.store.next_checkpoint_id(self.job_id)
        self.pending[checkpoint_id] = PendingCheckpoint(checkpoint_id, now, kind)
        self._last_trigger = now
        log.debug("checkpoint triggered id=%d", checkpoint_id)
        self._trigger_tasks(checkpoint_id)
        return checkpoint_id

    def _on_ack(self, ack: _Ack, now: float) -> None:
        cp = self.pending.get(ack.checkpoint_id)
        task = (ack.state.operator, ack.state.subtask)
        if cp is None or task not in self.tasks:
            log.info(
                "late or unknown ack ignored checkpoint=%d task=%s/%d", ack.checkpoint_id, *task
            )
            return
        cp.acks[task] = ack.state  # a duplicate ack replaces the first: same checkpoint, same task
        if len(cp.acks) == len(self.tasks):
            self._complete(cp, now)

    def _complete(self, cp: PendingCheckpoint, now: float) -> None:
        del self.pending[cp.checkpoint_id]
        states = tuple(cp.acks[t] for t in sorted(cp.acks))
        stats = self._stats(states, cp, now)
        completed = CompletedCheckpoint(
            self.job_id, cp.checkpoint_id, cp.kind, cp.triggered_at, now, states, stats
        )
        released = self.store.add_completed(completed, self.options.retain)
        self.completed.append(completed)
        self.latest_completed_id = cp.checkpoint_id
        self._last_completion = now
        self._consecutive_failures = 0
        for older in [p for p in self.pending.values() if p.checkpoint_id < cp.checkpoint_id]:
            self._abort(
                older, f"subsumed by checkpoint {cp.checkpoint_id}", now, count_failure=False
            )
        log.info(
            "checkpoint completed id=%d duration_ms=%.1f released=%d",
            cp.checkpoint_id,
            (now - cp.triggered_at) * 1e3,
            len(released),
        )
        if released:
            self._deleter.submit(self._delete, released)
        self._notify_complete(cp.checkpoint_id)
        for listener in self.listeners:
            listener(completed)

    def _stats(
        self, states: tuple[SubtaskState, ...], cp: PendingCheckpoint, now: float
    ) -> dict[str, Any]:
        previous = set(self.completed[-1].files()) if self.completed else set()
        sizes: dict[str, int] = {}
        for s in states:
            for h in s.handles:
                for f, size in _file_sizes(h):
                    sizes[f] = size
        new = {f: n for f, n in sizes.items() if f not in previous}
        return {
            "duration_ms": round((now - cp.triggered_at) * 1e3, 3),
            "files_total": len(sizes),
            "files_new": len(new),
            "bytes_total": sum(sizes.values()),
            "bytes_new": sum(new.values()),
            "subtask_stats": {f"{s.operator}/{s.subtask}": s.stats for s in states if s.stats},
        }

    def _abort(
        self, cp: PendingCheckpoint, reason: str, now: float, count_failure: bool = True
    ) -> None:
        self.pending.pop(cp.checkpoint_id, None)
        log.warning("checkpoint aborted id=%d reason=%s", cp.checkpoint_id, reason)
        # No file of an aborted checkpoint is deleted here: its changelog segments are
        # shared with later checkpoints; leftovers are the orphan sweep's.
        self._notify_abort(cp.checkpoint_id, reason)
        if count_failure:
            self._consecutive_failures += 1
            if self._consecutive_failures > self.options.tolerable_failures:
                raise JobFailedError(
                    f"{self._consecutive_failures} consecutive checkpoint failures "
                    f"(tolerable: {self.options.tolerable_failures}); last: checkpoint {cp.checkpoint_id} {reason}"
                )

    def _delete(self, files: list[str]) -> None:
        for url in files:
            try:
                self._fileio.delete(self._fileio.relative(url))
            except (StorageError, ConfigError) as exc:
                log.warning("release delete failed file=%s error=%s", url, exc)


def _file_sizes(handle: Any) -> list[tuple[str, int]]:
    """(file, size) pairs of a handle and the handles nested in it."""
    out: list[tuple[str, int]] = []
    size = getattr(handle, "size_bytes", None)
    location = getattr(handle, "location", None)
    if isinstance(location, str) and isinstance(size, int):
        out.append((location, size))
    for name in ("materialized", "changelog", "state_files"):
        for nested in getattr(handle, name, ()) or ():
            out.extend(_file_sizes(nested))
    return out


def run_in_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a named daemon thread (the runtime joins it)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread
