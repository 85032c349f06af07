"""Planning of the Spark data source without Spark: options, state slices, change feeds."""

from __future__ import annotations

import pytest

from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from backends.keygroups import KeyGroupRange
from coordinator.metadata import CompletedCheckpoint, SubtaskState
from dstl.errors import CheckpointNotFoundError, ConfigError
from dstl.handles import ChangelogHandle
from tools.spark.options import DEFAULT_ROWS_PER_PARTITION, parse
from tools.spark.plan import feed_slices, slices

HASH = "sha256:" + "0" * 64


def test_options_parse_typed_and_refuse_mistakes() -> None:
    opts = parse(
        {
            "STORE": "s3://b/state",
            "storage.client_kwargs.endpoint_url": "http://127.0.0.1:9",
            "storage.anon": "false",
            "checkpoint": "7",
        }
    )
    assert opts.store == "s3://b/state" and opts.checkpoint == 7
    assert opts.storage_options == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "anon": False,
    }
    assert opts.rows_per_partition == DEFAULT_ROWS_PER_PARTITION and not opts.change_feed
    feed = parse({"store": "x", "readChangeFeed": "TRUE", "changeStartCheckpoint": "0"})
    assert feed.change_feed and feed.change_start == 0 and feed.change_end == "latest"
    for bad, message in [
        ({}, "needs .option"),
        ({"store": "x", "chekpoint": "3"}, "unknown option"),
        ({"store": "x", "checkpoint": "-1"}, "out of range"),
        ({"store": "x", "rowsPerPartition": "0"}, ">= 1"),
        ({"store": "x", "readChangeFeed": "yes"}, "true or false"),
        ({"store": "x", "readChangeFeed": "true"}, "needs changeStartCheckpoint"),
        ({"store": "x", "changeStartCheckpoint": "1"}, "need readChangeFeed"),
        (
            {
                "store": "x",
                "readChangeFeed": "true",
                "changeStartCheckpoint": "1",
                "checkpoint": "2",
            },
            "use changeEndCheckpoint",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse(bad)


def _piece(state: str, lo: int, hi: int, rows: int) -> StateFileHandle:
    return StateFileHandle(
        f"jobs/j/materialized/op/0000/{lo:016x}-a/{state}.kg{lo}", 1, HASH, state, lo, hi, rows
    )


def _log(writer: str, start: int, end: int, rows: int = 10, seg: int = 1) -> ChangelogHandle:
    return ChangelogHandle(
        f"jobs/j/changelog/w/{seg:016x}-a.parquet", 0, writer, start, end, rows, 9
    )


def test_slices_cut_at_pieces_and_subtasks_and_merge_small_ones() -> None:
    mat = MaterializationHandle(
        "a",
        1,
        0,
        64,
        "heap-parquet",
        (
            _piece("s", 0, 16, 100),
            _piece("s", 16, 32, 100),
            _piece("s", 32, 64, 100),
            _piece("t", 0, 64, 999),
        ),
    )
    h0 = KeyedStateHandle("a", 0, 64, "str", 128, (mat,), (_log("a", 1, 3, rows=64),))
    h1 = KeyedStateHandle("b", 64, 128, "str", 128, (), (_log("b", 0, 2, rows=64),))
    fine = slices([h1, h0], "s", 1)
    assert [(s.key_groups.start, s.key_groups.end) for s in fine] == [
        (0, 16),
        (16, 32),
        (32, 64),
        (64, 128),
    ]
    assert [s.estimated_rows for s in fine] == [116, 116, 132, 64]
    assert [s.handles for s in fine] == [(h0,), (h0,), (h0,), (h1,)]
    two = slices([h0, h1], "s", 250)  # merged up to the limit, never across subtasks
    assert [s.key_groups for s in two] == [
        KeyGroupRange(0, 32),
        KeyGroupRange(32, 64),
        KeyGroupRange(64, 128),
    ]
    whole = slices([h0, h1], "s", 10**9)
    assert [(s.key_groups, s.handles) for s in whole] == [
        (KeyGroupRange(0, 64), (h0,)),
        (KeyGroupRange(64, 128), (h1,)),
    ]


def _cp(cid: int, *handles: KeyedStateHandle) -> CompletedCheckpoint:
    states = tuple(SubtaskState("op", i, (h,)) for i, h in enumerate(handles))
    return CompletedCheckpoint("j", cid, "checkpoint", 1.0, 2.0, states)


def test_feed_blocks_are_the_changes_between_the_checkpoints_in_order() -> None:
    a, b, c = _log("w", 0, 3, seg=1), _log("w", 3, 5, seg=2), _log("w", 5, 9, seg=3)
    start = _cp(1, KeyedStateHandle("w", 0, 128, "str", 128, (), (a,)))
    mid = _cp(2, KeyedStateHandle("w", 0, 128, "str", 128, (), (a, b)))
    end = _cp(4, KeyedStateHandle("w", 0, 128, "str", 128, (), (a, b, c)))
    parts = feed_slices("op", start, [mid, end])
    blocks = [blk for p in parts for blk in p.blocks]
    assert [(blk.handle, blk.lo, blk.hi) for blk in blocks] == [(b, 3, 5), (c, 5, 9)]
    assert [blk.ordinal for blk in blocks] == [0, 1]
    assert blocks[0].thresholds == ((5, 2), (9, 4))  # sqn < 5: checkpoint 2, else 4
    everything = [blk.handle for p in feed_slices("op", None, [end]) for blk in p.blocks]
    assert everything == [a, b, c]


def test_a_restored_jobs_writers_follow_the_ones_they_restored_from() -> None:
    old = _log("old", 0, 4, seg=1)
    new = _log("new", 0, 2, seg=2)
    start = _cp(1, KeyedStateHandle("old", 0, 128, "str", 128, (), (_log("old", 0, 2, seg=0),)))
    end = _cp(
        3, KeyedStateHandle("new", 0, 128, "str", 128, (), (_log("old", 0, 2, seg=0), old, new))
    )
    blocks = [blk for p in feed_slices("op", start, [end]) for blk in p.blocks]
    assert [(blk.handle.writer_id, blk.lo, blk.ordinal) for blk in blocks] == [
        ("old", 2, 0),
        ("new", 0, 1),
    ]


def test_a_feed_across_a_materialization_names_the_missing_changes() -> None:
    start = _cp(1, KeyedStateHandle("w", 0, 128, "str", 128, (), (_log("w", 0, 3),)))
    mat = MaterializationHandle("w", 6, 0, 128, "heap-parquet", ())
    end = _cp(2, KeyedStateHandle("w", 0, 128, "str", 128, (mat,), (_log("w", 6, 8, seg=2),)))
    with pytest.raises(CheckpointNotFoundError, match="writer w from sqn 3 on"):
        feed_slices("op", start, [end])


def test_a_checkpoint_of_another_branch_is_refused() -> None:
    start = _cp(5, KeyedStateHandle("w", 0, 128, "str", 128, (), (_log("w", 0, 9),)))
    end = _cp(
        7, KeyedStateHandle("v", 0, 128, "str", 128, (), (_log("w", 0, 4), _log("v", 0, 2, seg=3)))
    )
    with pytest.raises(ConfigError, match="not in the history"):
        feed_slices("op", start, [end])
