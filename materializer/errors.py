"""Errors of the materializer, rooted in :mod:`dstl.errors`.

::

    StateBackendError
    └── MaterializationError                 a materialization could not be taken or uploaded
        └── MaterializationFailuresExceededError
                                             too many consecutive failures: the task fails
"""

from __future__ import annotations

from dstl.errors import StateBackendError


class MaterializationError(StateBackendError):
    """A materialization failed (snapshot, reading a local file, or the upload).

    The backend is unchanged: its checkpoints keep referencing the previous base and the log.
    """


class MaterializationFailuresExceededError(MaterializationError):
    """``failures`` materializations in a row failed; the owning task must fail.

    ``last_error`` is the failure that exhausted the budget.
    """

    def __init__(self, failures: int, last_error: BaseException) -> None:
        super().__init__(
            f"materialization failed {failures} times in a row; last error: "
            f"{last_error.__class__.__name__}: {last_error}"
        )
        self.failures = failures
        self.last_error = last_error
