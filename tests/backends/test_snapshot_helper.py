"""Heap snapshots of columnar states served by the long-lived helper process.

Real processes throughout: the helper is started, killed and reaped for real, and its
parent is killed for real.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends import (
    HeapKeyedStateBackend,
    KeyGroupRange,
    ListStateDescriptor,
    ValueStateDescriptor,
    _heapstate,
)
from backends import forked as forked_mod
from backends import snapshot_helper as helper_mod
from backends.errors import SnapshotProcessError
from backends.forked import ForkedSnapshot, materialization_snapshot
from backends.serializers import FLOAT64, INT64, STR
from backends.snapshot_helper import SnapshotHelper, helper_snapshot, running_helper
from backends.tables import state_files
from dstl import gil
from tests.processes import continued, stopped

pytestmark = pytest.mark.skipif(
    not _heapstate.NATIVE, reason="the helper takes int64 keys from the C store's views"
)

MAX_PAR = 128
PIECE_ROWS = 512
KEYS = 3000


def _backend(n: int, first: int = 0) -> HeapKeyedStateBackend:
    b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    _write(b, range(first, first + n), 1)
    return b


def _write(b: HeapKeyedStateBackend, keys: Any, step: int) -> None:
    count = b.get_state(ValueStateDescriptor("count", INT64))
    total = b.get_state(ValueStateDescriptor("total", FLOAT64))
    for i in keys:
        b.set_current_key(i * 7919)
        count.update(i * step)
        total.update(i * 0.5 * step)
        if i % 11 == 0:
            total.clear()


def _pieces(files: Iterator[Any]) -> list[tuple[str, str | None, int, int, int, bytes]]:
    return [(f.name, f.state, f.key_group_start, f.key_group_end, f.rows, f.data) for f in files]


def _want(b: HeapKeyedStateBackend) -> list[tuple[str, str | None, int, int, int, bytes]]:
    return _pieces(state_files(b.column_snapshot(7), PIECE_ROWS))


@pytest.fixture
def helper(monkeypatch: pytest.MonkeyPatch) -> Iterator[SnapshotHelper]:
    """A fresh, ready helper for stores of :data:`KEYS` entries and more; closed (and
    reaped) at the end."""
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", KEYS)
    monkeypatch.setattr(helper_mod, "_starts", 0)
    helper_mod.close_helper()
    started = running_helper()
    assert started is not None and started.wait_ready()
    yield started
    helper_mod.close_helper()
    assert started.returncode() is not None  # ended and reaped


def _served(b: HeapKeyedStateBackend) -> ForkedSnapshot:
    snap = helper_snapshot(b, 7)
    assert snap is not None and snap.end_job is not None
    return snap


def test_the_pieces_are_the_state_as_of_the_snapshot_while_the_task_writes_on(
    helper: SnapshotHelper,
) -> None:
    b = _backend(KEYS + 500)
    want = _want(b)
    snap = _served(b)
    assert snap.pid == helper.pid
    _write(b, range(0, KEYS + 900, 3), -1)  # after the snapshot: not in the pieces
    assert _pieces(snap.pieces(PIECE_ROWS)) == want
    snap.release()
    want = _want(b)  # the next snapshot, through the same region, sees the writes
    snap = _served(b)
    assert _pieces(snap.pieces(PIECE_ROWS)) == want
    snap.release()


def test_the_helper_writes_the_pieces_to_a_local_disk_but_those_it_may_skip(
    helper: SnapshotHelper, tmp_path: Path
) -> None:
    from backends.handles import file_id_of
    from dstl import FileIO
    from dstl.integrity import content_hash

    b = _backend(KEYS + 100)
    want = _want(b)
    skipped = (want[1][0], file_id_of(content_hash(want[1][5])))
    snap = _served(b)
    fileio = FileIO(str(tmp_path / "store"))
    got = list(snap.write_pieces(PIECE_ROWS, fileio, "m/0001", [skipped]))
    snap.release()
    assert [(w.name, w.state, w.key_group_start, w.key_group_end, w.rows) for w in got] == [
        p[:5] for p in want
    ]
    for w, p in zip(got, want, strict=True):
        if w.name == skipped[0]:
            assert w.path is None
        else:
            assert w.path is not None and fileio.read(w.path) == p[5]


def test_a_store_that_is_not_all_columnar_is_forked(helper: SnapshotHelper) -> None:
    b = _backend(KEYS + 100)
    b.get_state(ListStateDescriptor("seen", STR)).add("x")
    assert helper_snapshot(b, 7) is None
    snap = materialization_snapshot(b, 7)
    assert isinstance(snap, ForkedSnapshot) and snap.end_job is None and snap.pid != helper.pid
    assert _pieces(snap.pieces(PIECE_ROWS)) == _pieces(state_files(b.snapshot(7), PIECE_ROWS))
    snap.release()


def test_a_small_store_copies_and_a_large_one_waits_for_the_helper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below a quarter of the fork's threshold nothing starts; from there the helper is
    started, and until it is ready the store forks."""
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", 4 * KEYS)
    monkeypatch.setattr(helper_mod, "_starts", 0)
    helper_mod.close_helper()
    try:
        small = _backend(KEYS // 4)  # entries: under a quarter of the threshold
        assert small.entry_count() < KEYS
        assert materialization_snapshot(small, 1).__class__.__name__ == "StateSnapshot"
        assert running_helper(start=False) is None
        _write(small, range(KEYS // 4, KEYS // 4 + 1000), 1)  # a quarter and more: started
        assert KEYS <= small.entry_count() < 4 * KEYS
        assert materialization_snapshot(small, 1).__class__.__name__ == "StateSnapshot"
        started = running_helper(start=False)
        assert started is not None
        large = _backend(2 * KEYS + 500)
        assert large.entry_count() >= 4 * KEYS
        if not started.ready():  # the fork meanwhile
            snap = materialization_snapshot(large, 1)
            assert isinstance(snap, ForkedSnapshot) and snap.end_job is None
            snap.release()
        assert started.wait_ready()
        snap = materialization_snapshot(large, 1)
        assert isinstance(snap, ForkedSnapshot) and snap.pid == started.pid
        snap.release()
    finally:
        helper_mod.close_helper()


def test_a_region_is_leased_to_one_snapshot_at_a_time_and_kept(
    helper: SnapshotHelper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(helper_mod, "_MIN_REGION", 0)
    b = _backend(KEYS + 100)
    first = _served(b)
    region = b.snapshot_region
    generation = region.generation
    assert helper_snapshot(b, 7) is None  # the first one is still in flight
    first.release()
    want = _want(b)
    second = _served(b)
    assert b.snapshot_region is region and region.generation == generation  # no new pages
    assert _pieces(second.pieces(PIECE_ROWS)) == want
    second.release()
    _write(b, range(KEYS + 100, 4 * KEYS), 1)  # outgrows it: a new generation, told
    want = _want(b)
    third = _served(b)
    assert region.generation != generation
    assert _pieces(third.pieces(PIECE_ROWS)) == want
    third.release()


def test_a_region_that_cannot_be_made_leaves_the_store_to_the_fork(
    helper: SnapshotHelper, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*args: Any) -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "memfd_create", no_memory)
    b = _backend(KEYS + 100)
    assert helper_snapshot(b, 7) is None
    snap = materialization_snapshot(b, 7)
    assert isinstance(snap, ForkedSnapshot) and snap.end_job is None
    assert _pieces(snap.pieces(PIECE_ROWS)) == _want(b)
    snap.release()
    monkeypatch.undo()
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", KEYS)
    _served(b).release()  # the lease was given back


def test_a_snapshot_released_unread_leaves_the_helper_serving(helper: SnapshotHelper) -> None:
    b = _backend(KEYS + 100)
    _served(b).release()  # before its request
    snap = _served(b)
    pieces = snap.pieces(PIECE_ROWS)
    next(pieces)  # one piece read, then given up
    snap.release()
    _write(b, range(0, KEYS, 5), 3)
    want = _want(b)
    snap = _served(b)
    assert _pieces(snap.pieces(PIECE_ROWS)) == want
    snap.release()
    assert helper.alive()


def test_a_background_job_runs_on_a_thread_below_the_task(
    helper: SnapshotHelper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At NICE_MIN_ENTRIES entries the job's thread (only) is niced and, where the helper
    may lift it out again (as root: CAP_SYS_NICE), under SCHED_IDLE: the helper's main
    thread is neither, and no such thread outlives the job."""
    monkeypatch.setattr(forked_mod, "NICE_MIN_ENTRIES", KEYS)
    b = _backend(KEYS + 100)
    snap = _served(b)
    assert snap.background
    idle = helper_mod._idle_liftable()  # as the helper finds it, with the same rights
    want = (forked_mod.CHILD_NICE, os.SCHED_IDLE if idle else os.SCHED_OTHER)
    threads = _thread_scheds(helper.pid, until=lambda n: want in n.values())
    assert threads[helper.pid] == (0, os.SCHED_OTHER)
    assert _pieces(snap.pieces(PIECE_ROWS))
    snap.release()
    monkeypatch.setattr(forked_mod, "NICE_MIN_ENTRIES", 1 << 30)
    snap = _served(b)
    assert not snap.background
    assert _pieces(snap.pieces(PIECE_ROWS))
    snap.release()
    # The helper joins a job's thread before it takes the next job, but a joined thread
    # may still be in the kernel's thread exit, niced, on a busy machine: it must go.
    _thread_scheds(helper.pid, until=lambda n: all(v == (0, os.SCHED_OTHER) for v in n.values()))


def test_a_background_job_leaves_sched_idle_after_its_bound(
    helper: SnapshotHelper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past IDLE_MAX_S the job's thread runs on under SCHED_OTHER, still niced: a busy
    machine cannot hold a materialization back for good."""
    if not helper_mod._idle_liftable():
        pytest.skip("this user cannot lift a thread out of SCHED_IDLE (no CAP_SYS_NICE)")
    monkeypatch.setattr(forked_mod, "NICE_MIN_ENTRIES", KEYS)
    monkeypatch.setattr(helper_mod, "IDLE_MAX_S", 0.0)
    b = _backend(KEYS + 100)
    snap = _served(b)  # the job lives until its release
    lifted = (forked_mod.CHILD_NICE, os.SCHED_OTHER)
    _thread_scheds(helper.pid, until=lambda n: lifted in n.values())
    assert _pieces(snap.pieces(PIECE_ROWS)) == _want(b)
    snap.release()


def test_an_unprivileged_helper_keeps_background_jobs_out_of_sched_idle() -> None:
    """Without CAP_SYS_NICE and with RLIMIT_NICE 0 (a user's default) a thread cannot
    leave SCHED_IDLE, so the helper does not put jobs there: they run niced only."""
    code = (
        "import os, resource, sys\n"
        "from backends.snapshot_helper import _idle_liftable\n"
        "print(int(_idle_liftable()))\n"
        "resource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n"
        "if os.geteuid() == 0:\n"
        "    os.setgid(65534); os.setuid(65534)\n"
        "print(int(_idle_liftable()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()  # fmt: skip
    assert out[1] == "0"
    if os.geteuid() == 0:
        assert out[0] == "1"


def _thread_scheds(pid: int, until: Any = lambda n: True) -> dict[int, tuple[int, int]]:
    """The niceness and scheduling policy of each thread of ``pid`` (fields 19 and 41 of
    its stat), once ``until`` them."""
    for _ in range(10_000):
        out = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[16]), int(fields[38]))
        if until(out):
            return out
        select.select([], [], [], 0.001)  # a yield to the helper, which starts its thread
    raise AssertionError(f"the helper's threads never showed it: {out}")


def test_a_helper_that_dies_fails_its_snapshot_and_is_replaced(helper: SnapshotHelper) -> None:
    b = _backend(KEYS + 100)
    snap = _served(b)
    os.kill(helper.pid, signal.SIGKILL)
    with pytest.raises(SnapshotProcessError):
        list(snap.pieces(PIECE_ROWS))
    snap.release()
    helper._proc.wait()
    assert helper_snapshot(b, 7) is None  # a new one is started, not ready yet
    fresh = running_helper(start=False)
    assert fresh is not None and fresh.pid != helper.pid and fresh.wait_ready()
    want = _want(b)
    snap = _served(b)
    assert snap.pid == fresh.pid and _pieces(snap.pieces(PIECE_ROWS)) == want
    snap.release()


def test_the_helper_outlives_the_thread_that_asked_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel kills the helper when the thread that started it ends: a task thread
    that asks for it must not be that thread."""
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", KEYS)
    monkeypatch.setattr(helper_mod, "_starts", 0)
    helper_mod.close_helper()
    asked: list[SnapshotHelper | None] = []

    def task() -> None:
        asked.append(running_helper())
        assert asked[0] is not None and asked[0].wait_ready()  # it watches its parent now

    thread = threading.Thread(target=task)
    thread.start()
    thread.join()
    started = asked[0]
    try:
        assert started is not None and started.ready()
        b = _backend(KEYS + 100)
        want = _want(b)
        snap = _served(b)
        assert snap.pid == started.pid and _pieces(snap.pieces(PIECE_ROWS)) == want
        snap.release()
    finally:
        helper_mod.close_helper()


def test_the_helper_is_stopped_during_a_critical_section(helper: SnapshotHelper) -> None:
    token = gil.open_critical(max_wait_s=60, owner=None)
    try:
        stopped(helper.pid)
    finally:
        gil.close_critical(token)
    continued(helper.pid)


_PARENT = """
import os, signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: the helper must not inherit it
sys.path.insert(0, {root!r})
from backends import forked
from backends.snapshot_helper import helper_snapshot, running_helper
from tests.backends.test_snapshot_helper import _backend
from tests.processes import stopped
from dstl import gil
forked.FORK_MIN_ENTRIES = 100
b = _backend(200)
assert running_helper().wait_ready()
snap = helper_snapshot(b, 1)
assert snap is not None
if {stop}:
    gil.open_critical(max_wait_s=600, owner=None)  # stopped now, and for as long as we live
    stopped(snap.pid)
print(snap.pid, flush=True)
time.sleep(600)
"""

_GRANDPARENT = """
import ctypes, os, select, signal, subprocess, sys
if {subreaper}:  # orphans come here: in our session, in another group, never orphaned
    assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
parent = subprocess.Popen([sys.executable, "-c", {parent!r}], stdout=subprocess.PIPE, text=True)
pid = int(parent.stdout.readline())
handle = os.pidfd_open(pid)  # readable once the helper has ended
parent.kill()
parent.wait()
ended = bool(select.select([handle], [], [], 10)[0])
if not ended:
    signal.pidfd_send_signal(handle, signal.SIGKILL)
if {subreaper}:
    os.waitpid(pid, 0)  # ours now
print("ended" if ended else f"the helper {{pid}} is still there", flush=True)
"""


@pytest.mark.parametrize(
    ("stop", "subreaper"),
    [(False, False), (True, False), (True, True)],
    ids=["running", "stopped", "stopped-beside-a-subreaper"],
)
def test_the_helper_ends_when_its_parent_is_killed(stop: bool, subreaper: bool) -> None:
    """Killed (SIGKILL) with a job in flight: a running helper reads the end of its socket;
    a stopped one is killed by the kernel, even when the orphaned-group rule would not
    reach it (a subreaper in its session takes it: its group is not orphaned)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = _PARENT.format(root=root, stop=stop)
    out = subprocess.run(
        [sys.executable, "-c", _GRANDPARENT.format(parent=parent, subreaper=subreaper)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "ended", out.stderr


def test_only_columns_names_every_state_of_an_all_columnar_int64_store() -> None:
    b = _backend(10)
    only = b.only_columns()
    assert only is not None and {n: k for n, (k, _) in only.items()} == {
        "count": "q",
        "total": "d",
    }
    keyed_by_text = HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    keyed_by_text.get_state(ValueStateDescriptor("count", INT64))
    assert keyed_by_text.only_columns() is None
    b.get_state(ListStateDescriptor("seen", STR))  # registered, even empty: not columnar
    assert b.only_columns() is None
