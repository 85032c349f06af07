"""Nothing leaks: after a clean run every file under the job's prefix is referenced.

Regression: materializations replaced before any completed checkpoint referenced them
(and the one applied after the final checkpoint) stayed on disk until an orphan sweep.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.gc import plan_sweep
from coordinator.metadata import MetadataStore
from dstl.changelog import ChangelogStorage, ChangelogWriter
from dstl.fileio import FileIO
from tools.demo_job import DemoConfig, pipeline


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_a_clean_run_leaves_no_orphans(tmp_path: Path, backend: str) -> None:
    config = DemoConfig(events_per_source=6000, users=300, rate_per_source=12_000.0)
    options = RuntimeOptions(
        store_url=str(tmp_path),
        # Materializing more often than checkpointing makes bases that no checkpoint
        # ever references.
        checkpoint=CheckpointOptions(interval_s=0.15, retain=1),
        materialization_interval_s=0.04,
        source_batch=64,
        state_backend=backend,
        local_dir=str(tmp_path / "local"),
    )
    result = EmbeddedRuntime(pipeline(config, str(tmp_path / "out")), options).run()
    assert result.materializations >= 2
    store = MetadataStore.for_local_store(str(tmp_path), create=False)
    plan = plan_sweep(FileIO(str(tmp_path)), store, "demo", min_age_s=0)
    store.close()
    assert plan.orphans == (), [f.path for f in plan.orphans]


def test_a_finished_task_closes_its_changelog_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's teardown frees its change buffers (up to 10 MiB per writer) at once: they
    must not wait for a garbage collection to find the task's reference cycles."""
    writers: list[ChangelogWriter] = []
    create = ChangelogStorage.create_writer

    def recording(self: ChangelogStorage, writer_id: str, initial_sqn: int = 0) -> ChangelogWriter:
        writers.append(create(self, writer_id, initial_sqn))
        return writers[-1]

    monkeypatch.setattr(ChangelogStorage, "create_writer", recording)
    config = DemoConfig(events_per_source=2000, users=100, rate_per_source=12_000.0)
    options = RuntimeOptions(
        store_url=str(tmp_path),
        checkpoint=CheckpointOptions(interval_s=0.1),
        source_batch=64,
        local_dir=str(tmp_path / "local"),
    )
    EmbeddedRuntime(pipeline(config, str(tmp_path / "out")), options).run()
    assert writers
    for w in writers:
        assert w._closed and len(w._buffer) == 0
        assert all(u.changes is None for u in w._uploads)
