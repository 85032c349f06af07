"""What one Spark task of the ``changelog-state`` data source does (no Spark here).

Runs in executors' Python workers, on picklable values from :mod:`tools.spark.plan`: the
store's :class:`~dstl.fileio.FileIO` (it reconnects after unpickling, so S3 works through
our own FileIO, no ``s3a://`` needed), a slice, the state's declaration. Every file read
is verified (size and SHA-256 as recorded) and nothing of the store is unpickled.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from backends.heap import HeapKeyedStateBackend
from backends.restore import restore_into
from backends.serializers import Serializer
from backends.state import StateMeta
from backends.tables import table_for
from dstl.fileio import FileIO
from dstl.integrity import read_verified
from dstl.segment import SegmentReader
from tools.spark.plan import FeedSlice, StateSlice
from tools.spark.shape import change_rows, empty_state, op_filter, state_rows

BATCH_ROWS = 65_536


def _never() -> int:
    """TTL clock of a reader: time 0, so every entry the checkpoint holds is returned."""
    return 0


def read_state(
    fileio: FileIO,
    part: StateSlice,
    meta: StateMeta,
    key_serializer: Serializer,
    max_parallelism: int,
) -> pa.Table:
    """The entries of ``meta``'s state in the slice's key groups (see
    :func:`tools.spark.shape.state_schema`)."""
    backend = HeapKeyedStateBackend(key_serializer, part.key_groups, max_parallelism, _never)
    restore_into(backend, fileio, part.handles, trusted=False, states={meta.name})
    restored = backend.state_metas().get(meta.name)
    if restored is None:  # no entry of it here, and no piece read for its declaration
        return empty_state(meta, key_serializer)
    return state_rows(restored, table_for(restored, key_serializer, backend.raw_table(meta.name)))


def _owners(sqns: pa.Array, thresholds: tuple[tuple[int, int], ...]) -> pa.Array:
    """The checkpoint of each sqn: the first threshold whose reach is above it."""
    reaches = [r for r, _ in thresholds]
    unique = pc.unique(sqns)
    owner = [thresholds[bisect.bisect_right(reaches, s)][1] for s in unique.to_pylist()]
    return pa.array(owner, pa.int64()).take(pc.index_in(sqns, value_set=unique))


def read_changes(
    fileio: FileIO, part: FeedSlice, meta: StateMeta, key_serializer: Serializer
) -> Iterator[pa.Table]:
    """The changes of ``meta``'s state in the slice's blocks, one table per block (see
    :func:`tools.spark.shape.change_schema`). The segment file is read once."""
    ref = part.blocks[0].handle.file_refs()[0]
    reader = SegmentReader(read_verified(fileio, ref), fileio.url(fileio.relative(ref.location)))
    for block in part.blocks:
        table = reader.read_block(block.handle.block, block.handle.writer_id)
        n = table.num_rows
        table = table.append_column("__row", pa.array(range(n), pa.int64()))
        sqn = table["sqn"]
        in_range = pc.and_(pc.greater_equal(sqn, block.lo), pc.less(sqn, block.hi))
        table = op_filter(table.filter(in_range), meta.name)
        if table.num_rows == 0:
            continue
        rows = table["__row"].combine_chunks()
        extra = {
            "sequence": pc.add(rows, block.ordinal << 32),
            "checkpoint_id": _owners(table["sqn"].combine_chunks(), block.thresholds),
            "writer": pa.array([block.handle.writer_id] * table.num_rows, pa.string()),
        }
        yield change_rows(meta, key_serializer, table.drop_columns(["__row"]), extra)


def batches(table: pa.Table, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """``table`` cast to ``schema`` (what Spark expects, field for field) in batches."""
    yield from table.cast(schema).to_batches(max_chunksize=BATCH_ROWS)
