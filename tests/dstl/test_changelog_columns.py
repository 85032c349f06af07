"""The writer's columnar buffer: chunks of one (sqn, state, op), mixed with single rows."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from dstl import ChangelogStorage, FileIO, read_changes
from dstl.changelog import ChangelogOptions, ChangelogWriter
from dstl.segment import BLOCK_SCHEMA


@pytest.fixture
def storage(fileio: FileIO) -> Iterator[ChangelogStorage]:
    with ChangelogStorage(fileio, "job", "w0", ChangelogOptions(batch_delay_s=0.01)) as st:
        yield st


def _fill(w: ChangelogWriter) -> list[tuple[Any, ...]]:
    """Appends of every shape; returns the rows expected, in order."""
    expected: list[tuple[Any, ...]] = []
    w.append_meta("s", 0, b"meta")
    expected.append((-1, 0, "s", 0, b"", None, b"meta"))
    keys = [b"k%d" % i for i in range(100)]
    w.append_columns(array("i", range(100)), "s", 1, keys, [b"v%d" % i for i in range(100)])
    expected += [(i, 0, "s", 1, keys[i], None, b"v%d" % i) for i in range(100)]
    w.append(7, "t", 5, b"x", b"u", b"y")
    expected.append((7, 0, "t", 5, b"x", b"u", b"y"))
    boundary = w.next_sqn()
    w.append_columns([1, 2], "t", 6, [b"a", b"b"], [None, None], [b"u1", b"u2"])  # short run
    expected += [(1, boundary, "t", 6, b"a", b"u1", None), (2, boundary, "t", 6, b"b", b"u2", None)]
    kg = pa.array(list(range(50)), pa.int32())
    w.append_columns(kg, "s", 2, pa.array([b"z"] * 50), pa.array([None] * 50, pa.binary()))
    expected += [(i, boundary, "s", 2, b"z", None, None) for i in range(50)]
    # longer than the chunks before with the same sqn, state and op (to_table shares
    # one array per repeated value between chunks, and must grow it here)
    w.append_columns(array("i", range(150)), "s", 2, [b"w"] * 150, [b"%d" % i for i in range(150)])
    expected += [(i, boundary, "s", 2, b"w", None, b"%d" % i) for i in range(150)]
    return expected


def _rows(tables: Iterator[pa.Table]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for t in tables:
        assert t.schema.equals(BLOCK_SCHEMA)
        out += list(zip(*(t[c].to_pylist() for c in BLOCK_SCHEMA.names), strict=True))
    return out


def test_every_append_shape_round_trips_in_order(fileio: FileIO, storage: ChangelogStorage) -> None:
    """A segment a persist waits for holds its rows as appended (not grouped by key
    group: see dstl.segment.encode_segment)."""
    w = storage.create_writer("a")
    expected = _fill(w)
    assert w.last_appended_sqn() == 1
    handles = w.persist(0, 1).result()
    assert [h.block for h in handles] == [0]
    assert _rows(read_changes(fileio, handles)) == expected


def test_a_pre_emptive_segment_holds_its_rows_by_key_group(fileio: FileIO) -> None:
    """Off the checkpoint's path (the lane, the helper), a block's rows are grouped by key
    group, each key's changes in order."""
    options = ChangelogOptions(preemptive_persist_bytes=1)  # every append is handed over
    with ChangelogStorage(fileio, "job", "w0", options, start_thread=False) as st:
        w = st.create_writer("a")
        keys = [b"a", b"b", b"c", b"b"]
        w.append_columns(array("i", [3, 1, 2, 1]), "s", 1, keys, [b"1", b"2", b"3", b"4"])
        st.drain_once()  # the pre-emptive upload, not one a persist waits for
        persisted = w.persist(0, 1)
        st.drain_once()
        handles = persisted.result()
    rows = _rows(read_changes(fileio, handles))
    assert [(r[0], r[4], r[6]) for r in rows] == [
        (1, b"b", b"2"),
        (1, b"b", b"4"),
        (2, b"c", b"3"),
        (3, b"a", b"1"),
    ]


def test_truncate_drops_whole_chunks_and_rows_below(
    fileio: FileIO, storage: ChangelogStorage
) -> None:
    w = storage.create_writer("a")
    expected = _fill(w)
    w.truncate(1)
    handles = w.persist(1, 1).result()
    assert _rows(read_changes(fileio, handles)) == [r for r in expected if r[1] >= 1]


def test_columns_of_different_lengths_are_refused(storage: ChangelogStorage) -> None:
    w = storage.create_writer("a")
    with pytest.raises(ValueError):
        w.append_columns([1, 2], "s", 1, [b"a"], [b"v"])
