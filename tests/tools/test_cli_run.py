"""``statectl run``: a user's pipeline function, stopped by SIGTERM/SIGINT with a final
checkpoint, resumed from it; a finite job runs to its end; bad targets are clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.metadata import MetadataStore
from tools.cli import EXIT_OK, EXIT_REFUSED, main

REPO = Path(__file__).resolve().parents[2]

JOBS = """
import random
from backends.serializers import INT64, STR
from backends.state import ValueStateDescriptor
from coordinator.embedded import GeneratorSource, PipelineBuilder, PrintSink


class Count:
    def open(self, state):
        self.n = state.get_state(ValueStateDescriptor("n", INT64))

    def process(self, key, value, ctx):
        n = (self.n.value() or 0) + 1
        self.n.update(n)
        ctx.emit([key, value, n])


def _make(rng, i):
    return (f"k{i % 5}", i)


def build(count):
    job = PipelineBuilder("cli-job")
    (
        job.source("gen", GeneratorSource(_make, count), 1, rate_per_s=400.0)
        .key_by(lambda r: r[0], STR, value=lambda r: r[1])
        .process("count", Count)
        .sink("out", PrintSink(), parallelism=1)
    )
    return job


def endless():
    return build(None)


def finite():
    return build(50)


def not_a_job():
    return 42
"""


@pytest.fixture
def jobs_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "userjobs"
    directory.mkdir()
    (directory / "myjobs.py").write_text(JOBS)
    return directory


def _stop_after_output(cwd: Path, store: str, signum: int) -> list[list[object]]:
    """Run ``myjobs:endless``; at its first committed record on stdout, send ``signum``;
    every record it printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(cwd / "stderr.log", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "run", "myjobs:endless", "--store", store],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # committed records only: a checkpoint completed
        proc.send_signal(signum)
        rest = proc.stdout.read()  # through the same buffer as readline
        code = proc.wait(timeout=120)
        err.seek(0)
        assert first and code == EXIT_OK, err.read()[-3000:]
    lines = [first, *rest.splitlines()]
    return [json.loads(line) for line in lines if line.startswith("[")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_cleanly_with_a_final_checkpoint_and_a_rerun_resumes(
    tmp_path: Path, jobs_dir: Path, signum: int
) -> None:
    store = str(tmp_path / "store")
    records = _stop_after_output(jobs_dir, store, signum)
    meta = MetadataStore.for_local_store(store, create=False)
    try:
        final = meta.latest("cli-job")
        assert final is not None
        emitted = final.source_offsets["gen/0"]
    finally:
        meta.close()
    # the final checkpoint committed everything read: every emitted record is printed
    assert sorted(r[1] for r in records) == list(range(emitted))
    again = _stop_after_output(jobs_dir, store, signum)
    # A restore publishes the restored checkpoint's staged transactions again: idempotent
    # for the file and SQL sinks, printed again by the print sink (as documented). Those
    # are the records the final checkpoint staged, a suffix of the first run's; whether
    # there are any depends on batching (it passed only when the final stage was empty).
    reprinted = sorted(r[1] for r in again if r[1] < emitted)
    assert reprinted == list(range(emitted - len(reprinted), emitted))
    new = [r for r in again if r[1] >= emitted]
    assert min(r[1] for r in new) == emitted  # resumed where the stop left off
    k0_before = sum(1 for r in records if r[0] == "k0")
    assert next(r[2] for r in new if r[0] == "k0") == k0_before + 1  # state restored


def test_a_finite_job_runs_to_its_end(
    tmp_path: Path,
    jobs_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(jobs_dir)
    store = str(tmp_path / "store")
    code = main(
        [
            "run",
            "myjobs:finite",
            "--store",
            store,
            "--option",
            "checkpoint.interval-s=0.05",
            "--json",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == EXIT_OK
    assert sorted(json.loads(line)[1] for line in out if line.startswith("[")) == list(range(50))
    start = max(i for i, line in enumerate(out) if line == "{")  # the report, indented
    report = json.loads("\n".join(out[start:]))
    assert report["job"] == "cli-job" and report["restored_from"] is None
    # a savepoint id given as a checkpoint (and the reverse) is refused, not guessed
    code = main(["run", "myjobs:finite", "--store", store, "--from-savepoint", "1"])
    assert code != EXIT_OK


@pytest.mark.parametrize(
    "args",
    [
        ["myjobs"],  # no function
        ["nosuchmodule:build"],
        ["myjobs:nosuch"],
        ["myjobs:not_a_job"],
        ["myjobs:finite", "--option", "checkpoint.nosuch=1"],
    ],
)
def test_bad_targets_and_options_are_refused(
    tmp_path: Path,
    jobs_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
) -> None:
    monkeypatch.chdir(jobs_dir)
    assert main(["run", *args, "--store", str(tmp_path / "s")]) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert err.startswith("statectl: error:") and len(err.splitlines()) == 1
