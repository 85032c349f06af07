"""Content-defined pieces of heap state tables, so unchanged parts are shared.

The heap backend's own snapshot files are one Parquet table per state and 16-key-group
chunk: their number is fixed, so a chunk grows with the state and one update re-uploads a
whole chunk. This layout cuts every state table into *pieces* of about ``piece_rows`` rows
whose boundaries depend only on the keys (content-defined chunking, as in rsync or
restic): rows are sorted by ``(key group, serialized key)`` and a piece ends after a key
of ``r`` rows whose hash hits ``hash % (piece_rows / 2) < r``, once the piece has at least
``piece_rows / 2`` rows (a minimum, as FastCDC has, keeps sizes even), or after
``4 * piece_rows`` rows (a cap). A changed key re-cuts at most its piece and, rarely, the
next one before the boundaries fall back in step.
An update to a key changes only the piece holding it; every other piece comes out
byte-identical (sorted rows, deterministic Parquet), hence shared. Pieces never split a
key (map state: all entries of a key stay in one file), so every piece is a standalone,
self-describing state table that :func:`backends.restore.restore_into` reads like any other.

A piece's name is derived from its first key, so it is stable while that key exists.

The natural home of this is ``backends/heap.py`` (``StateSnapshot.files``); it lives here
until the backends owner adopts it, and only reads the snapshot's public fields.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from backends.heap import StateSnapshot, Table
from backends.snapshot import MaterializationSnapshot, SnapshotFile
from backends.state import MAP_LIKE, StateMeta
from backends.tables import table_for, table_to_parquet

DEFAULT_PIECE_ROWS = 2048
"""Expected rows per piece: big enough that a Parquet footer is a small overhead."""

_CAP_FACTOR = 4


def snapshot_files(
    snapshot: MaterializationSnapshot, piece_rows: int | None
) -> Iterator[SnapshotFile]:
    """The files to upload for ``snapshot``: content-defined pieces for heap snapshots.

    ``piece_rows=None`` or a non-heap snapshot (RocksDB SSTs) keeps the snapshot's own files.
    """
    if piece_rows is None or not isinstance(snapshot, StateSnapshot):
        return snapshot.files()
    return heap_pieces(snapshot, piece_rows)


def _key_hash(key_bytes: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key_bytes, digest_size=8).digest(), "big")


def heap_pieces(snapshot: StateSnapshot, piece_rows: int) -> Iterator[SnapshotFile]:
    """Every state of ``snapshot`` as content-defined pieces (CPU work: not on the task thread).

    Every state yields at least one file (an empty state records its metadata).
    """
    if piece_rows < 1:
        raise ValueError("piece_rows must be >= 1")
    key_ser = snapshot.key_serializer
    rng = snapshot.key_group_range
    for name, meta in sorted(snapshot.metas.items()):
        table = snapshot.tables.get(name, {})
        rows: list[tuple[int, bytes, Any]] = [
            (kg, key_ser.serialize(key), key)
            for kg, entries in table.items()
            if kg in rng
            for key in entries
        ]
        if not rows:
            arrow = table_for(meta, key_ser, {})
            yield SnapshotFile(
                f"{name}.empty.parquet", name, rng.start, rng.end, 0, table_to_parquet(arrow)
            )
            continue
        rows.sort(key=lambda r: (r[0], r[1]))
        yield from _pieces(name, meta, snapshot, table, rows, piece_rows)


def _pieces(
    name: str,
    meta: StateMeta,
    snapshot: StateSnapshot,
    table: Table,
    rows: list[tuple[int, bytes, Any]],
    piece_rows: int,
) -> Iterator[SnapshotFile]:
    cap = _CAP_FACTOR * piece_rows
    least = max(piece_rows // 2, 1)  # no cut before this many rows (FastCDC's minimum size)
    span = max(piece_rows - least, 1)
    uk_ser = meta.user_key_ser() if meta.kind in MAP_LIKE else None
    piece: Table = {}
    first: tuple[int, int] | None = None  # (key group, key hash) of the piece's first key
    last_kg = 0
    count = 0
    for kg, key_bytes, key in rows:
        h = _key_hash(key_bytes)
        value = table[kg][key]
        key_rows = 1
        if uk_ser is not None:  # map entries in serialized user-key order: deterministic bytes
            value = dict(sorted(value.items(), key=lambda kv: uk_ser.serialize(kv[0])))
            key_rows = max(len(value), 1)
        count += key_rows
        if first is None:
            first = (kg, h)
        piece.setdefault(kg, {})[key] = value
        last_kg = kg
        # Past the minimum, a key of r rows ends a piece with probability r / span: pieces
        # of ~piece_rows rows whose sizes vary little (a hot key's piece is not a big one).
        if (count >= least and (h >> 32) % span < key_rows) or count >= cap:
            yield _piece_file(name, meta, snapshot, piece, first, last_kg)
            piece, first, count = {}, None, 0
    if first is not None:
        yield _piece_file(name, meta, snapshot, piece, first, last_kg)


def _piece_file(
    name: str,
    meta: StateMeta,
    snapshot: StateSnapshot,
    piece: Table,
    first: tuple[int, int],
    last_kg: int,
) -> SnapshotFile:
    arrow = table_for(meta, snapshot.key_serializer, piece)
    kg, h = first
    return SnapshotFile(
        f"{name}.p{kg:04x}-{h:016x}.parquet",
        name,
        kg,
        last_kg + 1,
        arrow.num_rows,
        table_to_parquet(arrow),
    )
