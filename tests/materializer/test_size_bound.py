"""The size bound of periodic materialization: a checkpoint's full size stays within 1.5x
the live state at the default options, whatever the update rate. No sleeps: a fake clock,
materializations run when the test says, checkpoints every ten steps of 0.1 s."""

from __future__ import annotations

import random

from backends import ChangelogKeyedStateBackend, HeapKeyedStateBackend, KeyGroupRange
from backends.serializers import INT64
from backends.state import ValueStateDescriptor
from backends.tables import DEFAULT_PIECE_ROWS, state_files
from dstl import ChangelogStorage, FileIO
from materializer import MaterializationOptions, MaterializationScheduler, Materializer
from tests.materializer.fakes import ManualExecutor

MAX_PAR = 128
KEYS = 20_000
UPDATES_PER_STEP = 2_500  # 25k records/s over 20k keys: the log outgrows the state in 1 s
STEP_S = 0.1


def _live_bytes(b: ChangelogKeyedStateBackend[HeapKeyedStateBackend]) -> int:
    """What a materialization of the state now would store."""
    snap = b.inner.snapshot()
    try:
        return sum(len(f.data or b"") for f in state_files(snap, DEFAULT_PIECE_ROWS))
    finally:
        snap.release()


def _run(
    storage: tuple[FileIO, ChangelogStorage], options: MaterializationOptions, seconds: float
) -> tuple[list[float], MaterializationScheduler]:
    """Count and sum per key (the end-to-end bench's job) with uniform keys; the full
    size over the live state of every checkpoint after the first materialization."""
    fileio, st = storage
    b = ChangelogKeyedStateBackend(
        HeapKeyedStateBackend(INT64, KeyGroupRange(0, MAX_PAR), MAX_PAR), st.create_writer("op-0")
    )
    clock = [0.0]
    executor = ManualExecutor()
    sched = MaterializationScheduler(
        Materializer(b, fileio, "job", "op", 0, lambda: clock[0]),
        options,
        clock=lambda: clock[0],
        rng=lambda: 0.0,
        executor=executor,
    )
    count = b.get_state(ValueStateDescriptor("count", INT64, default=0))
    total = b.get_state(ValueStateDescriptor("sum", INT64, default=0))
    rnd = random.Random(16)
    amps: list[float] = []
    for step in range(round(seconds / STEP_S)):
        keys = range(KEYS) if step == 0 else [rnd.randrange(KEYS) for _ in range(UPDATES_PER_STEP)]
        for k in keys:
            b.set_current_key(k)
            count.update(count.value() + 1)
            total.update(total.value() + k)
        clock[0] = (step + 1) * STEP_S
        sched.run_once()
        executor.run_all()  # the upload finishes within the step...
        sched.poll()  # ...and is applied at the next turn of the task loop
        if step % 10 == 9:
            handle = b.checkpoint(step).result()
            sched.on_barrier(step)
            sched.on_checkpoint_complete(step)
            full = sum(r.size_bytes for r in handle.file_refs())
            if handle.materialized:
                amps.append(full / _live_bytes(b))
    sched.close()
    return amps, sched


def test_full_checkpoint_within_one_and_a_half_times_the_state(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    amps, sched = _run(storage, MaterializationOptions(), seconds=5.0)
    assert len(amps) >= 4
    assert max(amps) <= 1.5, amps
    assert sched.size_triggered > 0  # the bound, not the 5 s interval, materialized


def test_without_the_size_bound_the_log_outgrows_it(
    storage: tuple[FileIO, ChangelogStorage],
) -> None:
    """The same run by interval only: what the bound prevents (and why the test above
    would fail without it)."""
    amps, sched = _run(storage, MaterializationOptions(max_log_ratio=0.0), seconds=5.0)
    assert sched.size_triggered == 0
    assert max(amps) > 3.0, amps
