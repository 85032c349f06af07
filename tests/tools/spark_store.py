"""Stores whose exact state at every checkpoint the tests know, and DataFrames as dumps.

:class:`Recorder` drives real backends (heap or RocksDB, changelog on or off), records
their checkpoint handles in a real metadata store, and keeps a raw dump of each state at
each checkpoint, as the job saw it (TTL-expired entries left out at the job's clock).
The reader returns every entry a checkpoint holds with its TTL timestamp and leaves
expiry to the query: :func:`df_dump` applies it at the job's clock, so equality checks
the timestamps too.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

from backends import ChangelogKeyedStateBackend, KeyGroupRange
from backends.state import MAP_LIKE, StateKind, StateMeta
from backends.wrappers import alive
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl import ChangelogStorage, FileIO
from materializer import FullSnapshotCheckpointer, Materializer
from tests.backends.conftest import MAX_PAR, Factory
from tests.backends.helpers import dump

Dump = dict[str, dict[Any, Any]]


def merge(dumps: list[Dump]) -> Dump:
    merged: Dump = {}
    for d in dumps:
        for name, entries in d.items():
            merged.setdefault(name, {}).update(entries)
    return merged


class Recorder:
    """Backends of one job's operator ``op`` in a store at ``root``; records checkpoints.

    Test thread only. ``expected[checkpoint id]`` is the merged raw dump at that checkpoint.
    """

    def __init__(
        self, root: Path, job: str, kind: str, changelog: bool, parallelism: int = 2
    ) -> None:
        self.root = root
        self.job = job
        self.kind = kind
        self.changelog = changelog
        self.fileio = FileIO(str(root))
        self.store = MetadataStore.for_local_store(str(root))
        self.store.start_attempt(job)
        self.storage = ChangelogStorage(self.fileio, job, f"w-{job}")
        self.factory = Factory(root / f"local-{job}", self.storage, self.fileio)
        self.expected: dict[int, Dump] = {}
        self.clock_at: dict[int, int] = {}
        self.backends = [self.new_backend(i, parallelism, "a0") for i in range(parallelism)]

    def new_backend(self, subtask: int, parallelism: int, attempt: str) -> Any:
        rng = KeyGroupRange.for_subtask(subtask, parallelism, MAX_PAR)
        inner = self.factory.store(self.kind, rng)
        writer = f"op-{subtask}-{attempt}"
        if self.changelog:
            return ChangelogKeyedStateBackend(inner, self.storage.create_writer(writer))
        return FullSnapshotCheckpointer(inner, self.fileio, self.job, "op", subtask, writer)

    def live(self, subtask: int) -> Any:
        """What a job's function mutates: the logged backend, or the plain store when
        every checkpoint is a full snapshot (the checkpointer reads it at checkpoints)."""
        b = self.backends[subtask]
        return b.inner if isinstance(b, FullSnapshotCheckpointer) else b

    def materialize(self, subtask: int) -> None:
        b = self.backends[subtask]
        Materializer(b, self.fileio, self.job, "op", subtask).materialize_now()

    def checkpoint(self) -> CompletedCheckpoint:
        cid = self.store.next_checkpoint_id(self.job)
        handles = [b.checkpoint(cid).result() for b in self.backends]
        now = time.time()
        cp = CompletedCheckpoint(
            self.job,
            cid,
            "checkpoint",
            now,
            now,
            tuple(SubtaskState("op", i, (h,)) for i, h in enumerate(handles)),
        )
        self.store.record_completed(cp, retain=1000)
        for b in self.backends:
            if isinstance(b, FullSnapshotCheckpointer):
                b.notify_checkpoint_complete(cid)
            else:
                b.writer.confirm(cid)
        self.expected[cid] = merge([dump(b.inner) for b in self.backends])
        self.clock_at[cid] = self.factory.clock()
        return cp

    def close(self) -> None:
        for b in self.backends:
            if isinstance(b, FullSnapshotCheckpointer):
                b.close()
        self.factory.close()
        self.storage.close()
        self.store.close()


def value_of(meta: StateMeta, value: Any, ts: Any = None) -> Any:
    """A reader's column value as the backend's raw value (the test trusts its pickles)."""

    def one(v: Any, t: Any) -> Any:
        if hasattr(v, "asDict"):  # a struct: a typed tuple
            v = tuple(v)
        if meta.value_serializer == "pickle" and v is not None:
            v = pickle.loads(v)
        return v if meta.ttl is None else (t, v)

    if meta.kind is StateKind.LIST:
        stamps = ts if ts is not None else [None] * len(value)
        return [one(v, t) for v, t in zip(value, stamps, strict=True)]
    return one(value, ts)


def df_dump(meta: StateMeta, rows: list[Any], now: int | None = None) -> dict[Any, Any]:
    """The rows of a state DataFrame as ``{key: raw value}`` (maps: ``{key: {uk: v}}``),
    with TTL entries expired at ``now`` left out (as :func:`tests.backends.helpers.dump`)."""
    out: dict[Any, Any] = {}
    for r in rows:
        d = r.asDict()
        v = value_of(meta, d["value"], d.get("ttl_timestamp"))
        key = tuple(d["key"]) if hasattr(d["key"], "asDict") else d["key"]
        if meta.kind in MAP_LIKE:
            out.setdefault(key, {})[d["user_key"]] = v
        else:
            assert key not in out, f"key {key!r} twice"
            out[key] = v
    if meta.ttl is None or now is None:
        return out
    is_list, is_map = meta.kind is StateKind.LIST, meta.kind in MAP_LIKE
    kept = {k: alive(v, is_list, is_map, meta.ttl.ttl_ms, now) for k, v in out.items()}
    return {k: v for k, v in kept.items() if v is not None}
