"""Fault injection: a FileIO that fails, stalls, or writes half a file.

Invariants checked: every completed persist reads back exactly; a failed persist raises
UploadFailedError; no returned handle references a missing or partial file; nothing is
left behind but complete segments.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from dstl import ChangelogStorage, read_changes
from dstl.changelog import ChangelogOptions
from dstl.errors import StorageError, TransientStorageError, UploadFailedError
from dstl.handles import ChangelogHandle
from dstl.retry import ManualClock
from dstl.segment import SegmentReader
from tests.dstl.faults import FaultyFileIO

NO_WAIT = {"upload_retry_delay_s": 0.0, "upload_attempt_timeout_s": None}


@pytest.fixture
def fio(tmp_path: Path) -> FaultyFileIO:
    return FaultyFileIO(str(tmp_path))


def _values(fio: FaultyFileIO, handles: tuple[ChangelogHandle, ...], from_sqn: int) -> list[bytes]:
    return [v for t in read_changes(fio, handles, from_sqn) for v in t["value"].to_pylist()]


def _per_key(fio: FaultyFileIO, handles: tuple[ChangelogHandle, ...]) -> dict[int, list[bytes]]:
    """Each key group's values, in the order read (a segment groups a block's rows by key
    group: only the order of each key's changes is kept)."""
    out: dict[int, list[bytes]] = {}
    for t in read_changes(fio, handles, 0):
        for kg, v in zip(t["key_group"].to_pylist(), t["value"].to_pylist(), strict=True):
            out.setdefault(kg, []).append(v)
    return out


def _assert_only_complete_segments(fio: FaultyFileIO) -> None:
    for info in fio.list("jobs"):
        SegmentReader(fio.read(fio.relative(info.path)), info.path)  # parses: not partial
        assert not info.path.endswith(".tmp")


def test_random_faults_never_lose_or_corrupt_a_completed_persist(fio: FaultyFileIO) -> None:
    rng = random.Random(1580)
    opts = ChangelogOptions(upload_max_attempts=3, preemptive_persist_bytes=2_000, **NO_WAIT)
    storage = ChangelogStorage(fio, "job", "w0", opts, start_thread=False)
    writers = [storage.create_writer(f"w{i}") for i in range(4)]
    expected: dict[str, dict[int, list[bytes]]] = {w.writer_id: {} for w in writers}
    referenced: set[str] = set()
    failures = successes = 0
    for checkpoint in range(1, 41):
        fio.script(*rng.choices(["ok", "transient", "half", "oserror", "fatal"], k=4))
        for w in writers:
            for _ in range(rng.randrange(0, 30)):
                value = f"{w.writer_id}-{rng.random()}".encode() * rng.randrange(1, 4)
                kg = rng.randrange(8)
                w.append(kg, "s", 1, b"k%d" % kg, None, value)
                expected[w.writer_id].setdefault(kg, []).append(value)
        futures = [(w, w.persist(0, checkpoint)) for w in writers]
        while not storage._queue.empty():
            storage.drain_once(block=False)
        for w, fut in futures:
            exc = fut.exception()
            if exc is not None:
                assert isinstance(exc, UploadFailedError), exc
                assert isinstance(exc.__cause__, StorageError)
                failures += 1
                continue
            successes += 1
            handles = fut.result()
            assert _per_key(fio, handles) == expected[w.writer_id]
            for h in handles:
                assert fio.exists(fio.relative(h.location))
                assert fio.size(fio.relative(h.location)) == h.size_bytes
                referenced.add(fio.relative(h.location))
    storage.close()
    assert failures > 0 and successes > 0  # the plan exercised both paths
    _assert_only_complete_segments(fio)
    # every file on disk is a segment some persist returned (losers and halves were deleted)
    assert {fio.relative(f.path) for f in fio.list("jobs")} <= referenced


def test_failed_persist_is_a_clear_error_and_the_next_one_recovers(fio: FaultyFileIO) -> None:
    fio.script("transient", "half", "transient")
    opts = ChangelogOptions(upload_max_attempts=3, **NO_WAIT)
    with ChangelogStorage(fio, "job", "w0", opts) as storage:
        w = storage.create_writer("a")
        w.append(0, "s", 1, b"k", None, b"v1")
        with pytest.raises(UploadFailedError, match="after 3 attempt") as info:
            w.persist(0, 1).result(timeout=30)
        assert info.value.attempts == 3
        assert isinstance(info.value.__cause__, TransientStorageError)
        w.append(0, "s", 1, b"k", None, b"v2")
        handles = w.persist(0, 2).result(timeout=30)
    assert _values(fio, handles, 0) == [b"v1", b"v2"]
    _assert_only_complete_segments(fio)


def test_raw_library_errors_are_translated(fio: FaultyFileIO) -> None:
    fio.script("oserror")
    opts = ChangelogOptions(upload_max_attempts=1, **NO_WAIT)
    with ChangelogStorage(fio, "job", "w0", opts) as storage:
        w = storage.create_writer("a")
        w.append(0, "s", 1, b"k", None, b"v")
        with pytest.raises(UploadFailedError, match="disk full") as info:
            w.persist(0, 1).result(timeout=30)
    assert isinstance(info.value.__cause__, StorageError)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def stalled_storage(fio: FaultyFileIO, clock: ManualClock) -> Iterator[ChangelogStorage]:
    opts = ChangelogOptions(upload_attempt_timeout_s=5.0, batch_delay_s=0.0)
    storage = ChangelogStorage(fio, "job", "w0", opts, clock=clock)
    try:
        yield storage
    finally:
        fio.release.set()  # never leave a stalled attempt behind
        storage.close()


def test_stalled_upload_is_hedged_and_the_loser_deleted(
    fio: FaultyFileIO, clock: ManualClock, stalled_storage: ChangelogStorage
) -> None:
    fio.script("stall")
    w = stalled_storage.create_writer("a")
    w.append(0, "s", 1, b"k", None, b"v")
    fut = w.persist(0, 1)
    assert fio.stalled.wait(10)
    assert clock.wait_for_sleeper() == pytest.approx(5.0)
    clock.advance(5.0)
    (handle,) = fut.result(timeout=10)  # the hedged attempt won
    stalled_path, hedged_path = (p for p, _ in fio.writes)
    assert fio.relative(handle.location) == hedged_path
    fio.release.set()
    stalled_storage.close()  # joins the attempt pool: the late attempt has finished
    assert [fio.relative(f.path) for f in fio.list("jobs")] == [hedged_path]
    assert stalled_path in fio.deleted
    assert _values(fio, (handle,), 0) == [b"v"]


def test_backpressure_blocks_appends_until_uploads_catch_up(fio: FaultyFileIO) -> None:
    fio.script("stall")
    opts = ChangelogOptions(
        preemptive_persist_bytes=1_000, in_flight_max_bytes=3_000, batch_delay_s=0.0
    )
    with ChangelogStorage(fio, "job", "w0", opts) as storage:
        w = storage.create_writer("a")
        done = threading.Event()
        result: Future[tuple[ChangelogHandle, ...]] = Future()

        def task() -> None:  # the task thread: keeps appending
            for i in range(20):
                w.append(0, "s", 1, b"k", None, bytes([i]) * 600)
            result.set_result(w.persist(0, 1).result(timeout=30))
            done.set()

        t = threading.Thread(target=task, name="test-task")
        t.start()
        assert fio.stalled.wait(10)
        assert storage.budget.wait_for_blocked(1, 10)  # appends block, nothing fails
        assert not done.is_set()
        assert storage.budget.used <= opts.in_flight_max_bytes
        fio.release.set()
        t.join(30)
        assert done.is_set()
        handles = result.result()
    assert _values(fio, handles, 0) == [bytes([i]) * 600 for i in range(20)]
