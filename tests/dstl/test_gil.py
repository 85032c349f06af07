"""Shorter GIL slices: counted, and the previous interval put back by the last user.
Critical sections: task threads stand aside while one of another thread is open, within
its bound, and registered processes (real child processes here) are stopped meanwhile."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from dstl import gil
from dstl.gil import (
    CHECKPOINT_GIL_SLICE_S,
    GIL_SLICE_S,
    critical_section,
    short_gil_slices,
    yield_to_critical,
)
from tests.processes import continued, running, stopped


def test_short_gil_slices_are_counted_and_restored() -> None:
    before = sys.getswitchinterval()
    with short_gil_slices():
        assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SLICE_S))
        with short_gil_slices():
            pass
        assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SLICE_S))
    assert sys.getswitchinterval() == before


def test_an_error_in_the_body_restores_the_interval() -> None:
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), short_gil_slices():
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == before


def test_the_shortest_slice_asked_for_holds_until_its_user_leaves() -> None:
    before = sys.getswitchinterval()
    outer = short_gil_slices()
    outer.__enter__()
    with short_gil_slices(CHECKPOINT_GIL_SLICE_S):
        assert sys.getswitchinterval() == pytest.approx(CHECKPOINT_GIL_SLICE_S)
    assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SLICE_S))
    with short_gil_slices(CHECKPOINT_GIL_SLICE_S):
        outer.__exit__(None, None, None)  # the longer one leaves first
        assert sys.getswitchinterval() == pytest.approx(CHECKPOINT_GIL_SLICE_S)
    assert sys.getswitchinterval() == before


def _wait_until_waiting(waiters: int) -> None:
    """Until ``waiters`` threads wait on the sections' condition (no sleep: the waiters
    are registered before they block)."""
    while len(gil._critical_cond._waiters) < waiters:  # type: ignore[attr-defined]
        threading.Event().wait(0.001)  # a yield to the waiter, not a wait for it to act


def test_no_section_open_costs_no_wait() -> None:
    assert yield_to_critical() == 0.0


def test_a_task_waits_until_another_threads_section_ends() -> None:
    waited: list[float] = []
    task = threading.Thread(target=lambda: waited.append(yield_to_critical()))
    with critical_section(max_wait_s=60.0):
        task.start()
        _wait_until_waiting(1)
        assert task.is_alive() and not waited  # standing aside while the section is open
    task.join(timeout=30)
    assert not task.is_alive()
    assert waited and 0 < waited[0] < 30  # released by the end, not by the bound
    assert not gil._critical


def test_a_thread_never_waits_for_its_own_section() -> None:
    with critical_section(max_wait_s=60.0):
        assert yield_to_critical() == 0.0


def test_a_section_past_its_bound_is_not_waited_for() -> None:
    with critical_section(max_wait_s=1e-9):  # expired at once: a stalled metadata store
        task = threading.Thread(target=yield_to_critical)
        task.start()
        task.join(timeout=30)
        assert not task.is_alive()


def test_a_bound_of_zero_opens_no_section() -> None:
    with critical_section(max_wait_s=0.0):
        assert not gil._critical


def test_an_error_in_a_section_closes_it() -> None:
    with pytest.raises(RuntimeError), critical_section(max_wait_s=60.0):
        raise RuntimeError("boom")
    assert not gil._critical


def test_a_section_opened_for_every_thread_is_waited_for_by_its_opener_too() -> None:
    tokens: list[int | None] = []
    waited: list[float] = []

    def task() -> None:  # a barrier's persist opens it on the task thread itself
        tokens.append(gil.open_critical(max_wait_s=60.0, owner=None))
        waited.append(yield_to_critical())

    thread = threading.Thread(target=task)
    thread.start()
    _wait_until_waiting(1)
    gil.close_critical(tokens[0])  # the upload thread, once the segment is written
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert waited and waited[0] > 0 and not gil._critical


def test_a_section_never_closed_is_dropped_once_past_its_bound() -> None:
    token = gil.open_critical(max_wait_s=1e-9, owner=None)
    assert token is not None and token in gil._critical
    assert yield_to_critical() < 1.0
    assert not gil._critical  # nothing left for the fast path to trip over
    gil.close_critical(token)  # closing it late is harmless


# -- processes stopped while a section is open ------------------------------------------


def _sleep() -> subprocess.Popen[bytes]:
    """A child process of this one (so ``waitpid`` sees it stop and continue) that leads a
    process group of its own, as a forked snapshot's child does: the group of the test
    process may be orphaned (started in a session of its own), and a member of an
    orphaned group is never stopped by :data:`~dstl.gil.PAUSE_SIGNAL`."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)


@pytest.fixture
def sleeper() -> Iterator[int]:
    """A child of this process, to be stopped and continued (:func:`_sleep`)."""
    proc = _sleep()
    yield proc.pid
    gil.forget_paused(proc.pid)
    proc.kill()
    proc.wait()


def test_a_registered_process_is_stopped_while_a_section_is_open(sleeper: int) -> None:
    gil.pause_during_critical(sleeper)
    assert running(sleeper)
    first = gil.open_critical(owner=None)
    stopped(sleeper)
    second = gil.open_critical(owner=None)  # already stopped: no second stop
    gil.close_critical(first)
    assert running(sleeper)  # one section is still open: it stays stopped
    gil.close_critical(second)
    continued(sleeper)
    with critical_section():
        stopped(sleeper)
    continued(sleeper)


def test_a_forgotten_process_is_continued_and_never_stopped_again(sleeper: int) -> None:
    gil.pause_during_critical(sleeper)
    token = gil.open_critical(owner=None)
    stopped(sleeper)
    gil.forget_paused(sleeper)
    continued(sleeper)
    gil.close_critical(token)
    with critical_section():
        assert running(sleeper)


def test_a_process_registered_during_a_section_is_stopped_at_once(sleeper: int) -> None:
    other = _sleep()
    try:
        gil.pause_during_critical(other.pid)
        token = gil.open_critical(owner=None)
        stopped(other.pid)
        gil.pause_during_critical(sleeper)
        stopped(sleeper)
        gil.close_critical(token)
        continued(sleeper)
        continued(other.pid)
    finally:
        gil.forget_paused(other.pid)
        other.kill()
        other.wait()


def test_a_stop_ends_at_its_bound_even_while_the_section_stays_open(
    sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    gil.pause_during_critical(sleeper)
    monkeypatch.setattr(gil, "PAUSE_MAX_S", 0.0)  # every stop is overdue at once
    token = gil.open_critical(owner=None)
    stopped(sleeper)
    gil.resume_overdue()
    continued(sleeper)
    later = gil.open_critical(owner=None)  # overdue: not stopped again while one is open
    assert running(sleeper)
    gil.close_critical(later)
    gil.close_critical(token)
    monkeypatch.setattr(gil, "PAUSE_MAX_S", 30.0)
    with critical_section():  # every section closed: the next one stops it again
        stopped(sleeper)
    continued(sleeper)


def test_a_stop_ends_when_its_sections_are_dropped_past_their_bound(sleeper: int) -> None:
    gil.pause_during_critical(sleeper)
    token = gil.open_critical(max_wait_s=1e-9, owner=None)  # past its bound at once
    stopped(sleeper)
    yield_to_critical()  # drops it
    continued(sleeper)
    gil.close_critical(token)  # closed already: nothing
    assert running(sleeper)


def test_a_process_is_forgotten_inside_the_module_s_own_lock(sleeper: int) -> None:
    """A snapshot's finalizer forgets its child; a garbage collection can run it inside
    any allocation, this module's own locked steps included: no deadlock."""
    gil.pause_during_critical(sleeper)
    token = gil.open_critical(owner=None)
    stopped(sleeper)

    def finalizer_inside_the_lock() -> None:
        with gil._critical_cond:
            gil.forget_paused(sleeper)

    thread = threading.Thread(target=finalizer_inside_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "forget_paused deadlocked on the module's lock"
    continued(sleeper)
    gil.close_critical(token)


_ORPHAN = """
import os
if os.fork():  # the parent goes
    os._exit(0)
os.setpgid(0, 0)  # a group of its own, as a forked snapshot's child
os.write(1, b"%d\\n" % os.getpid())  # only now: before, a stop would stop it
while byte := os.read(0, 1):  # echo until the test closes its end
    os.write(1, byte)
"""


def test_a_process_whose_parent_died_is_never_stopped(reaped_by_pid: list[int]) -> None:
    """A stop that reaches a registered process after its parent died (its group is then
    orphaned) must not take effect: nothing would ever continue it (see
    :data:`~dstl.gil.PAUSE_SIGNAL`). With ``SIGSTOP`` it would stop, and not echo."""
    parent = subprocess.Popen(  # unbuffered: select() sees what read() gets
        [sys.executable, "-c", _ORPHAN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    assert parent.stdin is not None and parent.stdout is not None
    orphan = int(parent.stdout.readline())
    reaped_by_pid.append(orphan)
    assert parent.wait(timeout=30) == 0
    gil.pause_during_critical(orphan)
    try:
        with critical_section():  # the stop is sent now
            parent.stdin.write(b"x")
            ready = select.select([parent.stdout], [], [], 10.0)[0]
            assert ready, f"process {orphan} stopped after its parent died"
            assert parent.stdout.read(1) == b"x"
    finally:
        gil.forget_paused(orphan)
        parent.stdin.close()
        parent.stdout.close()


@pytest.fixture
def reaped_by_pid() -> Iterator[list[int]]:
    """Processes that are not children of this one, killed at the end (and waited for
    through a pidfd, at most 10 s)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            handle = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            select.select([handle], [], [], 10.0)
        finally:
            os.close(handle)
