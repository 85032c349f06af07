"""A RocksDB store restores a RocksDB materialization by adopting its files as its
database (no row read), and falls back to loading rows where that would be wrong:
a store not empty, a materialization it owns only part of (rescale), TTL states."""

from __future__ import annotations

import os
from typing import Any

import pytest

import backends.restore
import backends.rocksdb as rocksdb
from backends import (
    KeyGroupRange,
    ListStateDescriptor,
    MapStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
    restore_into,
)
from backends.restore import restore_changelog_backend
from backends.serializers import INT64, STR
from materializer import Materializer
from tests.backends.conftest import MAX_PAR, Factory
from tests.backends.helpers import dump, opened_with_level


def _fill(b: Any, seed: int, ttl: bool = False) -> None:
    v = b.get_state(ValueStateDescriptor("v", INT64, default=0))
    lst = b.get_state(ListStateDescriptor("l", STR))
    m = b.get_state(MapStateDescriptor("m", STR, INT64))
    t = (
        b.get_state(ValueStateDescriptor("t", INT64, ttl=StateTtlConfig(ttl_ms=10_000)))
        if ttl
        else None
    )
    for i in range(300):
        b.set_current_key(f"k{(i * seed) % 53}")
        v.update(v.value() + i)
        lst.add(f"e{i}")
        m.put(f"u{i % 4}", i)
        if t is not None:
            t.update(i)


def _materialized(factory: Factory, ttl: bool = False) -> tuple[Any, Any]:
    b = factory.logged("rocksdb")
    _fill(b, 3, ttl)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    _fill(b, 5, ttl)
    return b, b.checkpoint(1).result(timeout=30)


def _rows_loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = backends.restore._decode_rocksdb_sst

    def spy(*args: Any) -> Any:
        calls.append(args[2].writer_id)
        return original(*args)

    monkeypatch.setitem(backends.restore._DECODERS, "rocksdb-sst", spy)
    return calls


def test_an_empty_store_adopts_the_files(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    b, handle = _materialized(factory)
    loaded = _rows_loaded(monkeypatch)
    target = factory.logged("rocksdb")
    assert target.inner.can_adopt()
    restore_changelog_backend(target, factory.fileio, [handle])
    assert loaded == []  # adopted: no row was read
    assert not target.inner.can_adopt()
    assert dump(target.inner) == dump(b.inner)
    # It keeps working: new changes, a materialization sharing the adopted SSTs, a restore.
    _fill(target, 7)
    mat = Materializer(target, factory.fileio, "job", "op", 0).materialize_now()
    again = target.checkpoint(2).result(timeout=30)
    assert again.materialized == (mat,)
    assert factory.restored("heap", [again]) == dump(target.inner)


def test_an_adopted_database_runs_with_the_stores_options(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adopted files carry the OPTIONS file of the store that wrote them; the store
    must still run with db_options(): the shared block cache (rocksdict gave a reopened
    database a new 8 MiB one) and today's column family options, not the saved ones."""
    _, handle = _materialized(factory)
    monkeypatch.setattr(rocksdb, "BOTTOMMOST_ZSTD_LEVEL", 5)  # the saved OPTIONS say 7
    target = factory.logged("rocksdb")
    restore_changelog_backend(target, factory.fileio, [handle])
    assert not target.inner.can_adopt()
    db = target.inner._db
    assert db.property_int_value("rocksdb.block-cache-capacity") == rocksdb.BLOCK_CACHE_BYTES
    log = os.path.join(target.inner.path, "db", "LOG")
    assert opened_with_level(log) == 5


def test_a_heap_store_loads_rows(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    b, handle = _materialized(factory)
    loaded = _rows_loaded(monkeypatch)
    assert factory.restored("heap", [handle]) == dump(b.inner)
    assert loaded == [b.backend_id]


def test_part_of_a_materialization_loads_rows(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, handle = _materialized(factory)
    loaded = _rows_loaded(monkeypatch)
    assert factory.restored("rocksdb", [handle], q=2) == dump(b.inner)
    assert len(loaded) == 2


def test_a_store_with_states_loads_rows(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    b, handle = _materialized(factory)
    loaded = _rows_loaded(monkeypatch)
    target = factory.store("rocksdb")
    target.get_state(ValueStateDescriptor("v", INT64, default=0))
    assert not target.can_adopt()
    restore_into(target, factory.fileio, [handle])
    assert dump(target) == dump(b.inner)
    assert len(loaded) == 1


def test_ttl_states_load_rows(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    b, handle = _materialized(factory, ttl=True)
    loaded = _rows_loaded(monkeypatch)
    target = factory.store("rocksdb", KeyGroupRange(0, MAX_PAR))
    restore_into(target, factory.fileio, [handle])
    assert dump(target) == dump(b.inner)
    assert len(loaded) == 1
