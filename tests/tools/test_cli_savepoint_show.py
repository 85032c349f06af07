"""``statectl savepoint`` and ``checkpoints show`` on stores written for the purpose."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import MetadataStore
from tools.cli import main
from tools.demo_job import DemoConfig, pipeline


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    config = DemoConfig(events_per_source=2000, users=100, rate_per_source=None)
    options = RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=2),
        materialization_interval_s=0.1,
    )
    EmbeddedRuntime(pipeline(config, str(root / "output")), options).run()
    return root


def _list(store: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert main(["checkpoints", "list", "--store", str(store), "--json"]) == 0
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def _restore(store: Path, checkpoint: str, out: Path) -> int:
    return main(["restore", "--store", str(store), "--checkpoint", checkpoint, "-o", str(out)])


def _tables(directory: Path) -> dict[str, list[dict[str, object]]]:
    out = {}
    for path in sorted(directory.rglob("*.parquet")):
        rows = pq.read_table(path).to_pylist()
        out[str(path.relative_to(directory))] = sorted(rows, key=repr)
    return out


def test_savepoint_restores_like_its_checkpoint_after_the_job_files_are_gone(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _list(store, capsys)
    latest = max(int(str(r["checkpoint"])) for r in before)
    assert main(["savepoint", "--store", str(store), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["from_checkpoint"] == latest and made["savepoint"] > latest
    sid = str(made["savepoint"])
    assert _restore(store, str(latest), tmp_path / "cp") == 0

    shutil.rmtree(store / "jobs")  # every file of the job's own checkpoints
    assert _restore(store, sid, tmp_path / "sp") == 0
    capsys.readouterr()
    assert _tables(tmp_path / "sp") == _tables(tmp_path / "cp") != {}

    rows = {str(r["checkpoint"]): r for r in _list(store, capsys)}
    assert rows[sid]["kind"] == "savepoint"
    # the savepoint's id came from the job's sequence: the job's next checkpoint is after it
    with MetadataStore.for_local_store(str(store)) as meta:
        assert meta.next_checkpoint_id("demo") == int(sid) + 1


def test_the_default_source_is_the_latest_checkpoint_not_a_savepoint(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made = []
    for _ in range(2):
        assert main(["savepoint", "--store", str(store), "--json"]) == 0
        made.append(json.loads(capsys.readouterr().out))
    assert made[0]["from_checkpoint"] == made[1]["from_checkpoint"]
    assert made[1]["savepoint"] > made[0]["savepoint"]


def test_a_savepoint_is_not_copied_again(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["savepoint", "--store", str(store), "--json"]) == 0
    sid = str(json.loads(capsys.readouterr().out)["savepoint"])
    assert main(["savepoint", "--store", str(store), "--checkpoint", sid]) == 5
    err = capsys.readouterr().err
    assert f"savepoint {sid} of job demo is already self-contained" in err
    assert err.strip().count("\n") == 0


def test_a_job_numbering_its_own_checkpoints_gets_no_savepoint(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Spark query records its batch ids as checkpoint ids, past the job's sequence: a
    savepoint id from the sequence would clash with one now or later, so none is made."""
    with MetadataStore.for_local_store(str(store)) as meta:
        latest = meta.latest("demo")
        assert latest is not None
        batch = dataclasses.replace(latest, checkpoint_id=latest.checkpoint_id + 50)
        meta.record_completed(batch, retain=5)
    before = _list(store, capsys)
    assert main(["savepoint", "--store", str(store)]) == 5
    err = capsys.readouterr().err
    assert f"numbers its checkpoints itself (the latest is {batch.checkpoint_id}" in err
    assert err.strip().count("\n") == 0
    assert _list(store, capsys) == before
    assert not (store / "savepoints").exists() or not [
        p for p in (store / "savepoints").rglob("*") if p.is_file()
    ]


def test_unknown_checkpoint_is_not_found(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["savepoint", "--store", str(store), "--checkpoint", "9999"]) == 3
    assert "checkpoint 9999 does not exist" in capsys.readouterr().err


def test_a_missing_file_records_nothing_and_leaves_no_copy(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What happens when retention deletes the checkpoint's files during the copy."""
    before = _list(store, capsys)
    latest = max(int(str(r["checkpoint"])) for r in before)
    with MetadataStore.for_local_store(str(store)) as meta:
        victim = store / meta.get("demo", latest).files()[-1]
    victim.unlink()
    assert main(["savepoint", "--store", str(store)]) == 1
    err = capsys.readouterr().err
    assert f"from checkpoint {latest}" in err
    assert victim.name in err and err.strip().count("\n") == 0
    assert _list(store, capsys) == before
    assert not [p for p in (store / "savepoints").rglob("*") if p.is_file()]


def test_a_damaged_file_is_corruption_and_records_nothing(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _list(store, capsys)
    latest = max(int(str(r["checkpoint"])) for r in before)
    with MetadataStore.for_local_store(str(store)) as meta:
        victim = store / meta.get("demo", latest).files()[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["savepoint", "--store", str(store)]) == 4  # corruption, as for every read
    err = capsys.readouterr().err
    assert f"from checkpoint {latest}" in err and victim.name in err
    assert "meanwhile" not in err and err.strip().count("\n") == 0
    assert _list(store, capsys) == before
    assert not [p for p in (store / "savepoints").rglob("*") if p.is_file()]


def test_show_prints_each_subtask_materialization(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.metadata import CompletedCheckpoint, SubtaskState

    mat = {
        "materialization_id": 4,
        "duration_ms": 12.5,
        "files_new": 2,
        "files_shared": 7,
        "bytes_new": 300,
        "bytes_total": 9000,
    }
    with MetadataStore.for_local_store(str(tmp_path)) as meta:
        meta.start_attempt("j")
        cp = CompletedCheckpoint(
            "j",
            meta.next_checkpoint_id("j"),
            "checkpoint",
            1.0,
            2.0,
            (SubtaskState("op", 0), SubtaskState("op", 1)),
            {"subtask_stats": {"op/1": {"materialization": mat}}},
        )
        meta.record_completed(cp, retain=1)
    assert main(["checkpoints", "show", "1", "--store", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  op/0: 0 files\n" in out
    assert (
        "  op/1: 0 files; materialization 4: 12.5 ms, files new 2 / shared 7, "
        "bytes new 300 / total 9000\n" in out
    )
