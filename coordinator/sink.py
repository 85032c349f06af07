"""A transactional (two-phase commit) file sink: exactly-once output with aligned barriers.

Pre-commit at a barrier: the records since the previous barrier are staged durably in the
state store (write-once) and the staged transactions are part of the sink's checkpoint
state. Commit on "checkpoint complete": each staged transaction is published into the
output directory as ``part-<checkpoint:016x>-<subtask:04x>.jsonl``; publishing is
write-once, so committing twice (after a crash between commit and notification, or on
restore) is a no-op. Transactions of aborted checkpoints stay staged and are committed
with the next completed checkpoint, as Flink's ``TwoPhaseCommitSinkFunction`` does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from dstl import layout
from dstl.errors import StorageConflictError
from dstl.fileio import FileIO
from dstl.handles import register_handle
from dstl.integrity import FileRef, content_hash, read_verified
from dstl.layout import check_location

PART_SUFFIXES = ("jsonl", "parquet")


@register_handle("sink-transaction")
@dataclass(frozen=True, slots=True)
class SinkTransactionHandle:
    """A staged (pre-committed) sink transaction: its file and what it commits as.

    ``suffix`` is the committed part's file type: ``jsonl`` (the embedded runtime's JSON
    lines) or ``parquet`` (the Spark host's typed output).
    """

    location: str
    checkpoint_id: int
    subtask: int
    records: int
    size_bytes: int
    content_hash: str = ""
    suffix: str = "jsonl"

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        check_location(self.location)
        # checkpoint 0 exists on the Spark host: its checkpoint ids are the batch ids
        if self.checkpoint_id < 0 or self.records < 1 or self.suffix not in PART_SUFFIXES:
            raise ValueError(f"invalid sink transaction {self!r}")

    def files(self) -> list[str]:
        """The staged file."""
        return [self.location]

    def file_refs(self) -> list[FileRef]:
        """The staged file, with its size and content hash."""
        return [FileRef(self.location, self.size_bytes, self.content_hash)]


def part_name(checkpoint_id: int, subtask: int, suffix: str = "jsonl") -> str:
    """Name of a committed output part (sorts by checkpoint)."""
    return f"part-{checkpoint_id:016x}-{subtask:04x}.{suffix}"


class TransactionalFileSink:
    """The sink logic of one subtask. Task thread only.

    Invariant: every record handed to :meth:`write` is in exactly one staged transaction
    once :meth:`pre_commit` ran, and in exactly one committed part once a checkpoint
    covering it completed.
    """

    def __init__(
        self, state_io: FileIO, output_io: FileIO, job: str, operator: str, subtask: int
    ) -> None:
        self._state_io = state_io
        self._output_io = output_io
        self._job = job
        self._operator = operator
        self._subtask = subtask
        self._current: list[Any] = []
        self.staged: dict[int, SinkTransactionHandle] = {}

    def write(self, records: Iterable[Any]) -> None:
        """Buffer records for the current transaction."""
        self._current.extend(records)

    def pre_commit(self, checkpoint_id: int) -> tuple[SinkTransactionHandle, ...]:
        """Stage the current transaction; returns every staged, uncommitted transaction."""
        if self._current:
            data = "".join(
                json.dumps(r, separators=(",", ":")) + "\n" for r in self._current
            ).encode()
            path = layout.sink_transaction_path(
                self._job, self._operator, self._subtask, checkpoint_id
            )
            self._state_io.write_new(path, data)
            self.staged[checkpoint_id] = SinkTransactionHandle(
                path,
                checkpoint_id,
                self._subtask,
                len(self._current),
                len(data),
                content_hash(data),
            )
            self._current = []
        return tuple(self.staged[c] for c in sorted(self.staged))

    def commit_up_to(self, checkpoint_id: int) -> None:
        """Publish every staged transaction of a checkpoint ``<= checkpoint_id``."""
        for cid in sorted(c for c in self.staged if c <= checkpoint_id):
            commit(self._state_io, self._output_io, self.staged.pop(cid))


def commit(state_io: FileIO, output_io: FileIO, txn: SinkTransactionHandle) -> bool:
    """Publish one staged transaction; False if it was already committed (idempotent)."""
    data = read_verified(state_io, txn.file_refs()[0])
    try:
        output_io.write_new(part_name(txn.checkpoint_id, txn.subtask, txn.suffix), data)
    except StorageConflictError:
        return False
    return True


def read_output(output_io: FileIO) -> list[Any]:
    """Every committed record, in part order (for verification and tools)."""
    out: list[Any] = []
    for info in output_io.list(""):
        name = info.path.rsplit("/", 1)[-1]
        if name.startswith("part-") and name.endswith(".jsonl"):
            data = output_io.read(output_io.relative(info.path))
            out.extend(json.loads(line) for line in data.decode().splitlines() if line)
    return out
