"""Periodic materialization: jitter, skips, failure budget, thread hand-off. No sleeps."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dstl.errors import ConfigError, StateBackendError
from dstl.fileio import FileIO
from materializer import (
    MaterializationFailuresExceededError,
    MaterializationOptions,
    MaterializationScheduler,
    Materializer,
)
from tests.materializer.fakes import FailingFileIO, LocalFilesBackend, ManualExecutor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _setup(
    tmp_path: Path, fileio: FileIO | None = None, failures: int = 3
) -> tuple[LocalFilesBackend, MaterializationScheduler, ManualExecutor, Clock]:
    local = tmp_path / "db"
    local.mkdir(exist_ok=True)
    backend = LocalFilesBackend(str(local))
    backend.write("sst-1", b"x" * 100)
    backend.live = ["sst-1"]
    clock = Clock()
    mat = Materializer(backend, fileio or FileIO(str(tmp_path / "store")), "job", "op", 0, clock)
    executor = ManualExecutor()
    sched = MaterializationScheduler(
        mat,
        MaterializationOptions(interval_s=10.0, max_consecutive_failures=failures),
        clock=clock,
        rng=lambda: 0.5,
        executor=executor,
    )
    return backend, sched, executor, clock


def test_first_run_is_jittered_then_periodic(tmp_path: Path) -> None:
    backend, sched, executor, _clock = _setup(tmp_path)
    assert sched.next_due == 1000.0 + 10.0 * 0.75  # rng 0.5 -> 3/4 of the interval
    assert not sched.tick(1007.4)
    assert sched.tick(1007.5)
    assert sched.in_flight and sched.next_due == 1017.5
    assert sched.poll() is None  # the upload has not run yet
    executor.run_all()
    result = sched.poll()
    assert result is not None and backend.base == (result.handle,)
    assert not sched.in_flight and sched.applied == 1
    assert sched.last_applied == result.stats


def test_jitter_spreads_the_first_run(tmp_path: Path) -> None:
    _, sched_lo, _, _ = _setup(tmp_path)
    mat = sched_lo.materializer
    sched_hi = MaterializationScheduler(
        mat, MaterializationOptions(interval_s=10.0), clock=lambda: 0.0, rng=lambda: 0.999
    )
    sched_zero = MaterializationScheduler(
        mat, MaterializationOptions(interval_s=10.0), clock=lambda: 0.0, rng=lambda: 0.0
    )
    with sched_hi, sched_zero:
        assert sched_zero.next_due == 5.0
        assert 9.99 < sched_hi.next_due < 10.0


def test_skipped_while_in_flight_and_until_applied(tmp_path: Path) -> None:
    backend, sched, executor, _clock = _setup(tmp_path)
    assert sched.tick(1010.0)
    assert not sched.tick(1020.0)  # previous still uploading
    assert sched.skipped_in_flight == 1
    executor.run_all()
    assert not sched.tick(1030.0)  # uploaded but not yet applied (poll not called)
    assert sched.skipped_in_flight == 2
    assert sched.poll() is not None
    backend.changed = True
    assert sched.tick(1040.0)


def test_skipped_when_nothing_changed(tmp_path: Path) -> None:
    backend, sched, _executor, _clock = _setup(tmp_path)
    backend.changed = False
    assert not sched.tick(1010.0)
    assert sched.skipped_unchanged == 1 and sched.next_due == 1020.0
    backend.changed = True
    assert sched.tick(1020.0)


def test_failure_budget_fails_the_task(tmp_path: Path) -> None:
    failing = FailingFileIO(str(tmp_path / "store"), fail_on=0)
    backend, sched, executor, _clock = _setup(tmp_path, failing, failures=3)
    now = 1010.0
    # two failures, then a success resets the count
    for _ in range(2):
        failing.fail_on = failing.calls + 1
        assert sched.tick(now)
        executor.run_all()
        assert sched.poll() is None
        now += 10
    assert sched.consecutive_failures == 2 and backend.base == ()
    assert sched.tick(now)
    executor.run_all()
    assert sched.poll() is not None and sched.consecutive_failures == 0
    backend.changed = True
    # three in a row: the third raises a clear error, and keeps raising
    for i in range(3):
        now += 10
        backend.write("sst-1", f"version {i}".encode())  # a new file to upload
        failing.fail_on = failing.calls + 1
        assert sched.tick(now)
        executor.run_all()
        if i < 2:
            assert sched.poll() is None
    with pytest.raises(MaterializationFailuresExceededError, match="3 times in a row") as info:
        sched.poll()
    assert isinstance(info.value, StateBackendError)
    assert info.value.failures == 3
    with pytest.raises(MaterializationFailuresExceededError):
        sched.tick(now + 100)


def test_snapshot_failure_counts_against_the_budget(tmp_path: Path) -> None:
    backend, sched, _executor, _clock = _setup(tmp_path, failures=1)

    def broken() -> None:
        raise OSError("disk gone")

    backend.snapshot_for_materialization = broken  # type: ignore[assignment,method-assign]
    with pytest.raises(MaterializationFailuresExceededError, match="disk gone"):
        sched.tick(1010.0)


def test_owned_thread_is_named_and_results_come_back_to_the_task_thread(
    tmp_path: Path,
) -> None:
    """Uploads and the deletes of released files run on the named thread; results are
    applied on the task thread."""
    local = tmp_path / "db"
    local.mkdir()
    backend = LocalFilesBackend(str(local))
    backend.write("sst-1", b"x")
    backend.live = ["sst-1"]
    clock = Clock()
    ready = threading.Event()
    upload_threads: list[str] = []
    mat = Materializer(backend, FileIO(str(tmp_path / "store")), "job", "op", 0, clock)
    original = mat.upload_result

    def spy(mat_id, snap):  # type: ignore[no-untyped-def]
        upload_threads.append(threading.current_thread().name)
        return original(mat_id, snap)

    mat.upload_result = spy  # type: ignore[method-assign]
    delete_threads: list[str] = []
    deleted = mat.delete_files

    def delete_spy(urls: list[str]) -> None:
        delete_threads.append(threading.current_thread().name)
        deleted(urls)

    mat.delete_files = delete_spy  # type: ignore[method-assign]
    with MaterializationScheduler(
        mat,
        MaterializationOptions(interval_s=1.0),
        clock=clock,
        rng=lambda: 0.0,
        name="op-0",
        on_ready=ready.set,
    ) as sched:
        clock.now += 1
        assert sched.run_once() is None  # starts one
        assert ready.wait(30)
        result = sched.poll()
        assert result is not None and backend.base == (result.handle,)
        ready.clear()
        backend.write("sst-2", b"y")
        backend.live = ["sst-2"]
        backend.changed = True
        clock.now += 1
        assert sched.run_once() is None  # starts the second
        assert ready.wait(30)
        assert sched.poll() is not None  # releases the first base: nothing claims it
        assert sched.released_files == 1
    assert upload_threads[0].startswith("materialize-op-0")
    assert delete_threads[0].startswith("materialize-op-0")
    assert not mat.fileio.exists(mat.fileio.relative(result.new_files[0]))
    assert not any(t.name.startswith("materialize-op-0") for t in threading.enumerate())


def test_close_discards_an_unapplied_result(tmp_path: Path) -> None:
    backend, sched, executor, _clock = _setup(tmp_path)
    assert sched.tick(1010.0)
    executor.run_all()
    fileio = sched.materializer.fileio
    assert fileio.list("jobs/job/materialized")
    sched.close()
    assert fileio.list("jobs/job/materialized") == []  # nothing references them
    assert backend.base == ()
    with pytest.raises(ConfigError):
        sched.tick(2000.0)


def test_options_from_dotted_keys() -> None:
    opts = MaterializationOptions.from_dict(
        {"materialization.interval-s": "2.5", "materialization.max-consecutive-failures": 5}
    )
    assert opts == MaterializationOptions(2.5, 5)
    assert MaterializationOptions.from_dict({"materialization.max-log-ratio": "0"}) == (
        MaterializationOptions(max_log_ratio=0.0)
    )
    with pytest.raises(ConfigError):
        MaterializationOptions(max_log_ratio=-0.1)
    with pytest.raises(ConfigError, match="unknown"):
        MaterializationOptions.from_dict({"materialization.intervall": 1})
    with pytest.raises(ConfigError):
        MaterializationOptions(interval_s=0)


@pytest.mark.parametrize(
    ("store_ratio", "option", "starts"),
    [(None, None, False), (0.2, None, True), (0.2, 0.4, False), (None, 0.2, True)],
)
def test_the_size_bound_takes_the_stores_own_ratio_unless_one_is_set(
    tmp_path: Path, store_ratio: float | None, option: float | None, starts: bool
) -> None:
    """A log of 0.3x the (minimum) base starts a materialization before its interval
    only under a ratio of 0.2: the store's own (``max_log_ratio``, the RocksDB store's)
    when the option is unset, the option's when set; 0.4 when neither names one."""
    from materializer.scheduler import DEFAULT_MAX_LOG_RATIO, MIN_BASE_BYTES

    backend = LocalFilesBackend(str(tmp_path))
    backend.write("sst-1", b"x" * 100)
    backend.live = ["sst-1"]
    if store_ratio is not None:
        backend.max_log_ratio = store_ratio  # type: ignore[attr-defined]
    clock = Clock()
    executor = ManualExecutor()
    sched = MaterializationScheduler(
        Materializer(backend, FileIO(str(tmp_path / "store")), "job", "op", 0, clock),
        MaterializationOptions(interval_s=100.0, max_log_ratio=option),
        clock=clock,
        rng=lambda: 0.5,
        executor=executor,
    )
    expected = option if option is not None else store_ratio or DEFAULT_MAX_LOG_RATIO
    assert sched.max_log_ratio == expected
    backend.log = int(0.3 * MIN_BASE_BYTES)
    assert sched.tick(clock.now + 1.0) is starts  # the interval is far away
    assert sched.size_triggered == int(starts)
    executor.run_all()
    sched.close()


def test_the_log_is_looked_at_right_after_a_base_is_applied(tmp_path: Path) -> None:
    """Materializations back to back: the log written while one ran is over the bound
    when it is applied, and the next starts at the same tick, not a size check later."""
    from materializer.scheduler import MIN_BASE_BYTES, SIZE_CHECK_S

    backend = LocalFilesBackend(str(tmp_path))
    backend.write("sst-1", b"x" * 100)
    backend.live = ["sst-1"]
    clock = Clock()
    executor = ManualExecutor()
    sched = MaterializationScheduler(
        Materializer(backend, FileIO(str(tmp_path / "store")), "job", "op", 0, clock),
        MaterializationOptions(interval_s=100.0, max_log_ratio=0.4),
        clock=clock,
        rng=lambda: 0.5,
        executor=executor,
    )
    backend.log = MIN_BASE_BYTES
    clock.now += 1.0
    assert sched.tick(clock.now)  # the bound, far before the interval
    clock.now += SIZE_CHECK_S / 10
    assert not sched.tick(clock.now)  # in flight
    executor.run_all()
    clock.now += SIZE_CHECK_S / 10  # still within the last check's SIZE_CHECK_S
    assert sched.poll() is not None  # applied; the log written meanwhile is over the bound
    backend.changed = True
    assert sched.tick(clock.now)
    assert sched.size_triggered == 2
    executor.run_all()
    backend.log = 0
    clock.now += SIZE_CHECK_S / 10
    assert sched.poll() is not None
    backend.changed = True
    assert not sched.tick(clock.now)  # a log under the bound waits
    backend.log = MIN_BASE_BYTES
    assert not sched.tick(clock.now + SIZE_CHECK_S / 2)  # looked at: not again so soon
    assert sched.tick(clock.now + SIZE_CHECK_S)
    executor.run_all()
    sched.close()


def _materialize(sched: MaterializationScheduler, executor: ManualExecutor, clock: Clock) -> object:
    clock.now = sched.next_due
    assert sched.tick(clock.now)
    executor.run_all()
    result = sched.poll()
    assert result is not None
    return result


def test_unreferenced_bases_are_released_claimed_ones_kept(tmp_path: Path) -> None:
    backend, sched, executor, clock = _setup(tmp_path)
    store = FileIO(str(tmp_path / "store"))
    backend.changed = True
    first = _materialize(sched, executor, clock)
    sched.on_barrier(7)  # checkpoint 7 references the first base while it is pending
    backend.write("sst-2", b"y" * 100)
    backend.live = ["sst-2"]
    backend.changed = True
    second = _materialize(sched, executor, clock)
    (old_file,) = first.new_files  # type: ignore[attr-defined]
    assert store.exists(store.relative(old_file)), "claimed by a pending checkpoint"
    sched.on_checkpoint_aborted(7)
    assert store.exists(store.relative(old_file)), "deleted on the executor, not the task"
    executor.run_all()
    assert not store.exists(store.relative(old_file)), "released once the claim is gone"
    # A base a completed checkpoint holds is left to the metadata store's reference counts.
    sched.on_barrier(8)
    sched.on_checkpoint_complete(8)
    backend.write("sst-3", b"z" * 100)
    backend.live = ["sst-3"]
    backend.changed = True
    _materialize(sched, executor, clock)
    (kept,) = second.new_files  # type: ignore[attr-defined]
    assert store.exists(store.relative(kept))
    sched.close()


def test_a_file_shared_by_unreferenced_bases_is_released_with_the_last(tmp_path: Path) -> None:
    """sst-1, uploaded by base 1 and shared by base 2, goes when base 2 is replaced too.

    Regression: releasing base 1 kept sst-1 (base 2 shared it) and forgot it; releasing
    base 2 deleted only base 2's own new files, so sst-1 stayed until an orphan sweep.
    """
    backend, sched, executor, clock = _setup(tmp_path)
    store = FileIO(str(tmp_path / "store"))
    backend.changed = True
    first = _materialize(sched, executor, clock)
    (shared,) = first.new_files  # type: ignore[attr-defined]
    backend.write("sst-2", b"y" * 100)
    backend.live = ["sst-1", "sst-2"]
    backend.changed = True
    second = _materialize(sched, executor, clock)
    assert shared in second.handle.files()  # type: ignore[attr-defined]
    assert store.exists(store.relative(shared)), "the current base shares it"
    backend.write("sst-3", b"z" * 100)
    backend.live = ["sst-3"]
    backend.changed = True
    third = _materialize(sched, executor, clock)
    executor.run_all()
    gone = [*first.new_files, *second.new_files]  # type: ignore[attr-defined]
    assert [f for f in gone if store.exists(store.relative(f))] == []
    assert all(store.exists(store.relative(f)) for f in third.handle.files())  # type: ignore[attr-defined]
    sched.close()  # the last base: referenced by nothing either
    assert [f for f in third.handle.files() if store.exists(store.relative(f))] == []  # type: ignore[attr-defined]


def test_a_due_snapshot_waits_for_the_backend_to_prepare_it(tmp_path: Path) -> None:
    """A backend that prepares its snapshot off the task thread (RocksDB: a background
    memtable flush) is asked each tick once due, and the snapshot is taken at the first
    tick it is ready, with the period kept; not asked when nothing would be taken."""
    backend, sched, executor, _clock = _setup(tmp_path)
    answers = [False, False, True]
    asked: list[int] = []

    def prepare() -> bool:
        asked.append(1)
        return answers.pop(0)

    backend.prepare_materialization = prepare  # type: ignore[attr-defined]
    assert not sched.tick(1007.0)  # not due: not asked
    assert asked == []
    assert not sched.tick(1007.5) and not sched.tick(1007.6)
    assert not sched.in_flight and sched.next_due == 1007.5
    assert sched.tick(1007.7)
    assert len(asked) == 3 and sched.in_flight and sched.next_due == 1017.7
    assert not sched.tick(1017.7)  # in flight: skipped without asking
    assert len(asked) == 3 and sched.skipped_in_flight == 1
    executor.run_all()
    assert sched.poll() is not None
    backend.changed = False
    assert not sched.tick(1027.7)  # unchanged: skipped without asking
    assert len(asked) == 3 and sched.skipped_unchanged == 1
