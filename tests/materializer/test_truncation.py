"""After a materialization the log before it is truncated and its segments are released.

Bytes are deleted by global reference counting in the metadata store: a segment goes when
no retained checkpoint references it, so truncation happens at min(last subsumed, last
materialized) without anyone computing that minimum.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyedStateHandle,
    KeyGroupRange,
    ListStateDescriptor,
    ValueStateDescriptor,
    restore_into,
)
from backends.serializers import INT64, STR
from coordinator.metadata import MetadataStore
from dstl import ChangelogStorage, FileIO
from materializer import MaterializationOptions, MaterializationScheduler, Materializer
from tests.backends.helpers import snapshot_entries
from tests.materializer.fakes import ManualExecutor, record

MAX_PAR = 128
JOB = "job"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[FileIO, ChangelogStorage, MetadataStore]]:
    fileio = FileIO(str(tmp_path / "store"))
    store = MetadataStore("sqlite:///" + str(tmp_path / "meta.db"))
    store.start_attempt(JOB)
    with ChangelogStorage(fileio, JOB, "w0") as st:
        yield fileio, st, store
    store.close()


def _mutate(b: ChangelogKeyedStateBackend, start: int, n: int) -> None:
    count = b.get_state(ValueStateDescriptor("count", INT64))
    seen = b.get_state(ListStateDescriptor("seen", STR))
    for i in range(start, start + n):
        b.set_current_key(f"k{i % 97}")
        count.update((count.value() or 0) + 1)
        seen.add(f"e{i}")


def _restore(fileio: FileIO, handle: KeyedStateHandle) -> dict[str, dict[Any, Any]]:
    nb = HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
    restore_into(nb, fileio, [handle])
    return snapshot_entries(nb)


def _segments(handle: KeyedStateHandle) -> set[str]:
    return {c.location for c in handle.changelog}


@pytest.mark.parametrize("retain", [1, 2])
def test_segments_before_a_materialization_are_released(
    env: tuple[FileIO, ChangelogStorage, MetadataStore], retain: int
) -> None:
    fileio, st, store = env
    b = ChangelogKeyedStateBackend(
        HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR), st.create_writer("op-0")
    )
    executor = ManualExecutor()
    sched = MaterializationScheduler(
        Materializer(b, fileio, JOB, "op", 0),
        MaterializationOptions(interval_s=10.0),
        clock=lambda: 0.0,
        rng=lambda: 0.0,
        executor=executor,
    )

    _mutate(b, 0, 300)
    cp1 = b.checkpoint(1).result()
    assert record(store, fileio, JOB, 1, [cp1], retain) == []
    _mutate(b, 300, 300)
    cp2 = b.checkpoint(2).result()
    assert _segments(cp1) < _segments(cp2)  # before materializing, the log only grows
    assert record(store, fileio, JOB, 2, [cp2], retain) == []
    old_segments = _segments(cp2)

    # The materialization (snapshot on this thread, upload on the executor, then applied).
    before = snapshot_entries(b.inner)
    assert sched.tick(5.0)
    _mutate(b, 600, 50)  # changes after the snapshot stay in the log
    executor.run_all()
    result = sched.poll()
    assert result is not None and b.base == (result.handle,)

    cp3 = b.checkpoint(3).result()
    assert cp3.materialized == (result.handle,)
    assert not (_segments(cp3) & old_segments), "cp3 must not reference the truncated log"
    assert all(c.sqn_end > result.handle.sqn for c in cp3.changelog)
    released = record(store, fileio, JOB, 3, [cp3], retain)
    if retain == 1:  # cp2 is subsumed: every segment before the materialization goes
        assert set(released) == old_segments
    else:  # cp2 is still retained and needs them: nothing goes yet
        assert released == []
        _mutate(b, 650, 10)
        cp4 = b.checkpoint(4).result()
        assert set(record(store, fileio, JOB, 4, [cp4], retain)) == old_segments
    for url in old_segments:
        assert not fileio.exists(fileio.relative(url))
    for url in result.handle.files():
        assert fileio.exists(fileio.relative(url))

    # Restore after materialization + truncation equals the state at the checkpoint.
    assert _restore(fileio, cp3) != before  # the 50 later changes are in cp3's log
    latest = store.latest(JOB)
    assert latest is not None
    (handle,) = [h for s in latest.subtasks for h in s.handles]
    assert _restore(fileio, handle) == snapshot_entries(b.inner)
    sched.close()


def test_restore_right_after_materialization_with_an_empty_log(
    env: tuple[FileIO, ChangelogStorage, MetadataStore],
) -> None:
    fileio, st, _ = env
    b = ChangelogKeyedStateBackend(
        HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR), st.create_writer("op-0")
    )
    _mutate(b, 0, 500)
    b.checkpoint(1).result()
    mat = Materializer(b, fileio, JOB, "op", 0).materialize_now()
    assert not b.changed_since_materialization()
    cp = b.checkpoint(2).result()
    assert cp.materialized == (mat,)
    assert all(c.sqn_end > mat.sqn for c in cp.changelog)
    assert _restore(fileio, cp) == snapshot_entries(b.inner)
