"""Restore or export a checkpoint's keyed state as Parquet tables: plan, then execute.

:func:`plan_restore` is pure: it says which operators, handles and files a restore uses.
:func:`check_plan` verifies that every file exists before anything is written.
:func:`state_tables` restores each operator in memory (every file checked against its
recorded size and hash; nothing of the store unpickled) and yields one typed Arrow table
per state. Two writers put them somewhere:

- :func:`write_local` (``statectl restore``): into a temporary directory next to the
  target, renamed into place at the end, so a failed restore leaves nothing behind;
- :func:`write_url` (``statectl export``): through a FileIO (a local directory or an S3
  prefix), tables first and the ``_STATECTL.json`` marker last, so a reader that waits
  for the marker never sees half an export.

Both write ``<target>/<operator>/<state>.parquet``, refuse names from the store that are
not plain (:func:`dstl.layout.plain_name`), refuse a target inside the store or holding it
(:func:`check_target`), and replace an existing target only with ``force`` and only if it
is empty or a previous output of theirs (it holds the marker): ``--force`` never deletes
a directory that statectl did not write.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from backends.handles import KeyedStateHandle
from backends.heap import HeapKeyedStateBackend, StateSnapshot
from backends.keygroups import KeyGroupRange
from backends.restore import restore_into
from backends.serializers import serializer_for
from backends.tables import snapshot_tables
from coordinator.metadata import CompletedCheckpoint
from dstl.errors import ConfigError, StorageNotFoundError
from dstl.fileio import FileIO
from dstl.layout import plain_name

MARKER = "_STATECTL.json"
"""Written last into every restore or export output: what it holds, and proof that
statectl wrote the directory (``--force`` replaces nothing else)."""


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What a restore of ``checkpoint`` reads and writes."""

    checkpoint: CompletedCheckpoint
    operators: dict[str, tuple[KeyedStateHandle, ...]]
    files: tuple[str, ...]
    output_dir: str
    bytes_total: int = 0

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary (what ``--dry-run`` prints)."""
        return {
            "job": self.checkpoint.job_id,
            "checkpoint": self.checkpoint.checkpoint_id,
            "output": self.output_dir,
            "operators": {
                op: {
                    "subtasks": len(hs),
                    "materializations": sum(len(h.materialized) for h in hs),
                    "changelog_blocks": sum(len(h.changelog) for h in hs),
                }
                for op, hs in self.operators.items()
            },
            "files": list(self.files),
            "bytes": self.bytes_total,
        }


def plan_restore(checkpoint: CompletedCheckpoint, output_dir: str) -> RestorePlan:
    """The restore plan of every keyed operator in ``checkpoint``.

    Operator names come from the metadata store: one that is not a plain name is
    corrupt metadata (:class:`~dstl.errors.CorruptionError`), never a path.
    """
    operators: dict[str, list[KeyedStateHandle]] = {}
    files: dict[str, int] = {}
    for s in checkpoint.subtasks:
        for h in s.handles:
            if isinstance(h, KeyedStateHandle):
                operators.setdefault(plain_name("operator", s.operator), []).append(h)
                for ref in h.file_refs():
                    files.setdefault(ref.location, ref.size_bytes)
    return RestorePlan(
        checkpoint,
        {op: tuple(hs) for op, hs in sorted(operators.items())},
        tuple(files),
        output_dir,
        sum(files.values()),
    )


def check_plan(plan: RestorePlan, fileio: FileIO) -> None:
    """Raise :class:`StorageNotFoundError` naming the first missing file."""
    for location in plan.files:
        path = fileio.relative(location)
        if not fileio.exists(path):
            raise StorageNotFoundError(
                f"checkpoint {plan.checkpoint.checkpoint_id} references a missing file",
                fileio.url(path),
            )


def restore_operator(fileio: FileIO, handles: tuple[KeyedStateHandle, ...]) -> StateSnapshot:
    """All key groups of one operator's state, restored in memory, with pickled values
    (and keys) left as their bytes: nothing of the store is unpickled."""
    first = handles[0]
    backend = HeapKeyedStateBackend(
        serializer_for(first.key_serializer, trusted=False),
        KeyGroupRange(0, first.max_parallelism),
        first.max_parallelism,
    )
    restore_into(backend, fileio, handles, trusted=False)  # a tool never runs the store's code
    return backend.snapshot()


def state_tables(plan: RestorePlan, fileio: FileIO) -> Iterator[tuple[str, str, pa.Table]]:
    """``(operator, state, table)`` for every state of every operator of ``plan``."""
    for operator, handles in plan.operators.items():
        snapshot = restore_operator(fileio, handles)
        for meta, table in snapshot_tables(snapshot):
            yield operator, plain_name("state", meta.name), table


# -- targets ---------------------------------------------------------------------------
def _local_root(url: str) -> str | None:
    """The resolved local path of a ``file://`` (or plain path) URL, else None."""
    if "://" in url and not url.startswith("file://"):
        return None
    return os.path.realpath(url.removeprefix("file://"))


def check_target(store_url: str, target: str) -> None:
    """Refuse (:class:`ConfigError`) a target inside the store, the store itself, or a
    directory that holds the store: writing or ``--force`` there would destroy it.

    Local paths are compared resolved (``realpath``: symlinks followed, ``.`` and ``..``
    gone); S3 targets by bucket and key prefix.
    """
    store_local, target_local = _local_root(store_url), _local_root(target)
    if store_local is not None and target_local is not None:
        a, b = store_local.rstrip("/") + "/", target_local.rstrip("/") + "/"
        if a.startswith(b) or b.startswith(a):
            raise ConfigError(
                f"refusing to write into {target}: it is inside the store {store_url} "
                "or holds it (writing there would destroy checkpoints)"
            )
        return
    if store_local is None and target_local is None:
        a = store_url.rstrip("/") + "/"
        b = target.rstrip("/") + "/"
        if a.startswith(b) or b.startswith(a):
            raise ConfigError(f"refusing to write into {target}: it overlaps the store {store_url}")


def _marker(plan: RestorePlan, counts: dict[str, dict[str, int]]) -> bytes:
    return json.dumps(
        {
            "written_by": "statectl",
            "job": plan.checkpoint.job_id,
            "checkpoint": plan.checkpoint.checkpoint_id,
            "kind": plan.checkpoint.kind,
            "rows": counts,
        },
        indent=2,
        sort_keys=True,
    ).encode()


def _parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def write_local(
    plan: RestorePlan,
    fileio: FileIO,
    force: bool = False,
    on_table: Callable[[str, str, int], None] | None = None,
) -> dict[str, dict[str, int]]:
    """Write ``<output>/<operator>/<state>.parquet`` atomically; rows per operator and state.

    Checks everything before the first byte: the target is not the store's, an existing
    target is replaced only with ``force`` and only if statectl wrote it, every file
    exists. ``on_table(operator, state, rows)`` is called after each table (progress).
    """
    target = os.path.abspath(plan.output_dir)
    check_target(fileio.root_url, target)
    replace = _check_replaceable(target, force)
    check_plan(plan, fileio)
    parent = os.path.dirname(target)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:8]}")
    counts: dict[str, dict[str, int]] = {op: {} for op in plan.operators}
    try:
        os.makedirs(tmp)
        for operator, state, table in state_tables(plan, fileio):
            os.makedirs(os.path.join(tmp, operator), exist_ok=True)
            with open(os.path.join(tmp, operator, f"{state}.parquet"), "xb") as fh:
                fh.write(_parquet(table))
            counts[operator][state] = table.num_rows
            if on_table is not None:
                on_table(operator, state, table.num_rows)
        with open(os.path.join(tmp, MARKER), "xb") as fh:
            fh.write(_marker(plan, counts))
        if replace:
            old = os.path.join(parent, f".{os.path.basename(target)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
        else:
            os.rename(tmp, target)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
    return counts


def _check_replaceable(target: str, force: bool) -> bool:
    """Whether an existing ``target`` is to be replaced; ConfigError if it may not be."""
    if not os.path.lexists(target):
        return False
    if not force:
        raise ConfigError(f"{target} exists: pass --force to replace it")
    if not os.path.isdir(target) or os.path.islink(target):
        raise ConfigError(f"{target} is not a directory: refusing to replace it")
    if os.listdir(target) and not os.path.isfile(os.path.join(target, MARKER)):
        raise ConfigError(
            f"{target} is not a statectl output (no {MARKER}): refusing to replace it"
        )
    return True


def write_url(
    plan: RestorePlan,
    fileio: FileIO,
    output: FileIO,
    force: bool = False,
    on_table: Callable[[str, str, int], None] | None = None,
) -> dict[str, dict[str, int]]:
    """Export to ``output`` (a local directory or an S3 prefix); rows per operator and state.

    Tables are written first and :data:`MARKER` last. An existing output is replaced only
    with ``force`` and only if it holds the marker (a previous export): its files are
    deleted first, so an interrupted replace leaves no marker behind.
    """
    check_target(fileio.root_url, output.root_url)
    existing = output.list("")
    if existing:
        if not force:
            raise ConfigError(f"{output.root_url} is not empty: pass --force to replace it")
        if not output.exists(MARKER):
            raise ConfigError(
                f"{output.root_url} is not a statectl output (no {MARKER}): refusing to replace it"
            )
    check_plan(plan, fileio)
    if existing:
        output.delete(MARKER)  # first: the old export is no longer complete
        for info in existing:
            output.delete(info.path)
    counts: dict[str, dict[str, int]] = {op: {} for op in plan.operators}
    for operator, state, table in state_tables(plan, fileio):
        output.write_new(f"{operator}/{state}.parquet", _parquet(table))
        counts[operator][state] = table.num_rows
        if on_table is not None:
            on_table(operator, state, table.num_rows)
    output.write_new(MARKER, _marker(plan, counts))
    return counts
