"""What ``waitpid`` reports of a child process of the test: stops and continues, waited
for with a bound (a report that never comes fails the test instead of hanging it)."""

from __future__ import annotations

import os
import threading
import time

from dstl.gil import PAUSE_SIGNAL


def _reported(pid: int, flag: int) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG | flag)
        if got:
            return status
        threading.Event().wait(0.001)  # a yield to the signalled process
    raise AssertionError(f"process {pid}: nothing reported in 10 s")


def stopped(pid: int) -> None:
    """Wait until the child ``pid`` has stopped (:data:`~dstl.gil.PAUSE_SIGNAL`)."""
    status = _reported(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == PAUSE_SIGNAL


def continued(pid: int) -> None:
    """Wait until the stopped child ``pid`` has been continued."""
    assert os.WIFCONTINUED(_reported(pid, os.WCONTINUED))


def running(pid: int) -> bool:
    """No stop or continue of the child ``pid`` is waiting to be reported."""
    return os.waitpid(pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED) == (0, 0)
