"""Heap snapshots taken by fork(): the child's pieces are the state as of the fork.

Real processes throughout: the child is a fork of the test process, killed and reaped
for real.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends import (
    HeapKeyedStateBackend,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
    _heapstate,
)
from backends import forked as forked_mod
from backends.errors import SnapshotProcessError
from backends.forked import ForkedSnapshot, fork_snapshot, materialization_snapshot
from backends.heap import StateSnapshot
from backends.serializers import INT64, STR
from backends.state import StateTtlConfig
from backends.tables import DEFAULT_PIECE_ROWS, state_files
from dstl import gil
from tests.processes import continued, stopped

MAX_PAR = 128
PIECE_ROWS = 512


def _backend(n: int, clock: Any = None) -> HeapKeyedStateBackend:
    kwargs = {"clock": clock} if clock is not None else {}
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR, **kwargs)
    count = b.get_state(ValueStateDescriptor("count", INT64))
    seen = b.get_state(ListStateDescriptor("seen", STR))
    tags = b.get_state(MapStateDescriptor("tags", STR, INT64))
    for i in range(n):
        b.set_current_key(i)
        count.update(i)
        if i % 3 == 0:
            seen.add(f"s{i}")
            tags.put(f"t{i % 5}", i)
    return b


def _mutate(b: HeapKeyedStateBackend, n: int) -> None:
    """Change, add and delete entries of every state."""
    count = b.get_state(ValueStateDescriptor("count", INT64))
    seen = b.get_state(ListStateDescriptor("seen", STR))
    tags = b.get_state(MapStateDescriptor("tags", STR, INT64))
    for i in range(0, n + 50, 7):
        b.set_current_key(i)
        count.update(-i)
        seen.add("later")
        tags.put("later", 1)
        if i % 2:
            count.clear()
            tags.clear()


def _pieces(files: Iterator[Any]) -> list[tuple[str, str | None, int, int, int, bytes]]:
    return [(f.name, f.state, f.key_group_start, f.key_group_end, f.rows, f.data) for f in files]


@pytest.fixture
def reaped() -> Iterator[list[int]]:
    """Pids of forked children; each must be gone (reaped) at the end of the test."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_the_pieces_are_the_state_as_of_the_fork_while_the_task_writes_on(
    reaped: list[int],
) -> None:
    b = _backend(3000)
    want = _pieces(state_files(b.snapshot(7), PIECE_ROWS))
    snap = fork_snapshot(b, 7)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    _mutate(b, 3000)  # after the fork: the child's copy must not see it
    assert _pieces(state_files(b.snapshot(7), PIECE_ROWS)) != want
    assert snap.sqn == 7 and snap.kind == "heap-parquet"
    got = _pieces(snap.pieces(PIECE_ROWS))
    snap.release()
    assert got == want
    assert len(got) > 3  # several pieces of every state


def test_pieces_of_the_default_size_and_of_fixed_key_group_chunks(reaped: list[int]) -> None:
    b = _backend(2000)
    for rows in (None, 100_000):
        want = _pieces(state_files(b.snapshot(1), rows))
        snap = fork_snapshot(b, 1)
        assert isinstance(snap, ForkedSnapshot)
        reaped.append(snap.pid)
        got = _pieces(snap.pieces(rows) if rows is None else snap.files())
        snap.release()
        assert got == want


def test_only_a_large_state_s_child_runs_below_the_task_s_priority(
    reaped: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small state's child encodes for milliseconds: at the task's priority it ends
    sooner, and a small state's full checkpoint depends on that (NICE_MIN_ENTRIES)."""
    b = _backend(500)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for min_entries, niceness in ((b.entry_count() + 1, own), (b.entry_count(), own + 10)):
        monkeypatch.setattr(forked_mod, "NICE_MIN_ENTRIES", min_entries)
        snap = fork_snapshot(b, 1)
        assert isinstance(snap, ForkedSnapshot)
        reaped.append(snap.pid)
        assert os.getpriority(os.PRIO_PROCESS, snap.pid) == min(niceness, 19)
        assert snap.background is (niceness != own)
        assert _pieces(snap.pieces(PIECE_ROWS)) == _pieces(state_files(b.snapshot(1), PIECE_ROWS))
        snap.release()


def test_a_released_snapshot_stops_and_reaps_its_child(reaped: list[int]) -> None:
    b = _backend(500)
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    snap.release()
    snap.release()  # idempotent
    with pytest.raises(SnapshotProcessError, match="released"):
        next(snap.pieces(PIECE_ROWS))


def test_a_snapshot_released_halfway_through_reaps_its_child(reaped: list[int]) -> None:
    b = _backend(3000)
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    pieces = snap.pieces(64)
    next(pieces)
    snap.release()


def test_a_dropped_snapshot_reaps_its_child(reaped: list[int]) -> None:
    b = _backend(500)
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    del snap


def test_a_child_that_dies_fails_the_read(reaped: list[int]) -> None:
    b = _backend(500)
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    os.kill(snap.pid, signal.SIGKILL)
    with pytest.raises(SnapshotProcessError, match="ended before"):
        list(snap.pieces(PIECE_ROWS))
    snap.release()


@pytest.mark.parametrize("rows", [PIECE_ROWS, DEFAULT_PIECE_ROWS])  # anew; encoded ahead
def test_an_error_in_the_child_is_raised_in_the_parent(
    reaped: list[int], monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    def broken(snapshot: StateSnapshot, piece_rows: int | None) -> Iterator[Any]:
        yield from state_files(snapshot, piece_rows)
        raise ValueError("cannot encode this")

    monkeypatch.setattr(forked_mod, "state_files", broken)  # the child is a copy of us
    b = _backend(500)
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    with pytest.raises(SnapshotProcessError, match="ValueError: cannot encode this"):
        list(snap.pieces(rows))
    snap.release()


@pytest.mark.parametrize("rows", [DEFAULT_PIECE_ROWS, PIECE_ROWS])
def test_the_child_encodes_default_pieces_before_it_is_asked(
    reaped: list[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rows: int
) -> None:
    """The child starts on pieces of the default size at once; asked for those it sends
    what it encoded, asked for another size it encodes anew. It tells us each
    ``state_files`` call through a FIFO (it keeps no inherited descriptor)."""
    fifo = str(tmp_path / "calls")
    os.mkfifo(fifo)

    def told(snapshot: StateSnapshot, piece_rows: int | None) -> Iterator[Any]:
        fd = os.open(fifo, os.O_WRONLY)
        os.write(fd, b"%d\n" % piece_rows)
        os.close(fd)
        yield from state_files(snapshot, piece_rows)

    monkeypatch.setattr(forked_mod, "state_files", told)
    b = _backend(3000)
    want = _pieces(state_files(b.snapshot(1), rows))
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    calls = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # no wait for a writer
    assert select.select([calls], [], [], 10)[0], "the child did not start encoding"
    assert os.read(calls, 64) == b"%d\n" % DEFAULT_PIECE_ROWS  # before it was asked
    got = _pieces(snap.pieces(rows))
    snap.release()
    assert got == want
    later = b""
    while chunk := os.read(calls, 64):  # end of file: the child is gone
        later += chunk
    os.close(calls)
    assert later == (b"" if rows == DEFAULT_PIECE_ROWS else b"%d\n" % rows)


def test_a_silent_child_times_out(reaped: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()

    def stuck(snapshot: StateSnapshot, piece_rows: int | None) -> Iterator[Any]:
        gate.wait()  # never set in the child (no thread sets it there)
        yield from ()

    monkeypatch.setattr(forked_mod, "state_files", stuck)
    monkeypatch.setattr(forked_mod, "READ_TIMEOUT_S", 0.05)
    b = _backend(500)
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    with pytest.raises(SnapshotProcessError, match="sent nothing"):
        list(snap.pieces(PIECE_ROWS))
    snap.release()  # kills the stuck child


def test_the_child_keeps_no_inherited_descriptor(
    reaped: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock file, socket or output pipe of the parent must not live on in the child
    (e.g. after the parent was killed): it holds its two pipes and /dev/null only."""
    gate = threading.Event()

    def first_piece_then_wait(snapshot: StateSnapshot, piece_rows: int | None) -> Iterator[Any]:
        yield next(iter(state_files(snapshot, piece_rows)))
        # Only for the requested size: the child encodes ahead in the default size until
        # the request comes, and waiting there hung it whenever it got this far before
        # the parent sent the request (seen once in CI, a loaded machine).
        if piece_rows == PIECE_ROWS:
            gate.wait()  # never set in the child: it stays alive, holding what it holds

    monkeypatch.setattr(forked_mod, "state_files", first_piece_then_wait)
    b = _backend(500)
    with tempfile.TemporaryFile() as held:
        held_fd = held.fileno()
        snap = fork_snapshot(b, 1)
        assert isinstance(snap, ForkedSnapshot)
        reaped.append(snap.pid)
        next(snap.pieces(PIECE_ROWS))  # the child closes them before it reads the request
        fds = _descriptors(snap.pid)
        snap.release()
    assert held_fd not in fds
    assert sorted(fds) == [0, 1, 2, *sorted(fds)[3:]] and len(fds) == 5
    assert {fds[0], fds[1], fds[2]} == {os.devnull}
    assert all(t.startswith("pipe:") for fd, t in fds.items() if fd > 2)


def _descriptors(pid: int) -> dict[int, str]:
    """The open descriptors of process ``pid`` and what they are."""
    return {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def test_small_states_and_failed_forks_copy_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _backend(100)
    assert isinstance(materialization_snapshot(b, 1), StateSnapshot)  # below the threshold
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", 10)

    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    before = set(os.listdir("/proc/self/fd"))
    snap = materialization_snapshot(b, 1)
    assert isinstance(snap, StateSnapshot)
    assert set(os.listdir("/proc/self/fd")) <= before  # the pipes were closed
    assert _pieces(state_files(snap, PIECE_ROWS)) == _pieces(state_files(b.snapshot(1), 512))


def test_large_states_fork(reaped: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", 10)
    b = _backend(100)
    snap = materialization_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    snap.release()


@pytest.mark.skipif(not _heapstate.NATIVE, reason="the C column store unshares its pages")
def test_after_a_fork_the_task_writes_its_values_without_a_fault_per_page(
    reaped: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child shares the value arrays' pages; the parent moves them to fresh memory
    right after the fork (``unshare_columns``), not through a fault per page at its writes,
    each taken with the GIL held."""
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    count = b.get_state(ValueStateDescriptor("count", INT64))
    n, per_page = 1 << 18, 4096 // 8  # 512 pages of values
    for i in range(n):
        b.set_current_key(i)
        count.update(i)

    def faults_writing_each_page() -> int:
        snap = fork_snapshot(b, 1)
        assert isinstance(snap, ForkedSnapshot)
        reaped.append(snap.pid)
        try:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            for i in range(0, n, per_page):
                b.set_current_key(i)
                count.update(-i)
            return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        finally:
            snap.release()

    unshared = faults_writing_each_page()
    monkeypatch.setattr(HeapKeyedStateBackend, "unshare_columns", lambda self: None)
    shared = faults_writing_each_page()
    pages = n // per_page
    assert shared >= pages // 2, "the control: a fault per page written"
    assert unshared < pages // 4, f"{unshared} faults writing {pages} pages after unshare"
    b.set_current_key(per_page)
    assert count.value() == -per_page


def test_expired_entries_are_purged_before_the_fork(reaped: list[int]) -> None:
    now = [1_000]
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR, clock=lambda: now[0])
    ttl = StateTtlConfig(ttl_ms=100)
    v = b.get_state(ValueStateDescriptor("v", INT64, ttl=ttl))
    for i in range(50):
        b.set_current_key(i)
        v.update(i)
    now[0] += 60
    for i in range(0, 50, 2):
        b.set_current_key(i)
        v.update(-i)  # refreshed: alive at 1_110
    now[0] += 50
    snap = fork_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    got = _pieces(snap.pieces(PIECE_ROWS))
    snap.release()
    assert sum(p[4] for p in got) == 25
    assert b.entry_count() == 25  # purged from the live store too, as the copy does


# -- stopped while a critical section is open (dstl.gil) ---------------------------------


def test_the_child_is_stopped_while_a_critical_section_is_open(reaped: list[int]) -> None:
    b = _backend(3000)
    want = _pieces(state_files(b.snapshot(3), PIECE_ROWS))
    snap = fork_snapshot(b, 3)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    assert os.getpgid(snap.pid) == snap.pid  # a group of its own (orphaned: ended)
    with gil.critical_section():
        stopped(snap.pid)
    continued(snap.pid)
    assert _pieces(snap.pieces(PIECE_ROWS)) == want
    snap.release()


def test_a_section_left_open_does_not_hold_the_materialization(
    reaped: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing closes the section and no task yields: the reader waiting for the child
    continues it once its stop is overdue (or the read would time out)."""
    monkeypatch.setattr(forked_mod, "READ_TIMEOUT_S", 5.0)
    b = _backend(3000)
    want = _pieces(state_files(b.snapshot(3), PIECE_ROWS))
    token = gil.open_critical(max_wait_s=600, owner=None)
    try:
        snap = fork_snapshot(b, 3)  # registered during the section: stopped at once
        assert isinstance(snap, ForkedSnapshot)
        reaped.append(snap.pid)
        stopped(snap.pid)
        assert _pieces(snap.pieces(PIECE_ROWS)) == want
        snap.release()
    finally:
        gil.close_critical(token)


_ORPHAN = """
import os, sys, time
sys.path.insert(0, {root!r})
from tests.backends.test_forked import _backend
from backends.forked import fork_snapshot
from dstl import gil
snap = fork_snapshot(_backend(3000), 1)
gil.open_critical(max_wait_s=600, owner=None)  # stopped now, and for as long as we live
print(snap.pid, flush=True)
time.sleep(600)
"""


def test_a_stopped_child_ends_when_its_parent_is_killed() -> None:
    """The parent dies (SIGKILL) while its child is stopped: the kernel continues the
    orphaned group and hangs it up, so the child does not stay behind, stopped."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN.format(root=root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        handle = os.pidfd_open(child)  # readable once the child has ended
    finally:
        parent.kill()
        parent.wait()
    try:
        poller = select.poll()
        poller.register(handle, select.POLLIN)
        assert poller.poll(10_000), f"the orphaned child {child} is still there"
    finally:
        with contextlib.suppress(ProcessLookupError):  # not left behind when it failed
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        os.close(handle)


def test_the_child_writes_the_pieces_itself_but_those_it_may_skip(
    reaped: list[int], tmp_path: Path
) -> None:
    """``write_pieces``: the files are the pieces the child would have sent, byte for byte,
    at the materialization's paths; a piece whose (name, file id) is to be skipped is
    reported, not written."""
    from backends.handles import file_id_of
    from dstl import FileIO
    from dstl.integrity import content_hash

    b = _backend(3000)
    want = _pieces(state_files(b.snapshot(7), PIECE_ROWS))
    skipped = (want[1][0], file_id_of(content_hash(want[1][5])))
    snap = fork_snapshot(b, 7)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    _mutate(b, 3000)  # after the fork: not in the files
    fileio = FileIO(str(tmp_path / "store"))
    got = list(snap.write_pieces(PIECE_ROWS, fileio, "m/0001", [skipped, ("other", "x")]))
    snap.release()
    assert [(w.name, w.state, w.key_group_start, w.key_group_end, w.rows) for w in got] == [
        p[:5] for p in want
    ]
    for w, p in zip(got, want, strict=True):
        assert (w.file_id, w.size_bytes) == (file_id_of(content_hash(p[5])), len(p[5]))
        if (w.name, w.file_id) == skipped:
            assert w.path is None and not fileio.exists(f"m/0001/{w.name}")
        else:
            assert w.path == f"m/0001/{w.name}" and fileio.read(w.path) == p[5]
    assert len(fileio.list("m/0001")) == len(want) - 1


def test_a_write_that_fails_in_the_child_fails_the_read(reaped: list[int], tmp_path: Path) -> None:
    from dstl import FileIO

    fileio = FileIO(str(tmp_path / "store"))
    fileio.write_new("m", b"a file where the directory should be")
    snap = fork_snapshot(_backend(500), 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    with pytest.raises(SnapshotProcessError, match=r"the snapshot process failed: .*m/0001"):
        list(snap.write_pieces(PIECE_ROWS, fileio, "m/0001", []))
    snap.release()


def test_the_child_writes_to_a_local_disk_only(reaped: list[int]) -> None:
    from dstl import FileIO

    snap = fork_snapshot(_backend(500), 1)
    assert isinstance(snap, ForkedSnapshot)
    reaped.append(snap.pid)
    with pytest.raises(ValueError, match="local disk only"):
        next(snap.write_pieces(PIECE_ROWS, FileIO("memory://forked"), "m", []))
    snap.release()
