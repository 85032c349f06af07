"""Heap snapshots packed into Arrow columns: the same pieces as a copy, as of the snapshot."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from backends import (
    HeapKeyedStateBackend,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from backends import forked as forked_mod
from backends.forked import ForkedSnapshot, materialization_snapshot
from backends.keygroups import key_group_for
from backends.packed import PackedSnapshot, packed_snapshot, packs
from backends.serializers import FLOAT64, INT64, PICKLE, STR
from backends.state import StateTtlConfig
from backends.tables import state_files

MAX_PAR = 128


def _pieces(files: Iterator[Any]) -> list[tuple[str, str | None, int, int, int, bytes]]:
    return [(f.name, f.state, f.key_group_start, f.key_group_end, f.rows, f.data) for f in files]


ALL = KeyGroupRange(0, MAX_PAR)


def _backend(n: int, key_groups: KeyGroupRange = ALL) -> Any:
    """Value-like states of every packable type, keys inserted out of order (so the
    pieces need their sort), some deleted, and one state left empty."""
    b = HeapKeyedStateBackend(INT64, key_groups, MAX_PAR)
    count = b.get_state(ValueStateDescriptor("count", INT64))
    ratio = b.get_state(ValueStateDescriptor("ratio", FLOAT64))
    name = b.get_state(ValueStateDescriptor("name", STR))
    total = b.get_state(ReducingStateDescriptor("total", lambda a, c: a + c, INT64))
    b.get_state(ValueStateDescriptor("unused", INT64))
    keys = list(range(n))
    random.Random(5).shuffle(keys)
    for i in keys:
        if key_group_for(INT64.serialize(i), MAX_PAR) not in key_groups:
            continue
        b.set_current_key(i)
        count.update(i)
        ratio.update(i / 3)
        name.update(f"n{i}")
        total.add(i)
        if i % 7 == 0:
            name.clear()
    return b


@pytest.mark.parametrize("piece_rows", [None, 1, 256, 65536])
def test_the_pieces_are_those_of_a_copy_byte_for_byte(piece_rows: int | None) -> None:
    b = _backend(3000)
    want = _pieces(state_files(b.snapshot(3), piece_rows))
    snap = packed_snapshot(b, 3)
    assert isinstance(snap, PackedSnapshot) and snap.sqn == 3 and snap.kind == "heap-parquet"
    assert _pieces(snap.pieces(piece_rows)) == want
    assert {p[1] for p in want} == {"count", "ratio", "name", "total", "unused"}


def test_a_part_of_the_key_groups_gives_the_pieces_of_its_range() -> None:
    rng = KeyGroupRange(37, 90)
    b = _backend(3000, rng)
    assert _pieces(packed_snapshot(b, 1).pieces(300)) == _pieces(  # type: ignore[union-attr]
        state_files(b.snapshot(1), 300)
    )


def test_the_pieces_are_the_state_as_of_the_snapshot_while_the_task_writes_on() -> None:
    b = _backend(2000)
    want = _pieces(state_files(b.snapshot(1), 256))
    snap = packed_snapshot(b, 1)
    assert snap is not None
    count = b.get_state(ValueStateDescriptor("count", INT64))
    name = b.get_state(ValueStateDescriptor("name", STR))
    for i in range(0, 2500, 3):  # updates, inserts and deletes after the snapshot
        b.set_current_key(i)
        count.update(-i)
        name.clear()
    assert _pieces(snap.pieces(256)) == want != _pieces(state_files(b.snapshot(1), 256))
    snap.release()
    assert list(snap.pieces(256)) == []  # released: nothing held


def test_lists_maps_pickles_and_ttl_do_not_pack() -> None:
    def one(descriptor: Any) -> HeapKeyedStateBackend:
        b = HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR)
        b.get_state(ValueStateDescriptor("count", INT64))
        b.get_state(descriptor)
        return b

    assert packs(one(ValueStateDescriptor("other", STR)))
    others: list[Any] = [
        ListStateDescriptor("l", INT64),
        MapStateDescriptor("m", STR, INT64),
        ValueStateDescriptor("p", PICKLE),
        ValueStateDescriptor("t", INT64, ttl=StateTtlConfig(ttl_ms=100)),
    ]
    for descriptor in others:
        b = one(descriptor)
        assert not packs(b)
        assert packed_snapshot(b, 1) is None
    assert not packs(HeapKeyedStateBackend(PICKLE, KeyGroupRange(0, MAX_PAR), MAX_PAR))


def test_a_large_heap_store_packs_when_it_can_and_forks_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forked_mod, "FORK_MIN_ENTRIES", 500)
    b = _backend(50)
    assert not isinstance(materialization_snapshot(b, 1), PackedSnapshot)  # below: a copy
    b = _backend(300)
    assert isinstance(materialization_snapshot(b, 1), PackedSnapshot)
    b.get_state(ListStateDescriptor("seen", STR))
    snap = materialization_snapshot(b, 1)
    assert isinstance(snap, ForkedSnapshot)
    snap.release()
