"""State -> changelog + materialization -> restore gives the same state, at any parallelism."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyedStateHandle,
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    ValueStateDescriptor,
    restore_into,
)
from backends.serializers import FLOAT64, INT64, PICKLE, STR
from dstl import ChangelogStorage, FileIO
from dstl.errors import SchemaMismatchError
from materializer import Materializer
from tests.backends.helpers import snapshot_entries

MAX_PAR = 128


@pytest.fixture
def storage(tmp_path: Any) -> Iterator[tuple[FileIO, ChangelogStorage]]:
    fileio = FileIO(str(tmp_path))
    with ChangelogStorage(fileio, "job", "w0") as st:
        yield fileio, st


def _backend(st: ChangelogStorage, writer: str, rng: KeyGroupRange) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(
        HeapKeyedStateBackend(STR, rng, MAX_PAR), st.create_writer(writer)
    )


def _mutate(b: ChangelogKeyedStateBackend, seed: int, n: int) -> None:
    rnd = random.Random(seed)
    count = b.get_state(ValueStateDescriptor("count", INT64))
    items = b.get_state(ListStateDescriptor("items", STR))
    prices = b.get_state(MapStateDescriptor("prices", STR, FLOAT64))
    blob = b.get_state(ValueStateDescriptor("blob", PICKLE))
    for i in range(n):
        key = f"k{rnd.randrange(40)}"
        if not _owns(b, key):
            continue
        b.set_current_key(key)
        op = rnd.randrange(9)
        if op == 0:
            count.update((count.value() or 0) + 1)
        elif op == 1:
            count.clear()
        elif op == 2:
            items.add(f"i{i}")
        elif op == 3:
            items.update(items.get()[-2:])
        elif op == 4:
            items.clear()
        elif op == 5:
            prices.put(f"p{rnd.randrange(5)}", i * 0.5)
        elif op == 6:
            prices.remove(f"p{rnd.randrange(5)}")
        elif op == 7:
            blob.update({"i": i, "t": (1, "x")})
        else:
            prices.clear()


def _owns(b: ChangelogKeyedStateBackend, key: str) -> bool:
    from backends.keygroups import key_group_for

    return key_group_for(STR.serialize(key), MAX_PAR) in b.key_group_range


def _restore(
    fileio: FileIO, handles: list[KeyedStateHandle], parallelism: int
) -> dict[str, dict[Any, Any]]:
    merged: dict[str, dict[Any, Any]] = {}
    for s in range(parallelism):
        nb = HeapKeyedStateBackend(STR, KeyGroupRange.for_subtask(s, parallelism, MAX_PAR), MAX_PAR)
        restore_into(nb, fileio, handles)
        for name, entries in snapshot_entries(nb).items():
            assert not (merged.get(name, {}).keys() & entries.keys()), (
                "a key restored into two subtasks"
            )
            merged.setdefault(name, {}).update(entries)
    return merged


def test_log_only_round_trip(storage: tuple[FileIO, ChangelogStorage]) -> None:
    fileio, st = storage
    b = _backend(st, "op-0", KeyGroupRange(0, MAX_PAR))
    _mutate(b, 1, 500)
    handle = b.checkpoint(1).result()
    assert handle.materialized == ()
    assert _restore(fileio, [handle], 1) == snapshot_entries(b.inner)


def test_materialization_plus_log_round_trip(storage: tuple[FileIO, ChangelogStorage]) -> None:
    fileio, st = storage
    b = _backend(st, "op-0", KeyGroupRange(0, MAX_PAR))
    _mutate(b, 2, 400)
    b.checkpoint(1).result()
    mat = Materializer(b, fileio, "job", "op", 0).materialize_now()
    _mutate(b, 3, 400)
    handle = b.checkpoint(2).result()
    assert handle.materialized == (mat,)
    # After materialization the checkpoint references only the log from mat.sqn on.
    assert all(c.sqn_end > mat.sqn for c in handle.changelog)
    assert _restore(fileio, [handle], 1) == snapshot_entries(b.inner)


@pytest.mark.parametrize(("p", "q"), [(1, 3), (2, 1), (2, 5), (3, 2), (4, 4)])
def test_rescale(storage: tuple[FileIO, ChangelogStorage], p: int, q: int) -> None:
    fileio, st = storage
    backends = [_backend(st, f"op-{i}", KeyGroupRange.for_subtask(i, p, MAX_PAR)) for i in range(p)]
    for i, b in enumerate(backends):
        _mutate(b, 10 + i, 600)
        if i % 2 == 0:
            Materializer(b, fileio, "job", "op", i).materialize_now()
        _mutate(b, 20 + i, 300)
    handles = [b.checkpoint(7).result() for b in backends]
    expected: dict[str, dict[Any, Any]] = {}
    for b in backends:
        for name, entries in snapshot_entries(b.inner).items():
            expected.setdefault(name, {}).update(entries)
    restored = _restore(fileio, handles, q)
    assert restored == expected


def test_rescale_twice_does_not_replay_shared_logs_twice(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    # Regression: after p=1 -> q=2, both new handles reference the same old log; restoring
    # them into one backend must not apply the old list appends twice.
    fileio, st = storage
    b = _backend(st, "op-0", KeyGroupRange(0, MAX_PAR))
    _mutate(b, 5, 500)
    h1 = b.checkpoint(1).result()
    from backends import restore_changelog_backend

    halves = []
    for s in range(2):
        nb = _backend(st, f"op-{s}-a1", KeyGroupRange.for_subtask(s, 2, MAX_PAR))
        restore_changelog_backend(nb, fileio, [h1])
        halves.append(nb.checkpoint(2).result())
    assert _restore(fileio, halves, 1) == snapshot_entries(b.inner)


def test_schema_mismatch_on_restore_is_clear(storage: tuple[FileIO, ChangelogStorage]) -> None:
    fileio, st = storage
    b = _backend(st, "op-0", KeyGroupRange(0, MAX_PAR))
    _mutate(b, 1, 50)
    handle = b.checkpoint(1).result()
    nb = HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    restore_into(nb, fileio, [handle])
    with pytest.raises(SchemaMismatchError, match="count"):
        nb.get_state(ValueStateDescriptor("count", STR))
    wrong_keys = HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    with pytest.raises(SchemaMismatchError, match="keys"):
        restore_into(wrong_keys, fileio, [handle])
