"""Offline compaction folds a checkpointed state into heap-parquet tables that restore,
and a live backend adopts: its next checkpoints rest on them, with the same state.

Every store (heap, RocksDB) as the source and as the restore target; a state restored
and rescaled from several writers; the refusals (a compaction older than the base, one
from another branch of the job's history, one of other key groups).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from backends import ChangelogKeyedStateBackend, KeyedStateHandle, KeyGroupRange
from backends.restore import restore_changelog_backend
from dstl import layout
from materializer import Materializer
from materializer.compaction import (
    FoldTask,
    assemble,
    fold,
    fold_all,
    log_changes,
    needs_compaction,
    plan_tasks,
)
from tests.backends.conftest import MAX_PAR, STORES, Factory
from tests.backends.helpers import dump, merge_dumps, workload


def _dir(subtask: int = 0, checkpoint: int = 1) -> str:
    return layout.compaction_dir("job", "op", subtask, checkpoint, "t0")


def _restored(factory: Factory, kind: str, handles: list[KeyedStateHandle], q: int = 1) -> Any:
    return factory.restored(kind, handles, q)


def _only(handle: KeyedStateHandle, mat: Any) -> KeyedStateHandle:
    """``handle`` resting on ``mat`` alone (what a checkpoint after adopting it holds)."""
    return dataclasses.replace(handle, materialized=(mat,), changelog=())


@pytest.mark.parametrize("source", STORES)
def test_fold_restores_the_checkpointed_state(factory: Factory, source: str) -> None:
    b = factory.logged(source)
    workload(b, 1, 700, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    workload(b, 2, 700, factory.clock)
    handle = b.checkpoint(1).result()
    assert needs_compaction(handle) and log_changes(handle) > 0
    mat = fold_all(factory.fileio, handle, _dir(), task_rows=200)  # several tasks
    assert mat.kind == "heap-parquet" and mat.writer_id == handle.backend_id
    assert mat.sqn == handle.coverage()[handle.backend_id]
    for target in STORES:
        assert _restored(factory, target, [_only(handle, mat)], q=2) == dump(b.inner)


def test_a_retried_task_keeps_its_files(factory: Factory) -> None:
    b = factory.logged("heap")
    workload(b, 3, 500, factory.clock)
    handle = b.checkpoint(1).result()
    task = FoldTask("op", 0, handle, handle.key_group_range, _dir())
    first = fold(factory.fileio, task)
    again = fold(factory.fileio, task)  # same names, same content: kept
    assert first == again
    mat = assemble(factory.fileio, handle, _dir(), [first, again])
    assert _restored(factory, "heap", [_only(handle, mat)]) == dump(b.inner)


@pytest.mark.parametrize("store", STORES)
def test_live_backend_adopts_and_rests_on_it(factory: Factory, store: str) -> None:
    b = factory.logged(store)
    workload(b, 4, 600, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()
    workload(b, 5, 600, factory.clock)
    source = b.checkpoint(1).result()
    mat = fold_all(factory.fileio, source, _dir())
    workload(b, 6, 400, factory.clock)  # the job goes on while the compaction ran
    assert b.adopt(mat)
    after = b.checkpoint(2).result()
    assert after.materialized == (mat,)
    assert all(c.sqn_end > mat.sqn for c in after.changelog)
    assert _restored(factory, store, [after]) == dump(b.inner)
    workload(b, 7, 300, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()  # online again
    assert _restored(factory, store, [b.checkpoint(3).result()]) == dump(b.inner)


def test_rescaled_state_of_several_writers(factory: Factory) -> None:
    olds = [factory.logged("heap", KeyGroupRange.for_subtask(i, 2, MAX_PAR)) for i in range(2)]
    for i, b in enumerate(olds):
        workload(b, 10 + i, 500, factory.clock)
        if i == 0:
            Materializer(b, factory.fileio, "job", "op", i).materialize_now()
        workload(b, 20 + i, 300, factory.clock)
    handles = [b.checkpoint(1).result() for b in olds]
    news = []
    for s in range(3):
        nb = factory.logged("rocksdb", KeyGroupRange.for_subtask(s, 3, MAX_PAR))
        restore_changelog_backend(nb, factory.fileio, handles)
        workload(nb, 30 + s, 300, factory.clock)
        news.append((nb, nb.checkpoint(2).result()))
    for s, (nb, h) in enumerate(news):
        mat = fold_all(factory.fileio, h, _dir(s, 2))
        assert {w for w, _ in mat.covers} >= {b.backend_id for b in olds} & set(h.coverage())
        workload(nb, 40 + s, 200, factory.clock)
        assert nb.adopt(mat), nb.adoption_problem(mat)
        assert nb.restored_log == ()
    finals = [nb.checkpoint(3).result() for nb, _ in news]
    expected = merge_dumps([dump(nb.inner) for nb, _ in news])
    assert _restored(factory, "heap", finals, q=2) == expected


def test_adopt_refuses_what_would_lose_state(factory: Factory) -> None:
    b: ChangelogKeyedStateBackend[Any] = factory.logged("heap")
    workload(b, 8, 500, factory.clock)
    stale = fold_all(factory.fileio, b.checkpoint(1).result(), _dir(0, 1))
    workload(b, 9, 500, factory.clock)
    Materializer(b, factory.fileio, "job", "op", 0).materialize_now()  # newer than it
    assert "older" in str(b.adoption_problem(stale))
    assert not b.adopt(stale)
    assert b.base[0].writer_id == b.backend_id and b.base[0] is not stale

    # another branch: a job restored from checkpoint 1 must not adopt a compaction of a
    # later checkpoint of the old attempt (it holds changes the restored job never made)
    workload(b, 10, 300, factory.clock)
    one = b.checkpoint(2).result()
    workload(b, 11, 300, factory.clock)
    later = fold_all(factory.fileio, b.checkpoint(3).result(), _dir(0, 3))
    nb = factory.logged("heap")
    restore_changelog_backend(nb, factory.fileio, [one])
    assert "lacks" in str(nb.adoption_problem(later))
    half = factory.logged("heap", KeyGroupRange(0, 64))
    restore_changelog_backend(half, factory.fileio, [one])
    assert "key groups" in str(half.adoption_problem(fold_all(factory.fileio, one, _dir(0, 2))))


def test_tasks_cut_the_range() -> None:
    h = KeyedStateHandle("w", 0, 128, "str", 128)
    assert [t.key_groups for t in plan_tasks("op", 0, h, "d")] == [KeyGroupRange(0, 128)]
