"""Segment tracking and release (the rule in dstl.tracking), driven step by step.

The storage runs without its thread (``start_thread=False``): each ``drain_once()`` writes
one segment or performs queued deletions, so every test controls exactly what is in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dstl import ChangelogStorage, ChangelogWriter, FileIO, read_changes
from dstl.changelog import ChangelogOptions
from dstl.errors import StateBackendError
from dstl.tracking import SegmentTracker


@pytest.fixture
def storage(fileio: FileIO) -> Iterator[ChangelogStorage]:
    st = ChangelogStorage(fileio, "job", "w0", ChangelogOptions(), start_thread=False)
    yield st
    st.close()


def _segments(fileio: FileIO) -> list[str]:
    return [fileio.relative(f.path) for f in fileio.list("jobs/job/changelog")]


def _drain(storage: ChangelogStorage) -> None:
    while not storage._queue.empty():
        storage.drain_once(block=False)


def _change(w: ChangelogWriter, value: bytes) -> None:
    w.append(0, "s", 1, b"k", None, value)


def test_truncated_unclaimed_segment_is_deleted(fileio: FileIO, storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    _change(w, b"1")
    fut = w.persist(0, 1)
    _drain(storage)
    (h1,) = fut.result()
    w.reset(1)  # checkpoint 1 aborted: its claim is gone
    assert _segments(fileio) == [fileio.relative(h1.location)]
    w.truncate(w.next_sqn())  # materialized: nobody needs [0, 1) any more
    _drain(storage)
    assert _segments(fileio) == []
    assert storage.segments_deleted == 1 and storage.tracked_segments() == {}


def test_pending_checkpoint_keeps_its_segment_until_reset(
    fileio: FileIO, storage: ChangelogStorage
) -> None:
    w = storage.create_writer("a")
    _change(w, b"1")
    fut = w.persist(0, 7)
    _drain(storage)
    (h,) = fut.result()
    w.truncate(w.next_sqn())
    _drain(storage)
    assert _segments(fileio) == [fileio.relative(h.location)]  # checkpoint 7 may still need it
    assert [t.num_rows for t in read_changes(fileio, (h,))] == [1]
    w.reset(7)
    _drain(storage)
    assert _segments(fileio) == []


def test_confirmed_segment_is_never_deleted_by_the_dstl(
    fileio: FileIO, storage: ChangelogStorage
) -> None:
    w = storage.create_writer("a")
    _change(w, b"1")
    fut = w.persist(0, 3)
    _drain(storage)
    (h,) = fut.result()
    w.confirm(3)
    path = fileio.relative(h.location)
    assert storage.tracked_segments() == {path: True}  # handed over to the coordinator
    w.truncate(w.next_sqn())
    w.reset(3)  # a late abort of a confirmed checkpoint changes nothing
    _drain(storage)
    assert _segments(fileio) == [path]
    assert storage.tracked_segments() == {}  # released from tracking, bytes kept


def test_shared_segment_waits_for_every_writer(fileio: FileIO, storage: ChangelogStorage) -> None:
    a, b = storage.create_writer("a"), storage.create_writer("b")
    _change(a, b"a")
    _change(b, b"b")
    fa, fb = a.persist(0, 1), b.persist(0, 1)
    _drain(storage)
    assert fa.result()[0].location == fb.result()[0].location  # one segment, two blocks
    a.reset(1)
    b.reset(1)
    a.truncate(a.next_sqn())
    _drain(storage)
    assert len(_segments(fileio)) == 1  # b still needs its block
    b.truncate(b.next_sqn())
    _drain(storage)
    assert _segments(fileio) == []


def test_segment_truncated_while_in_flight_is_deleted_on_arrival(
    fileio: FileIO, tmp_path: Path
) -> None:
    opts = ChangelogOptions(preemptive_persist_bytes=100)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as storage:
        w = storage.create_writer("a")
        _change(w, b"x" * 200)  # pre-emptive upload, not claimed by any checkpoint
        w.truncate(w.next_sqn())  # while it is still queued
        _drain(storage)
        assert storage.segments_written == 1
        assert _segments(fileio) == []


def test_in_flight_persist_protects_its_segment(fileio: FileIO, storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    _change(w, b"1")
    fut = w.persist(0, 9)  # claimed while the upload is still queued
    w.truncate(w.next_sqn())
    _drain(storage)
    (h,) = fut.result()
    assert _segments(fileio) == [fileio.relative(h.location)]
    assert [t.num_rows for t in read_changes(fileio, (h,))] == [1]


def test_unconfirmed_segments_survive_close(fileio: FileIO) -> None:
    storage = ChangelogStorage(fileio, "job", "w0", start_thread=False)
    w = storage.create_writer("a")
    _change(w, b"1")
    fut = w.persist(0, 1)  # never confirmed nor reset: unknown outcome
    storage.close()  # uploads what is queued, deletes nothing
    (h,) = fut.result()
    w.truncate(w.next_sqn())
    assert _segments(fileio) == [fileio.relative(h.location)]


def test_persist_below_the_truncation_point_is_refused(storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    _change(w, b"1")
    w.truncate(w.next_sqn())
    with pytest.raises(StateBackendError, match="truncated"):
        w.persist(0, 1)


def test_tracker_failed_upload_drops_claims() -> None:
    tracker = SegmentTracker()
    tracker.submitted("a", 0, 1)
    tracker.claim("a", 5, [0])
    tracker.upload_failed([("a", 0, 1)])  # checkpoint 5's persist failed with it
    tracker.submitted("a", 0, 1)  # the next persist uploads it again
    assert tracker.uploaded("seg-2", [("a", 0, 1)]) == []
    assert tracker.truncate("a", 1) == ["seg-2"]
