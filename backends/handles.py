"""Handles of keyed state: materialized files and a backend's complete checkpoint state.

Coverage: a materialization holds the state that a set of writers' logs built up to
given sequence numbers (its *coverage*, writer -> sqn); restore replays each writer's
log from there. An online materialization covers one writer (its own backend); an
offline compaction covers every writer whose log the compacted state was built from
(a restored or rescaled state has logs of several). :func:`replacement_problem` says
whether a materialization may replace a state's current base (what adopting an offline
compaction, and registering one, must check).
"""

from __future__ import annotations

from collections.abc import Sequence
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

    It covers exactly the changes of writer ``writer_id`` with ``sqn < sqn``, and of each
    writer ``w`` of ``covers`` with sqn below its own ``s`` (``((w, s), ...)``, sorted by
    writer, none of them ``writer_id``: an offline compaction of a state built from
    several writers' logs; records written before it existed have none). Files may be
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
    covers: tuple[tuple[str, int], ...] = ()

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        if self.sqn < 0:
            raise ValueError("materialization sqn must be >= 0")
        KeyGroupRange(self.key_group_start, self.key_group_end)
        writers = []
        for pair in self.covers:
            if (
                not isinstance(pair, tuple)
                or len(pair) != 2
                or not isinstance(pair[0], str)
                or not isinstance(pair[1], int)
                or pair[1] < 0
            ):
                raise ValueError(f"covers entries are (writer, sqn >= 0), not {pair!r}")
            writers.append(pair[0])
        if writers != sorted(set(writers)) or self.writer_id in writers:
            raise ValueError(f"covers must name distinct writers in order, not {self.writer_id}")

    def covered_sqn(self, writer_id: str) -> int:
        """The first sqn of ``writer_id``'s log this materialization does not hold."""
        if writer_id == self.writer_id:
            return self.sqn
        for writer, sqn in self.covers:
            if writer == writer_id:
                return sqn
        return 0

    def coverage(self) -> dict[str, int]:
        """Every writer this materialization covers -> the first sqn it does not hold."""
        return {self.writer_id: self.sqn, **dict(self.covers)}

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

    def replay_segments(
        self, writer_id: str, key_groups: KeyGroupRange | None = None
    ) -> list[tuple[int, int, int]]:
        """``key_groups`` (default: the state's) cut by the materializations that hold
        them: ``(start, end, from_sqn)`` per run of key groups, ``from_sqn`` the first sqn
        of ``writer_id``'s log that the materialization holding them does not hold (0
        where none does); adjacent runs with the same ``from_sqn`` are one.

        A materialization covers only its own key groups. A state restored from several
        old ranges (a rescale that merged them) lists several, each covering the writers
        of its own old range, beside logs that span them all: one writer's log may be
        held by the materialization of some key groups and not of others. Pure.
        """
        rng = key_groups or self.key_group_range
        runs: list[tuple[int, int, int]] = []
        pos = rng.start
        for m in sorted(self.materialized, key=lambda m: m.key_group_start):
            start, end = max(m.key_group_start, pos), min(m.key_group_end, rng.end)
            if start >= end:
                continue
            if start > pos:
                runs.append((pos, start, 0))
            runs.append((start, end, m.covered_sqn(writer_id)))
            pos = end
        if pos < rng.end:
            runs.append((pos, rng.end, 0))
        merged: list[tuple[int, int, int]] = []
        for run in runs:
            if merged and merged[-1][1] == run[0] and merged[-1][2] == run[2]:
                merged[-1] = (merged[-1][0], run[1], run[2])
            else:
                merged.append(run)
        return merged

    def replay_from(self, writer_id: str) -> int:
        """The first sqn of ``writer_id``'s log that some key group of the state still
        needs: the lowest ``from_sqn`` of :meth:`replay_segments`."""
        return min((s for _, _, s in self.replay_segments(writer_id)), default=0)

    def coverage(self) -> dict[str, int]:
        """How far the state reaches in each writer's log: writer -> the first sqn it does
        not hold (the furthest of its materializations and changelog blocks)."""
        return extent(self.materialized, self.changelog)

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


def extent(
    materialized: Sequence[MaterializationHandle], changelog: Sequence[ChangelogHandle]
) -> dict[str, int]:
    """Writer -> the first sqn that ``materialized`` plus ``changelog`` do not hold."""
    out: dict[str, int] = {}
    for m in materialized:
        for writer, sqn in m.coverage().items():
            out[writer] = max(out.get(writer, 0), sqn)
    for c in changelog:
        out[c.writer_id] = max(out.get(c.writer_id, 0), c.sqn_end)
    return out


def replacement_problem(
    candidate: MaterializationHandle,
    key_groups: KeyGroupRange,
    base: Sequence[MaterializationHandle],
    changelog: Sequence[ChangelogHandle],
    live_writer: str | None = None,
) -> str | None:
    """Why ``candidate`` may not replace ``base`` as the materialization of a state of
    ``key_groups`` whose log is ``changelog`` (``None``: it may).

    It may when it holds exactly these key groups, is not older than ``base`` (it covers
    every writer at least as far) and holds nothing the state's history lacks (no
    writer's changes beyond what ``base`` plus ``changelog`` reach; ``live_writer``, the
    state's own writer that is still appending, reaches arbitrarily far). Then the state
    equals ``candidate`` plus the replay of each writer's log from its coverage. Pure.
    """
    if candidate.key_group_range != key_groups:
        return (
            f"it holds key groups [{candidate.key_group_start}, {candidate.key_group_end}), "
            f"the state [{key_groups.start}, {key_groups.end})"
        )
    for m in base:
        for writer, sqn in m.coverage().items():
            if candidate.covered_sqn(writer) < sqn:
                return (
                    f"it is older than the current materialization (writer {writer}: "
                    f"sqn {candidate.covered_sqn(writer)} < {sqn})"
                )
    reach = extent(base, changelog)
    for writer, sqn in candidate.coverage().items():
        if sqn > 0 and writer != live_writer and sqn > reach.get(writer, 0):
            return (
                f"it holds changes of writer {writer} up to sqn {sqn} that the state's history "
                f"lacks (it reaches {reach.get(writer, 0)}): the job restored an older checkpoint"
            )
    return None
