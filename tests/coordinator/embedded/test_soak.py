"""Soak: 1,000 checkpoints, retention 3, a SIGKILL every few dozen, then the orphan sweep.

Afterwards nothing may be left that no checkpoint references: no orphan file, no temp
file of an interrupted write, no RocksDB working directory of a killed attempt; every
retained checkpoint verifies, and the output is exactly once.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.metadata import MetadataStore
from coordinator.sink import read_output
from dstl.fileio import FileIO
from tests.coordinator.embedded.soak_worker import CONFIG
from tools.cli import EXIT_OK, main
from tools.demo_job import reference

REPO = Path(__file__).resolve().parents[3]
TARGET = 1000


def _attempt(store: Path, local: Path, kill_after: int | None) -> tuple[int, bool]:
    """Run one attempt; kill it after ``kill_after`` checkpoints. (checkpoints, finished).

    An attempt left to finish runs unpaced, with checkpoints every 250 ms: the input's pace
    and the 10 ms checkpoints are for the killed attempts; at either the rest of the input
    took minutes.
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.coordinator.embedded.soak_worker",
            str(store),
            str(local),
            "rocksdb",
            *(["unpaced"] if kill_after is None else []),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    seen, finished = 0, False
    for line in proc.stdout:
        event = json.loads(line)
        finished = finished or bool(event.get("finished"))
        seen += "id" in event
        if kill_after is not None and seen >= kill_after:
            proc.send_signal(signal.SIGKILL)
            break
    proc.stdout.close()
    code = proc.wait(timeout=120)
    assert code in (0, -signal.SIGKILL), f"attempt failed with exit {code}"
    return seen, finished


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_thousand_checkpoints_with_kills_leave_nothing_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, local = tmp_path / "store", tmp_path / "local"
    rng = random.Random(17)
    total, kills, finished = 0, 0, False
    while not finished:
        kill_after = rng.randint(20, 60) if total < TARGET else None
        seen, finished = _attempt(store, local, kill_after)
        total += seen
        kills += not finished
    print(f"soak: {total} checkpoints, {kills} kills")
    assert total >= TARGET and kills >= 10

    # what the kills left: temp dirs of RocksDB stores, maybe temp files and unreferenced files
    assert main(["gc", "--store", str(store), "--delete", "--min-age-s", "0",
                 "--local-dir", str(local), "--json"]) == EXIT_OK  # fmt: skip
    capsys.readouterr()
    assert main(["verify", "--store", str(store), "--checkpoint", "all", "--quiet"]) == EXIT_OK
    with MetadataStore.for_local_store(str(store), create=False) as meta:
        referenced = meta.referenced_files()
        assert len(meta.list("demo")) <= 3
    fileio = FileIO(str(store))
    listed = {f.path for f in fileio.list("jobs")} | {f.path for f in fileio.list("savepoints")}
    assert listed == referenced  # no orphan, no temp file
    assert [p for p in local.rglob("*") if p.is_dir()] == []  # no leaked working directory
    rows = sorted(tuple(r) for r in read_output(FileIO(str(store / "output"))))
    assert rows == reference(CONFIG)[0]  # and exactly once through every kill
