"""Write-once uploads of whole files, with the changelog's retries, hedging and byte budget.

Changelog segments have had retries, hedged attempts and backpressure since the DSTL was
built (:mod:`dstl.changelog`, :mod:`dstl.retry`); materialized state files, channel state
and staged sink transactions used to be one plain write each, so one slow or failed PUT
failed a materialization or a checkpoint. :class:`Uploader` gives them the same:

- each attempt writes under its own name (:func:`attempt_path`: attempt 0 the given path,
  attempt ``i`` ``<stem>.a<i><ext>``), so a hedged attempt never races another on one
  object, and the winner's path is what the caller records in its handle;
- transient failures are retried after the policy's backoff, a slow attempt is hedged,
  losing and failed attempts' files are deleted (:class:`~dstl.retry.HedgedWrite`);
- the bytes of uploads in progress are bounded by an :class:`~dstl.retry.InFlightBudget`:
  a caller blocks (backpressure) until its file fits, never fails for slowness.
"""

from __future__ import annotations

import itertools
import posixpath
from concurrent.futures import ThreadPoolExecutor

from dstl.fileio import FileIO
from dstl.retry import Clock, HedgedWrite, InFlightBudget, RetryPolicy, SystemClock


def attempt_path(path: str, attempt: int) -> str:
    """The name attempt ``attempt`` of an upload to ``path`` writes (0: ``path`` itself)."""
    if attempt == 0:
        return path
    directory, name = posixpath.split(path)
    stem, dot, ext = name.partition(".")
    suffixed = f"{stem}.a{attempt}{dot}{ext}" if dot else f"{stem}.a{attempt}"
    return posixpath.join(directory, suffixed) if directory else suffixed


class Uploader:
    """Uploads whole files with retries, hedging and an in-flight byte budget.

    Thread-safe: any thread may call :meth:`upload` (it blocks until the file is durable
    or the policy gave up); attempts run on an owned pool of named threads
    (``upload-<name>``), joined by :meth:`close`, or on the caller's thread for a store
    whose writes are not hedged (:attr:`~dstl.fileio.FileIO.hedged`: local disk). The
    budget is shared by every caller.
    """

    def __init__(
        self,
        fileio: FileIO,
        policy: RetryPolicy | None = None,
        budget: InFlightBudget | None = None,
        clock: Clock | None = None,
        name: str = "files",
    ) -> None:
        self.fileio = fileio
        self.policy = policy or RetryPolicy()
        self.budget = budget or InFlightBudget(100 * 1024 * 1024)
        self._clock = clock or SystemClock()
        # attempts of concurrent uploads run side by side; a hedge adds one more each
        self._pool = ThreadPoolExecutor(
            max_workers=4 * self.policy.max_attempts, thread_name_prefix=f"upload-{name}"
        )

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def upload(self, path: str, data: bytes | memoryview) -> str:
        """Durably write ``data`` under ``path`` (or an attempt's name); returns the path
        that holds it. Raises the last attempt's :class:`~dstl.errors.StorageError` when
        the policy gives up; no file of a failed upload is left behind (but one whose
        write outcome is unknown, which the orphan sweep reclaims)."""
        attempts = itertools.count()
        size = len(data)
        self.budget.acquire(size)  # backpressure: blocks, never fails
        try:
            return HedgedWrite(
                self.fileio.write_new,
                self.fileio.delete,
                lambda: attempt_path(path, next(attempts)),
                data,
                self.policy,
                self._clock,
                self._pool if self.fileio.hedged else None,
            ).run()
        finally:
            self.budget.release(size)

    def close(self) -> None:
        """Wait for attempts still running and stop the pool. Idempotent."""
        self._pool.shutdown(wait=True)
