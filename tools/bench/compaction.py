"""Offline compaction and the Spark reader, against ``statectl restore``; offline vs online.

Part 1, on one store: the demo job (:mod:`tools.demo_job`: per user a count, a sum, the
last five items and counts per category; 2 sources, 2 operator subtasks) runs unpaced
with ``materialization="offline"``, so its last checkpoint rests on the whole log. On a
``local[2]`` Spark session (started and warmed up before anything is timed):

- ``compaction``: ``tools.spark.compact.compact`` of that checkpoint: log changes folded
  per second (every change of every block, the files written and registered);
- ``reader`` / ``restore``: every state of that checkpoint read through the
  ``changelog-state`` data source (each DataFrame written to Spark's ``noop`` sink, so
  every row is produced, none collected; after one untimed read that starts Spark's
  planner processes) and restored by ``statectl restore`` (in this process, one thread,
  to local Parquet); rows (entries) per second each;
- the same two on the checkpoint the job takes after adopting the compaction (the job
  is started again on its exhausted input: one final checkpoint), labelled
  ``compacted``: what compaction buys a reader and a restore.

Part 2: the same job, paced (``rate`` events per second and source), runs in a worker
process with online materialization (every second), then offline with this process
compacting its latest checkpoint back to back while it runs (the JVM and Spark's Python
workers are not the worker's children: their CPU is not counted), then offline with no
compaction. Per run: checkpoint duration p50/p99 (``duration_ms`` of the records) and
the worker's CPU seconds (``wait4``: user + system, its helper processes included).
On this 2-core machine the compactions compete with the worker for the cores (a
cluster would run them elsewhere): the run without them isolates that.

Summary fields: ``compaction_changes_per_s``, ``reader_rows_per_s``,
``restore_rows_per_s`` (the log checkpoint), ``reader_over_restore``,
``*_compacted`` variants, ``offline_cpu_ratio`` and ``offline_cp_p50_ratio`` (offline
with compactions over online), ``offline_alone_*`` (without them).

``python -m tools.bench run compaction [--quick] --json OUT``; the worker is
``python -m tools.bench.compaction worker ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median
from typing import Any

COLUMNS = [
    "case",
    "checkpoint",
    "mode",
    "items",
    "seconds",
    "per_s",
    "checkpoints",
    "cp_p50_ms",
    "cp_p99_ms",
    "worker_cpu_s",
    "compactions",
]

JOB = "demo"


def _config(events: int, users: int, rate: float | None) -> Any:
    from tools.demo_job import DemoConfig

    return DemoConfig(events_per_source=events, users=users, rate_per_source=rate)


def _options(root: str, mode: str, interval_s: float) -> Any:
    from coordinator.checkpoint import CheckpointOptions
    from coordinator.embedded import RuntimeOptions

    return RuntimeOptions(
        store_url=root,
        checkpoint=CheckpointOptions(interval_s=interval_s, retain=1),
        materialization=mode,
        materialization_interval_s=1.0,
    )


# -- the worker: one paced run, in its own process -------------------------------------
def worker(argv: list[str]) -> None:
    """Run the job once; print its checkpoint durations as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--users", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True)
    args = parser.parse_args(argv)
    from coordinator.embedded import EmbeddedRuntime
    from tools.demo_job import pipeline

    config = _config(args.events, args.users, args.rate)
    job = pipeline(config, args.store + "-out")
    result = EmbeddedRuntime(job, _options(args.store, args.mode, 0.2)).run()
    durations = [c.stats["duration_ms"] for c in result.checkpoints]
    print(json.dumps({"durations_ms": durations, "materializations": result.materializations}))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _paced_run(
    spark: Any, root: str, mode: str, compact_while: bool, events: int, users: int, rate: float
) -> dict[str, Any]:
    """One worker run; with ``compact_while``, compactions back to back until it ends."""
    from coordinator.errors import CompactionSupersededError
    from coordinator.metadata import MetadataStore
    from dstl.errors import CheckpointNotFoundError, MetadataNotFoundError
    from dstl.fileio import FileIO
    from tools.spark.compact import compact

    cmd = [
        sys.executable, "-m", "tools.bench.compaction", "worker", "--store", root,
        "--mode", mode, "--events", str(events), "--users", str(users), "--rate", str(rate),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    ended: list[tuple[str, int, Any]] = []
    done = threading.Event()

    def reap() -> None:  # wait4, not Popen.wait: the worker's own resource usage
        out = proc.stdout.read() if proc.stdout is not None else ""
        _, status, usage = os.wait4(proc.pid, 0)
        ended.append((out, status, usage))
        done.set()

    reaper = threading.Thread(target=reap, name="bench-reaper")
    reaper.start()
    compactions = 0
    while compact_while and not done.wait(2.0):  # at most one compaction per 2 s
        try:
            with MetadataStore.for_local_store(root, create=False) as store:
                compact(spark, FileIO(root), store, JOB, "latest")
                compactions += 1
        except (CompactionSupersededError, CheckpointNotFoundError, MetadataNotFoundError):
            continue  # lost a race, or the job has no checkpoint yet
    reaper.join()
    out, status, usage = ended[0]
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"worker failed with {os.waitstatus_to_exitcode(status)}")
    durations = json.loads(out)["durations_ms"]
    return {
        "case": "paced job",
        "mode": mode + (" + compactions" if compact_while else ""),
        "items": events * 2,
        "checkpoints": len(durations),
        "cp_p50_ms": round(median(durations), 2) if durations else 0.0,
        "cp_p99_ms": round(_percentile(durations, 0.99), 2),
        "worker_cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "compactions": compactions,
    }


# -- part 1: compaction, reader, restore ------------------------------------------------
def _read_all(spark: Any, root: str, checkpoint: int, states: list[str]) -> float:
    from tools.spark import register

    register(spark)
    warm = spark.read.format("changelog-state").option("store", root).option("state", "count")
    warm.load().write.format("noop").mode("overwrite").save()  # planner processes up
    started = time.perf_counter()
    for state in states:
        df = (
            spark.read.format("changelog-state")
            .option("store", root)
            .option("checkpoint", str(checkpoint))
            .option("state", state)
            .load()
        )
        df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started


def _restore(root: str, checkpoint: int, target: str) -> tuple[float, int]:
    from tools.cli import main as statectl

    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = statectl(
            ["restore", "--store", root, "--checkpoint", str(checkpoint), "-o", target, "--quiet"]
        )
    elapsed = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"statectl restore failed with {code}")
    with open(os.path.join(target, "_STATECTL.json")) as fh:
        rows = json.load(fh)["rows"]
    shutil.rmtree(target)
    return elapsed, sum(n for states in rows.values() for n in states.values())


def _read_and_restore(
    spark: Any, root: str, checkpoint: int, label: str, scratch: str
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    restore_s, rows = _restore(root, checkpoint, os.path.join(scratch, f"restored-{label}"))
    states = ["by_category", "count", "recent_items", "total_cents"]
    reader_s = _read_all(spark, root, checkpoint, states)
    cases = [
        {"case": "reader", "checkpoint": label, "items": rows, "seconds": round(reader_s, 3),
         "per_s": round(rows / reader_s)},
        {"case": "restore", "checkpoint": label, "items": rows, "seconds": round(restore_s, 3),
         "per_s": round(rows / restore_s)},
    ]  # fmt: skip
    return cases, {"reader": rows / reader_s, "restore": rows / restore_s}


def _compaction_part(
    spark: Any, scratch: str, quick: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from coordinator.embedded import EmbeddedRuntime
    from coordinator.metadata import MetadataStore
    from dstl.fileio import FileIO
    from tools.demo_job import pipeline
    from tools.spark.compact import compact

    root = os.path.join(scratch, "store")
    config = _config(30_000 if quick else 250_000, 3_000 if quick else 30_000, None)
    job = pipeline(config, root + "-out")
    EmbeddedRuntime(job, _options(root, "offline", 1.0)).run()
    with MetadataStore.for_local_store(root, create=False) as store:
        latest = store.latest(JOB)
        assert latest is not None
        cases, log_rates = _read_and_restore(spark, root, latest.checkpoint_id, "log", scratch)
        started = time.perf_counter()
        report = compact(spark, FileIO(root), store, JOB, latest.checkpoint_id)
        compact_s = time.perf_counter() - started
    cases.insert(
        0,
        {"case": "compaction", "checkpoint": "log", "items": report.changes,
         "seconds": round(compact_s, 3), "per_s": round(report.changes / compact_s)},
    )  # fmt: skip
    EmbeddedRuntime(job, _options(root, "offline", 1.0)).run()  # adopts it: one checkpoint
    with MetadataStore.for_local_store(root, create=False) as store:
        adopted = store.latest(JOB)
    assert adopted is not None and any("/compacted/" in f for f in adopted.files())
    more, compacted_rates = _read_and_restore(
        spark, root, adopted.checkpoint_id, "compacted", scratch
    )
    cases += more
    summary = {
        "compaction_changes_per_s": round(report.changes / compact_s),
        "reader_rows_per_s": round(log_rates["reader"]),
        "restore_rows_per_s": round(log_rates["restore"]),
        "reader_over_restore": round(log_rates["reader"] / log_rates["restore"], 3),
        "reader_rows_per_s_compacted": round(compacted_rates["reader"]),
        "restore_rows_per_s_compacted": round(compacted_rates["restore"]),
        "compaction_tasks": report.tasks,
    }
    return cases, summary


def run(quick: bool) -> dict[str, Any]:
    """Both parts; see the module docstring."""
    from tools.spark.session import get_session

    spark, spark_log = get_session("local[2]", "bench-compaction")
    spark.sparkContext.parallelize(range(4), 2).map(lambda x: x).collect()  # workers up
    scratch = tempfile.mkdtemp(prefix="bench-compaction-")
    try:
        cases, summary = _compaction_part(spark, scratch, quick)
        events, users, rate = (16_000, 2_000, 4_000.0) if quick else (60_000, 20_000, 4_000.0)
        runs = {}
        for mode, with_compactions in (("online", False), ("offline", True), ("offline", False)):
            root = os.path.join(scratch, f"paced-{mode}-{with_compactions}")
            runs[(mode, with_compactions)] = _paced_run(
                spark, root, mode, with_compactions, events, users, rate
            )
        cases += list(runs.values())
        online, offline, alone = (
            runs[("online", False)],
            runs[("offline", True)],
            runs[("offline", False)],
        )
        summary.update(
            {
                "offline_cpu_ratio": round(offline["worker_cpu_s"] / online["worker_cpu_s"], 3),
                "offline_cp_p50_ratio": round(offline["cp_p50_ms"] / online["cp_p50_ms"], 3),
                "offline_cp_p99_ratio": round(offline["cp_p99_ms"] / online["cp_p99_ms"], 3),
                "offline_alone_cpu_ratio": round(alone["worker_cpu_s"] / online["worker_cpu_s"], 3),
                "offline_alone_cp_p50_ratio": round(alone["cp_p50_ms"] / online["cp_p50_ms"], 3),
                "offline_alone_cp_p99_ratio": round(alone["cp_p99_ms"] / online["cp_p99_ms"], 3),
                "spark_log": spark_log,
            }
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"cases": cases, **summary}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
    else:
        print("usage: python -m tools.bench.compaction worker ...", file=sys.stderr)
        sys.exit(2)
