"""The changelog writer and storage: sequence ranges, batching, corruption detection."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import pyarrow as pa
import pytest

from dstl import ChangelogStorage, FileIO, read_changes
from dstl.buffer import ChangeBuffer
from dstl.changelog import ChangelogOptions, _Lane, _pending, _Request, _segments
from dstl.encoder import EncodedSegment, PendingBlock, SegmentEncoder, encode_here
from dstl.errors import ConfigError, CorruptionError, StateBackendError, StorageConflictError
from dstl.handles import ChangelogHandle, handle_from_json, handle_to_json
from tests.dstl.faults import STALL_LIMIT_S, FaultyFileIO


@pytest.fixture
def storage(fileio: FileIO) -> Iterator[ChangelogStorage]:
    with ChangelogStorage(fileio, "job", "w0", ChangelogOptions(batch_delay_s=0.05)) as st:
        yield st


def _rows(fileio: FileIO, handles: tuple[ChangelogHandle, ...], from_sqn: int = 0) -> list[bytes]:
    return [v for t in read_changes(fileio, handles, from_sqn) for v in t["value"].to_pylist()]


def test_persist_covers_from_sqn_without_gaps(fileio: FileIO, storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    w.append(0, "s", 1, b"k", None, b"v1")
    first = w.persist(0, 1).result()
    w.append(0, "s", 1, b"k", None, b"v2")
    second = w.persist(0, 2).result()
    assert second[0] == first[0]
    assert [(h.sqn_start, h.sqn_end) for h in second] == [(0, 1), (1, 2)]
    assert _rows(fileio, second) == [b"v1", b"v2"]
    assert _rows(fileio, second, from_sqn=1) == [b"v2"]
    boundary = w.next_sqn()
    assert w.persist(boundary, 3).result() == ()


def test_writers_share_one_segment_per_upload(fileio: FileIO, storage: ChangelogStorage) -> None:
    writers = [storage.create_writer(f"w{i}") for i in range(16)]
    for i, w in enumerate(writers):
        w.append(i, "s", 1, b"k", None, str(i).encode())
    futures = [w.persist(0, 1) for w in writers]
    handles = [f.result()[0] for f in futures]
    assert len({h.location for h in handles}) < 16  # batched into few files
    for i, h in enumerate(handles):
        assert _rows(fileio, (h,)) == [str(i).encode()]


def test_handles_round_trip_json(fileio: FileIO, storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    w.append(3, "s", 1, b"k", b"uk", b"v")
    (h,) = w.persist(0, 1).result()
    assert handle_from_json(handle_to_json(h)) == h


def test_truncated_segment_is_named_in_the_error(fileio: FileIO, storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    w.append(3, "s", 1, b"k", None, b"v" * 1000)
    (h,) = w.persist(0, 1).result()
    path = fileio.relative(h.location)
    data = fileio.read(path)
    fileio.delete(path)
    fileio.write_new(path, data[: len(data) // 2])
    with pytest.raises(CorruptionError, match=path.split("/")[-1]):
        list(read_changes(fileio, (h,)))


def test_write_new_never_overwrites(fileio: FileIO) -> None:
    fileio.write_new("x/a", b"1")
    with pytest.raises(StorageConflictError):
        fileio.write_new("x/a", b"2")
    assert fileio.read("x/a") == b"1"


def test_failed_upload_is_retried_by_the_next_persist(fileio: FileIO) -> None:
    class Flaky(FileIO):
        fail = True

        def write_new(self, path: str, data: bytes | memoryview) -> None:
            if Flaky.fail:
                Flaky.fail = False
                raise OSError("disk full")
            super().write_new(path, data)

    flaky = Flaky(fileio.root_url)
    with ChangelogStorage(flaky, "job", "w0") as st:
        w = st.create_writer("a")
        w.append(0, "s", 1, b"k", None, b"v")
        with pytest.raises(Exception, match="disk full"):
            w.persist(0, 1).result()
        handles = w.persist(0, 2).result()
    assert _rows(fileio, handles) == [b"v"]
    assert isinstance(pa.table({"a": [1]}), pa.Table)


def test_sixteen_writers_produce_one_segment_per_batch(fileio: FileIO) -> None:
    with ChangelogStorage(fileio, "job", "w0", start_thread=False) as st:
        writers = [st.create_writer(f"w{i}") for i in range(16)]
        for checkpoint in (1, 2):
            for i, w in enumerate(writers):
                w.append(i, "s", 1, b"k", None, f"{checkpoint}-{i}".encode())
            futures = [w.persist(w.next_sqn() - 1, checkpoint) for w in writers]
            st.drain_once(block=False)  # one upload batch
            handles = [f.result(timeout=10)[0] for f in futures]
            assert len({h.location for h in handles}) == 1  # ONE segment, not one per writer
            assert [h.block for h in handles] == list(range(16))
            for i, h in enumerate(handles):
                assert _rows(fileio, (h,)) == [f"{checkpoint}-{i}".encode()]
        assert st.segments_written == 2
        assert st.upload_attempts == 2
    assert len(fileio.list("jobs/job/changelog")) == 2


def test_a_batch_holding_every_open_writer_closes_without_waiting(fileio: FileIO) -> None:
    # A sharing window of a minute: a batch that waited for it would hold the drain.
    opts = ChangelogOptions(batch_delay_s=60.0)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        a, b = st.create_writer("a"), st.create_writer("b")
        st.create_writer("gone").close()  # a closed writer is waited for no longer
        for w in (a, b):
            w.append(0, "s", 1, b"k", None, w.writer_id.encode())
        futures = [w.persist(0, 1) for w in (a, b)]
        drain = threading.Thread(target=st.drain_once, kwargs={"block": True})
        drain.start()
        drain.join(timeout=30)
        assert not drain.is_alive(), "the batch waited for the sharing window"
        ha, hb = (f.result(timeout=0)[0] for f in futures)
        assert ha.location == hb.location and (ha.block, hb.block) == (0, 1)  # still shared
        timings = b.last_persist_timings()
        for step in (
            "persist_queue_ms",
            "persist_window_ms",
            "encode_ms",
            "encode_cpu_ms",
            "write_ms",
        ):
            assert timings[step] >= 0
        assert timings["segment_blocks"] == 2


def test_a_persists_small_batch_is_encoded_here_a_preemptive_one_by_the_helper(
    fileio: FileIO,
) -> None:
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        helper = st._encoder = SegmentEncoder()  # not started: counts what asks for it
        try:
            w = st.create_writer("a")
            w.append(0, "s", 1, b"k", None, b"v" * 100)
            future = w.persist(0, 1)
            st.drain_once(block=False)
            assert future.result(timeout=0) and helper.started == 0  # no round trip
            for _ in range(60):  # over the threshold: uploaded beside the task
                w.append(0, "s", 1, b"k", None, b"v" * 100)
            st.drain_once(block=False)
            assert helper.started == 1
            second = w.persist(0, 2)
            while not st._queue.empty():
                st.drain_once(block=False)
            assert _rows(fileio, second.result(timeout=0)) == [b"v" * 100] * 61
        finally:
            helper.close()


def test_a_bug_in_a_persists_upload_fails_it_and_the_thread_goes_on(
    fileio: FileIO, storage: ChangelogStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a storage or data error: the persist fails with it (no wait until a timeout),
    and the next persist uploads as usual."""
    from dstl import changelog as changelog_mod

    def broken(blocks: list[PendingBlock], grouped: bool = True) -> EncodedSegment:
        raise RuntimeError("a bug")

    w = storage.create_writer("a")
    w.append(0, "s", 1, b"k", None, b"v1")
    with monkeypatch.context() as patch:
        patch.setattr(changelog_mod, "_encoded_here", broken)
        with pytest.raises(RuntimeError, match="a bug"):
            w.persist(0, 1).result(timeout=30)
    assert _rows(fileio, w.persist(0, 2).result(timeout=30)) == [b"v1"]


def test_only_an_upload_a_persist_waits_for_runs_in_a_critical_section(
    fileio: FileIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tasks stand aside (dstl.gil) for a barrier's segment, not for the uploads
    that run beside them between barriers."""
    from dstl import changelog as changelog_module
    from dstl import gil

    sections: list[int] = []  # segments written when each section opened
    real = changelog_module.critical_section

    @contextlib.contextmanager
    def recorded() -> Iterator[None]:
        sections.append(st.segments_written)
        with real():
            yield

    monkeypatch.setattr(changelog_module, "critical_section", recorded)
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        w = st.create_writer("a")
        for _ in range(60):  # over the threshold: a pre-emptive upload
            w.append(0, "s", 1, b"k", None, b"v" * 100)
        st.drain_once(block=False)
        assert st.segments_written == 1 and not sections
        w.append(0, "s", 1, b"k", None, b"tail")
        future = w.persist(0, 1)
        # open from the persist on, for every task thread (the persisting one too): the
        # uploads queued before the barrier's are on its path as well
        assert [owner for owner, _ in gil._critical.values()] == [None]
        st.drain_once(block=False)
        assert future.result(timeout=0) and st.segments_written == 2
        assert sections == [1]  # the barrier's upload, the second one
        assert not gil._critical  # closed once it is written


def test_preemptive_persist_uploads_above_the_threshold(fileio: FileIO) -> None:
    opts = ChangelogOptions(preemptive_persist_bytes=10_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        w = st.create_writer("a")
        for i in range(9):
            w.append(0, "s", 1, b"k", None, bytes([i]) * 1_000)
        assert st._queue.empty()  # below the threshold: nothing uploaded yet
        w.append(0, "s", 1, b"k", None, b"\xff" * 1_000)
        assert not st._queue.empty()  # crossed it: handed to the uploader at once
        st.drain_once(block=False)
        assert st.segments_written == 1
        w.append(0, "s", 1, b"k", None, b"tail")
        fut = w.persist(0, 1)
        st.drain_once(block=False)  # the checkpoint only uploads the small tail
        handles = fut.result(timeout=10)
        assert st.segments_written == 2
        assert [h.rows for h in handles] == [10, 1]
        assert handles[1].size_bytes < handles[0].size_bytes
        assert _rows(fileio, handles)[-1] == b"tail"


def test_uploaded_changes_are_not_kept_until_the_next_checkpoint(fileio: FileIO) -> None:
    """Between checkpoints, pre-emptive uploads must not pile up in memory; a failed one
    is kept (the next persist sends it again), a successful one is not needed."""
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        w = st.create_writer("a")
        for round_ in range(3):
            for i in range(5):
                w.append(0, "s", 1, b"k", None, bytes([round_, i]) * 500)
            assert w._uploads[-1].changes is not None  # just submitted: not durable yet
            st.drain_once(block=False)
        # each submit lets go of the uploads finished before it
        assert [u.changes is None for u in w._uploads] == [True, True, False]
        w.append(0, "s", 1, b"k", None, b"tail")
        fut = w.persist(0, 1)
        st.drain_once(block=False)
        handles = fut.result(timeout=10)
        assert [h.rows for h in handles] == [5, 5, 5, 1]
        assert _rows(fileio, handles)[-1] == b"tail"


def test_closing_a_writer_lets_go_of_its_changes_and_finishes_its_uploads(
    fileio: FileIO,
) -> None:
    """A closed writer holds no change buffers (a task's teardown must free them, not a
    later garbage collection), yet an upload it started still completes."""
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        w = st.create_writer("a")
        for i in range(5):
            w.append(0, "s", 1, b"k", None, bytes([i]) * 1000)  # the fifth submits
        w.append(0, "s", 1, b"k", None, b"buffered")
        fut = w._uploads[0].future
        w.close()
        assert len(w._buffer) == 0 and [u.changes for u in w._uploads] == [None]
        with pytest.raises(StateBackendError, match="closed"):
            w.persist(0, 1)
        st.drain_once(block=False)
        assert fut.result(timeout=10).rows == 5


def test_options_from_dotted_keys() -> None:
    opts = ChangelogOptions.from_dict(
        {"dstl.batch.delay-s": "0.5", "dstl.in-flight.max-bytes": 1024}
    )
    assert opts.batch_delay_s == 0.5 and opts.in_flight_max_bytes == 1024
    with pytest.raises(ConfigError, match="unknown changelog option"):
        ChangelogOptions.from_dict({"dstl.nope": 1})
    with pytest.raises(ConfigError, match="cannot parse"):
        ChangelogOptions.from_dict({"dstl.batch.max-bytes": "lots"})


def test_truncate_drops_buffered_changes_below_the_materialization(
    fileio: FileIO, storage: ChangelogStorage
) -> None:
    # Regression: changes appended before a materialization but not yet uploaded were
    # uploaded with the next checkpoint anyway (restore filtered them out again).
    w = storage.create_writer("a")
    for i in range(1000):
        w.append(0, "s", 1, b"k", None, b"old%d" % i)
    boundary = w.next_sqn()  # what a materialization snapshot does
    w.append(0, "s", 1, b"k", None, b"new")
    w.truncate(boundary)  # the materialization was applied
    handles = w.persist(boundary, 1).result()
    assert sum(h.rows for h in handles) == 1
    assert _rows(fileio, handles, from_sqn=boundary) == [b"new"]


def test_a_cut_starts_a_new_segment_so_a_truncation_leaves_no_older_changes(
    fileio: FileIO,
) -> None:
    """A materialization's boundary: changes from before it go in an upload of their own,
    so after the truncation no segment a checkpoint references holds any of them."""
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        w = st.create_writer("a")
        for i in range(3):
            w.append(0, "s", 1, b"k", None, b"old%d" % i * 100)  # below the threshold
        assert st._queue.empty()
        boundary = w.cut()
        assert not st._queue.empty()  # handed to an upload at once
        for i in range(60):  # crosses the threshold: a pre-emptive upload, after the cut
            w.append(0, "s", 1, b"k", None, bytes([i]) * 100)
        assert st._queue.qsize() == 2
        st.drain_once(block=False)  # takes both in one batch, and writes them apart
        before = w._uploads[0].future.result(timeout=10)  # the changes up to the boundary
        assert before.sqn_end == boundary
        w.truncate(boundary)  # the materialization was applied
        fut = w.persist(boundary, 1)
        while not st._queue.empty():  # the deletion the truncation queued, and the persist
            st.drain_once(block=False)
        handles = fut.result(timeout=10)
        assert not fileio.exists(before.location)  # nothing references it any more
        assert [h.sqn_start >= boundary for h in handles] == [True] * len(handles)
        assert sum(h.rows for h in handles) == 60
        assert _rows(fileio, handles) == [bytes([i]) * 100 for i in range(60)]
        # no segment the checkpoint references holds the changes from before the boundary
        assert before.location not in {h.location for h in handles}
        assert w.cut() == w.next_sqn()  # nothing appended since: the same boundary


def test_a_cut_just_after_a_preemptive_upload_ends_that_uploads_segment(
    fileio: FileIO,
) -> None:
    """The buffer was handed to a pre-emptive upload by the last append: the cut has
    nothing to submit, and the upload ending at the boundary ends its segment instead."""
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        w = st.create_writer("a")
        while st._queue.empty():  # until the threshold submits the buffer
            w.append(0, "s", 1, b"k", None, b"x" * 100)
        boundary = w.cut()
        assert st._queue.qsize() == 1 and boundary == w._uploads[-1].sqn_end
        while st._queue.qsize() == 1:  # the next pre-emptive upload, after the cut
            w.append(0, "s", 1, b"k", None, b"y" * 100)
        st.drain_once(block=False)
        first, second = (u.future.result(timeout=10) for u in w._uploads)
        assert first.sqn_end == boundary == second.sqn_start
        assert first.location != second.location


def test_a_failed_upload_at_the_boundary_still_ends_its_segment_when_retried(
    tmp_path: Path,
) -> None:
    """The persist sends the failed boundary upload again before its own newer changes
    (sqn order), so the boundary's mark still ends its segment."""
    faulty = FaultyFileIO(str(tmp_path))
    faulty.script("fatal")
    with ChangelogStorage(faulty, "job", "w0", start_thread=False) as st:
        w = st.create_writer("a")
        w.append(0, "s", 1, b"k", None, b"old")
        boundary = w.cut()
        st.drain_once(block=False)
        assert w._uploads[0].future.exception() is not None  # the boundary's upload failed
        w.append(0, "s", 1, b"k", None, b"new")
        fut = w.persist(0, 1)
        st.drain_once(block=False)  # both requests, in one batch
        old, new = fut.result(timeout=10)
        assert old.sqn_end == boundary == new.sqn_start
        assert old.location != new.location
        assert _rows(faulty, (old,)) == [b"old"] and _rows(faulty, (new,)) == [b"new"]


def test_the_lane_takes_its_backlog_across_segment_ends() -> None:
    """Pre-emptive uploads queued behind a slow one are taken in one step, up to the
    batch size, and split into segments at materializations' boundaries only."""
    lane = _Lane(max_bytes=1 << 20)
    reqs = [_request(sqn, ends_segment=sqn == 1) for sqn in range(4)]
    lane.put(reqs)
    taken = lane.take()
    lane.done()
    assert taken is not None and [r.sqn_start for r in taken] == [0, 1, 2, 3]
    assert [[r.sqn_start for r in s] for s in _segments(reqs)] == [[0, 1], [2, 3]]
    assert [[r.sqn_start for r in s] for s in _segments(reqs[:2])] == [[0, 1]]
    small = _Lane(max_bytes=1)  # over the batch size: one at a time, at least one
    small.put(reqs[:2])
    assert [r.sqn_start for r in small.take() or []] == [0]


def test_a_backlog_of_segments_is_encoded_in_one_round_trip_a_file_each(
    fileio: FileIO,
) -> None:
    """The lane's step (and a barrier taking its backlog along) sends every segment it
    uploads to the encoder in one round trip: a round trip per segment capped the lane
    at one segment per step while materializations cut one up to 20 times a second."""
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        trips: list[int] = []
        real = st._encoder.encode_many

        def counted(segments: list[list[PendingBlock]]) -> list[EncodedSegment]:
            trips.append(len(segments))
            return real(segments)

        st._encoder.encode_many = counted  # type: ignore[method-assign]
        w = st.create_writer("a")
        for n in range(3):  # three materializations' boundaries: three segments
            for i in range(10):
                w.append(0, "s", 1, b"k", None, b"%d-%d" % (n, i) * 50)
            w.cut()
        assert st._queue.qsize() == 3
        st.drain_once(block=False)
        handles = [u.future.result(timeout=10) for u in w._uploads]
        assert trips == [3] and st.segments_written == 3
        assert len({h.location for h in handles}) == 3
        rows = _rows(fileio, tuple(handles))
        assert rows == [b"%d-%d" % (n, i) * 50 for n in range(3) for i in range(10)]
        assert w._uploads[-1].timings["upload_segments"] == 3


def test_a_segment_that_cannot_be_encoded_fails_alone(fileio: FileIO) -> None:
    with ChangelogStorage(fileio, "job", "w0", start_thread=False) as st:
        empty = ChangeBuffer()
        empty.seal()
        bad = _Request("a", 1, 2, empty, Future(), {}, urgent=False)
        segments = [[_request(0, False)], [bad], [_request(2, False)]]
        first, failed, last = st._encode(segments, False)
        assert isinstance(failed, ValueError) and "empty block" in str(failed)
        assert isinstance(first, EncodedSegment) and isinstance(last, EncodedSegment)
        assert bytes(first.data) == encode_here(_pending(segments[0])).data


def _request(sqn: int, ends_segment: bool) -> _Request:
    changes = ChangeBuffer()
    changes.append(0, sqn, "s", 1, b"k", None, b"v")
    changes.seal()
    return _Request(
        "a", sqn, sqn + 1, changes, Future(), {}, urgent=False, ends_segment=ends_segment
    )


def test_read_changes_keeps_each_run_from_its_own_sqn(
    fileio: FileIO, storage: ChangelogStorage
) -> None:
    """Key groups [0, 4) from sqn 1, [4, 8) from sqn 0 (a state merged from two old
    ranges), metadata from the lowest; blocks that all pass come back as read, others
    filtered."""
    w = storage.create_writer("a")
    w.append_meta("s", 9, b"meta")
    for kg in (0, 5, 9):
        w.append(kg, "s", 1, b"k", None, f"old{kg}".encode())
    first = w.persist(0, 1).result()
    for kg in (1, 6):
        w.append(kg, "s", 1, b"k", None, f"new{kg}".encode())
    handles = w.persist(0, 2).result()
    assert handles[0] == first[0]

    def values(**kw: object) -> list[bytes]:
        return [v for t in read_changes(fileio, handles, **kw) for v in t["value"].to_pylist()]

    assert values(runs=[(0, 4, 1), (4, 8, 0)]) == [b"meta", b"old5", b"new1", b"new6"]
    assert values(runs=[(0, 8, 0)]) == [b"meta", b"old0", b"old5", b"new1", b"new6"]
    assert values(runs=[(0, 8, 1)]) == [b"new1", b"new6"]
    assert values(from_sqn=1, key_groups=(0, 4)) == [b"new1"]
    assert values() == [b"meta", b"old0", b"old5", b"old9", b"new1", b"new6"]
    tables = list(read_changes(fileio, handles, runs=[(0, 8, 0)], state_dictionary=True))
    assert pa.types.is_dictionary(tables[0].schema.field("state").type)
    assert tables[0]["state"].to_pylist() == ["s"] * 3
    with pytest.raises(ValueError):
        list(read_changes(fileio, handles, from_sqn=1, runs=[(0, 8, 0)]))


def test_log_size_counts_what_a_persist_would_reference(
    fileio: FileIO, storage: ChangelogStorage
) -> None:
    w = storage.create_writer("a")
    assert w.log_size() == (0, 0)
    for i in range(100):
        w.append(i % 8, "s", 1, b"k%d" % i, None, b"v" * 20)
    assert w.log_size() == (800, 100)  # nothing uploaded yet: 8 bytes a row, a guess
    (h,) = w.persist(0, 1).result()
    assert w.log_size() == (h.size_bytes, 100)  # uploaded: the segment's size
    for _ in range(50):
        w.append(0, "s", 1, b"k", None, b"v")
    per_row = h.size_bytes / 100
    assert w.log_size() == (h.size_bytes + round(50 * per_row), 150)  # at the rate seen
    boundary = w.next_sqn()
    w.truncate(boundary)  # materialized: nothing left to reference
    assert w.log_size() == (0, 0)


def test_log_size_counts_a_shared_segment_once(fileio: FileIO) -> None:
    """Blocks that share a segment (of writers sharing an upload, or one writer's
    batched uploads) split its bytes by rows: every handle names the whole file's size,
    and summing those made a materialization start k times early (the size bound)."""
    with ChangelogStorage(fileio, "job", "w0", start_thread=False) as st:
        a, b = st.create_writer("a"), st.create_writer("b")
        for i in range(300):
            a.append(0, "s", 1, b"k%d" % i, None, b"v" * 20)
        for i in range(100):
            b.append(1, "s", 1, b"k%d" % i, None, b"v" * 20)
        futures = [w.persist(0, 1) for w in (a, b)]
        st.drain_once(block=False)
        (ha,), (hb,) = (f.result(timeout=10) for f in futures)
        assert ha.location == hb.location and ha.size_bytes == hb.size_bytes
        assert a.log_size() == (ha.size_bytes * 3 // 4, 300)
        assert a.log_size()[0] + b.log_size()[0] == ha.size_bytes
    opts = ChangelogOptions(preemptive_persist_bytes=2_000)
    with ChangelogStorage(fileio, "job", "w1", opts, start_thread=False) as st:
        c = st.create_writer("c")
        for i in range(100):  # pre-emptive uploads
            c.append(0, "s", 1, b"k%d" % i, None, b"v" * 20)
        c.append(0, "s", 1, b"k", None, b"tail")
        future = c.persist(0, 1)
        st.drain_once(block=False)  # all in one batch
        handles = future.result(timeout=10)
        assert len(handles) > 1 and len({h.location for h in handles}) == 1
        assert c.log_size() == (handles[0].size_bytes, 101)


def test_a_writer_lets_go_of_the_changes_it_uploaded(storage: ChangelogStorage) -> None:
    """Only a failed upload's changes are kept (to send again): a writer that persists
    over and over without a materialization holds its current buffer, not its log.
    (For a while the queued request kept every uploaded buffer alive: a long-log run
    peaked at 800 MB instead of 340 MB.)"""

    def live_buffers() -> int:
        gc.collect()
        return sum(isinstance(o, ChangeBuffer) for o in gc.get_objects())

    before = live_buffers()
    w = storage.create_writer("a")
    for checkpoint in range(1, 11):
        for i in range(100):
            w.append(0, "s", 1, b"k%d" % i, None, b"v" * 100)
        w.persist(0, checkpoint).result()
    w.persist(0, 11).result()  # lets go of what the last persist uploaded
    assert live_buffers() - before <= 1  # the writer's (empty) buffer; it held 11
    assert w.log_size()[1] == 1000  # while a checkpoint still references all of it


def test_a_barriers_upload_does_not_queue_behind_a_preemptive_one(tmp_path: Path) -> None:
    """A persist's batch is encoded and written while a pre-emptive upload is still
    being written (it used to wait for it on the one upload thread), taking along the
    pre-emptive requests not started yet; the persist still completes only once all are
    durable, and the tasks stand aside until then."""
    from dstl import gil

    fio = FaultyFileIO(str(tmp_path))
    fio.script("stall")  # the pre-emptive segment's write
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fio, "job", "w0", opts) as st:
        w = st.create_writer("a")
        for i in range(60):  # over the threshold: a pre-emptive upload
            w.append(0, "s", 1, b"k", None, b"%03d" % i * 30)
        assert fio.stalled.wait(STALL_LIMIT_S)
        for i in range(60):  # another one, waiting for the lane
            w.append(0, "s", 1, b"k", None, b"%03d" % i * 30)
        w.append(0, "s", 1, b"k", None, b"tail")
        persisted = w.persist(0, 1)
        tail = w._uploads[-1]
        with gil._critical_cond:  # the persist's own section: every task thread waits
            (critical,) = (t for t, (owner, _) in gil._critical.items() if owner is None)
        tail_handle = tail.future.result(timeout=STALL_LIMIT_S)  # written beside the stall
        assert not persisted.done()
        assert critical in gil._critical  # the barrier still waits: the tasks stand aside
        fio.release.set()
        handles = persisted.result(timeout=STALL_LIMIT_S)
        assert handles[-1] == tail_handle and handles[0].location != tail_handle.location
        assert handles[1].location == tail_handle.location  # one file for the backlog
        assert len(fio.writes) == 2
        rows = _rows(fio, handles)
        assert rows[-1] == b"tail" and len(rows) == 121
        st.close()  # joins the lane: every callback has run
        assert critical not in gil._critical


def test_a_preemptive_upload_goes_straight_to_the_lane(tmp_path: Path) -> None:
    """A pre-emptive upload is handed to the lane by the task thread itself, not through
    the upload thread (one thread fewer to wake beside the busy task, which halved the
    barriers that found a pre-emptive block still waiting, 14 to 6 in 4+4 end-to-end runs):
    it is written while the upload thread is stuck in a barrier's write."""
    fio = FaultyFileIO(str(tmp_path))
    fio.script("stall")  # the barrier's segment
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fio, "job", "w0", opts) as st:
        w = st.create_writer("a")
        w.append(0, "s", 1, b"k", None, b"barrier")
        persisted = w.persist(0, 1)
        assert fio.stalled.wait(STALL_LIMIT_S)  # the upload thread is writing it
        while len(w._uploads) < 2:  # over the threshold: a pre-emptive upload
            w.append(0, "s", 1, b"k", None, b"x" * 100)
        preemptive = w._uploads[1].future.result(timeout=STALL_LIMIT_S)
        assert not persisted.done()
        assert w._uploads[1].timings["persist_queue_ms"] == 0  # never queued
        fio.release.set()
        (barrier,) = persisted.result(timeout=STALL_LIMIT_S)
        assert barrier.location != preemptive.location
        assert _rows(fio, (barrier,)) == [b"barrier"]


def test_a_persist_with_nothing_of_its_own_takes_the_lanes_backlog(tmp_path: Path) -> None:
    """The barrier came right after a pre-emptive upload: the persist has nothing to
    upload itself, and its upload thread takes the pre-emptive request still waiting for
    the lane (here: behind a stalled one) and writes it as a barrier's, the tasks
    standing aside until everything the persist waits for is durable."""
    from dstl import gil

    fio = FaultyFileIO(str(tmp_path))
    fio.script("stall")  # the first pre-emptive segment's write
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fio, "job", "w0", opts) as st:
        w = st.create_writer("a")
        i = 0
        while len(w._uploads) < 2:  # the last append hands the buffer over
            w.append(0, "s", 1, b"k", None, b"%03d" % i * 30)
            i += 1
            if len(w._uploads) == 1:
                assert fio.stalled.wait(STALL_LIMIT_S)
        assert not len(w._buffer)
        persisted = w.persist(0, 1)
        with gil._critical_cond:
            (critical,) = (t for t, (owner, _) in gil._critical.items() if owner is None)
        second = w._uploads[1].future.result(timeout=STALL_LIMIT_S)  # beside the stall
        assert not persisted.done() and critical in gil._critical
        assert w._uploads[1].timings["encode_cpu_ms"] > 0  # encoded here, not by the helper
        fio.release.set()
        handles = persisted.result(timeout=STALL_LIMIT_S)
        assert handles[-1] == second and len(fio.writes) == 2
        assert len(_rows(fio, handles)) == i
        st.close()
        assert critical not in gil._critical


def test_a_persist_with_nothing_of_its_own_has_the_queued_upload_encoded_here(
    fileio: FileIO,
) -> None:
    """The pre-emptive request is still queued when the persist comes: the batch that
    takes it is a barrier's (encoded here, in a critical section), not the helper's."""
    from dstl import gil

    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fileio, "job", "w0", opts, start_thread=False) as st:
        helper = st._encoder = SegmentEncoder()  # not started: counts what asks for it
        try:
            w = st.create_writer("a")
            while not w._uploads:
                w.append(0, "s", 1, b"k", None, b"v" * 100)
            persisted = w.persist(0, 1)
            assert gil._critical and st._queue.qsize() == 2  # the request, then the marker
            st.drain_once(block=False)
            assert persisted.result(timeout=0) and helper.started == 0
            assert not gil._critical
        finally:
            helper.close()


def test_a_preemptive_upload_failed_on_the_lane_is_uploaded_again_by_the_persist(
    tmp_path: Path,
) -> None:
    fio = FaultyFileIO(str(tmp_path))
    fio.script("fatal")  # the pre-emptive segment's only attempt
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fio, "job", "w0", opts) as st:
        w = st.create_writer("a")
        for i in range(60):
            w.append(0, "s", 1, b"k", None, b"%03d" % i * 30)
        failed = w._uploads[0].future.exception(timeout=STALL_LIMIT_S)
        assert isinstance(failed, StateBackendError)
        w.append(0, "s", 1, b"k", None, b"tail")
        handles = w.persist(0, 1).result(timeout=STALL_LIMIT_S)
        assert [(h.sqn_start, h.sqn_end) for h in handles] == [(0, 1), (1, 2)]
        rows = _rows(fio, handles)
        assert rows[-1] == b"tail" and len(rows) == 61
        assert st.budget.used == 0


def test_the_lane_uploads_with_short_gil_slices(tmp_path: Path) -> None:
    """Each of its GIL hand-backs (after the round trip, after the write) waited up to
    a switch interval beside a busy task: the lane fell behind at 1M keys."""
    import sys

    from dstl import gil

    before = sys.getswitchinterval()
    fio = FaultyFileIO(str(tmp_path))
    fio.script("stall")  # the pre-emptive segment's write
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fio, "job", "w0", opts) as st:
        w = st.create_writer("a")
        for i in range(60):  # over the threshold: a pre-emptive upload, on the lane
            w.append(0, "s", 1, b"k", None, b"%03d" % i * 30)
        assert fio.stalled.wait(STALL_LIMIT_S)
        assert sys.getswitchinterval() == pytest.approx(min(before, gil.GIL_SLICE_S))
        fio.release.set()
        w._uploads[0].future.result(timeout=STALL_LIMIT_S)
    assert sys.getswitchinterval() == pytest.approx(before)  # the lane is joined


class _DeleteRecordingFileIO(FileIO):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.deleted_on: list[tuple[str, int]] = []  # (thread name, files)

    def delete_many(self, locations: Sequence[str]) -> tuple[tuple[str, StateBackendError], ...]:
        self.deleted_on.append((threading.current_thread().name, len(locations)))
        return super().delete_many(locations)


def test_segments_no_checkpoint_needs_are_deleted_on_the_deleter_thread(tmp_path: Path) -> None:
    """Not on the upload thread (nor the lane): each unlink waited for the GIL beside a
    busy task, 145-203 ms for the segments one materialization at 1M keys truncated,
    while the pre-emptive uploads it routes to the lane queued behind it."""
    fio = _DeleteRecordingFileIO(str(tmp_path))
    opts = ChangelogOptions(preemptive_persist_bytes=5_000)
    with ChangelogStorage(fio, "job", "w0", opts) as st:
        w = st.create_writer("a")
        for i in range(60):  # over the threshold: a pre-emptive upload no checkpoint claims
            w.append(0, "s", 1, b"k", None, b"%03d" % i * 30)
        old = w._uploads[0].future.result(timeout=STALL_LIMIT_S)
        boundary = w.cut()
        w.append(0, "s", 1, b"k", None, b"new")
        w.truncate(boundary)  # the materialization was applied: the old segment goes
        (new,) = w.persist(boundary, 1).result(timeout=STALL_LIMIT_S)
        st.close()  # waits for the deletions queued
        assert not fio.exists(old.location) and fio.exists(new.location)
        assert fio.deleted_on and {name for name, _ in fio.deleted_on} == {"dstl-delete-w0"}
        assert st.segments_deleted >= 1


class _BrokenOnceFileIO(FileIO):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.calls = 0

    def delete_many(self, locations: Sequence[str]) -> tuple[tuple[str, StateBackendError], ...]:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug")
        return super().delete_many(locations)


def test_a_bug_in_a_delete_does_not_stop_the_deleter_thread(tmp_path: Path) -> None:
    fio = _BrokenOnceFileIO(str(tmp_path))
    fio.write_new("a", b"1")
    fio.write_new("b", b"2")
    with ChangelogStorage(fio, "job", "w0") as st:
        st._delete(["a"])  # crashes: left to the orphan sweep
        st._delete(["b"])
    assert fio.calls == 2 and fio.exists("a") and not fio.exists("b")
    assert st.segments_deleted == 1
