"""Offline materialization: the job only writes the log; a compaction registered while it
runs is adopted at the next barrier, later checkpoints rest on it, and retention releases
the log before it. The state and the output stay exactly those of a failure-free run.

The compaction here folds on the coordinator thread (a checkpoint listener), reading the
store while the tasks keep writing it; ``tests/tools/test_spark_compact.py`` runs the same
through Spark and ``statectl compact``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from backends.handles import KeyedStateHandle
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from coordinator.sink import read_output
from dstl import layout
from dstl.errors import ConfigError
from dstl.fileio import FileIO
from materializer.compaction import fold_all
from tools.demo_job import DemoConfig, pipeline, reference
from tools.restore import plan_restore, state_tables

# The input lasts 4 s (the rate only paces the sources), so checkpoints keep coming well
# after the compaction registered at checkpoint 2 however loaded the machine is; at 1.3 s
# a loaded run sometimes registered it at the last checkpoint and none could adopt it.
CONFIG = DemoConfig(events_per_source=8000, users=150, rate_per_source=2000.0)


def compact_now(root: Path, cp: CompletedCheckpoint) -> dict[tuple[str, int], Any]:
    """Fold every keyed subtask of ``cp`` and register the result."""
    fileio = FileIO(str(root))
    proposals = {}
    for s in cp.subtasks:
        for h in s.handles:
            if isinstance(h, KeyedStateHandle):
                directory = layout.compaction_dir(
                    cp.job_id, s.operator, s.subtask, cp.checkpoint_id, "t"
                )
                proposals[(s.operator, s.subtask)] = fold_all(fileio, h, directory)
    with MetadataStore.for_local_store(str(root), create=False) as store:
        store.register_compaction(cp.job_id, cp.checkpoint_id, proposals)
    return proposals


def state_of(root: Path, cp: CompletedCheckpoint) -> dict[str, dict[Any, Any]]:
    out: dict[str, dict[Any, Any]] = {}
    for _op, name, table in state_tables(plan_restore(cp, "unused"), FileIO(str(root))):
        d = table.to_pydict()
        if "user_key" in d:
            folded: dict[Any, Any] = {}
            for k, uk, v in zip(d["key"], d["user_key"], d["value"], strict=True):
                folded.setdefault(k, {})[uk] = v
            out[name] = folded
        else:
            out[name] = dict(zip(d["key"], d["value"], strict=True))
    return out


def test_offline_job_adopts_a_compaction_and_releases_the_log(tmp_path: Path) -> None:
    root = tmp_path / "store"
    options = RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.02, retain=1),
        materialization="offline",
        materialization_interval_s=0.05,  # ignored offline: the job never materializes
        source_batch=64,
    )
    compacted: list[tuple[CompletedCheckpoint, dict[tuple[str, int], Any]]] = []
    registered_at: list[float] = []

    def listener(cp: CompletedCheckpoint) -> None:
        if not compacted and cp.checkpoint_id >= 2:
            compacted.append((cp, compact_now(root, cp)))
            registered_at.append(time.time())

    job = pipeline(CONFIG, str(tmp_path / "out"))
    result = EmbeddedRuntime(job, options, on_checkpoint=listener).run()
    assert result.materializations == 0 and compacted
    source, proposals = compacted[0]
    fileio = FileIO(str(root))
    assert not fileio.list(f"jobs/{job.job_id}/materialized")
    files = {f for h in proposals.values() for f in h.files()}
    later = [cp for cp in result.checkpoints if cp.checkpoint_id > source.checkpoint_id]
    adopted = [cp for cp in later if files <= set(cp.files())]
    assert adopted, "no checkpoint after the compaction rests on it"
    # at one of the first two barriers after the registration: a record looks the
    # compactions up as it reserves the next checkpoint's id, so one registered after the
    # record that reserved the next trigger's id is offered a trigger later
    firsts = [cp.checkpoint_id for cp in later if cp.triggered_at >= registered_at[0]]
    assert adopted[0].checkpoint_id in firsts[:2]
    with MetadataStore.for_local_store(str(root), create=False) as store:
        assert store.pending_compactions(job.job_id) == []
        final = store.latest(job.job_id)
    assert final is not None
    # the log the compaction folded went with the checkpoints that referenced it
    folded_log = {
        c.location for s in source.subtasks for h in s.handles for c in getattr(h, "changelog", ())
    }
    assert folded_log and not any(fileio.exists(f) for f in folded_log)
    rows, state = reference(CONFIG)
    assert state_of(root, final) == state
    assert sorted(tuple(r) for r in read_output(FileIO(str(tmp_path / "out")))) == rows


def test_offline_needs_the_changelog() -> None:
    with pytest.raises(ConfigError, match="offline"):
        RuntimeOptions(store_url="x", materialization="offline", changelog_enabled=False)
    with pytest.raises(ConfigError, match="online or offline"):
        RuntimeOptions(store_url="x", materialization="sometimes")
