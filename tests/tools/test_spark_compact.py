"""Offline compaction on a real local Spark session, and ``statectl compact``.

- After a compaction, the job's next checkpoint rests on it, restores to the same state,
  and the log it folded is gone once retention released it.
- A compaction that loses a real race with a newer materialization registers nothing and
  leaves no file behind; compactions racing a running job never break a restore.
- An S3 store; the standalone module (``python -m tools.spark.compact``: what
  spark-submit runs) prints clean JSON; every error path is one line with its exit code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from backends.handles import KeyedStateHandle
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.errors import CompactionSupersededError
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from coordinator.sink import read_output
from dstl.fileio import FileIO
from tests.coordinator.embedded.test_offline_materialization import state_of
from tests.services import S3Bucket
from tools.cli import EXIT_CORRUPT, EXIT_NOT_FOUND, EXIT_OK, EXIT_REFUSED, main
from tools.demo_job import DemoConfig, offsets_of, pipeline, reference
from tools.restore import plan_restore, state_tables
from tools.spark.compact import compact

REPO = Path(__file__).resolve().parents[2]
JOB = "demo"


def _options(root: str, **kw: Any) -> RuntimeOptions:
    base: dict[str, Any] = {
        "store_url": root,
        "checkpoint": CheckpointOptions(interval_s=0.05, retain=1),
        "materialization": "offline",
        "source_batch": 64,
    }
    return RuntimeOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished offline job: its only checkpoint rests on the whole log."""
    root = tmp_path_factory.mktemp("compact") / "store"
    config = DemoConfig(events_per_source=2500, users=90, rate_per_source=None)
    EmbeddedRuntime(pipeline(config, str(root.parent / "out")), _options(str(root))).run()
    return root


@pytest.fixture
def store(stopped: Path, tmp_path: Path) -> Path:
    root = tmp_path / "store"
    shutil.copytree(stopped, root)
    shutil.copytree(stopped.parent / "out", tmp_path / "out")  # the job's committed output
    return root


def _latest(root: Path) -> CompletedCheckpoint:
    with MetadataStore.for_local_store(str(root), create=False) as s:
        cp = s.latest(JOB)
    assert cp is not None
    return cp


def _compacted(root: Path) -> list[str]:
    return [f.path for f in FileIO(str(root)).list(f"jobs/{JOB}/compacted")]


def _log_of(cp: CompletedCheckpoint) -> set[str]:
    return {
        c.location
        for s in cp.subtasks
        for h in s.handles
        if isinstance(h, KeyedStateHandle)
        for c in h.changelog
    }


def test_the_next_checkpoint_rests_on_it_and_the_log_goes(
    spark: Any, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = DemoConfig(events_per_source=2500, users=90, rate_per_source=None)
    before = _latest(store)
    assert main(["compact", "--store", str(store), "--json", "--quiet"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoint"] == before.checkpoint_id and report["compaction"] == 1
    assert report["changes"] == sum(
        c.rows for s in before.subtasks for h in s.handles for c in getattr(h, "changelog", ())
    )
    written = set(_compacted(store))
    assert written
    # the job starts again (its input is exhausted: one final checkpoint) and adopts it
    result = EmbeddedRuntime(
        pipeline(config, str(store.parent / "out")), _options(str(store))
    ).run()
    after = _latest(store)
    assert (
        after.checkpoint_id > before.checkpoint_id and result.restored_from == before.checkpoint_id
    )
    assert written <= set(after.files())
    assert not _log_of(after) & _log_of(before)
    assert not any(FileIO(str(store)).exists(f) for f in _log_of(before))  # released
    _, state = reference(config)
    assert state_of(store, after) == state
    rows, _ = reference(config)
    assert sorted(tuple(r) for r in read_output(FileIO(str(store.parent / "out")))) == rows
    assert main(["verify", "--store", str(store), "--checkpoint", "latest", "--quiet"]) == EXIT_OK


def _keyed(cp: CompletedCheckpoint) -> list[KeyedStateHandle]:
    return [
        h for s in cp.states_of("user-stats") for h in s.handles if isinstance(h, KeyedStateHandle)
    ]


class Running:
    """The demo job running on its own thread; ``seen`` its completed checkpoints."""

    def __init__(self, config: DemoConfig, options: RuntimeOptions, out: Path) -> None:
        self.seen: list[CompletedCheckpoint] = []
        self.cond = threading.Condition()
        self.errors: list[BaseException] = []
        self.runtime = EmbeddedRuntime(pipeline(config, str(out)), options, on_checkpoint=self._on)
        self.thread = threading.Thread(target=self._run, name="pipeline")

    def _on(self, cp: CompletedCheckpoint) -> None:
        with self.cond:
            self.seen.append(cp)
            self.cond.notify_all()

    def _run(self) -> None:
        try:
            self.runtime.run()
        except BaseException as exc:
            self.errors.append(exc)

    def wait_for(self, predicate: Any) -> CompletedCheckpoint:
        with self.cond:
            assert self.cond.wait_for(lambda: any(predicate(cp) for cp in self.seen), timeout=60)
            return next(cp for cp in reversed(self.seen) if predicate(cp))

    def __enter__(self) -> Running:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive() and not self.errors


def test_losing_a_race_with_a_materialization_registers_and_leaves_nothing(
    spark: Any, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    config = DemoConfig(events_per_source=30000, users=100, rate_per_source=3000.0)
    # Every checkpoint retained: the source must stay readable while it is compacted (with
    # retain=1 its log segments go as soon as a materialization covers them, and the
    # compaction loses earlier, reading them, not at its registration tested here).
    options = _options(
        str(root),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=1000),
        materialization="online",
        materialization_interval_s=0.1,
    )
    with Running(config, options, tmp_path / "out") as job:
        source = job.wait_for(lambda cp: any(h.changelog for h in _keyed(cp)))
        reach = {h.backend_id: h.coverage().get(h.backend_id, 0) for h in _keyed(source)}

        def materialized_past(cp: CompletedCheckpoint) -> bool:
            return all(
                any(m.covered_sqn(w) > reach[w] for h in _keyed(cp) for m in h.materialized)
                for w in reach
            )

        fileio = FileIO(str(root))
        with MetadataStore.for_local_store(str(root), create=False) as store:
            with pytest.raises(CompactionSupersededError, match="older than the current"):
                compact(
                    spark,
                    fileio,
                    store,
                    JOB,
                    source.checkpoint_id,
                    before_register=lambda: job.wait_for(materialized_past) and None,
                )
            assert store.pending_compactions(JOB) == []
        assert _compacted(root) == []


def test_compactions_racing_a_running_job_never_break_a_restore(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "store"
    config = DemoConfig(events_per_source=24000, users=120, rate_per_source=3000.0)
    options = _options(str(root), checkpoint=CheckpointOptions(interval_s=0.05, retain=3))
    registered = superseded = 0
    with Running(config, options, tmp_path / "out") as job:
        job.wait_for(lambda cp: True)
        fileio = FileIO(str(root))
        with MetadataStore.for_local_store(str(root), create=False) as store:
            while job.thread.is_alive() and registered < 3:
                try:
                    compact(spark, fileio, store, JOB, "latest", task_rows=500)
                    registered += 1
                except CompactionSupersededError:
                    superseded += 1
    assert registered >= 1
    with MetadataStore.for_local_store(str(root), create=False) as store:
        retained = [store.get(JOB, c.checkpoint_id) for c in store.list(JOB)]
    adopted = [cp for cp in job.seen if any("/compacted/" in f for f in cp.files())]
    assert adopted, "the running job adopted none of them"
    for cp in retained:
        _, state = reference(config, offsets_of(cp.source_offsets, config))
        assert state_of(root, cp) == state, f"checkpoint {cp.checkpoint_id}"
    assert main(["verify", "--store", str(root), "--checkpoint", "all", "--quiet"]) == EXIT_OK
    print(f"registered {registered}, superseded {superseded}, adopted in {len(adopted)}")


def test_an_s3_store(
    spark: Any, s3_bucket: S3Bucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = DemoConfig(events_per_source=1200, users=50, rate_per_source=None)
    metadata = f"sqlite:///{tmp_path}/metadata.db"
    options = _options(
        s3_bucket.url, metadata_url=metadata, storage_options=s3_bucket.storage_options
    )
    EmbeddedRuntime(pipeline(config, str(tmp_path / "out")), options).run()
    so = s3_bucket.storage_options
    flags = [
        "--store", s3_bucket.url, "--metadata", metadata,
        "--storage-option", f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}",
        "--storage-option", f"key={so['key']}", "--storage-option", f"secret={so['secret']}",
    ]  # fmt: skip
    assert main(["compact", *flags, "--quiet"]) == EXIT_OK
    assert "registered as compaction 1" in capsys.readouterr().out
    with MetadataStore(metadata, create=False) as store:
        pending = {c.subtask: c for c in store.pending_compactions(JOB)}
        latest = store.latest(JOB)
    assert sorted(pending) == [0, 1]
    assert latest is not None
    fileio = FileIO(s3_bucket.url, s3_bucket.storage_options)
    assert all(fileio.exists(f) for c in pending.values() for f in c.handle.files())
    # the compactions alone restore the checkpoint's state
    _, state = reference(config)
    rebased = _rest_on(latest, {s: c.handle for s, c in pending.items()})
    counts = {
        name: t.to_pydict() for _, name, t in state_tables(plan_restore(rebased, "x"), fileio)
    }["count"]
    assert dict(zip(counts["key"], counts["value"], strict=True)) == state["count"]


def _rest_on(cp: CompletedCheckpoint, mats: dict[int, Any]) -> CompletedCheckpoint:
    """``cp`` with each keyed subtask's state replaced by the materialization alone."""
    subtasks = tuple(
        dataclasses.replace(
            s,
            handles=tuple(
                dataclasses.replace(h, materialized=(mats[s.subtask],), changelog=())
                if isinstance(h, KeyedStateHandle)
                else h
                for h in s.handles
            ),
        )
        for s in cp.subtasks
    )
    return dataclasses.replace(cp, subtasks=subtasks)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )


def test_the_standalone_module_prints_clean_json(store: Path) -> None:
    proc = _cli("-m", "tools.spark.compact", "--store", str(store), "--json", "--quiet")
    assert proc.returncode == EXIT_OK, proc.stderr
    report = json.loads(proc.stdout)  # the JVM's output went to its log, not here
    assert report["compaction"] == 1 and os.path.exists(report["spark_log"])
    assert proc.stderr == ""


def test_errors_are_one_line_with_their_exit_code(
    spark: Any, store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for args, code, text in [
        (["--checkpoint", "99999"], EXIT_NOT_FOUND, "checkpoint 99999 does not exist"),
        (["--checkpoint", "nope"], 2, "not a checkpoint id"),
        (["--task-rows", "0"], 2, "must be >= 1"),
    ]:
        proc = _cli("-m", "tools.cli", "compact", "--store", str(store), *args)
        assert proc.returncode == code and text in proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    proc = _cli("-m", "tools.cli", "compact", "--store", str(store.parent / "nope"))
    assert proc.returncode == EXIT_NOT_FOUND and "store does not exist" in proc.stderr
    # a second compaction of the same checkpoint: the first is not adopted yet
    assert main(["compact", "--store", str(store), "--quiet"]) == EXIT_OK
    capsys.readouterr()
    assert main(["compact", "--store", str(store), "--quiet"]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "is as new and not yet adopted" in err and err.count("\n") == 1


@pytest.mark.parametrize(("damage", "code"), [("flip", EXIT_CORRUPT), ("remove", EXIT_NOT_FOUND)])
def test_a_damaged_file_fails_in_the_task_and_leaves_nothing(
    spark: Any, store: Path, capsys: pytest.CaptureFixture[str], damage: str, code: int
) -> None:
    segment = store / sorted(_log_of(_latest(store)))[0]
    if damage == "flip":
        data = bytearray(segment.read_bytes())
        data[len(data) // 2] ^= 0xFF
        segment.write_bytes(bytes(data))
    else:
        segment.unlink()
    assert main(["compact", "--store", str(store), "--quiet"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and segment.name in err and "in a Spark task" in err
    assert _compacted(store) == []
    with MetadataStore.for_local_store(str(store), create=False) as s:
        assert s.pending_compactions(JOB) == []
