"""A running job keeps what existed at its start out of the cyclic GC's passes, and has
its young generation collected only once it grew by 20000 objects
(coordinator/embedded/gcpolicy.py): a full collection over ~100k startup objects held the
GIL 40-90 ms mid-run, and young collections 8% of the run (issue 16)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.embedded.gcpolicy import YOUNG_THRESHOLD, job_gc_policy
from tools.demo_job import DemoConfig, pipeline


@pytest.fixture(autouse=True)
def _no_freeze_before() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


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
    with job_gc_policy():
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
        with job_gc_policy():  # a second job freezes what was allocated since
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() >= frozen  # the first job still runs
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dropped() is None


def test_a_process_that_froze_objects_itself_is_left_alone() -> None:
    gc.freeze()
    theirs = gc.get_freeze_count()
    mine = _Node()
    with job_gc_policy():
        assert gc.get_freeze_count() == theirs
        del mine
    assert gc.get_freeze_count() == theirs


def test_the_young_threshold_is_raised_while_jobs_run_and_put_back_after() -> None:
    gc.set_threshold(700, 10, 10)
    with job_gc_policy():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        with job_gc_policy():
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)  # the first job still runs
    assert gc.get_threshold() == (700, 10, 10)


def test_young_thresholds_a_process_chose_are_left_alone() -> None:
    gc.set_threshold(YOUNG_THRESHOLD * 5, 10, 10)  # higher already
    with job_gc_policy():
        assert gc.get_threshold() == (YOUNG_THRESHOLD * 5, 10, 10)
    assert gc.get_threshold() == (YOUNG_THRESHOLD * 5, 10, 10)
    gc.set_threshold(700, 10, 10)
    with job_gc_policy():
        gc.set_threshold(1000, 20, 20)  # changed while the job ran: theirs now
    assert gc.get_threshold() == (1000, 20, 20)


def test_young_collections_still_free_garbage_cycles() -> None:
    gc.set_threshold(700, 10, 10)
    with job_gc_policy():
        gc.collect()
        first = _cycle()
        for _ in range(YOUNG_THRESHOLD):  # garbage cycles count towards the threshold
            _cycle()
        assert first() is None  # freed by a young collection, no gc.collect() here


def test_a_run_freezes_while_its_tasks_run_and_unfreezes_at_its_end(tmp_path: Path) -> None:
    during: list[tuple[int, int]] = []  # on the coordinator thread, after each commit
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
        on_checkpoint=lambda _: during.append((gc.get_freeze_count(), gc.get_threshold()[0])),
    )
    gc.set_threshold(700, 10, 10)
    assert gc.get_freeze_count() == 0
    runtime.run()
    assert during and min(f for f, _ in during) > 10_000  # the modules and the job, frozen
    assert {young for _, young in during} == {YOUNG_THRESHOLD}
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)
