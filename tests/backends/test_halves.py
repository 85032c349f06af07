"""A job in two halves (:func:`backends.halves.run_halves`): the upper half in a forked
child, and whatever the child does not finish (it fails, is stuck, or cannot be forked)
in the caller, so the result is the same either way."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from backends import halves


def _halves(tmp_path: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two halves that each record, in a file of their own, which process ran them."""

    def half(name: str) -> Callable[[], None]:
        def run() -> None:
            (tmp_path / name).write_text(str(os.getpid()))

        return run

    return half("lower"), half("upper")


def _ran(tmp_path: Path) -> dict[str, int]:
    return {name: int((tmp_path / name).read_text()) for name in ("lower", "upper")}


def _never_ends() -> None:  # pragma: no cover - a child's, until it is killed
    signal.pause()


@pytest.fixture
def forked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the children run_halves forks."""
    pids: list[int] = []
    fork = halves._fork

    def recording(upper: Callable[[], None]) -> int | None:
        pid = fork(upper)
        assert pid is not None
        pids.append(pid)
        return pid

    monkeypatch.setattr(halves, "_fork", recording)
    return pids


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def test_the_upper_half_runs_in_a_child_the_lower_here(
    tmp_path: Path, forked: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="backends.halves"):
        halves.run_halves(*_halves(tmp_path))
    ran = _ran(tmp_path)
    assert ran["lower"] == os.getpid()
    assert ran["upper"] == forked[0] != os.getpid()
    assert _reaped(forked[0])
    assert caplog.text == ""


def test_a_failed_child_leaves_its_half_to_the_caller(
    tmp_path: Path,
    forked: list[int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    lower, upper = _halves(tmp_path)

    def failing_in_the_child() -> None:
        if os.getpid() != parent:
            raise RuntimeError("disk full")
        upper()

    parent = os.getpid()
    monkeypatch.setattr(halves.traceback, "print_exc", lambda: None)  # the child's stderr
    with caplog.at_level(logging.WARNING, logger="backends.halves"):
        halves.run_halves(lower, failing_in_the_child)
    assert "exited 1" in caplog.text
    assert _ran(tmp_path) == {"lower": os.getpid(), "upper": os.getpid()}
    assert _reaped(forked[0])


def test_a_stuck_child_is_killed_and_reaped(
    tmp_path: Path, forked: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child still running past its deadline (here: one that never ends) is killed
    and reaped; the caller runs its half."""
    lower, upper = _halves(tmp_path)

    def stuck_in_the_child() -> None:
        if os.getpid() != parent:
            _never_ends()
        upper()

    parent = os.getpid()
    monkeypatch.setattr(halves, "_child_deadline_s", lambda own_s: 0.05)
    halves.run_halves(lower, stuck_in_the_child)
    assert _ran(tmp_path) == {"lower": os.getpid(), "upper": os.getpid()}
    assert _reaped(forked[0])


def test_a_failed_fork_runs_both_halves_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    with caplog.at_level(logging.WARNING, logger="backends.halves"):
        halves.run_halves(*_halves(tmp_path))
    assert "fork failed" in caplog.text
    assert _ran(tmp_path) == {"lower": os.getpid(), "upper": os.getpid()}


def test_a_failing_caller_kills_and_reaps_its_child(tmp_path: Path, forked: list[int]) -> None:
    """The caller's own half fails: the error is raised, and the child (here: one that
    would never end) is killed and reaped first."""

    def failing() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        halves.run_halves(failing, _never_ends)
    assert _reaped(forked[0])
