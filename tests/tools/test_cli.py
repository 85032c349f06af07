"""statectl against a store written by a real (small) pipeline run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from tools.cli import main
from tools.demo_job import DemoConfig, pipeline, reference

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store")
    config = DemoConfig(events_per_source=3000, users=200, rate_per_source=None)
    options = RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=3),
        materialization_interval_s=0.1,
    )
    EmbeddedRuntime(pipeline(config, str(root / "output")), options).run()
    return root


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_list_json(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", "list", "--store", str(store), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert 1 <= len(rows) <= 3
    assert all(r["job"] == "demo" for r in rows)


def test_restore_writes_one_table_per_state(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoints", "list", "--store", str(store), "--json"]) == 0
    latest = json.loads(capsys.readouterr().out)[-1]["checkpoint"]
    out = tmp_path / "restored"
    assert (
        main(["restore", "--store", str(store), "--checkpoint", str(latest), "-o", str(out)]) == 0
    )
    tables = sorted(p.name for p in (out / "user-stats").iterdir())
    assert tables == [
        "by_category.parquet",
        "count.parquet",
        "recent_items.parquet",
        "total_cents.parquet",
    ]
    counts = pq.read_table(out / "user-stats" / "count.parquet").to_pydict()
    _, expected = reference(DemoConfig(events_per_source=3000, users=200))
    assert dict(zip(counts["key"], counts["value"], strict=True)) == expected["count"]
    # Refuses to overwrite without --force, and says so in one line.
    assert (
        main(["restore", "--store", str(store), "--checkpoint", str(latest), "-o", str(out)]) == 5
    )
    assert "--force" in capsys.readouterr().err
    assert (
        main(
            [
                "restore",
                "--store",
                str(store),
                "--checkpoint",
                str(latest),
                "-o",
                str(out),
                "--force",
            ]
        )
        == 0
    )


def test_unknown_checkpoint_is_one_clear_line(store: Path, tmp_path: Path) -> None:
    proc = _run(
        "restore", "--store", str(store), "--checkpoint", "99999", "-o", str(tmp_path / "x")
    )
    assert proc.returncode == 3
    assert proc.stderr.strip().count("\n") == 0
    assert "checkpoint 99999 does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


def test_missing_store_is_one_clear_line(tmp_path: Path) -> None:
    proc = _run(
        "restore", "--store", str(tmp_path / "nope"), "--checkpoint", "1", "-o", str(tmp_path / "x")
    )
    assert proc.returncode == 3
    assert "store does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_missing_file_fails_before_writing(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoints", "list", "--store", str(store), "--json"]) == 0
    latest = str(json.loads(capsys.readouterr().out)[-1]["checkpoint"])
    out = tmp_path / "o"
    assert (
        main(
            [
                "restore",
                "--store",
                str(store),
                "--checkpoint",
                latest,
                "-o",
                str(out),
                "--dry-run",
                "--json",
            ]
        )
        == 0
    )
    victim = store / json.loads(capsys.readouterr().out)["files"][-1]
    aside = tmp_path / "aside"
    victim.rename(aside)
    try:
        assert main(["restore", "--store", str(store), "--checkpoint", latest, "-o", str(out)]) == 3
        err = capsys.readouterr().err
        assert "missing file" in err and victim.name in err
        assert not out.exists()
    finally:
        aside.rename(victim)
