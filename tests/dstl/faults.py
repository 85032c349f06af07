"""A FileIO that fails, stalls or writes half a file on command (fault injection).

``plan`` is consumed one action per ``write_new`` call (empty plan: write normally):

- ``"ok"``: write normally
- ``"transient"``: raise :class:`TransientStorageError` without writing
- ``"fatal"``: raise a non-retryable :class:`StorageError` without writing
- ``"oserror"``: raise a raw ``OSError`` (as a library would) without writing
- ``"half"``: write the first half of the bytes under the target name, then raise a
  transient error (a connection reset mid-upload on a store without atomic PUT)
- ``"stall"``: set ``stalled``, block until ``release`` is set, then write normally

Its faults are an object store's (a connection reset, a stalled PUT), so its writes are
hedged like S3's (:attr:`FileIO.hedged`) unless made with ``hedged=False``.

Thread-safe: guarded by ``self._cond``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from dstl.errors import StorageError, TransientStorageError
from dstl.fileio import FileIO

STALL_LIMIT_S = 30.0  # a safety net so a broken test cannot hang forever, not a sleep


class FaultyFileIO(FileIO):
    """A :class:`FileIO` whose writes follow :attr:`plan`."""

    def __init__(
        self, root: str, storage_options: Mapping[str, Any] | None = None, hedged: bool = True
    ) -> None:
        super().__init__(root, storage_options)
        self._hedged = hedged
        self._cond = threading.Condition()
        self.plan: list[str] = []
        self.release = threading.Event()
        self.stalled = threading.Event()
        self.writes: list[tuple[str, str]] = []  # (path, action)
        self.deleted: list[str] = []

    @property
    def hedged(self) -> bool:
        return self._hedged

    def script(self, *actions: str) -> None:
        """Append ``actions`` to the plan."""
        with self._cond:
            self.plan.extend(actions)

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        with self._cond:
            action = self.plan.pop(0) if self.plan else "ok"
            self.writes.append((path, action))
            self._cond.notify_all()
        if action == "stall":
            self.stalled.set()
            if not self.release.wait(STALL_LIMIT_S):
                raise AssertionError("stalled write was never released")
            action = "ok"
        if action == "transient":
            raise TransientStorageError("injected: connection reset", self.url(path))
        if action == "fatal":
            raise StorageError("injected: access denied", self.url(path))
        if action == "oserror":
            raise OSError("injected: disk full")
        if action == "half":
            super().write_new(path, data[: len(data) // 2])
            raise TransientStorageError("injected: reset after half the bytes", self.url(path))
        super().write_new(path, data)

    def delete(self, path: str) -> bool:
        found = super().delete(path)
        with self._cond:
            self.deleted.append(path)
            self._cond.notify_all()
        return found

    def wait_for_writes(self, count: int, timeout_s: float = 10.0) -> bool:
        """Wait until ``count`` writes were attempted."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.writes) >= count, timeout_s)
