"""Whole-file uploads (materialized state, channel state, sink transactions) get the
changelog's retries, hedging and byte budget (regression: one failed PUT failed them)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from backends import HeapKeyedStateBackend, KeyGroupRange, ValueStateDescriptor
from backends.serializers import INT64, STR
from dstl.errors import StorageError, TransientStorageError
from dstl.retry import InFlightBudget, RetryPolicy
from dstl.upload import Uploader, attempt_path
from tests.dstl.faults import FaultyFileIO


def test_attempt_names_keep_the_extension() -> None:
    assert attempt_path("a/b/count.kg0000-0010.parquet", 0) == "a/b/count.kg0000-0010.parquet"
    assert attempt_path("a/b/count.kg0000-0010.parquet", 2) == "a/b/count.a2.kg0000-0010.parquet"
    assert attempt_path("x/0000000000000003.jsonl", 1) == "x/0000000000000003.a1.jsonl"
    assert attempt_path("CURRENT", 1) == "CURRENT.a1"


@pytest.fixture
def fio(tmp_path: Path) -> FaultyFileIO:
    return FaultyFileIO(str(tmp_path / "store"))


def test_a_transient_failure_is_retried_under_another_name(fio: FaultyFileIO) -> None:
    fio.script("half", "ok")
    with Uploader(fio, RetryPolicy(max_attempts=3, base_delay_s=0)) as up:
        where = up.upload("m/state.parquet", b"payload" * 10)
    assert where == "m/state.a1.parquet"
    assert [f.path for f in fio.list("m")] == [where]  # the half-written attempt is gone
    assert fio.read(where) == b"payload" * 10


def test_a_permanent_failure_is_raised_and_leaves_nothing(fio: FaultyFileIO) -> None:
    fio.script("fatal")
    with (
        Uploader(fio, RetryPolicy(max_attempts=3, base_delay_s=0)) as up,
        pytest.raises(StorageError),
    ):
        up.upload("m/f", b"x")
    fio.script("transient", "transient", "transient")
    with Uploader(fio, RetryPolicy(max_attempts=3, base_delay_s=0)) as up:
        with pytest.raises(TransientStorageError):
            up.upload("m/g", b"x")
        assert up.budget.used == 0
    assert fio.list("m") == []


def test_uploads_block_on_the_byte_budget(fio: FaultyFileIO) -> None:
    fio.script("stall")
    up = Uploader(fio, RetryPolicy(attempt_timeout_s=None), InFlightBudget(10))
    first = threading.Thread(target=up.upload, args=("a", b"0123456789"))
    first.start()
    assert fio.stalled.wait(10)
    second = threading.Thread(target=up.upload, args=("b", b"x"))
    second.start()
    assert up.budget.wait_for_blocked(1, 10)  # the budget is used up: the second waits
    fio.release.set()
    first.join(10)
    second.join(10)
    up.close()
    assert {f.path for f in fio.list("")} == {"a", "b"}


def test_a_materialization_survives_a_transient_write_failure(fio: FaultyFileIO) -> None:
    from backends import ChangelogKeyedStateBackend, restore_into
    from dstl import ChangelogStorage, FileIO
    from materializer import Materializer

    count = ValueStateDescriptor("count", INT64)
    with ChangelogStorage(FileIO(fio.root_url), "job", "w0") as storage:
        b = ChangelogKeyedStateBackend(
            HeapKeyedStateBackend(STR, KeyGroupRange(0, 128), 128), storage.create_writer("op")
        )
        for i in range(50):
            b.set_current_key(f"k{i}")
            b.get_state(count).update(i)
        b.checkpoint(1).result()
        fio.script("transient")  # the materialization's first file write fails once
        mat = Materializer(b, fio, "job", "op", 0)
        handle = mat.materialize_now()
        mat.close()
        assert any(".a1." in f.location for f in handle.state_files)
        restored = HeapKeyedStateBackend(STR, KeyGroupRange(0, 128), 128)
        restore_into(restored, fio, [b.checkpoint(2).result()])
        restored.set_current_key("k7")
        assert restored.get_state(count).value() == 7


def test_a_local_disk_is_written_on_the_uploading_thread(tmp_path: Path) -> None:
    """Without hedging (a local disk, :attr:`FileIO.hedged`) no attempt goes to a pool
    thread: the materializer's and the changelog's writes run on the threads that upload
    (a hand-off to a pool thread and back cost 2 GIL waits per file beside a busy task)."""
    from dstl import ChangelogStorage

    fio = FaultyFileIO(str(tmp_path / "store"), hedged=False)
    threads: list[str] = []
    write_new = fio.write_new

    def recording(path: str, data: bytes | memoryview) -> None:
        threads.append(threading.current_thread().name)
        write_new(path, data)

    fio.write_new = recording  # type: ignore[method-assign]
    fio.script("transient", "ok")
    with Uploader(fio, RetryPolicy(max_attempts=3, base_delay_s=0)) as up:
        assert up.upload("m/state.parquet", b"payload") == "m/state.a1.parquet"
    assert threads == [threading.current_thread().name] * 2
    threads.clear()
    with ChangelogStorage(fio, "job", "w0") as storage:
        writer = storage.create_writer("a")
        writer.append(0, "s", 1, b"k", None, b"v")
        (handle,) = writer.persist(0, 1).result(timeout=10)
        assert fio.exists(fio.relative(handle.location))
    assert threads and all(t.startswith(("dstl-upload-", "dstl-preempt-")) for t in threads)
