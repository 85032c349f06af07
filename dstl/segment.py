"""The changelog segment file format (version 1).

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

The footer's key-value metadata ``dstl.segment`` holds JSON ``{"version": 1, "blocks":
[{"writer", "sqn_start", "sqn_end", "rows"}]}`` in row-group order. Pages carry CRC
checksums (verified on read) and are zstd-compressed. A truncated or corrupt segment
raises :class:`~dstl.errors.CorruptionError` naming the file.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dstl.errors import CorruptionError

SEGMENT_VERSION = 1
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


@dataclass(frozen=True, slots=True)
class Block:
    """One writer's changes for a segment: a table of :data:`SCHEMA` minus ``writer``."""

    writer_id: str
    sqn_start: int
    sqn_end: int
    table: pa.Table


def encode_segment(blocks: list[Block]) -> bytes:
    """Serialize ``blocks`` (one row group each) into segment bytes."""
    if not blocks:
        raise ValueError("a segment needs at least one block")
    meta = {
        "version": SEGMENT_VERSION,
        "blocks": [
            {
                "writer": b.writer_id,
                "sqn_start": b.sqn_start,
                "sqn_end": b.sqn_end,
                "rows": b.table.num_rows,
            }
            for b in blocks
        ],
    }
    schema = SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta).encode()})
    sink = io.BytesIO()
    with pq.ParquetWriter(
        sink,
        schema,
        compression="zstd",
        write_page_checksum=True,
        write_statistics=["sqn", "key_group"],
    ) as writer:
        for block in blocks:
            n = block.table.num_rows
            if n == 0:
                raise ValueError(f"empty block for writer {block.writer_id!r}")
            writer_col = pa.array([block.writer_id] * n, pa.string())
            table = block.table.add_column(0, "writer", writer_col).cast(SCHEMA)
            writer.write_table(table, row_group_size=n)  # exactly one row group per block
    return sink.getvalue()


class SegmentReader:
    """Reads blocks of one segment held in memory. Not thread-safe; cheap to create."""

    def __init__(self, data: bytes, location: str) -> None:
        self.location = location
        try:
            self._file = pq.ParquetFile(io.BytesIO(data), page_checksum_verification=True)
            raw = (self._file.schema_arrow.metadata or {}).get(METADATA_KEY)
            if raw is None:
                raise CorruptionError(
                    "not a changelog segment (no dstl.segment metadata)", location
                )
            meta: dict[str, Any] = json.loads(raw)
        except CorruptionError:
            raise
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise CorruptionError(f"unreadable changelog segment ({exc})", location) from exc
        if meta.get("version") != SEGMENT_VERSION:
            raise CorruptionError(f"unsupported segment version {meta.get('version')}", location)
        self.blocks: list[dict[str, Any]] = meta["blocks"]

    def read_block(self, index: int, writer_id: str) -> pa.Table:
        """The rows of block ``index``, checked against the footer's description."""
        if not 0 <= index < len(self.blocks):
            raise CorruptionError(f"segment has no block {index}", self.location)
        desc = self.blocks[index]
        if desc["writer"] != writer_id:
            raise CorruptionError(
                f"block {index} belongs to writer {desc['writer']!r}, not {writer_id!r}",
                self.location,
            )
        try:
            table = self._file.read_row_group(index)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise CorruptionError(f"corrupt block {index} ({exc})", self.location) from exc
        if table.num_rows != desc["rows"]:
            raise CorruptionError(
                f"block {index} has {table.num_rows} rows, footer says {desc['rows']}",
                self.location,
            )
        return table
