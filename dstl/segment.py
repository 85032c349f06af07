"""The changelog segment file format (version 2; version 1 files are still read).

A segment is a Parquet file holding the changes of *many* writers, one row group per
writer block, so a plain Spark job can read it (``spark.read.parquet``). Columns:

==========  ==========  =====================================================
column      type        meaning
==========  ==========  =====================================================
writer      string      the writer (one backend instance) that logged the change
key_group   int32       key group of the changed key (``-1`` for metadata records)
sqn         int64       sequence number of the change set the record belongs to
state       string      state name (opaque to the DSTL)
op          int8        operation code (opaque to the DSTL; defined by backends)
key         binary      serialized key
user_key    binary      serialized user key (map state), nullable
value       binary      serialized value, nullable
==========  ==========  =====================================================

A block's rows are grouped by key group (:func:`by_key_group`) in the segments the
helper encodes off the checkpoint's path; a segment a checkpoint waits for, and files
written before grouping, hold them in the order they were appended (see
:func:`encode_segment`). Either way the changes of one key are in the order they were
made, and that is all a reader may rely on.

Self-describing: the footer's key-value metadata ``dstl.segment`` holds JSON::

    {"format": "dstl-changelog-segment", "version": 2, "checksum": "crc32",
     "blocks": [{"writer", "sqn_start", "sqn_end", "rows", "offset", "length", "crc32"}]}

with one entry per row group, in order. ``offset``/``length`` are the row group's byte
range in the file and ``crc32`` (zlib) its checksum: it covers page headers and data, which
Parquet's own page CRCs (also written, zstd-compressed pages) do not fully cover. A reader
verifies the checksum of every block it reads. A truncated or corrupt segment raises
:class:`~dstl.errors.CorruptionError` naming the file. Version 1 (no ``offset``/``crc32``)
is read without the block checksum.
"""

from __future__ import annotations

import io
import json
import zlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dstl.errors import CorruptionError

SEGMENT_VERSION = 2
READABLE_VERSIONS = (1, 2)
FORMAT_NAME = "dstl-changelog-segment"
METADATA_KEY = b"dstl.segment"

SCHEMA = pa.schema(
    [
        pa.field("writer", pa.string(), nullable=False),
        pa.field("key_group", pa.int32(), nullable=False),
        pa.field("sqn", pa.int64(), nullable=False),
        pa.field("state", pa.string(), nullable=False),
        pa.field("op", pa.int8(), nullable=False),
        pa.field("key", pa.binary(), nullable=False),
        pa.field("user_key", pa.binary()),
        pa.field("value", pa.binary()),
    ]
)

BLOCK_SCHEMA = pa.schema([f for f in SCHEMA if f.name != "writer"])
"""A block's table: :data:`SCHEMA` without ``writer`` (the block names it once)."""

_SINK_BUFFER_BYTES = 4 << 20
DICTIONARY_PAGE_BYTES = 128 << 10
"""How large a column's dictionary grows before Parquet falls back to plain encoding, for
the heap's state tables (``backends.tables``; segments: :data:`_SEGMENT_DICTIONARY_COLUMNS`).
Arrow's default (1 MiB) made columns of high-cardinality values (random map values,
many keys) build a large dictionary, then throw it away: 128 KiB keeps the dictionary
for what repeats (key groups, states, ops, a few thousand keys, enum-like values). On the
state-ops workloads segments took ~30% less CPU and ~14% fewer bytes; heap state tables
of 170-350K rows 25-55% less CPU and 10-18% fewer bytes."""
_SEGMENT_DICTIONARY_COLUMNS = ["writer", "key_group", "sqn", "state", "op"]
"""The columns a segment dictionary-encodes: those of few distinct values. Keys, user keys
and values are written plain, and zstd finds their repeats: with a block's rows grouped
by key group (:func:`by_key_group`), a dictionary (even one of 8 KiB, the limit used
before) cost more than it saved. Bytes a change of end-to-end worker segments (count and
sum, ~28k rows a block), grouped, 8 KiB dictionaries against none: 3.58 / 3.45 at 1M
uniform keys, 3.62 / 3.48 at 100k, 3.86 / 3.81 with 10k hot keys."""


def by_key_group(table: pa.Table) -> pa.Table:
    """``table``'s rows grouped by key group, in order of key group; within a key group in
    their original order (a stable sort), so the changes of one key keep their order.

    What a segment block holds. Each change names its key group, a hash of its key; in the
    order they were appended the key groups of a uniform workload are random, and the
    ``key_group`` column took 0.58 bytes a change, 14% of a segment. Grouped, it takes
    0.03. Bytes a change of end-to-end worker segments (count and sum, ~28k rows a block),
    as appended against grouped: 4.13 / 3.45 at 1M uniform keys, 4.14 / 3.48 at 100k,
    4.19 / 3.81 with 10k hot keys; the encoding took ~1.3 ms more a block (of ~3.4 ms),
    in the segment encoder's process. No reader relies on this order for what it reads:
    each selects the rows it replays by key group and sequence number, and replays a
    key's changes in the order they have in the log (block by block, row by row). For
    speed, the replay of value states puts a block in state order before it gathers it
    (``backends.restore``): grouped by key group, the states updated together alternate
    row by row.
    """
    kg = table.column("key_group")
    return table.take(pc.sort_indices(kg)) if table.num_rows > 1 else table


_WRITER_FIELD = SCHEMA.field("writer")


@dataclass(frozen=True, slots=True)
class Block:
    """One writer's changes for a segment: a table of :data:`SCHEMA` minus ``writer``."""

    writer_id: str
    sqn_start: int
    sqn_end: int
    table: pa.Table


def encode_segment(blocks: list[Block], grouped: bool = True) -> bytes:
    """Serialize ``blocks`` (one row group each) into segment bytes, checksummed per block:
    each block's rows grouped by key group (:func:`by_key_group`), or with ``grouped``
    false as they were appended.

    Ungrouped is for a segment a checkpoint waits for (``dstl.changelog``): the grouping's
    stable sort was 22% of such an encoding's CPU (seven blocks of 10-34k changes taken in
    the end-to-end worker at 1M uniform keys: 19.0 ms against 24.4 ms), for 15% fewer
    bytes on segments that are 2-3% of the log at 1M uniform keys (19-27% at 100k, where
    checkpoint bytes came out 843k against 840k). Readers take both: none relies on the
    order beyond each key's changes keeping theirs, which both keep."""
    if not blocks:
        raise ValueError("a segment needs at least one block")
    described: list[dict[str, Any]] = []
    out = io.BytesIO()
    # Buffered in Arrow: Parquet writes every page to its sink, and a Python sink makes each
    # write wait for the GIL, up to the switch interval (5 ms) while the task thread is
    # busy. That made encoding ~3x slower in wall time, and backpressure then blocked
    # the task thread. Here only the flush per block calls into Python.
    sink = pa.BufferedOutputStream(pa.PythonFile(out, mode="w"), _SINK_BUFFER_BYTES)
    writer = pq.ParquetWriter(
        sink,
        SCHEMA,
        compression="zstd",
        write_page_checksum=True,
        write_statistics=["sqn", "key_group"],
        use_dictionary=_SEGMENT_DICTIONARY_COLUMNS,
    )
    try:
        for block in blocks:
            n = block.table.num_rows
            if n == 0:
                raise ValueError(f"empty block for writer {block.writer_id!r}")
            writer_col = pa.repeat(pa.scalar(block.writer_id, pa.string()), n)
            rows = by_key_group(block.table) if grouped else block.table
            table = rows.add_column(0, _WRITER_FIELD, writer_col)
            if not table.schema.equals(SCHEMA):  # a cast is one GIL round trip per column
                table = table.cast(SCHEMA)
            start = sink.tell()
            writer.write_table(table, row_group_size=n)  # exactly one row group per block
            end = sink.tell()
            sink.flush()  # the checksum reads the bytes from ``out``
            described.append(
                {
                    "writer": block.writer_id,
                    "sqn_start": block.sqn_start,
                    "sqn_end": block.sqn_end,
                    "rows": n,
                    "offset": start,
                    "length": end - start,
                    "crc32": zlib.crc32(out.getbuffer()[start:end]),
                }
            )
        meta = {
            "format": FORMAT_NAME,
            "version": SEGMENT_VERSION,
            "checksum": "crc32",
            "blocks": described,
        }
        writer.add_key_value_metadata({METADATA_KEY.decode(): json.dumps(meta)})
    finally:
        writer.close()
        sink.flush()
    return out.getvalue()


_BLOCK_FIELDS_V1: dict[str, type] = {"writer": str, "sqn_start": int, "sqn_end": int, "rows": int}
_BLOCK_FIELDS: dict[str, type] = {**_BLOCK_FIELDS_V1, "offset": int, "length": int, "crc32": int}


class SegmentReader:
    """Reads blocks of one segment held in memory. Not thread-safe; cheap to create.

    ``state_dictionary``: blocks have the ``state`` column as Parquet stores it, a
    dictionary array (a few names; decoding it to one string per row is a quarter of a
    block's decoding time), instead of :data:`BLOCK_SCHEMA`'s strings.
    """

    def __init__(self, data: bytes, location: str, state_dictionary: bool = False) -> None:
        self.location = location
        self._data = data
        try:
            self._file = pq.ParquetFile(
                io.BytesIO(data),
                page_checksum_verification=True,
                read_dictionary=["state"] if state_dictionary else None,
            )
            raw = (self._file.metadata.metadata or {}).get(METADATA_KEY)
            if raw is None:
                raw = (self._file.schema_arrow.metadata or {}).get(METADATA_KEY)
            if raw is None:
                raise CorruptionError(
                    "not a changelog segment (no dstl.segment metadata)", location
                )
            expected = SCHEMA
            if state_dictionary:
                i = SCHEMA.get_field_index("state")
                field = SCHEMA.field(i)
                expected = SCHEMA.set(i, field.with_type(pa.dictionary(pa.int32(), field.type)))
            if not self._file.schema_arrow.equals(expected, check_metadata=False):
                raise CorruptionError(
                    f"segment schema differs from the changelog schema "
                    f"({self._file.schema_arrow.names})",
                    location,
                )
            meta: dict[str, Any] = json.loads(raw)
        except CorruptionError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise CorruptionError(f"unreadable changelog segment ({exc})", location) from exc
        if not isinstance(meta, dict) or meta.get("version") not in READABLE_VERSIONS:
            version = meta.get("version") if isinstance(meta, dict) else None
            raise CorruptionError(f"unsupported segment version {version}", location)
        blocks = meta.get("blocks")
        if not isinstance(blocks, list) or len(blocks) != self._file.metadata.num_row_groups:
            raise CorruptionError("segment footer does not match its row groups", location)
        self.version: int = meta["version"]
        fields = _BLOCK_FIELDS_V1 if self.version == 1 else _BLOCK_FIELDS
        for index, desc in enumerate(blocks):
            if not (
                isinstance(desc, dict)
                and all(isinstance(desc.get(name), typ) for name, typ in fields.items())
            ):
                raise CorruptionError(f"segment footer entry of block {index} is invalid", location)
            if desc["rows"] != self._file.metadata.row_group(index).num_rows:
                raise CorruptionError(
                    f"block {index} has {self._file.metadata.row_group(index).num_rows} rows, "
                    f"footer says {desc['rows']}",
                    location,
                )
        self.blocks: list[dict[str, Any]] = blocks

    def verify_block(self, index: int) -> None:
        """Check block ``index``'s bytes against its footer checksum (version 2+)."""
        desc = self.blocks[index]
        if self.version < 2:
            return
        try:
            offset, length, expected = int(desc["offset"]), int(desc["length"]), desc["crc32"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptionError(
                f"block {index} has no valid checksum entry", self.location
            ) from exc
        if offset < 0 or length < 0 or offset + length > len(self._data):
            raise CorruptionError(
                f"block {index} lies outside the file (truncated?)", self.location
            )
        actual = zlib.crc32(memoryview(self._data)[offset : offset + length])
        if actual != expected:
            raise CorruptionError(
                f"block {index} checksum mismatch (crc32 {actual:08x}, footer {expected:08x})",
                self.location,
            )

    def _check_chunks(self, index: int, offset: int, length: int) -> None:
        """The Parquet footer's column chunks of block ``index`` must tile exactly the
        bytes the checksum covered, in column order. The checksum covers the pages, not
        the footer that says where they are: a flipped bit there once pointed a column
        at another column's pages, whose own checksums held, and changed what was read.
        """
        group = self._file.metadata.row_group(index)
        at = offset
        for i in range(group.num_columns):
            chunk = group.column(i)
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else None
            if start is None:
                start = chunk.data_page_offset
            if start != at:
                raise CorruptionError(
                    f"block {index}: column {chunk.path_in_schema!r} starts at byte {start}, "
                    f"expected {at} (corrupt footer)",
                    self.location,
                )
            at += chunk.total_compressed_size
        if at != offset + length:
            raise CorruptionError(
                f"block {index}: its columns end at byte {at}, its checksum at "
                f"{offset + length} (corrupt footer)",
                self.location,
            )

    def read_block(self, index: int, writer_id: str) -> pa.Table:
        """The rows of block ``index`` as a table of :data:`BLOCK_SCHEMA` (with ``state``
        as a dictionary if so read), checked against the footer's description.

        The ``writer`` column is not decoded: the footer names the block's writer (checked
        against ``writer_id``), and decoding one string per row was a quarter of a block's
        decoding CPU (0.15 s of 0.65 s for a 4.2M-change log)."""
        if not 0 <= index < len(self.blocks):
            raise CorruptionError(f"segment has no block {index}", self.location)
        desc = self.blocks[index]
        if desc["writer"] != writer_id:
            raise CorruptionError(
                f"block {index} belongs to writer {desc['writer']!r}, not {writer_id!r}",
                self.location,
            )
        self.verify_block(index)
        try:
            table = self._file.read_row_group(index, columns=BLOCK_SCHEMA.names)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise CorruptionError(f"corrupt block {index} ({exc})", self.location) from exc
        if table.num_rows != desc["rows"]:
            raise CorruptionError(
                f"block {index} has {table.num_rows} rows, footer says {desc['rows']}",
                self.location,
            )
        if self.version >= 2:  # after the read: pyarrow aborts on some corrupt footers
            # if asked for their column chunks first, where reading raises
            self._check_chunks(index, int(desc["offset"]), int(desc["length"]))
        return table
