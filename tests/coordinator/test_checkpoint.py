"""The checkpoint coordinator driven step by step with an injected clock (no sleeps).

Every test runs against SQLite and a real PostgreSQL server (``metadata_url``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from coordinator.checkpoint import CheckpointCoordinator, CheckpointOptions
from coordinator.compactions import RegisteredCompaction
from coordinator.errors import CheckpointTriggerRejectedError
from coordinator.handles import ChannelStateHandle, SinkTransactionHandle
from coordinator.metadata import CompletedCheckpoint, MetadataStore, Retention, SubtaskState
from dstl.errors import CheckpointError, JobFailedError, MetadataStoreError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle

JOB = "j"
T = TypeVar("T")
TASKS = [("src", 0), ("op", 0)]


class Inline(Executor):
    """Runs what is submitted at once, on the caller's thread (records commit in the tick
    that completed them)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        f: Future[T] = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            f.set_exception(exc)
        return f


class Held(Executor):
    """Holds what is submitted until :meth:`run` (a commit that takes its time)."""

    def __init__(self) -> None:
        self.queued: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        f: Future[T] = Future()
        self.queued.append((f, lambda: fn(*args, **kwargs)))
        return f

    def run(self) -> None:
        while self.queued:
            f, call = self.queued.pop(0)
            try:
                f.set_result(call())
            except BaseException as exc:
                f.set_exception(exc)


class Harness:
    """A coordinator with fake tasks that record what they were told."""

    def __init__(
        self,
        store: MetadataStore,
        fileio: FileIO,
        options: CheckpointOptions,
        committer: Executor | None = None,
        wakeup: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.fileio = fileio
        self.triggered: list[int] = []
        self.completed: list[tuple[int, int | None]] = []
        self.aborted: list[tuple[int, str]] = []
        self.before_commit: list[CompletedCheckpoint] = []
        store.start_attempt(JOB)
        self.coord = CheckpointCoordinator(
            store,
            JOB,
            TASKS,
            self.triggered.append,
            lambda cid, last: self.completed.append((cid, last)),
            lambda cid, reason: self.aborted.append((cid, reason)),
            fileio,
            options,
            before_commit=self.before_commit.append,
            committer=committer or Inline(),
            wakeup=wakeup,
        )

    def file(self, name: str, data: bytes = b"x" * 10) -> str:
        path = f"jobs/{JOB}/{name}"
        if not self.fileio.exists(path):
            self.fileio.write_new(path, data)
        return path

    def op_state(
        self, cid: int, segments: list[str], extra: tuple[object, ...] = ()
    ) -> SubtaskState:
        logs = tuple(
            ChangelogHandle(self.file(f"changelog/{s}"), 0, "w", i, i + 1, 1, 10)
            for i, s in enumerate(segments)
        )
        return SubtaskState("op", 0, (*logs, *extra), stats={"async_ms": 1.0})

    def ack_all(self, cid: int, segments: list[str], extra: tuple[object, ...] = ()) -> None:
        self.coord.acknowledge(cid, SubtaskState("src", 0, offset=cid * 100))
        self.coord.acknowledge(cid, self.op_state(cid, segments, extra))

    def exists(self, url: str) -> bool:
        return self.fileio.exists(self.fileio.relative(url))


@pytest.fixture
def store(metadata_url: str) -> Iterator[MetadataStore]:
    s = MetadataStore(metadata_url)
    yield s
    s.close()


def _harness(store: MetadataStore, tmp_path: Path, **options: float) -> Harness:
    return Harness(store, FileIO(str(tmp_path / "state")), CheckpointOptions(**options))  # type: ignore[arg-type]


def test_interval_and_min_pause_gate_periodic_triggers(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=1.0, min_pause_s=2.0)
    h.coord.tick(0.0)
    assert h.triggered == [1]
    h.coord.tick(0.9)
    assert h.triggered == [1]  # max concurrent 1 and interval not reached
    h.ack_all(1, ["a"])
    h.coord.tick(0.5)
    assert h.completed == [(1, None)] and h.triggered == [1]
    h.coord.tick(2.4)  # interval passed, but only 1.9 s since the completion
    assert h.triggered == [1]
    h.coord.tick(2.5)
    assert h.triggered == [1, 2]


def test_the_next_checkpoint_runs_while_a_record_commits_and_nothing_is_confirmed_before(
    store: MetadataStore, tmp_path: Path
) -> None:
    held = Held()  # the committer thread, stopped before it writes
    h = Harness(store, FileIO(str(tmp_path / "state")), CheckpointOptions(), held)
    h.coord.tick(0.0)
    h.ack_all(1, ["a"])
    h.coord.tick(0.1)
    assert 1 in h.coord.committing and not h.coord.pending
    h.coord.tick(1.0)  # max-concurrent 1: the checkpoint committing does not hold the next
    assert h.triggered == [1, 2]
    h.ack_all(2, ["a", "b"])
    h.coord.tick(1.1)
    # every ack is in, but nothing is recorded: no task (no sink) was told of a completion
    assert h.completed == [] and h.before_commit == [] and store.latest(JOB) is None
    assert sorted(h.coord.committing) == [1, 2] and h.coord.latest_completed_id == 0
    held.run()  # 1 lands; 2 waits until 1 was applied
    assert [c.checkpoint_id for c in h.before_commit] == [1]
    assert store.latest(JOB).checkpoint_id == 1  # type: ignore[union-attr]
    assert h.completed == []  # applied on the coordinator thread's next tick only
    h.coord.tick(1.2)
    assert h.completed == [(1, None)] and list(h.coord.committing) == [2]
    held.run()
    assert [c.checkpoint_id for c in h.before_commit] == [1, 2]
    h.coord.tick(1.3)
    assert h.completed == [(1, None), (2, 1)] and not h.coord.committing
    h.coord.tick(2.0)  # the id reserved with the last record: no write at the trigger
    assert h.triggered[:2] == [1, 2] and h.triggered[2] > 2
    h.coord.close()


def test_a_savepoint_recorded_above_a_reserved_id_is_never_passed_under(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=1.0)
    h.coord.tick(0.0)
    h.ack_all(1, ["a"])
    h.coord.tick(0.1)  # recorded, and id 2 reserved with the record
    h.coord.tick(1.0)
    assert h.triggered == [1, 2]  # used without a read or a write
    h.ack_all(2, ["a"])
    h.coord.tick(1.1)  # id 3 reserved with the record
    taken = store.next_checkpoint_id(JOB)  # what statectl savepoint does meanwhile ...
    h.coord.tick(2.0)
    assert taken == 4 and h.triggered == [1, 2, 3]
    savepoint = CompletedCheckpoint(JOB, taken, "savepoint", 0.0, 0.0, (h.op_state(4, ["a"]),))
    store.record_savepoint(savepoint)  # ... and its record lands before checkpoint 3's
    h.ack_all(3, ["a", "b"])
    h.coord.tick(2.1)
    # below the savepoint's id: refused, nothing written, neither a failure nor confirmed
    assert h.aborted == [(3, "checkpoint 3 of job j not recorded: 4 is recorded already")]
    assert h.completed == [(1, None), (2, 1)] and h.coord.consecutive_failures == 0
    assert [c.checkpoint_id for c in store.list(JOB)] == [2, 4]
    h.coord.tick(3.0)
    assert h.triggered == [1, 2, 3, 5]  # reserved anew, above the savepoint
    h.ack_all(5, ["a", "b"])
    h.coord.tick(3.1)
    assert h.completed[-1] == (5, 2)
    assert [c.checkpoint_id for c in store.list(JOB)] == [4, 5]
    h.coord.close()


def test_a_taken_savepoint_id_recorded_after_the_checkpoint_below_it_passes(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=1.0)
    h.coord.tick(0.0)
    h.ack_all(1, ["a"])
    h.coord.tick(0.1)  # id 2 reserved with the record
    taken = store.next_checkpoint_id(JOB)
    h.coord.tick(1.0)
    h.ack_all(2, ["a"])
    h.coord.tick(1.1)  # 2 lands before the savepoint's 3: ids still rise in record order
    store.record_savepoint(CompletedCheckpoint(JOB, taken, "savepoint", 0.0, 0.0, ()))
    assert h.triggered == [1, 2] and h.completed == [(1, None), (2, 1)]
    assert [c.checkpoint_id for c in store.list(JOB)] == [2, 3]
    h.coord.close()


def test_acks_and_landed_records_wake_the_coordinator_thread(
    store: MetadataStore, tmp_path: Path
) -> None:
    held = Held()
    woken: list[int] = []
    wake = lambda: woken.append(len(woken))  # noqa: E731
    h = Harness(store, FileIO(str(tmp_path / "state")), CheckpointOptions(), held, wake)
    h.coord.tick(0.0)
    h.ack_all(1, ["a"])
    assert len(woken) == 2  # one per ack: no polling interval before they are applied
    h.coord.tick(0.1)
    held.run()
    assert len(woken) == 3  # the record landed
    h.coord.decline(2, ("op", 0), "no")
    assert len(woken) == 4
    h.coord.close()


def test_max_concurrent_and_subsumption(store: MetadataStore, tmp_path: Path) -> None:
    h = _harness(store, tmp_path, interval_s=1.0, max_concurrent=2, tolerable_failures=0)
    h.coord.tick(0.0)
    h.coord.tick(1.0)
    h.coord.tick(2.0)
    assert h.triggered == [1, 2]
    with pytest.raises(CheckpointTriggerRejectedError, match="max-concurrent=2"):
        h.coord.trigger_manual(2.0)
    h.ack_all(2, ["a"])
    h.coord.drain(2.5)
    # 2 completed; 1 is subsumed (aborted, not a failure: tolerable_failures=0 did not trip)
    assert h.completed == [(2, 1)]
    assert h.aborted == [(1, "subsumed by checkpoint 2")]
    assert h.coord.consecutive_failures == 0 and not h.coord.pending
    # a manual trigger ignores interval and min pause
    assert h.coord.trigger_manual(2.5) == 3


def test_timeout_aborts_and_a_late_ack_releases_only_private_files(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, timeout_s=5.0, interval_s=100.0)
    h.coord.tick(0.0)
    h.coord.tick(4.9)
    assert h.aborted == []
    h.coord.tick(5.0)
    assert h.aborted == [(1, "expired before all tasks acknowledged")]
    assert h.coord.consecutive_failures == 1
    # The late ack references: a changelog segment (reused by the writer's next
    # checkpoint), a staged sink transaction (committed with the next checkpoint) and
    # channel state (private to checkpoint 1). Only the last may go.
    channel = ChannelStateHandle(h.file("channel-state/op/0000/1.bin"), 1, "op", 0, 3, 10)
    sink = SinkTransactionHandle(h.file("sink/out/0000/1.jsonl"), 1, 0, 3, 10)
    h.ack_all(1, ["seg-1"], (channel, sink))
    h.coord.tick(5.1)
    h.coord.close()  # joins the deleter
    assert not h.exists(channel.location)
    assert h.exists(sink.location)
    assert h.exists(f"jobs/{JOB}/changelog/seg-1")
    assert h.completed == []


def test_decline_aborts_notifies_and_later_acks_are_late(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=100.0)
    h.coord.tick(0.0)
    h.coord.acknowledge(1, SubtaskState("src", 0, offset=1))
    h.coord.decline(1, ("op", 0), "disk full")
    h.coord.tick(0.1)
    assert h.aborted == [(1, "declined by op/0: disk full")]
    h.coord.acknowledge(1, h.op_state(1, ["a"]))
    h.coord.tick(0.2)
    assert h.completed == [] and store.latest(JOB) is None


def test_duplicate_and_unknown_acks_are_ignored(store: MetadataStore, tmp_path: Path) -> None:
    h = _harness(store, tmp_path, interval_s=100.0)
    h.coord.tick(0.0)
    h.coord.acknowledge(1, SubtaskState("src", 0, offset=7))
    h.coord.acknowledge(1, SubtaskState("src", 0, offset=8))  # duplicate: first one wins
    h.coord.acknowledge(1, SubtaskState("stranger", 3))
    h.coord.tick(0.1)
    assert h.completed == [] and 1 in h.coord.pending
    h.coord.acknowledge(1, h.op_state(1, ["a"]))
    h.coord.tick(0.2)
    latest = store.latest(JOB)
    assert latest is not None and latest.source_offsets == {"src/0": 7}


def test_tolerable_failures_then_the_job_fails(store: MetadataStore, tmp_path: Path) -> None:
    h = _harness(store, tmp_path, interval_s=1.0, tolerable_failures=2)
    for t in (0.0, 1.0):
        h.coord.tick(t)
        h.coord.decline(h.triggered[-1], ("op", 0), "boom")
    h.coord.tick(2.0)  # applies the second decline, triggers 3
    assert h.coord.consecutive_failures == 2
    h.ack_all(3, ["a"])  # a completion resets the count
    h.coord.tick(2.5)
    assert h.coord.consecutive_failures == 0
    for t in (3.5, 4.5, 5.5):
        h.coord.tick(t)
        h.coord.decline(h.triggered[-1], ("op", 0), "boom")
    with pytest.raises(
        JobFailedError, match=r"3 consecutive checkpoint failures.*tolerable-failures=2.*boom"
    ):
        h.coord.tick(6.5)


def test_retention_keeps_last_n_and_deletes_released_files_after_commit(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=1.0, retain=2)
    segments = {1: ["s1", "shared"], 2: ["s2", "shared"], 3: ["s3", "shared"], 4: ["s4"]}
    gone_early = h.file("changelog/s2")
    for cid, segs in segments.items():
        h.coord.tick(float(cid))
        h.ack_all(cid, segs)
        if cid == 4:
            h.fileio.delete(h.fileio.relative(gone_early))  # already gone: tolerated
        h.coord.tick(cid + 0.5)
    h.coord.close()
    assert [c.checkpoint_id for c in store.list(JOB)] == [3, 4]
    assert [c for c, _ in h.completed] == [1, 2, 3, 4]
    assert h.completed[2] == (3, 1) and h.completed[3] == (4, 2)
    url = h.fileio.url
    assert not h.exists(url(f"jobs/{JOB}/changelog/s1"))
    assert h.exists(url(f"jobs/{JOB}/changelog/shared"))  # still referenced by 3
    assert h.exists(url(f"jobs/{JOB}/changelog/s3"))
    # the hook saw every checkpoint before its record existed; statistics are recorded
    assert [c.checkpoint_id for c in h.before_commit] == [1, 2, 3, 4]
    stats = store.get(JOB, 4).stats
    assert stats["files_total"] == 1 and stats["files_new"] == 1 and stats["bytes_new"] == 10
    stats3 = store.get(JOB, 3).stats
    assert stats3["files_new"] == 1 and stats3["files_shared"] == 1
    assert stats3["bytes_total"] == 20 and stats3["bytes_shared"] == 10
    assert stats3["duration_ms"] == 500.0
    assert stats3["subtask_stats"] == {"op/0": {"async_ms": 1.0}}


def test_restart_continues_ids_and_never_reuses_aborted_ones(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=1.0, timeout_s=0.5)
    h.coord.tick(0.0)
    h.ack_all(1, ["a"])
    h.coord.tick(0.1)
    h.coord.tick(1.0)  # 2 triggered, then expires
    h.coord.tick(1.6)
    h.coord.close()
    assert h.triggered == [1, 2] and h.aborted[0][0] == 2
    reopened = MetadataStore(store.url)
    h2 = Harness(reopened, h.fileio, CheckpointOptions(interval_s=1.0))
    h2.coord.tick(100.0)
    assert h2.triggered == [3]
    h2.ack_all(3, ["a", "b"])
    h2.coord.tick(100.1)
    assert h2.completed == [(3, 1)]
    # the restarted coordinator's statistics compare with the restored checkpoint
    assert reopened.get(JOB, 3).stats["files_new"] == 1
    h2.coord.close()
    reopened.close()


def test_savepoint_is_self_contained_and_survives_retention(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=1.0, retain=1)
    future = h.coord.request_savepoint()
    h.coord.tick(0.0)  # the savepoint (id 1) and a periodic checkpoint (id 2)
    assert h.triggered == [1, 2]
    sink = SinkTransactionHandle(h.file("sink/out/0000/1.jsonl", b"[1]\n"), 1, 0, 1, 4)
    h.ack_all(1, ["seg-a"], (sink,))
    h.coord.tick(0.1)
    sp = future.result(timeout=0)
    assert sp.kind == "savepoint" and sp.checkpoint_id == 1
    # 2 was triggered before 1 completed: a savepoint does not subsume it
    assert 2 in h.coord.pending
    files = sp.files()
    assert files and all(f.startswith(f"savepoints/{JOB}/{1:016x}/") for f in files)
    op = sp.states_of("op")[0]
    assert op.handles[0].location.endswith(f"savepoints/{JOB}/{1:016x}/jobs/{JOB}/changelog/seg-a")
    assert store.get(JOB, 1).files() == files  # the record points at the copies
    for cid in (2, 3, 4):  # retention of later checkpoints never removes the savepoint
        if cid not in h.coord.pending:
            h.coord.tick(float(cid))
        h.ack_all(cid, [f"seg-{cid}"])
        h.coord.tick(cid + 0.5)
    h.coord.close()
    assert [c.checkpoint_id for c in store.list(JOB)] == [1, 4]
    h.fileio.delete_tree(f"jobs/{JOB}")  # the job's own files are gone
    assert all(h.exists(f) for f in files)
    assert h.fileio.read(h.fileio.relative(files[-1])) == b"[1]\n"


def test_savepoint_failure_is_reported_and_not_a_checkpoint_failure(
    store: MetadataStore, tmp_path: Path
) -> None:
    h = _harness(store, tmp_path, interval_s=100.0, tolerable_failures=0)
    future = h.coord.request_savepoint()
    h.coord.tick(0.0)
    missing = ChangelogHandle(f"jobs/{JOB}/changelog/never-written", 0, "w", 0, 1, 1, 1)
    h.coord.acknowledge(1, SubtaskState("src", 0, offset=0))
    h.coord.acknowledge(1, SubtaskState("op", 0, (missing,)))
    h.coord.tick(0.1)  # no JobFailedError although tolerable_failures=0
    with pytest.raises(CheckpointError, match="savepoint 1"):
        future.result(timeout=0)
    assert store.latest(JOB) is None
    assert not h.fileio.exists(f"savepoints/{JOB}/{1:016x}")


class _CommitLandsButReportsFailure(MetadataStore):
    """A store whose commit lands and then reports an error: an unknown outcome."""

    fail = True

    def record_completed_and_reserve(
        self, checkpoint: CompletedCheckpoint, retain: int, compactions_after: int = 0
    ) -> tuple[Retention, int, list[RegisteredCompaction]]:
        result = super().record_completed_and_reserve(checkpoint, retain, compactions_after)
        if self.fail:
            raise MetadataStoreError("connection lost after COMMIT was sent")
        return result


def test_unknown_commit_outcome_deletes_nothing(metadata_url: str, tmp_path: Path) -> None:
    store = _CommitLandsButReportsFailure(metadata_url)
    h = _harness(store, tmp_path, interval_s=100.0)
    h.coord.tick(0.0)
    channel = ChannelStateHandle(h.file("channel-state/op/0000/1.bin"), 1, "op", 0, 3, 10)
    h.ack_all(1, ["seg-1"], (channel,))
    h.coord.tick(0.1)
    assert h.completed == [] and h.aborted and h.aborted[0][0] == 1
    assert h.coord.consecutive_failures == 1
    h.ack_all(1, ["seg-1"], (channel,))  # a late ack of the unknown checkpoint
    h.coord.tick(0.2)
    h.coord.close()
    assert h.exists(channel.location)  # the record did land and references it
    assert store.get(JOB, 1).files() == [
        f"jobs/{JOB}/changelog/seg-1",
        channel.location,
    ]
    store.close()


def test_close_fails_savepoints_that_did_not_complete(store: MetadataStore, tmp_path: Path) -> None:
    h = _harness(store, tmp_path, interval_s=100.0)
    triggered = h.coord.request_savepoint()
    h.coord.tick(0.0)
    never_triggered = h.coord.request_savepoint()
    h.coord.close()
    for fut in (triggered, never_triggered):
        with pytest.raises(CheckpointError, match="stopped before the savepoint completed"):
            fut.result(timeout=0)


def test_records_carry_wall_clock_times_not_the_injected_clock(
    store: MetadataStore, tmp_path: Path
) -> None:
    # Regression: records stored the monotonic clock, so statectl showed 1970 dates.
    import time

    h = _harness(store, tmp_path, interval_s=1.0)
    before = time.time()
    h.coord.tick(5.0)  # the injected clock is far from epoch time
    (cid,) = h.triggered
    h.ack_all(cid, ["a"])
    h.coord.tick(5.2)
    latest = store.latest(JOB)
    assert latest is not None
    assert before - 1 <= latest.triggered_at <= latest.completed_at <= time.time() + 1
    assert latest.stats["duration_ms"] == pytest.approx(200.0)


def test_the_tasks_stand_aside_from_the_last_ack_until_the_record_is_applied(
    store: MetadataStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What follows the last ack is ours alone (dstl.gil critical sections): the hand-off
    to the committer, the metadata commit and the notifications. Task threads wait at
    their next batch until it is applied, instead of sharing the GIL with it."""
    from dstl import gil

    held = Held()
    h = Harness(store, FileIO(str(tmp_path / "state")), CheckpointOptions(), committer=held)
    real = store.record_completed_and_reserve
    open_during: list[int] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        open_during.append(len(gil._critical))
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "record_completed_and_reserve", record)
    h.coord.tick(0.0)
    h.coord.acknowledge(1, SubtaskState("src", 0, offset=100))
    assert [owner for owner, _ in gil._critical.values()] == [None]  # until it is taken
    h.coord.tick(0.1)
    assert not gil._critical  # an ack is missing: nothing of ours to wait for yet
    h.coord.acknowledge(1, h.op_state(1, ["a"]))
    h.coord.tick(0.2)
    assert [owner for owner, _ in gil._critical.values()] == [None]  # every task waits
    held.run()
    assert open_during == [2]  # the record's own section inside the checkpoint's
    h.coord.tick(0.3)
    assert h.completed == [(1, None)] and not gil._critical  # applied: closed


def test_an_ack_never_taken_closes_its_critical_section_at_close(
    store: MetadataStore, tmp_path: Path
) -> None:
    from dstl import gil

    h = _harness(store, tmp_path)
    h.coord.tick(0.0)
    h.coord.acknowledge(1, SubtaskState("src", 0, offset=100))
    assert gil._critical
    h.coord.close()
    assert not gil._critical


def test_a_record_that_fails_closes_its_critical_section(
    store: MetadataStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dstl import gil

    h = _harness(store, tmp_path)

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise MetadataStoreError("the database went away")

    monkeypatch.setattr(store, "record_completed_and_reserve", fail)
    h.coord.tick(0.0)
    h.ack_all(1, ["a"])
    h.coord.tick(0.1)
    h.coord.tick(0.2)
    assert [cid for cid, _ in h.aborted] == [1] and not gil._critical
