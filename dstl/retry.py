"""Retries, hedging, clocks and the in-flight byte budget of segment uploads.

Small explicit objects in the spirit of Flink's ``RetryPolicy`` and ``UploadThrottle``:

- :class:`RetryPolicy` answers "retry after how long, or give up?" (``None``). Only
  :class:`~dstl.errors.TransientStorageError` is retried; attempts are bounded.
- :class:`HedgedWrite` writes one blob with attempts under *unique names*: an attempt that
  runs longer than ``attempt_timeout_s`` gets a hedged second attempt running beside it; the
  first success wins. Files of losing or late attempts are deleted once the winner is known
  (and only once that attempt itself has finished, so a late write cannot land after its
  delete). The winner's file is never deleted here.
- :class:`InFlightBudget` bounds the bytes handed to uploads: acquiring blocks while the
  budget is used up. It never fails for slowness.
- :class:`Clock` is the injected time source and waiter: :class:`SystemClock` in
  production, :class:`ManualClock` in tests (time moves only through ``advance``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from dstl.errors import ConfigError, StorageError, TransientStorageError

log = logging.getLogger(__name__)


class Clock(Protocol):
    """Monotonic seconds (``clock()``) and a wait for an event with an absolute deadline."""

    def __call__(self) -> float:
        """Now, in monotonic seconds."""
        ...

    def wait_until(self, event: threading.Event, deadline: float | None) -> None:
        """Return when ``event`` is set or ``deadline`` (``None``: never) has passed.

        May return early (spuriously); callers re-check their state.
        """
        ...


class SystemClock:
    """Real time: :func:`time.monotonic` and :meth:`threading.Event.wait`. Stateless."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now

    def __call__(self) -> float:
        return self._now()

    def wait_until(self, event: threading.Event, deadline: float | None) -> None:
        """Block on ``event`` up to ``deadline``."""
        event.wait(None if deadline is None else max(0.0, deadline - self._now()))


class ManualClock:
    """A clock for tests: time moves only when :meth:`advance` is called.

    Thread-safe (guarded by ``self._cond``). :meth:`advance` wakes every waiter so it can
    re-check its deadline; a waiter whose deadline already passed returns at once.
    :meth:`wait_for_sleeper` lets a test wait (without sleeping) until a thread is blocked
    on a finite deadline, so it knows when advancing the clock has an effect.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._cond = threading.Condition()
        self._now = start
        self._waiting: dict[threading.Event, float | None] = {}

    def __call__(self) -> float:
        with self._cond:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every waiter."""
        with self._cond:
            self._now += seconds
            waiting = list(self._waiting)
            self._waiting.clear()  # woken: they register again if they still need to wait
        for event in waiting:
            event.set()

    def wait_until(self, event: threading.Event, deadline: float | None) -> None:
        """Block until ``event`` is set (by its producer or by :meth:`advance`)."""
        with self._cond:
            if deadline is not None and self._now >= deadline:
                return
            self._waiting[event] = deadline
            self._cond.notify_all()
        try:
            event.wait()
        finally:
            with self._cond:
                self._waiting.pop(event, None)

    def wait_for_sleeper(self, timeout_s: float = 10.0) -> float | None:
        """The earliest deadline a thread is blocked on, once there is one (else None)."""

        def deadlines() -> list[float]:
            return [d for d in self._waiting.values() if d is not None]

        with self._cond:
            if not self._cond.wait_for(lambda: bool(deadlines()), timeout_s):
                return None
            return min(deadlines())


def as_clock(clock: Callable[[], float] | Clock) -> Clock:
    """``clock`` itself if it can wait, else a :class:`SystemClock` reading ``clock``."""
    if hasattr(clock, "wait_until"):
        return clock
    return SystemClock(clock)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When to retry a failed upload attempt, and when to hedge a slow one.

    Invariants: at most ``max_attempts`` attempts per upload (hedges count); only
    :class:`TransientStorageError` is retried, after an exponential delay capped at
    ``max_delay_s``; an attempt running longer than ``attempt_timeout_s`` (``None``: never)
    gets one hedged attempt beside it. Immutable, so thread-safe.
    """

    max_attempts: int = 3
    base_delay_s: float = 0.1
    max_delay_s: float = 2.0
    attempt_timeout_s: float | None = 10.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("dstl.upload.max-attempts must be >= 1")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ConfigError("dstl.upload retry delays must be >= 0")
        if self.attempt_timeout_s is not None and self.attempt_timeout_s <= 0:
            raise ConfigError("dstl.upload.attempt-timeout-s must be > 0")

    def next_delay(self, attempts_made: int, error: BaseException) -> float | None:
        """Seconds to wait before the next attempt, or ``None`` to give up."""
        if attempts_made >= self.max_attempts or not isinstance(error, TransientStorageError):
            return None
        return min(self.base_delay_s * (2 ** (attempts_made - 1)), self.max_delay_s)

    def may_hedge(self, attempts_made: int) -> bool:
        """Whether another (hedged) attempt may start beside a slow one."""
        return self.attempt_timeout_s is not None and attempts_made < self.max_attempts


class InFlightBudget:
    """A byte budget for uploads in flight: :meth:`acquire` blocks while it is used up.

    Thread-safe (guarded by ``self._cond``). Invariant: ``used <= max_bytes`` unless a
    single acquisition is larger than the whole budget, which is admitted alone (so a large
    buffer is slow, never stuck). Never raises for slowness.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._used = 0
        self._waiters = 0

    @property
    def used(self) -> int:
        """Bytes currently acquired."""
        with self._cond:
            return self._used

    def acquire(self, nbytes: int) -> None:
        """Take ``nbytes``, blocking (backpressure) until they fit."""
        with self._cond:
            if self._used > 0 and self._used + nbytes > self.max_bytes:
                self._waiters += 1
                self._cond.notify_all()
                try:
                    while self._used > 0 and self._used + nbytes > self.max_bytes:
                        self._cond.wait()
                finally:
                    self._waiters -= 1
            self._used += nbytes

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` and wake blocked acquirers."""
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    def wait_for_blocked(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` acquirers are blocked (for tests and diagnostics)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiters >= count, timeout_s)


@dataclass(slots=True)
class _Attempt:
    path: str
    started: float
    done: bool = False
    error: BaseException | None = None


class HedgedWrite:
    """One blob written with retries and hedging; the first successful attempt wins.

    Owned by one driving thread (the upload thread) that calls :meth:`run`; attempts run on
    ``executor`` and report back under ``self._lock``. Without an executor (a store whose
    writes are not hedged, :attr:`~dstl.fileio.FileIO.hedged`) each attempt runs on the
    driving thread, one after another: retried, never hedged, since nothing runs beside an
    attempt that blocks its driver. Every attempt writes under a fresh
    name from ``new_path``. Invariants: the winner's file is never deleted; every other
    attempt's file is deleted (tolerating "already gone") once both the winner is known and
    that attempt has finished; if every attempt fails, their files are deleted too (nothing
    can reference them) and :meth:`run` raises the last error.
    """

    def __init__(
        self,
        write: Callable[[str, bytes | memoryview], None],
        delete: Callable[[str], object],
        new_path: Callable[[], str],
        data: bytes | memoryview,
        policy: RetryPolicy,
        clock: Clock,
        executor: Executor | None,
    ) -> None:
        self._write = write
        self._delete = delete
        self._new_path = new_path
        self._data = data
        self._policy = policy
        self._clock = clock
        self._executor = executor
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._attempts: list[_Attempt] = []
        self._winner: int | None = None
        self._finished = False  # run() returned: late finishers clean up after themselves
        self._retry_at: float | None = None
        self._last_error: BaseException | None = None

    @property
    def attempts(self) -> int:
        """How many attempts were started."""
        with self._lock:
            return len(self._attempts)

    def run(self) -> str:
        """Drive attempts until one succeeds (returns its path) or the policy gives up."""
        while True:
            self._wakeup.clear()
            state, deadline, winner = self._step()
            if state == "won":
                assert winner is not None
                self._cleanup(keep=winner)
                return winner
            if state == "gave_up":
                self._cleanup(keep=None)
                assert self._last_error is not None
                raise self._last_error
            self._clock.wait_until(self._wakeup, deadline)

    def _step(self) -> tuple[str, float | None, str | None]:
        """One decision: ("wait", deadline or None, None), ("won", None, path), ("gave_up", ...)."""
        now = self._clock()
        start_new = False
        with self._lock:
            if self._winner is not None:
                return "won", None, self._attempts[self._winner].path
            running = [a for a in self._attempts if not a.done]
            made = len(self._attempts)
            deadline: float | None = None
            if not self._attempts:
                start_new = True
            elif running:
                newest = max(a.started for a in running)
                timeout = self._policy.attempt_timeout_s
                retryable = self._last_error is None or isinstance(
                    self._last_error, TransientStorageError
                )
                if (
                    len(running) == 1
                    and retryable
                    and timeout is not None
                    and self._policy.may_hedge(made)
                ):
                    if now >= newest + timeout:
                        start_new = True
                        log.info("segment upload slow, hedging attempts=%d", made)
                    else:
                        deadline = newest + timeout
            elif self._retry_at is None:
                assert self._last_error is not None
                delay = self._policy.next_delay(made, self._last_error)
                if delay is None:
                    return "gave_up", None, None
                self._retry_at = now + delay
                deadline = self._retry_at
                if delay == 0:
                    start_new = True
            elif now >= self._retry_at:
                start_new = True
            else:
                deadline = self._retry_at
            if start_new:
                self._retry_at = None
                index = len(self._attempts)
                self._attempts.append(_Attempt(self._new_path(), now))
        if start_new:
            if self._executor is None:
                self._attempt(index)
            else:
                self._executor.submit(self._attempt, index)
            return "wait", now, None  # step again at once: maybe a timeout is due
        return "wait", deadline, None

    def _attempt(self, index: int) -> None:
        with self._lock:
            path = self._attempts[index].path
        error: BaseException | None = None
        try:
            self._write(path, self._data)
        except BaseException as exc:  # reported to the driving thread, never lost
            error = exc
        with self._lock:
            attempt = self._attempts[index]
            attempt.done = True
            attempt.error = error
            if error is None and self._winner is None:
                self._winner = index
            elif error is not None:
                self._last_error = error
            late_loser = self._finished and self._winner != index
        if error is not None:
            log.warning("segment upload attempt failed path=%s error=%s", path, error)
        if late_loser:
            self._delete_quietly(path)
        self._wakeup.set()

    def _cleanup(self, keep: str | None) -> None:
        with self._lock:
            self._finished = True
            doomed = [a.path for a in self._attempts if a.done and a.path != keep]
        for path in doomed:
            self._delete_quietly(path)

    def _delete_quietly(self, path: str) -> None:
        try:
            self._delete(path)
        except StorageError as exc:  # left for the orphan sweep
            log.warning("could not delete losing upload path=%s error=%s", path, exc)
