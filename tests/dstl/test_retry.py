"""RetryPolicy, HedgedWrite and InFlightBudget, driven by a ManualClock and Events."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from dstl.changelog import ChangelogOptions
from dstl.errors import ConfigError, StorageError, TransientStorageError
from dstl.fileio import FileIO
from dstl.retry import HedgedWrite, InFlightBudget, ManualClock, RetryPolicy
from tests.dstl.faults import FaultyFileIO


def test_retry_policy_backs_off_and_gives_up() -> None:
    policy = RetryPolicy(max_attempts=4, base_delay_s=0.1, max_delay_s=0.25)
    transient = TransientStorageError("slow down")
    assert policy.next_delay(1, transient) == pytest.approx(0.1)
    assert policy.next_delay(2, transient) == pytest.approx(0.2)
    assert policy.next_delay(3, transient) == pytest.approx(0.25)  # capped
    assert policy.next_delay(4, transient) is None  # bounded attempts
    assert policy.next_delay(1, StorageError("access denied")) is None  # not retryable
    assert policy.next_delay(1, ValueError("bug")) is None
    assert policy.may_hedge(1) and not policy.may_hedge(4)
    assert not RetryPolicy(attempt_timeout_s=None).may_hedge(1)


def test_retry_options_parse_from_dotted_keys() -> None:
    opts = ChangelogOptions.from_dict(
        {
            "dstl.upload.max-attempts": "5",
            "dstl.upload.attempt-timeout-s": "none",
            "dstl.upload.retry-delay-s": "0.5",
            "dstl.upload.retry-max-delay-s": 3,
        }
    )
    assert opts.retry_policy() == RetryPolicy(5, 0.5, 3.0, None)
    with pytest.raises(ConfigError, match="unknown"):
        ChangelogOptions.from_dict({"dstl.upload.retries": 1})
    with pytest.raises(ConfigError):
        ChangelogOptions.from_dict({"dstl.upload.max-attempts": 0})


@pytest.fixture
def fio(tmp_path: Path) -> FaultyFileIO:
    return FaultyFileIO(str(tmp_path))


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(4, thread_name_prefix="test-attempt")
    yield pool
    pool.shutdown(wait=True)


def _hedged(
    fio: FaultyFileIO, policy: RetryPolicy, clock: ManualClock, pool: ThreadPoolExecutor
) -> HedgedWrite:
    names = iter(f"seg/{i:04d}" for i in range(100))
    return HedgedWrite(
        fio.write_new, fio.delete, lambda: next(names), b"payload" * 100, policy, clock, pool
    )


def _run_in_thread(write: HedgedWrite) -> Future[str]:
    result: Future[str] = Future()

    def body() -> None:
        try:
            result.set_result(write.run())
        except BaseException as exc:
            result.set_exception(exc)

    threading.Thread(target=body, name="test-hedged-driver").start()
    return result


def test_transient_errors_are_retried_after_the_policy_delay(
    fio: FaultyFileIO, executor: ThreadPoolExecutor
) -> None:
    clock = ManualClock()
    fio.script("half", "transient", "ok")
    policy = RetryPolicy(max_attempts=3, base_delay_s=1.0, max_delay_s=10, attempt_timeout_s=None)
    write = _hedged(fio, policy, clock, executor)
    result = _run_in_thread(write)
    assert clock.wait_for_sleeper() == pytest.approx(1.0)  # waits 1 s after the first failure
    assert not result.done()
    clock.advance(1.0)
    assert clock.wait_for_sleeper() == pytest.approx(3.0)  # then 2 s more
    clock.advance(2.0)
    assert result.result(timeout=10) == "seg/0002"
    assert write.attempts == 3
    executor.shutdown(wait=True)
    # the half-written file of attempt 0 is gone; only the winner remains
    assert [f.path.rsplit("/", 1)[1] for f in fio.list("seg")] == ["0002"]
    assert fio.read("seg/0002") == b"payload" * 100


def test_gives_up_after_max_attempts_and_deletes_partial_files(
    fio: FaultyFileIO, executor: ThreadPoolExecutor
) -> None:
    fio.script("half", "half", "half")
    policy = RetryPolicy(max_attempts=3, base_delay_s=0, attempt_timeout_s=None)
    write = _hedged(fio, policy, ManualClock(), executor)
    with pytest.raises(TransientStorageError, match="half the bytes"):
        write.run()
    assert write.attempts == 3
    assert fio.list("seg") == []


def test_permanent_error_is_not_retried(fio: FaultyFileIO, executor: ThreadPoolExecutor) -> None:
    fio.script("fatal")
    write = _hedged(fio, RetryPolicy(max_attempts=5, base_delay_s=0), ManualClock(), executor)
    with pytest.raises(StorageError, match="access denied"):
        write.run()
    assert write.attempts == 1


def test_slow_attempt_is_hedged_and_the_late_loser_deleted(
    fio: FaultyFileIO, executor: ThreadPoolExecutor
) -> None:
    clock = ManualClock()
    fio.script("stall", "ok")
    policy = RetryPolicy(max_attempts=3, attempt_timeout_s=5.0)
    write = _hedged(fio, policy, clock, executor)
    result = _run_in_thread(write)
    assert fio.stalled.wait(10)
    assert clock.wait_for_sleeper() == pytest.approx(5.0)  # the per-attempt timeout
    clock.advance(5.0)
    assert result.result(timeout=10) == "seg/0001"  # the hedge won
    assert fio.exists("seg/0001") and not fio.exists("seg/0000")
    fio.release.set()  # the first attempt now lands late...
    executor.shutdown(wait=True)
    assert [f.path.rsplit("/", 1)[1] for f in fio.list("seg")] == ["0001"]  # ...and is deleted
    assert "seg/0000" in fio.deleted


def test_first_success_wins_even_if_it_is_the_slow_one(
    fio: FaultyFileIO, executor: ThreadPoolExecutor
) -> None:
    clock = ManualClock()
    fio.script("stall", "stall")  # both attempts stall; whichever finishes first wins
    write = _hedged(fio, RetryPolicy(max_attempts=2, attempt_timeout_s=1.0), clock, executor)
    result = _run_in_thread(write)
    assert clock.wait_for_sleeper() == pytest.approx(1.0)
    clock.advance(1.0)
    assert fio.wait_for_writes(2)
    assert not result.done()  # never fails for slowness: no more attempts, keeps waiting
    fio.release.set()
    winner = result.result(timeout=10)
    executor.shutdown(wait=True)
    assert [f.path for f in fio.list("seg")] == [winner]


def test_without_an_executor_attempts_run_on_the_driving_thread_one_after_another(
    tmp_path: Path,
) -> None:
    """A store whose writes are not hedged (a local disk): each attempt runs on the thread
    that drives the write, so the write costs no hand-off to a pool thread and back; a
    transient failure is still retried (after the policy's delay), under a fresh name, and
    the half-written file of the failed attempt is deleted. A stall is waited out: nothing
    can run beside it."""
    fio = FaultyFileIO(str(tmp_path), hedged=False)
    threads: list[str] = []
    write_new = fio.write_new

    def recording(path: str, data: bytes | memoryview) -> None:
        threads.append(threading.current_thread().name)
        write_new(path, data)

    clock = ManualClock()
    fio.script("half", "stall", "ok")
    names = iter(f"seg/{i:04d}" for i in range(100))
    policy = RetryPolicy(max_attempts=3, base_delay_s=1.0, attempt_timeout_s=5.0)
    write = HedgedWrite(
        recording, fio.delete, lambda: next(names), b"payload" * 100, policy, clock, None
    )
    result = _run_in_thread(write)
    assert clock.wait_for_sleeper() == pytest.approx(1.0)  # the retry delay, on this thread
    clock.advance(1.0)
    assert fio.stalled.wait(10)
    clock.advance(10.0)  # past the attempt timeout: no hedge starts (no thread to run it)
    assert not result.done() and fio.writes[-1] == ("seg/0001", "stall")
    fio.release.set()
    assert result.result(timeout=10) == "seg/0001"
    assert write.attempts == 2
    assert threads == ["test-hedged-driver", "test-hedged-driver"]
    assert [f.path.rsplit("/", 1)[1] for f in fio.list("seg")] == ["0001"]
    assert fio.read("seg/0001") == b"payload" * 100


def test_only_an_object_store_hedges_its_writes(tmp_path: Path) -> None:
    assert not FileIO(str(tmp_path)).hedged
    assert not FileIO("memory://hedged-test").hedged
    assert FileIO("s3://bucket/prefix").hedged


def test_budget_blocks_until_released_and_never_fails() -> None:
    budget = InFlightBudget(100)
    budget.acquire(60)
    acquired = threading.Event()

    def second() -> None:
        budget.acquire(60)
        acquired.set()

    t = threading.Thread(target=second, name="test-budget")
    t.start()
    assert budget.wait_for_blocked(1, 10)
    assert not acquired.is_set()
    budget.release(60)
    t.join(10)
    assert acquired.is_set() and budget.used == 60
    budget.release(60)
    budget.acquire(500)  # bigger than the whole budget: admitted alone, never stuck
    assert budget.used == 500
