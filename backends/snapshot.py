"""The seam between a backend's snapshot and the materializer that uploads it.

A backend takes a :class:`MaterializationSnapshot` on its task thread (short: a copy of
the heap's dicts, a hard-linked RocksDB checkpoint); the materializer then iterates
:meth:`~MaterializationSnapshot.files` on its upload thread, uploads what is new, shares
what it already uploaded, and finally calls :meth:`~MaterializationSnapshot.release`.
A file's ``name`` is stable across snapshots for the same part (a key-group chunk of a
state table, an SST file name), which is what lets unchanged parts be shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from backends.keygroups import KeyGroupRange


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    """One file of a snapshot, in memory (``data``) or on local disk (``local_path``)."""

    name: str
    state: str | None
    key_group_start: int
    key_group_end: int
    rows: int
    data: bytes | None = None
    local_path: str | None = None

    def __post_init__(self) -> None:
        if (self.data is None) == (self.local_path is None):
            raise ValueError(f"snapshot file {self.name!r} needs exactly one of data, local_path")


class MaterializationSnapshot(Protocol):
    """A consistent, immutable snapshot of one backend, ready to upload.

    ``kind`` names the file format restore must use (``heap-parquet``, ``rocksdb-sst``);
    ``sqn`` is the changelog boundary it covers (``None`` without a changelog).
    """

    @property
    def kind(self) -> str:
        """The format tag recorded in the materialization handle."""
        ...

    @property
    def sqn(self) -> int | None:
        """The changelog boundary the snapshot covers."""
        ...

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups it holds."""
        ...

    def files(self) -> Iterator[SnapshotFile]:
        """Every file of the snapshot (may do CPU work: call off the task thread)."""
        ...

    def release(self) -> None:
        """Free local resources (temp directories); idempotent."""
        ...
