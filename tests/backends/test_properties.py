"""Property: any operation sequence, checkpointed / logged / materialized / restored (at
any parallelism, into either store), gives the same state as running it on a plain heap.
"""

from __future__ import annotations

import pathlib
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import KeyGroupRange, TimeDomain, TimerService, restore_into
from dstl import ChangelogStorage, FileIO
from materializer import Materializer
from tests.backends.conftest import MAX_PAR, STORES, Factory
from tests.backends.helpers import N_OPS, apply_op, dump, merge_dumps

CHECKPOINT, MATERIALIZE, ADVANCE = -1, -2, -3
ACTION = st.one_of(
    st.tuples(st.integers(0, N_OPS - 1).filter(lambda o: o != 16), st.integers(0, 11)),
    st.sampled_from([(CHECKPOINT, 0), (MATERIALIZE, 0), (ADVANCE, 0)]),
)


@pytest.mark.parametrize("store", STORES)
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    actions=st.lists(ACTION, min_size=20, max_size=80),
    target=st.sampled_from(STORES),
    q=st.integers(1, 3),
)
def test_restore_equals_direct_execution(
    store: str, actions: list[tuple[int, int]], target: str, q: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        fileio = FileIO(str(root / "store"))
        with ChangelogStorage(fileio, "job", "w0") as storage:
            f = Factory(root, storage, fileio)
            try:
                _run(f, store, actions, target, q)
            finally:
                f.close()


def _run(f: Factory, store: str, actions: list[tuple[int, int]], target: str, q: int) -> None:
    reference = f.store("heap")
    subject = f.logged(store)
    ref_timers = TimerService(reference, TimeDomain.EVENT)
    sub_timers = TimerService(subject, TimeDomain.EVENT)
    materializer = Materializer(subject, f.fileio, "job", "op", 0)
    checkpoint_id = 0
    for i, (op, key) in enumerate(actions):
        if op == CHECKPOINT:
            checkpoint_id += 1
            subject.checkpoint(checkpoint_id).result()
        elif op == MATERIALIZE:
            materializer.materialize_now()
        elif op == ADVANCE:
            f.clock.advance(400)
        else:
            apply_op(reference, f"k{key}", op, i, f.clock, ref_timers)
            apply_op(subject, f"k{key}", op, i, f.clock, sub_timers)
    expected = dump(reference)
    assert dump(subject.inner) == expected
    handle = subject.checkpoint(checkpoint_id + 1).result()
    dumps = []
    for s in range(q):
        nb = f.store(target, KeyGroupRange.for_subtask(s, q, MAX_PAR))
        restore_into(nb, f.fileio, [handle])
        dumps.append(dump(nb))
    assert merge_dumps(dumps) == expected
