"""The change buffer: a writer's change records until they are uploaded.

Task thread only while it fills; once handed to an upload (:meth:`ChangeBuffer.seal`)
it is never changed again, and the upload thread and the segment encoder read it.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dstl.segment import BLOCK_SCHEMA


class ChangeBuffer:
    """Buffer of change records of one writer.

    Task thread only while it fills; after :meth:`seal` (at an upload) read-only, read
    by the upload thread and, through :mod:`dstl.encoder`, by the encoder process.

    Records arrive one at a time (:meth:`append`: metadata, tests), as the columns a
    :class:`~dstl._records.RecordColumns` hands over (:meth:`add_records`: the changelog
    wrapper's hot path) or as Arrow columns of one state (:meth:`add_columns`: the batch
    path). They are kept as *chunks* whose ``sqn`` and ``state`` (and ``op``, when one
    for all) are stored once, not per row: they are expanded to columns only in
    :meth:`to_table`. Single records collect in plain lists, sealed into a chunk before
    the next columns arrive, so the buffer keeps the order records were appended in.

    Record-buffer columns stay plain bytes; :meth:`to_table` wraps them in the encoder
    process, so the task process makes no pyarrow call for them. Made every ~3 ms on the
    task thread, such calls (which release and retake the GIL) starved every other
    thread: in CPython 3.11 a waiting thread asks for the GIL only after 5 ms without a
    switch, and the upload thread needed ~100 ms per GIL round trip instead of ~5 ms.
    """

    __slots__ = ("_chunks", "_rows", "last_sqn", "nbytes", "rows")

    def __init__(self) -> None:
        # A chunk: (rows, nbytes, sqn, state, op, key_group, key, user_key, value) with
        # Arrow columns (user_key None: all null), (rows, nbytes, sqn, state, taken)
        # with what RecordColumns.take() returned, or (rows, nbytes, RecordBatch).
        self._chunks: list[tuple[Any, ...]] = []
        self._rows: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
        self.nbytes = 0
        self.rows = 0
        self.last_sqn: int | None = None

    def __len__(self) -> int:
        return self.rows

    def append(
        self,
        key_group: int,
        sqn: int,
        state: str,
        op: int,
        key: bytes,
        user_key: bytes | None,
        value: bytes | None,
    ) -> None:
        """Add one record."""
        kgs, sqns, states, ops, keys, uks, vals = self._rows
        kgs.append(key_group)
        sqns.append(sqn)
        states.append(state)
        ops.append(op)
        keys.append(key)
        uks.append(user_key)
        vals.append(value)
        self.rows += 1
        self.last_sqn = sqn
        self.nbytes += (
            24 + len(key) + (len(user_key) if user_key else 0) + (len(value) if value else 0)
        )

    def add_columns(
        self,
        sqn: int,
        state: str,
        op: int | pa.Array,
        key_groups: pa.Array,
        keys: pa.Array,
        user_keys: pa.Array | None,
        values: pa.Array,
    ) -> None:
        """Add ``len(keys)`` records of one change set and state; ``op`` is one operation for
        all of them or an int8 array of one per record."""
        n = len(keys)
        if not n:
            return
        nbytes = 13 * n + key_groups.nbytes + keys.nbytes + values.nbytes
        if user_keys is not None:
            nbytes += user_keys.nbytes
        self._add_chunk((n, nbytes, sqn, state, op, key_groups, keys, user_keys, values))

    def add_records(self, sqn: int, state: str, taken: tuple[Any, ...]) -> None:
        """Add the records a :class:`~dstl._records.RecordColumns` ``take()`` returned."""
        rows, key_groups, ops, key_offsets, key_data, user_keys, values = taken
        parts = (key_groups, ops, key_offsets, key_data, *values[2:], *(user_keys or ())[2:])
        nbytes = 13 * rows + sum(map(len, parts))  # as add_columns counts
        self._add_chunk((rows, nbytes, sqn, state, taken))

    @classmethod
    def from_chunks(cls, chunks: list[tuple[Any, ...]]) -> ChangeBuffer:
        """A sealed buffer of ``chunks`` as :attr:`chunks` returns them, for encoding (the
        encoder process rebuilds buffers this way; ``last_sqn`` stays None)."""
        buffer = cls()
        buffer._chunks = chunks
        buffer.rows = sum(c[0] for c in chunks)
        buffer.nbytes = sum(c[1] for c in chunks)
        return buffer

    @property
    def chunks(self) -> list[tuple[Any, ...]]:
        """The chunks, oldest first (the layouts are described in ``__init__``); read
        only, and complete only once :meth:`seal` was called."""
        return self._chunks

    def _add_chunk(self, chunk: tuple[Any, ...]) -> None:
        self.seal()
        self._chunks.append(chunk)
        self.rows += chunk[0]
        self.nbytes += chunk[1]
        self.last_sqn = chunk[2]

    def seal(self) -> None:
        """Turn the single records appended last into a chunk. Called before new columns
        arrive, before reading the chunks, and when the buffer is handed to an upload,
        after which it does not change."""
        rows = self._rows
        if not rows[0]:
            return
        batch = pa.RecordBatch.from_arrays(
            [pa.array(col, f.type) for col, f in zip(rows, BLOCK_SCHEMA, strict=True)],
            schema=BLOCK_SCHEMA,
        )
        self._chunks.append((batch.num_rows, batch.nbytes, batch))
        self._rows = ([], [], [], [], [], [], [])

    def drop_below(self, sqn: int) -> None:
        """Forget the records with a sequence number below ``sqn`` (they are sorted)."""
        if self.last_sqn is None or not self.rows:
            return
        self.seal()
        kept: list[tuple[Any, ...]] = []
        for chunk in self._chunks:
            if len(chunk) == 3:
                batch = chunk[2].filter(pc.greater_equal(chunk[2].column(1), sqn))
                if batch.num_rows:
                    kept.append((batch.num_rows, batch.nbytes, batch))
            elif chunk[2] >= sqn:
                kept.append(chunk)
        self._chunks = kept
        self.rows = sum(c[0] for c in kept)
        self.nbytes = sum(c[1] for c in kept)

    def to_table(self) -> pa.Table:
        """The records as an Arrow table of :data:`BLOCK_SCHEMA`, one record batch per chunk.

        The chunks are wrapped, not concatenated: this runs on the task thread at every
        persist, and concatenating cost about 200 ns per record there.
        """
        self.seal()
        batches: list[pa.RecordBatch] = []
        repeats: dict[tuple[pa.DataType, Any], pa.Array] = {}

        def repeat(value: Any, type_: pa.DataType, n: int) -> pa.Array:
            # Chunks of one buffer share few sqns, states and ops: slicing one long
            # array costs no allocation per chunk (a fresh one cost ~10 ns per record).
            array = repeats.get((type_, value))
            if array is None or len(array) < n:
                array = repeats[(type_, value)] = pa.repeat(pa.scalar(value, type_), n)
            return array.slice(0, n)

        for chunk in self._chunks:
            if len(chunk) == 3:
                batches.append(chunk[2])
                continue
            if len(chunk) == 5:
                chunk = _wrap_records(*chunk)
            n, _, sqn, state, op, kgs, keys, uks, vals = chunk
            columns = [
                kgs,
                repeat(sqn, pa.int64(), n),
                repeat(state, pa.string(), n),
                op if isinstance(op, pa.Array) else repeat(op, pa.int8(), n),
                keys,
                repeat(None, pa.binary(), n) if uks is None else uks,
                vals,
            ]
            batches.append(pa.RecordBatch.from_arrays(columns, schema=BLOCK_SCHEMA))
        return pa.Table.from_batches(batches, schema=BLOCK_SCHEMA)


def as_binary(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    """``values`` as an Arrow binary array (Arrow arrays pass through, cast if needed)."""
    if isinstance(values, pa.Array):
        return values if values.type == pa.binary() else values.cast(pa.binary())
    return pa.array(values, pa.binary())


def _wrap_records(
    rows: int, nbytes: int, sqn: int, state: str, taken: tuple[Any, ...]
) -> tuple[Any, ...]:
    """A record-buffer chunk as an Arrow-column chunk: the buffers are wrapped, not copied
    (they are Arrow's layout already)."""
    _, key_groups, ops, key_offsets, key_data, user_keys, values = taken
    return (
        rows,
        nbytes,
        sqn,
        state,
        pa.Array.from_buffers(pa.int8(), rows, [None, pa.py_buffer(ops)]),
        pa.Array.from_buffers(pa.int32(), rows, [None, pa.py_buffer(key_groups)]),
        _binary_column(rows, (0, None, key_offsets, key_data)),
        None if user_keys is None else _binary_column(rows, user_keys),
        _binary_column(rows, values),
    )


def _binary_column(rows: int, column: tuple[int, bytes | None, bytes, bytes]) -> pa.Array:
    """A binary array over a :class:`RecordColumns` column (no copy)."""
    nulls, validity, offsets, data = column
    bitmap = None if validity is None else pa.py_buffer(validity)
    buffers = [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.binary(), rows, buffers, null_count=nulls)


def as_int32(values: Sequence[int] | pa.Array) -> pa.Array:
    """Key groups as an Arrow int32 array; an ``array('i')`` is wrapped without a copy."""
    if isinstance(values, pa.Array):
        return values if values.type == pa.int32() else values.cast(pa.int32())
    if isinstance(values, array.array) and values.typecode == "i" and values.itemsize == 4:
        return pa.Array.from_buffers(pa.int32(), len(values), [None, pa.py_buffer(values)])
    return pa.array(values, pa.int32())
