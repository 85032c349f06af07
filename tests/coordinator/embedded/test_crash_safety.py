"""Crash safety: a real process dies between "files written" and "record committed"."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import backends.forked
from coordinator.embedded import EmbeddedRuntime
from coordinator.gc import plan_sweep, sweep
from coordinator.metadata import MetadataStore
from coordinator.sink import read_output
from dstl.errors import CheckpointNotFoundError
from dstl.fileio import FileIO
from tests.coordinator.embedded.crash_worker import CONFIG, options
from tools.demo_job import pipeline, reference

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("fork", [False, True], ids=["copy", "fork"])
def test_kill_before_commit_then_restart_and_sweep(
    tmp_path: Path, fork: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fork``: every heap materialization of both attempts forks (backends.forked)."""
    if fork:
        monkeypatch.setattr(backends.forked, "FORK_MIN_ENTRIES", 0)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    argv = [str(store_dir), "4", *(["fork"] if fork else [])]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.coordinator.embedded.crash_worker", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    crash = json.loads((store_dir / "crash.json").read_text())
    fileio = FileIO(str(store_dir))

    store = MetadataStore.for_local_store(str(store_dir), create=False)
    latest = store.latest("demo")
    assert latest is not None and latest.checkpoint_id < crash["id"]
    with pytest.raises(CheckpointNotFoundError):
        store.get("demo", crash["id"])  # never recorded
    assert all(fileio.exists(fileio.relative(f)) for f in latest.files())  # intact

    referenced = store.referenced_files()
    leftovers = [f for f in crash["files"] if f not in referenced]
    assert leftovers, "the killed checkpoint wrote no file of its own"
    assert all(fileio.exists(fileio.relative(f)) for f in leftovers)

    dry = plan_sweep(fileio, store, "demo", min_age_s=0)
    assert set(leftovers) <= {f.path for f in dry.orphans}
    assert not referenced & {f.path for f in dry.orphans}
    assert all(fileio.exists(fileio.relative(f)) for f in leftovers)  # planning deletes nothing
    deleted = sweep(fileio, store, dry)
    assert set(leftovers) <= set(deleted)
    assert not any(fileio.exists(fileio.relative(f)) for f in leftovers)
    assert all(fileio.exists(fileio.relative(f)) for f in latest.files())
    store.close()

    # the restart restores the latest checkpoint and the output is exactly once
    result = EmbeddedRuntime(
        pipeline(CONFIG, str(store_dir / "output")), options(str(store_dir))
    ).run()
    assert result.restored_from == latest.checkpoint_id
    assert result.materializations > 0
    rows = sorted(tuple(r) for r in read_output(FileIO(str(store_dir / "output"))))
    assert rows == reference(CONFIG)[0]
