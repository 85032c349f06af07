"""Handles of keyed state: materialized files and a backend's complete checkpoint state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from backends.keygroups import KeyGroupRange
from dstl.handles import ChangelogHandle, register_handle
from dstl.integrity import FileRef
from dstl.layout import check_location


@register_handle("state-file")
@dataclass(frozen=True, slots=True)
class StateFileHandle:
    """One durable file of materialized state (a Parquet table part or an SST file).

    ``state`` is the state it holds (``None`` for files that hold many, like SSTs);
    ``file_id`` is its identity for sharing: ``sha256:<hex>``, the content hash of
    :mod:`dstl.integrity`, which every read checks (older records: a BLAKE2b hex digest or
    ``sst:<size>:<hex>``, which only the size is checked against).
    ``name`` is the snapshot's file name (:attr:`SnapshotFile.name`); a ``rocksdb-sst``
    restore needs it to rebuild the database directory. Empty means "the last path
    component of ``location``" (true when the file is stored under its own name).
    """

    location: str
    size_bytes: int
    file_id: str
    state: str | None = None
    key_group_start: int = 0
    key_group_end: int = 0
    rows: int = 0
    name: str = ""

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        check_location(self.location)
        if self.size_bytes < 0 or not self.file_id:
            raise ValueError(f"invalid state file handle {self!r}")

    @property
    def content_hash(self) -> str:
        """The file's content hash ("" for records older than content hashes)."""
        return (
            self.file_id[len(FILE_ID_PREFIX) :] if self.file_id.startswith(FILE_ID_PREFIX) else ""
        )

    def files(self) -> list[str]:
        """The one file."""
        return [self.location]

    def file_refs(self) -> list[FileRef]:
        """The one file, with its recorded size and content hash."""
        return [FileRef(self.location, self.size_bytes, self.content_hash)]


FILE_ID_PREFIX = "sha256:"


def file_id_of(content_hash: str) -> str:
    """The sharing identity of a state file whose content hash is ``content_hash``."""
    return FILE_ID_PREFIX + content_hash


@register_handle("materialization")
@dataclass(frozen=True, slots=True)
class MaterializationHandle:
    """A materialized snapshot of one backend: every file it needs and the log position.

    It covers exactly the changes of writer ``writer_id`` with ``sqn < sqn``; files may be
    shared with earlier materializations. ``kind`` names the table format: ``heap-parquet``
    (typed Parquet state tables) or ``rocksdb-sst`` (a RocksDB checkpoint's files plus
    ``STATE-META.json``); restore dispatches on it.
    """

    writer_id: str
    sqn: int
    key_group_start: int
    key_group_end: int
    kind: str
    state_files: tuple[StateFileHandle, ...]
    materialization_id: int = 0

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        if self.sqn < 0:
            raise ValueError("materialization sqn must be >= 0")
        KeyGroupRange(self.key_group_start, self.key_group_end)

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups the snapshot holds."""
        return KeyGroupRange(self.key_group_start, self.key_group_end)

    def files(self) -> list[str]:
        """Every file this materialization needs."""
        return [f.location for f in self.state_files]

    def file_refs(self) -> list[FileRef]:
        """Every file this materialization needs, with sizes and content hashes."""
        return [r for f in self.state_files for r in f.file_refs()]


@register_handle("keyed-state")
@dataclass(frozen=True, slots=True)
class KeyedStateHandle:
    """Everything needed to restore one backend instance at a checkpoint.

    Restore = load every materialization (filtered by key group), then replay every
    changelog handle in order, keeping records of writer ``w`` with ``sqn >=`` the sqn of
    ``w``'s materialization (0 if none). Handles are immutable and JSON round-trippable.
    """

    backend_id: str
    key_group_start: int
    key_group_end: int
    key_serializer: str
    max_parallelism: int
    materialized: tuple[MaterializationHandle, ...] = ()
    changelog: tuple[ChangelogHandle, ...] = ()

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        KeyGroupRange(self.key_group_start, self.key_group_end)
        if not self.key_group_end <= self.max_parallelism:
            raise ValueError(
                f"key groups [{self.key_group_start}, {self.key_group_end}) exceed max parallelism {self.max_parallelism}"
            )

    @property
    def key_group_range(self) -> KeyGroupRange:
        """The key groups this state covers."""
        return KeyGroupRange(self.key_group_start, self.key_group_end)

    def replay_from(self, writer_id: str) -> int:
        """The first sqn of ``writer_id``'s log not covered by a materialization."""
        return max((m.sqn for m in self.materialized if m.writer_id == writer_id), default=0)

    def files(self) -> list[str]:
        """Every durable file the state needs (deduplicated, in order)."""
        return [r.location for r in self.file_refs()]

    def file_refs(self) -> list[FileRef]:
        """Every durable file the state needs, with sizes and hashes (deduplicated)."""
        seen: dict[str, FileRef] = {}
        for m in self.materialized:
            for r in m.file_refs():
                seen.setdefault(r.location, r)
        for c in self.changelog:
            for r in c.file_refs():
                seen.setdefault(r.location, r)
        return list(seen.values())
