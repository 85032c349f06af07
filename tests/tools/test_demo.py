"""The main job end to end: a real worker process is killed and restored; output is exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_kill_and_restore_matches_a_failure_free_run(tmp_path: Path) -> None:
    store = tmp_path / "demo-data"
    proc = subprocess.run(
        [
            sys.executable, "-m", "tools.demo",
            "--store", str(store),
            "--events", "16000",
            "--rate", "6000",
            "--checkpoint-interval", "0.4",
            "--materialization-interval", "0.9",
            "--kill-after", "2",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "killed                 yes (SIGKILL)" in proc.stdout
    assert "output matched         yes" in proc.stdout
    assert "final state matched    yes" in proc.stdout
    assert "RESULT: OK" in proc.stdout
    assert (store / "metadata.db").exists()
