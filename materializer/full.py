"""Changelog off: every checkpoint is a materialization (the baseline of the benchmarks).

:class:`FullSnapshotCheckpointer` wraps a plain keyed backend (no DSTL writer) and has the
checkpoint contract of :meth:`backends.changelog.ChangelogKeyedStateBackend.checkpoint`:
``checkpoint(id)`` takes the snapshot on the task thread, uploads on its own executor
thread, and returns a future of a :class:`~backends.handles.KeyedStateHandle` with
``materialized=(handle,)`` and no changelog. Files are shared with the materialization of
the newest *confirmed* checkpoint (``notify_checkpoint_complete``), as RocksDB incremental
checkpoints do: that makes RocksDB checkpoints incremental and heap checkpoints upload
only changed pieces. Sharing only from a confirmed checkpoint is what keeps reference
counting safe (see :mod:`materializer.materializer`): its files are referenced by the
newest completed checkpoint until ours completes.

Switching across a restore works both ways: :func:`restore_full_backend` restores any
checkpoint (a changelog one is replayed), and a changelog backend restores a full
checkpoint with :func:`backends.restore.restore_changelog_backend` (a materialization with
``sqn=0`` and no log).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from backends.backend import KeyedStateBackend
from backends.forked import materialization_snapshot
from backends.handles import KeyedStateHandle, MaterializationHandle
from backends.keygroups import KeyGroupRange
from backends.restore import relevant, restore_into
from backends.serializers import Serializer
from backends.snapshot import MaterializationSnapshot
from backends.state import StateDescriptor, StateMeta
from dstl import layout
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle
from dstl.upload import Uploader
from materializer.materializer import (
    MaterializationResult,
    MaterializationStats,
    Materializer,
    MaterializerOptions,
)

log = logging.getLogger(__name__)


class FullSnapshotCheckpointer:
    """A backend with the changelog switched off: checkpoints are materializations.

    Task thread: state access, :meth:`checkpoint`, the notifications, :attr:`base`. The
    upload runs on an owned single thread ``checkpoint-<backend_id>`` (joined by
    :meth:`close`); it completes the returned futures and writes ``self._results`` under
    ``self._lock``. Invariant: :attr:`base` is the materialization of the newest
    checkpoint confirmed complete (or the restored one), the only files shared.
    """

    def __init__(
        self,
        backend: KeyedStateBackend,
        fileio: FileIO,
        job: str,
        operator: str,
        subtask: int,
        backend_id: str,
        clock: Callable[[], float] = time.monotonic,
        options: MaterializerOptions | None = None,
        executor: Executor | None = None,
        uploader: Uploader | None = None,
    ) -> None:
        self.inner = backend
        self._backend_id = layout.check_name("backend", backend_id)
        self.base: tuple[MaterializationHandle, ...] = ()
        self.restored_log: tuple[ChangelogHandle, ...] = ()  # a full snapshot has no log
        # ``uploader``: a worker's shared one (its owner closes it), else the
        # materializer makes and closes its own
        self.materializer = Materializer(
            self, fileio, job, operator, subtask, clock, options, uploader=uploader
        )
        self._owned = executor is None
        self._executor: Executor = executor or ThreadPoolExecutor(
            1, thread_name_prefix=f"checkpoint-{backend_id}"
        )
        self._lock = threading.Lock()
        self._results: dict[int, MaterializationResult] = {}
        self._confirmed = 0

    def __enter__(self) -> FullSnapshotCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state access (the operator uses this object like a backend) --------------------
    @property
    def backend_id(self) -> str:
        """Unique per backend instance and attempt (the handles' writer id)."""
        return self._backend_id

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups this backend owns."""
        return self.inner.key_group_range

    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key every state call acts on."""
        self.inner.set_current_key(key)

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor`` (no logging: changelog is off)."""
        return self.inner.get_state(descriptor)

    # -- what timers need of a backend (backends.timers.TimerService) ----------------------
    @property
    def key_serializer(self) -> Serializer:
        """The key serializer of the wrapped store."""
        return self.inner.key_serializer

    @property
    def current_key(self) -> Any:
        """The current key."""
        return self.inner.current_key

    @property
    def current_key_bytes(self) -> bytes:
        """The current key, serialized."""
        return self.inner.current_key_bytes

    @property
    def current_key_group(self) -> int:
        """The current key's key group."""
        return self.inner.current_key_group

    def set_current_key_raw(self, key: Any, key_bytes: bytes, key_group: int) -> None:
        """Set the current key when its bytes and group are known."""
        self.inner.set_current_key_raw(key, key_bytes, key_group)

    def state_metas(self) -> dict[str, StateMeta]:
        """Every state declared or restored, by name."""
        return self.inner.state_metas()

    def entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """``(key_group, key, raw value)`` of every entry of state ``name``."""
        return self.inner.entries(name)

    # -- MaterializationSource ----------------------------------------------------------
    def snapshot_for_materialization(self) -> MaterializationSnapshot:
        """A snapshot of the state (a heap store forks, see :mod:`backends.forked`);
        ``sqn=0``: there is no log to replay after it."""
        return materialization_snapshot(self.inner, 0)

    def materialization_done(self, handle: MaterializationHandle) -> None:
        """Nothing: the base moves only when a checkpoint is confirmed."""

    def changed_since_materialization(self) -> bool:
        """Always True: without a log there is no cheap change signal."""
        return True

    def log_bytes(self) -> int:
        """0: a full snapshot has no log."""
        return 0

    # -- checkpoints --------------------------------------------------------------------
    @property
    def last_stats(self) -> MaterializationStats | None:
        """The cost of the newest finished upload."""
        return self.materializer.last_stats

    def checkpoint(self, checkpoint_id: int) -> Future[KeyedStateHandle]:
        """Snapshot now (task thread); the future completes on the upload thread.

        The handle shares every file of the newest confirmed checkpoint it can.
        """
        mat_id, snap = self.materializer.snapshot()
        kgr = self.key_group_range
        key_ser, max_par = self.inner.key_serializer.name, self.inner.max_parallelism
        result: Future[KeyedStateHandle] = Future()

        def upload() -> None:
            try:
                res = self.materializer.upload_result(mat_id, snap)
                handle = KeyedStateHandle(
                    self._backend_id, kgr.start, kgr.end, key_ser, max_par, (res.handle,), ()
                )
            except BaseException as exc:  # new files are already deleted by the upload
                result.set_exception(exc)
                return
            with self._lock:
                self._results[checkpoint_id] = res
            result.set_result(handle)

        try:
            self._executor.submit(upload)
        except RuntimeError:
            self.materializer.forget(mat_id)
            snap.release()
            raise
        return result

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` is durable in the metadata store: share its files.

        Results of older checkpoints are dropped (their files stay owned by the metadata
        store's reference counts).
        """
        if checkpoint_id <= self._confirmed:
            return
        with self._lock:
            res = self._results.get(checkpoint_id)
            for cid in [c for c in self._results if c <= checkpoint_id]:
                del self._results[cid]
        if res is None:
            return  # completed before its upload reported back: keep the older base
        self._confirmed = checkpoint_id
        self.base = (res.handle,)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """The checkpoint was aborted. Its files are not deleted here: whether a record
        references them is not known on this side, so the orphan sweep decides."""
        with self._lock:
            self._results.pop(checkpoint_id, None)

    def close(self) -> None:
        """Finish in-flight uploads and join the owned upload thread. Idempotent."""
        if self._owned:
            self._executor.shutdown(wait=True)
        self.materializer.close()


def restore_full_backend(
    checkpointer: FullSnapshotCheckpointer, fileio: FileIO, handles: Sequence[KeyedStateHandle]
) -> None:
    """Restore any checkpoint (full or changelog) into a changelog-off backend.

    The restored materializations become the base, so the first checkpoint shares what
    did not change (a changelog checkpoint's log is replayed, not referenced again).
    """
    restore_into(checkpointer.inner, fileio, handles)
    wanted = relevant(handles, checkpointer.key_group_range)
    checkpointer.base = tuple(m for h in wanted for m in h.materialized)
