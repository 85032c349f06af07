"""A running job keeps what existed at its start out of the cyclic GC's passes
(coordinator/embedded/gcfreeze.py): a full collection over ~100k startup objects held the
GIL 40-90 ms mid-run (issue 16)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.embedded.gcfreeze import frozen_heap
from tools.demo_job import DemoConfig, pipeline


@pytest.fixture(autouse=True)
def _no_freeze_before() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_last_job_out_unfreezes_and_frozen_garbage_is_freed_then() -> None:
    before = _cycle()  # garbage already: collected, not frozen
    held = _Node()
    held.other = _Node()
    held.other.other = held
    with frozen_heap():
        assert before() is None
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        dropped = weakref.ref(held)
        del held  # a frozen object made garbage: freed only once unfrozen
        gc.collect()
        assert dropped() is not None
        during = _cycle()  # the run's own garbage is collected as before
        gc.collect()
        assert during() is None
        with frozen_heap():  # a second job freezes what was allocated since
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen  # the first job still runs
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dropped() is None


def test_a_process_that_froze_objects_itself_is_left_alone() -> None:
    gc.freeze()
    theirs = gc.get_freeze_count()
    mine = _Node()
    with frozen_heap():
        assert gc.get_freeze_count() == theirs
        del mine
    assert gc.get_freeze_count() == theirs


def test_a_run_freezes_while_its_tasks_run_and_unfreezes_at_its_end(tmp_path: Path) -> None:
    during: list[int] = []  # on the coordinator thread, after each checkpoint's commit
    config = DemoConfig(events_per_source=2000, users=100, rate_per_source=20_000.0)
    options = RuntimeOptions(
        store_url=str(tmp_path),
        checkpoint=CheckpointOptions(interval_s=0.05),
        source_batch=64,
        local_dir=str(tmp_path / "local"),
    )
    runtime = EmbeddedRuntime(
        pipeline(config, str(tmp_path / "out")),
        options,
        on_checkpoint=lambda _: during.append(gc.get_freeze_count()),
    )
    assert gc.get_freeze_count() == 0
    runtime.run()
    assert during and min(during) > 10_000  # the imported modules and the job, frozen
    assert gc.get_freeze_count() == 0
