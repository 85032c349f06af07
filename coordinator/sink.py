"""Transactional (two-phase commit) sinks: exactly-once output, shared by both hosts.

Pre-commit at a barrier: the records since the previous barrier are staged durably in the
state store (write-once JSON lines) and the staged transactions are part of the sink's
checkpoint state. Commit on "checkpoint complete": a :class:`Publisher` makes each staged
transaction visible: the file sink writes ``part-<checkpoint:016x>-<subtask:04x>.jsonl``
into its output directory, the SQL sink (:mod:`coordinator.sql_sink`) inserts the rows
in one transaction. Publishing is idempotent (write-once, or a marker row), so
committing twice (after a crash between commit and notification, or on restore) is a
no-op. Transactions of aborted checkpoints stay staged and are committed with the next
completed checkpoint, as Flink's ``TwoPhaseCommitSinkFunction`` does.

A sink is declared with a factory (:class:`SinkFactory`: :class:`FileSink`,
:class:`~coordinator.sql_sink.SqlSink`, :class:`CollectSink`, :class:`PrintSink`) that
makes the publisher of a run.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator.handles import PART_SUFFIXES, SinkTransactionHandle
from dstl import layout
from dstl.errors import StorageConflictError
from dstl.fileio import FileIO
from dstl.integrity import content_hash, read_verified
from dstl.upload import Uploader


class Publisher(Protocol):
    """Makes staged transactions visible. Idempotent: publishing a transaction twice
    leaves one copy. Called from the sink's task thread (and the runtime's, on restore)."""

    def publish(self, txn: SinkTransactionHandle, data: bytes) -> bool:
        """Publish ``data`` (the staged JSON lines of ``txn``); False if it already was."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class SinkFactory(Protocol):
    """What a pipeline declares as its sink: it makes the publisher of a run."""

    def publisher(self, storage_options: dict[str, Any]) -> Publisher:
        """A publisher for this run (``storage_options`` of the job, for URLs)."""
        ...


def decode_lines(data: bytes) -> list[Any]:
    """The records of a staged transaction."""
    return [json.loads(line) for line in data.decode().splitlines() if line]


def part_name(checkpoint_id: int, subtask: int, suffix: str = "jsonl") -> str:
    """Name of a committed output part (sorts by checkpoint)."""
    return f"part-{checkpoint_id:016x}-{subtask:04x}.{suffix}"


class FilePublisher:
    """Publishes each transaction as a write-once part file in ``output_io``."""

    def __init__(self, output_io: FileIO) -> None:
        self.output_io = output_io

    def publish(self, txn: SinkTransactionHandle, data: bytes) -> bool:
        try:
            self.output_io.write_new(part_name(txn.checkpoint_id, txn.subtask, txn.suffix), data)
        except StorageConflictError:
            return False
        return True

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class FileSink:
    """Committed parts go to the directory ``url`` (any FileIO URL)."""

    url: str

    def publisher(self, storage_options: dict[str, Any]) -> FilePublisher:
        return FilePublisher(FileIO(self.url, storage_options))


class _CollectPublisher:
    """Appends committed records to a list in this process. Thread-safe (a lock)."""

    def __init__(self, sink: CollectSink) -> None:
        self._sink = sink

    def publish(self, txn: SinkTransactionHandle, data: bytes) -> bool:
        with self._sink.lock:
            if txn.location in self._sink.published:
                return False
            self._sink.published.add(txn.location)
            self._sink.records.extend(decode_lines(data))
        return True

    def close(self) -> None:
        pass


@dataclass(eq=False)
class CollectSink:
    """For tests: committed records are appended to :attr:`records` (this process only:
    what a killed process committed is gone with it)."""

    records: list[Any] = field(default_factory=list)
    published: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publisher(self, storage_options: dict[str, Any]) -> _CollectPublisher:
        return _CollectPublisher(self)


class _PrintPublisher:
    def publish(self, txn: SinkTransactionHandle, data: bytes) -> bool:
        for record in decode_lines(data):
            print(json.dumps(record), flush=True)
        return True

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class PrintSink:
    """Prints committed records as JSON lines on stdout (a record may print again after a
    restore: printing cannot be undone or checked)."""

    def publisher(self, storage_options: dict[str, Any]) -> _PrintPublisher:
        return _PrintPublisher()


class TransactionalSink:
    """The two-phase commit of one sink subtask. Task thread only.

    Invariant: every record handed to :meth:`write` is in exactly one staged transaction
    once :meth:`pre_commit` ran, and published exactly once once a checkpoint covering it
    completed. Staged files go through ``uploader`` (the worker's: retries, hedging, a
    byte budget shared with the materializer) when the host has one, else one write each.
    """

    def __init__(
        self,
        state_io: FileIO,
        publisher: Publisher,
        job: str,
        operator: str,
        subtask: int,
        uploader: Uploader | None = None,
    ) -> None:
        self._state_io = state_io
        self._uploader = uploader
        self.publisher = publisher
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
            if self._uploader is not None:
                path = self._uploader.upload(path, data)  # an attempt's name if a retry won
            else:
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
            publish_staged(self._state_io, self.publisher, self.staged.pop(cid))


class TransactionalFileSink(TransactionalSink):
    """The transactional sink with committed parts in ``output_io``."""

    def __init__(
        self, state_io: FileIO, output_io: FileIO, job: str, operator: str, subtask: int
    ) -> None:
        super().__init__(state_io, FilePublisher(output_io), job, operator, subtask)


def publish_staged(state_io: FileIO, publisher: Publisher, txn: SinkTransactionHandle) -> bool:
    """Publish one staged transaction (its bytes verified); False if it already was."""
    return publisher.publish(txn, read_verified(state_io, txn.file_refs()[0]))


def commit(state_io: FileIO, output_io: FileIO, txn: SinkTransactionHandle) -> bool:
    """Publish one staged transaction as a part file; False if it was already committed."""
    return publish_staged(state_io, FilePublisher(output_io), txn)


def read_output(output_io: FileIO) -> list[Any]:
    """Every committed record of a file sink, in part order (for verification and tools)."""
    out: list[Any] = []
    for info in output_io.list(""):
        name = info.path.rsplit("/", 1)[-1]
        if name.startswith("part-") and name.endswith(".jsonl"):
            out.extend(decode_lines(output_io.read(output_io.relative(info.path))))
    return out


__all__ = [
    "PART_SUFFIXES",
    "CollectSink",
    "FilePublisher",
    "FileSink",
    "PrintSink",
    "Publisher",
    "SinkFactory",
    "SinkTransactionHandle",
    "TransactionalFileSink",
    "TransactionalSink",
    "commit",
    "part_name",
    "publish_staged",
    "read_output",
]
