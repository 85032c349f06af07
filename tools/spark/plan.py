"""What a read of the ``changelog-state`` data source does, decided on the driver (no Spark).

State: :func:`plan_state` resolves the checkpoint (an id or ``latest``), the operator, the
state and its declaration (:func:`discover_states`: from the materialized tables' metadata,
the log's META records only when a state is not there), then cuts the operator's
key-group space into :class:`StateSlice` s: each subtask's range at the boundaries of the
state's materialized pieces, merged while they hold fewer than ``rowsPerPartition``
estimated entries. Each slice is one Spark partition: it restores its
own key groups from the handles that hold them, reading only the pieces of that range.

Change feed: :func:`plan_changes` defines the changes *between* checkpoints A and B as,
for each writer ``w`` of the operator's log, the records with ``a_w <= sqn < b_w``, where
``a_w`` is how far A's state reaches in ``w``'s log and ``b_w`` how far B's does
(:meth:`~backends.handles.KeyedStateHandle.coverage`): exactly the changes that checkpoint
A's state lacks and B's holds, since a change set belongs to the first checkpoint whose
persist follows it. They come from the log blocks of every *retained* checkpoint in
``[A, B]``; a part of ``[a_w, b_w)`` none of them holds is an error naming the writer and
range (an online materialization folded changes no checkpoint ever persisted, or
retention removed the checkpoints that referenced them). ``changeStartCheckpoint=0``
means the job's empty start. Each change's ``checkpoint_id`` is the first retained
checkpoint after A whose state holds it; ``sequence`` orders the changes of a key (it
increases along each writer's log, and a restored job's new writers follow the writers
they restored from); one slice per segment file, read once.

Every file is read through the verified read and nothing is unpickled.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow.compute as pc

from backends.handles import KeyedStateHandle, extent
from backends.keygroups import KeyGroupRange
from backends.restore import _file_name, relevant
from backends.rocksdb import META_FILE, decode_metadata
from backends.serializers import Serializer, serializer_for
from backends.state import Op, StateMeta
from backends.tables import parquet_to_table, table_meta
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from dstl.errors import CheckpointNotFoundError, ConfigError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle
from dstl.integrity import read_verified
from dstl.layout import plain_name
from dstl.read import read_changes
from tools.cli.common import open_metadata, resolve_checkpoint
from tools.restore import plan_restore
from tools.spark.options import ReadOptions


@dataclass(frozen=True, slots=True)
class Target:
    """The operator and state a read is about, at ``checkpoint``."""

    checkpoint: CompletedCheckpoint
    operator: str
    handles: tuple[KeyedStateHandle, ...]
    meta: StateMeta

    @property
    def key_serializer(self) -> Serializer:
        """The operator's key serializer, resolved without running the store's code."""
        return serializer_for(self.handles[0].key_serializer, trusted=False)

    @property
    def max_parallelism(self) -> int:
        """The operator's number of key groups."""
        return self.handles[0].max_parallelism


@dataclass(frozen=True, slots=True)
class StateSlice:
    """One Spark partition of a state read: restore ``key_groups`` from ``handles``."""

    key_groups: KeyGroupRange
    handles: tuple[KeyedStateHandle, ...]
    estimated_rows: int = 0


@dataclass(frozen=True, slots=True)
class FeedBlock:
    """Records ``lo <= sqn < hi`` of one log block; ``ordinal`` orders the blocks of a
    feed; ``thresholds`` ``((reach, checkpoint id), ...)``: a record with ``sqn < reach``
    belongs to the first such checkpoint."""

    handle: ChangelogHandle
    lo: int
    hi: int
    ordinal: int
    thresholds: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class FeedSlice:
    """One Spark partition of a change feed: the wanted blocks of one segment file."""

    location: str
    blocks: tuple[FeedBlock, ...]


def open_store(opts: ReadOptions) -> tuple[FileIO, MetadataStore]:
    """The store and its metadata store (the caller closes the latter)."""
    fileio = FileIO(opts.store, opts.storage_options)
    return fileio, open_metadata(opts.metadata, fileio, opts.store)


def operators_of(cp: CompletedCheckpoint) -> dict[str, tuple[KeyedStateHandle, ...]]:
    """The keyed operators of ``cp`` (names checked) and their subtasks' handles."""
    return plan_restore(cp, "").operators


def pick(names: Sequence[str], wanted: str | None, what: str, where: str) -> str:
    """``wanted`` if it is one of ``names``, or the only name; ConfigError otherwise."""
    if wanted is not None:
        if wanted not in names:
            raise ConfigError(f"{where} has no {what} {wanted!r}; it has {sorted(names)}")
        return wanted
    if len(names) != 1:
        raise ConfigError(f"{where} has {what}s {sorted(names)}: choose one with option {what}")
    return names[0]


def discover_states(
    fileio: FileIO, handles: Sequence[KeyedStateHandle], wanted: str | None = None
) -> dict[str, StateMeta]:
    """Every state of the operator by name, declarations resolved untrusted.

    Reads the materialized tables' metadata (one piece per state, RocksDB's
    ``STATE-META.json``); the log's META records only if ``wanted`` is not found there
    (a state declared since the last materialization) or no state is named.
    """
    found: dict[str, StateMeta] = {}
    for h in handles:
        for m in h.materialized:
            if m.kind == "heap-parquet":
                for f in sorted(m.state_files, key=lambda f: f.size_bytes):
                    if f.state is not None and f.state not in found:
                        url = fileio.url(fileio.relative(f.location))
                        table = parquet_to_table(read_verified(fileio, f.file_refs()[0]), url)
                        meta, _ = table_meta(table.slice(0, 0), url)
                        found.setdefault(meta.name, meta.untrusted())
            elif m.kind == "rocksdb-sst":
                for f in m.state_files:
                    if _file_name(f.location, f.name) == META_FILE:
                        data = read_verified(fileio, f.file_refs()[0])
                        _, _, metas = decode_metadata(data, f.location)
                        for meta in metas.values():
                            found.setdefault(meta.name, meta.untrusted())
    if wanted is None or wanted not in found:
        found.update(_log_declarations(fileio, handles, wanted))
    for name in found:
        plain_name("state", name)
    return found


def _log_declarations(
    fileio: FileIO, handles: Sequence[KeyedStateHandle], wanted: str | None
) -> dict[str, StateMeta]:
    """States declared in the log (META records), in log order; stops at ``wanted``: a
    writer logs a state's META before its first change, so that is usually the first
    block read, not the whole log."""
    found: dict[str, StateMeta] = {}
    for h in handles:
        for table in read_changes(fileio, h.changelog):
            metas = table.filter(pc.equal(table["op"], int(Op.META)))
            for value in metas["value"].to_pylist():
                meta = StateMeta.from_json(value)
                found.setdefault(meta.name, meta.untrusted())
            if wanted is not None and wanted in found:
                return found
    return found


def target(store: MetadataStore, fileio: FileIO, opts: ReadOptions, ref: int | str) -> Target:
    """The checkpoint ``ref`` and the operator and state ``opts`` name (or the only ones)."""
    cp = resolve_checkpoint(store, opts.job, ref)
    where = f"checkpoint {cp.checkpoint_id} of job {cp.job_id}"
    operators = operators_of(cp)
    if not operators:
        raise ConfigError(f"{where} holds no keyed state")
    operator = pick(list(operators), opts.operator, "operator", where)
    handles = operators[operator]
    states = discover_states(fileio, handles, opts.state)
    name = pick(list(states), opts.state, "state", f"operator {operator} of {where}")
    return Target(cp, operator, handles, states[name])


def plan_state(opts: ReadOptions) -> tuple[FileIO, Target, list[StateSlice]]:
    """The store, what the read is about, and its partitions (one per slice)."""
    fileio, store = open_store(opts)
    try:
        tgt = target(store, fileio, opts, opts.checkpoint)
    finally:
        store.close()
    return fileio, tgt, slices(tgt.handles, tgt.meta.name, opts.rows_per_partition)


def _atoms(h: KeyedStateHandle, state: str) -> list[tuple[int, int, float]]:
    """``(lo, hi, estimated rows)`` between the boundaries of ``state``'s pieces in ``h``."""
    rng = h.key_group_range
    pieces = [
        f
        for m in h.materialized
        if m.kind == "heap-parquet"
        for f in m.state_files
        if f.state == state and f.key_group_end > f.key_group_start
    ]
    cuts = {rng.start, rng.end}
    for f in pieces:
        cuts.update(c for c in (f.key_group_start, f.key_group_end) if rng.start < c < rng.end)
    log_rows = sum(c.rows for c in h.changelog)
    atoms = []
    for lo, hi in itertools.pairwise(sorted(cuts)):
        rows = log_rows * (hi - lo) / max(len(rng), 1)
        for f in pieces:
            overlap = min(hi, f.key_group_end) - max(lo, f.key_group_start)
            if overlap > 0:
                rows += f.rows * overlap / (f.key_group_end - f.key_group_start)
        atoms.append((lo, hi, rows))
    return atoms


def slices(
    handles: Sequence[KeyedStateHandle], state: str, rows_per_partition: int
) -> list[StateSlice]:
    """Contiguous key-group ranges of about ``rows_per_partition`` estimated entries of
    ``state``, cut at piece boundaries, never across two subtasks (a read is at least as
    parallel as the job that wrote the state), with the handles each one needs."""
    out: list[StateSlice] = []
    for h in sorted(handles, key=lambda h: h.key_group_start):
        lo: int | None = None
        hi, rows = 0, 0.0
        for a_lo, a_hi, a_rows in _atoms(h, state):
            if lo is not None and rows + a_rows > rows_per_partition:
                out.append(_slice(handles, lo, hi, rows))
                lo = None
            if lo is None:
                lo, rows = a_lo, 0.0
            hi, rows = a_hi, rows + a_rows
        if lo is not None:
            out.append(_slice(handles, lo, hi, rows))
    return out


def _slice(handles: Sequence[KeyedStateHandle], lo: int, hi: int, rows: float) -> StateSlice:
    rng = KeyGroupRange(lo, hi)
    return StateSlice(rng, tuple(relevant(handles, rng)), round(rows))


# -- the change feed -------------------------------------------------------------------
def plan_changes(opts: ReadOptions) -> tuple[FileIO, Target, list[FeedSlice]]:
    """The store, what the feed is about (at its end checkpoint) and its partitions."""
    fileio, store = open_store(opts)
    try:
        end = target(store, fileio, opts, opts.change_end)
        job = end.checkpoint.job_id
        end_id = end.checkpoint.checkpoint_id
        if opts.change_start >= end_id:
            raise ConfigError(
                f"changeStartCheckpoint {opts.change_start} must be before the end "
                f"checkpoint {end_id}"
            )
        start = store.get(job, opts.change_start) if opts.change_start else None
        records = [
            store.get(job, c.checkpoint_id)
            for c in store.list(job)
            if opts.change_start < c.checkpoint_id < end_id
        ]
    finally:
        store.close()
    return fileio, end, feed_slices(end.operator, start, [*records, end.checkpoint])


def _reach(cp: CompletedCheckpoint, operator: str) -> dict[str, int]:
    handles = operators_of(cp).get(operator, ())
    return extent(
        [m for h in handles for m in h.materialized], [c for h in handles for c in h.changelog]
    )


def feed_slices(
    operator: str, start: CompletedCheckpoint | None, later: Sequence[CompletedCheckpoint]
) -> list[FeedSlice]:
    """The partitions of the change feed from ``start`` (None: the job's start) through
    ``later`` (the retained checkpoints after it, ascending, the end one last)."""
    reach_a = _reach(start, operator) if start is not None else {}
    reaches = [(cp.checkpoint_id, _reach(cp, operator)) for cp in later]
    records = ([start] if start is not None else []) + list(later)
    blocks: dict[tuple[str, int, int], ChangelogHandle] = {}
    first_seen: dict[str, int] = {}
    for i, cp in enumerate(records):
        for h in operators_of(cp).get(operator, ()):
            for c in h.changelog:
                blocks.setdefault((c.writer_id, c.sqn_start, c.sqn_end), c)
        for writer in _reach(cp, operator):
            first_seen.setdefault(writer, i)
    wanted: list[tuple[int, int, str, int, FeedBlock]] = []
    for writer in sorted({w for _, r in reaches for w in r}, key=lambda w: (first_seen[w], w)):
        a = reach_a.get(writer, 0)
        seen = [(cid, r[writer]) for cid, r in reaches if writer in r]
        ends = [a] + [s for _, s in seen]
        if any(y < x for x, y in itertools.pairwise(ends)):
            raise ConfigError(
                f"the log of writer {writer} goes back between the checkpoints: checkpoint "
                f"{start.checkpoint_id if start else 0} is not in the history of checkpoint "
                f"{later[-1].checkpoint_id} (the job restored an older checkpoint)"
            )
        b = ends[-1]
        if b <= a:
            continue
        mine = sorted(
            (c for (w, s, e), c in blocks.items() if w == writer and e > a and s < b),
            key=lambda c: c.sqn_start,
        )
        _check_covered(writer, a, b, mine)
        thresholds = tuple((reach, cid) for cid, reach in seen)
        for c in mine:
            owner = next(cid for reach, cid in thresholds if reach > max(a, c.sqn_start))
            block = FeedBlock(c, max(a, c.sqn_start), min(b, c.sqn_end), 0, thresholds)
            wanted.append((owner, first_seen[writer], writer, c.sqn_start, block))
    wanted.sort(key=lambda t: t[:4])
    by_file: dict[str, list[FeedBlock]] = {}
    for ordinal, (*_, block) in enumerate(wanted):
        ordered = FeedBlock(block.handle, block.lo, block.hi, ordinal, block.thresholds)
        by_file.setdefault(block.handle.location, []).append(ordered)
    return [FeedSlice(location, tuple(bs)) for location, bs in by_file.items()]


def _check_covered(writer: str, a: int, b: int, blocks: Sequence[ChangelogHandle]) -> None:
    pos = a
    for c in blocks:
        if c.sqn_start > pos:
            break
        pos = max(pos, c.sqn_end)
    if pos < b:
        raise CheckpointNotFoundError(
            f"the changes of writer {writer} from sqn {pos} on (up to {b}) are in no retained "
            "checkpoint's log: a materialization folded them before a checkpoint persisted "
            "them, or retention removed the checkpoints that referenced them. Read between "
            "checkpoints no materialization separates, retain more checkpoints, or run the "
            'job with materialization="offline"'
        )
