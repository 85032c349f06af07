"""Verify a checkpoint without restoring it: every file there, intact, and consistent.

For each file a checkpoint references (:meth:`CompletedCheckpoint.file_refs`):

1. it exists, and its size and content hash are the ones recorded when it was written
   (:func:`dstl.integrity.read_verified`);
2. its format checks pass for every handle that uses it: a changelog segment's footer,
   block checksum, writer and row count; a heap state table's Parquet pages and state
   metadata; a RocksDB materialization's file names and ``STATE-META.json``; a staged sink
   transaction's JSON lines; a channel state file's header and checksum (never unpickled);

and the handles agree with each other: one operator's key-group ranges are disjoint and
within its maximum parallelism, with one key serializer; a materialization overlaps the
range of the state that references it; sink and channel state belong to this checkpoint
or an earlier one. Every problem is collected (nothing stops at the first), each naming
its file or handle. Pure apart from reading the store.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from backends.restore import _file_name
from backends.rocksdb import META_FILE, decode_metadata
from backends.tables import parquet_to_table, table_meta
from coordinator.embedded.channel_state import check_channel_state
from coordinator.handles import ChannelStateHandle, SinkTransactionHandle
from coordinator.metadata import CompletedCheckpoint
from dstl.errors import CorruptionError, StorageNotFoundError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle
from dstl.integrity import read_verified
from dstl.segment import SegmentReader

MISSING, CORRUPT, INCONSISTENT = "missing", "corrupt", "inconsistent"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a checkpoint: its kind, where (a URL or handle) and what."""

    checkpoint_id: int
    kind: str
    where: str
    detail: str

    def line(self) -> str:
        """One line for people."""
        return f"checkpoint {self.checkpoint_id}: {self.kind}: {self.where}: {self.detail}"


def _uses(cp: CompletedCheckpoint) -> dict[str, list[Any]]:
    """Every file location of ``cp`` -> the handles (and state files) that read it."""
    uses: dict[str, list[Any]] = {}
    for s in cp.subtasks:
        for h in s.handles:
            if isinstance(h, KeyedStateHandle):
                for m in h.materialized:
                    for f in m.state_files:
                        uses.setdefault(f.location, []).append((m, f))
                for c in h.changelog:
                    uses.setdefault(c.location, []).append(c)
            else:
                for location in h.files():
                    uses.setdefault(location, []).append(h)
    return uses


def _check_format(data: bytes, url: str, use: Any) -> None:
    """Raise :class:`CorruptionError` if ``data`` fails ``use``'s format checks."""
    if isinstance(use, ChangelogHandle):
        table = SegmentReader(data, url).read_block(use.block, use.writer_id)
        if table.num_rows != use.rows:
            raise CorruptionError(
                f"block {use.block} has {table.num_rows} rows, handle says {use.rows}", url
            )
    elif isinstance(use, tuple):
        mat, f = use
        assert isinstance(mat, MaterializationHandle) and isinstance(f, StateFileHandle)
        if mat.kind == "heap-parquet":
            table_meta(parquet_to_table(data, url), url)
        elif mat.kind == "rocksdb-sst":
            if _file_name(f.location, f.name) == META_FILE:
                decode_metadata(data, url)
        else:
            raise CorruptionError(f"unknown materialization kind {mat.kind!r}", url)
    elif isinstance(use, SinkTransactionHandle) and use.suffix == "parquet":
        # the Spark host stages its output parts as Parquet
        rows = parquet_to_table(data, url).num_rows
        if rows != use.records:
            raise CorruptionError(f"{rows} records, handle says {use.records}", url)
    elif isinstance(use, SinkTransactionHandle):
        lines = data.decode("utf-8", "strict").splitlines()
        if len(lines) != use.records:
            raise CorruptionError(f"{len(lines)} records, handle says {use.records}", url)
        for line in lines:
            json.loads(line)
    elif isinstance(use, ChannelStateHandle):
        check_channel_state(data, url)


def _check_handles(cp: CompletedCheckpoint) -> Iterator[Problem]:
    by_op: dict[str, list[KeyedStateHandle]] = {}
    for s in cp.subtasks:
        for h in s.handles:
            where = f"{s.operator}/{s.subtask}"
            if isinstance(h, KeyedStateHandle):
                by_op.setdefault(s.operator, []).append(h)
                for m in h.materialized:
                    if not m.key_group_range.intersects(h.key_group_range):
                        yield Problem(
                            cp.checkpoint_id,
                            INCONSISTENT,
                            where,
                            f"materialization {m.materialization_id} holds key groups "
                            f"[{m.key_group_start}, {m.key_group_end}) outside the state's "
                            f"[{h.key_group_start}, {h.key_group_end})",
                        )
            elif (
                isinstance(h, SinkTransactionHandle | ChannelStateHandle)
                and h.checkpoint_id > cp.checkpoint_id
            ):
                yield Problem(
                    cp.checkpoint_id,
                    INCONSISTENT,
                    where,
                    f"{type(h).TYPE_TAG} of later checkpoint {h.checkpoint_id}",
                )
    for op, handles in by_op.items():
        if len({(h.key_serializer, h.max_parallelism) for h in handles}) > 1:
            yield Problem(
                cp.checkpoint_id, INCONSISTENT, op, "subtasks disagree on keys or max parallelism"
            )
        spans = sorted((h.key_group_start, h.key_group_end) for h in handles)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                yield Problem(
                    cp.checkpoint_id, INCONSISTENT, op, f"key-group ranges overlap at {start}"
                )


def verify_checkpoint(
    fileio: FileIO, cp: CompletedCheckpoint, on_read: Callable[[int], None] | None = None
) -> list[Problem]:
    """Every problem of ``cp`` (empty: it restores as recorded). ``on_read(n)``: progress."""
    problems = list(_check_handles(cp))
    uses = _uses(cp)
    for ref in cp.file_refs():
        url = fileio.url(fileio.relative(ref.location))
        try:
            data = read_verified(fileio, ref)
            if on_read is not None:
                on_read(ref.size_bytes)
            for use in uses.get(ref.location, []):
                _check_format(data, url, use)
        except StorageNotFoundError:
            problems.append(Problem(cp.checkpoint_id, MISSING, url, "no such file"))
        except CorruptionError as exc:
            problems.append(Problem(cp.checkpoint_id, CORRUPT, url, _detail(exc, url)))
        except (UnicodeDecodeError, ValueError) as exc:
            problems.append(Problem(cp.checkpoint_id, CORRUPT, url, f"unreadable ({exc})"))
    return problems


def _detail(exc: CorruptionError, url: str) -> str:
    text = str(exc)
    return text[: -len(url) - 2] if text.endswith(f": {url}") else text
