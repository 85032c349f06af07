"""Reading the changelog back: the changes of a list of handles, in order, filtered by
key group and sequence number (restore, the Spark reader, offline compaction).

Split out of :mod:`dstl.changelog` (the writing side). Reads verify each segment file's
content hash before decoding it (:func:`~dstl.integrity.read_verified`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc

from dstl.changelog import META_KEY_GROUP
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle
from dstl.integrity import read_verified
from dstl.segment import SegmentReader

READ_AHEAD = 2
"""Segments :func:`read_changes` reads and decodes ahead, on as many threads (Parquet
decoding releases the GIL, so a restore's replay overlaps it with its own work)."""


def read_changes(
    fileio: FileIO,
    handles: Iterable[ChangelogHandle],
    from_sqn: int = 0,
    key_groups: tuple[int, int] | None = None,
    runs: Sequence[tuple[int, int, int]] | None = None,
    state_dictionary: bool = False,
) -> Iterator[pa.Table]:
    """Yield the changes of ``handles`` in order, as tables of :data:`BLOCK_SCHEMA`
    (``state_dictionary``: with ``state`` as a dictionary array, see
    :class:`~dstl.segment.SegmentReader`).

    Keeps records with ``sqn >= from_sqn`` and, if ``key_groups=(start, end)`` is given,
    only those in that half-open key-group range. ``runs`` (instead of both): records of
    key groups ``[start, end)`` with ``sqn >= from_sqn``, per ``(start, end, from_sqn)``
    run; none outside the runs. Metadata records pass from the lowest of those sqns on,
    whatever their key group. A block all of whose
    records pass is yielded as read (no filter copies it). Reads each segment file once
    even when several handles point into it (adjacent handles of one file), up to
    :data:`READ_AHEAD` files ahead on threads of its own, stopped when the generator is.
    """
    if runs is None:
        lo, hi = key_groups if key_groups is not None else (META_KEY_GROUP, 1 << 31)
        runs = [(lo, hi, from_sqn)]
    elif from_sqn or key_groups is not None:
        raise ValueError("read_changes: give runs, or from_sqn and key_groups, not both")
    runs = sorted(runs)
    groups = [list(g) for _, g in itertools.groupby(handles, key=lambda h: h.location)]
    if len(groups) <= 1 or READ_AHEAD < 1:
        for group in groups:
            yield from _read_segment(fileio, group, runs, state_dictionary)
        return
    pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="dstl-read")
    try:
        ahead: list[Future[list[pa.Table]]] = []
        todo = iter(groups)
        for group in itertools.islice(todo, READ_AHEAD):
            ahead.append(pool.submit(_read_segment, fileio, group, runs, state_dictionary))
        while ahead:
            tables = ahead.pop(0).result()
            nxt = next(todo, None)
            if nxt is not None:
                ahead.append(pool.submit(_read_segment, fileio, nxt, runs, state_dictionary))
            yield from tables
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read_segment(
    fileio: FileIO,
    handles: list[ChangelogHandle],
    runs: list[tuple[int, int, int]],
    state_dictionary: bool,
) -> list[pa.Table]:
    """The changes of ``handles`` (blocks of one segment file) that ``runs`` keep."""
    ref = handles[0].file_refs()[0]
    url = fileio.url(fileio.relative(ref.location))
    reader = SegmentReader(read_verified(fileio, ref), url, state_dictionary)
    newest = max((f for _, _, f in runs), default=0)
    whole = all(a[1] == b[0] for a, b in itertools.pairwise(runs))  # one contiguous span
    span = (runs[0][0], runs[-1][1]) if runs and whole else None
    out = []
    for handle in handles:
        table = reader.read_block(handle.block, handle.writer_id)
        kg = table["key_group"]
        if span is not None and handle.sqn_start >= newest and table.num_rows:
            low, high = (s.as_py() for s in pc.min_max(kg).values())
            if high < span[1] and (low >= span[0] or (low == META_KEY_GROUP and span[0] == 0)):
                out.append(table)  # every record passes
                continue
        sqn = table["sqn"]
        lowest = min((f for _, _, f in runs), default=0)
        keep = pc.and_(pc.equal(kg, META_KEY_GROUP), pc.greater_equal(sqn, lowest))
        for start, end, first in runs:
            in_run = pc.and_(pc.greater_equal(kg, start), pc.less(kg, end))
            keep = pc.or_(keep, pc.and_(in_run, pc.greater_equal(sqn, first)))
        out.append(table.filter(keep))
    return out
