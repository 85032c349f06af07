"""The changelog can be switched off per job, and on or off across a restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import CompletedCheckpoint
from coordinator.sink import read_output
from dstl.fileio import FileIO
from tools.demo_job import DemoConfig, pipeline, reference
from tools.restore import plan_restore, restore_operator

# 2 s of input: the first checkpoint waits for the DSTL encoder process to start (0.5-1 s),
# and full RocksDB snapshots (changelog off) are slow on a loaded machine: still 3 checkpoints
CONFIG = DemoConfig(events_per_source=4000, users=200, rate_per_source=2000.0)


class InjectedCrash(Exception):
    pass


def _options(root: Path, changelog: bool, backend: str = "heap") -> RuntimeOptions:
    return RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.02, retain=2),
        materialization_interval_s=0.1,
        source_batch=64,
        changelog_enabled=changelog,
        state_backend=backend,
        local_dir=str(root / "local"),
    )


@pytest.mark.parametrize(("before", "after"), [(False, False), (False, True), (True, False)])
def test_switch_across_a_crash_is_exactly_once(tmp_path: Path, before: bool, after: bool) -> None:
    job = pipeline(CONFIG, str(tmp_path / "out"))
    crashed: list[CompletedCheckpoint] = []

    def listener(cp: CompletedCheckpoint) -> None:
        if not crashed and cp.checkpoint_id >= 3:
            crashed.append(cp)
            raise InjectedCrash(f"after checkpoint {cp.checkpoint_id}")

    with pytest.raises(InjectedCrash):
        EmbeddedRuntime(job, _options(tmp_path, before), on_checkpoint=listener).run()
    state = crashed[0].states_of("user-stats")[0].handles[0]
    if not before:
        assert state.changelog == () and len(state.materialized) == 1
    result = EmbeddedRuntime(job, _options(tmp_path, after)).run()
    assert result.restored_from == crashed[0].checkpoint_id
    stats = [s.stats for c in result.checkpoints for s in c.states_of("user-stats")]
    assert any("materialization" in s for s in stats)
    rows: list[tuple[Any, ...]] = sorted(
        tuple(r) for r in read_output(FileIO(str(tmp_path / "out")))
    )
    expected, _ = reference(CONFIG)
    assert rows == expected


@pytest.mark.parametrize(
    ("before", "after", "changelog"),
    [
        ("rocksdb", "rocksdb", True),
        ("heap", "rocksdb", True),
        ("rocksdb", "heap", True),
        ("rocksdb", "rocksdb", False),
    ],
)
def test_rocksdb_store_and_switching_stores_across_a_crash(
    tmp_path: Path, before: str, after: str, changelog: bool
) -> None:
    job = pipeline(CONFIG, str(tmp_path / "out"))
    crashed: list[CompletedCheckpoint] = []

    def listener(cp: CompletedCheckpoint) -> None:
        if not crashed and cp.checkpoint_id >= 3:
            crashed.append(cp)
            raise InjectedCrash(f"after checkpoint {cp.checkpoint_id}")

    with pytest.raises(InjectedCrash):
        EmbeddedRuntime(job, _options(tmp_path, changelog, before), on_checkpoint=listener).run()
    result = EmbeddedRuntime(job, _options(tmp_path, changelog, after)).run()
    assert result.restored_from == crashed[0].checkpoint_id
    rows = sorted(tuple(r) for r in read_output(FileIO(str(tmp_path / "out"))))
    expected_rows, expected_state = reference(CONFIG)
    assert rows == expected_rows
    final = result.checkpoints[-1]
    snapshot = restore_operator(
        FileIO(str(tmp_path)), plan_restore(final, str(tmp_path / "r")).operators["user-stats"]
    )
    restored = {
        name: {k: v for entries in t.values() for k, v in entries.items()}
        for name, t in snapshot.tables.items()
    }
    assert restored == expected_state
