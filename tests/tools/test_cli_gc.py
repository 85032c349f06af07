"""``statectl gc``: the orphan sweep from the command line (dry run by default)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import MetadataStore
from tools.cli import EXIT_OK, EXIT_USAGE, main
from tools.demo_job import DemoConfig, pipeline


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    config = DemoConfig(events_per_source=500, users=50, rate_per_source=None)
    options = RuntimeOptions(
        store_url=str(root), checkpoint=CheckpointOptions(interval_s=0.05, retain=1)
    )
    EmbeddedRuntime(pipeline(config, str(root / "output")), options).run()
    orphan = root / "jobs" / "demo" / "changelog" / "dead-worker" / "0000000000000001-x.parquet"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"left behind by a crash")
    old = time.time() - 2 * 86400
    os.utime(orphan, (old, old))
    (root / "jobs" / "demo" / "young.tmp-data").write_bytes(b"in-flight work")
    return root


def _referenced(root: Path) -> set[str]:
    store = MetadataStore.for_local_store(str(root), create=False)
    refs = store.referenced_files()
    store.close()
    return refs


def test_dry_run_lists_old_orphans_only(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gc", "--store", str(store), "--json"]) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] is True
    (job,) = out["jobs"]
    assert [p.rsplit("/", 1)[-1] for p in job["orphans"]] == ["0000000000000001-x.parquet"]
    assert job["too_young"] >= 1 and job["deleted"] == []
    assert not set(job["orphans"]) & _referenced(store)
    assert (store / "jobs/demo/changelog/dead-worker/0000000000000001-x.parquet").exists()


def test_delete_with_min_age_zero_keeps_every_referenced_file(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refs = _referenced(store)
    assert refs
    assert main(["gc", "--store", str(store), "--job", "demo", "--delete", "--min-age-s", "0"]) == 0
    text = capsys.readouterr().out
    assert "deleted" in text and "young.tmp-data" in text
    assert not (store / "jobs/demo/changelog/dead-worker/0000000000000001-x.parquet").exists()
    assert not (store / "jobs/demo/young.tmp-data").exists()
    assert all((store / r).exists() for r in refs)
    # a second sweep finds nothing
    assert main(["gc", "--store", str(store), "--delete", "--min-age-s", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"][0]["orphans"] == []


@pytest.mark.parametrize("age", ["-1", "nan", "inf", "-inf", "1e999", "soon"])
def test_an_age_that_is_not_finite_and_non_negative_is_refused(
    store: Path, capsys: pytest.CaptureFixture[str], age: str
) -> None:
    """Regression: ``--min-age-s nan`` made every file old enough to delete."""
    before = sorted(p for p in store.rglob("*") if p.is_file())
    assert main(["gc", "--store", str(store), "--min-age-s", age, "--delete"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "min-age-s" in err and err.count("\n") == 1
    assert sorted(p for p in store.rglob("*") if p.is_file()) == before
