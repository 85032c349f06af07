"""spark-pipeline: the same keyed count-and-sum streaming query, our state vs Spark's own.

One local[2] session runs, on the same input (one Parquet file of random keys per
micro-batch, ``maxFilesPerTrigger=1``), and one after the other:

- **ours**: a :class:`~coordinator.spark.StatefulStep` (RocksDB ranges, also heap as a
  second case) on local disk + SQLite, output committed as Parquet;
- **spark**: ``groupBy(k).applyInPandasWithState`` on Spark's RocksDB state store provider
  with changelog checkpointing, output appended as Parquet by ``foreachBatch``.

Both emit one row per input row, ``(k, v, n, total)``. Spark's function is vectorized per
key and batch (pandas), but called once per key: with many distinct keys per batch it is
slow (measured here: ~3 ms per key on a loaded machine), so the keys per batch decide the
throughput ratio; the quick run has 2,000 keys (10,000 rows per batch), the full one
20,000. Restarts and rescales are timed on a batch of 200 rows. Per query: records/s and batch
duration from Spark's progress (``triggerExecution``; the first batch, JVM and worker
warm-up, left out), state commit time (ours: the ranges' changelog persists plus the
metadata record; Spark's: its operator's ``commitTimeMs``, also summed over partitions),
files written per batch in the state store (ours: the store; Spark's: the checkpoint's
``state/`` directory; both also write Spark's offset and commit logs, not counted), the
time from a restart to the end of its first batch (ours: state servers stopped, so every
range restores; Spark's: its loaded state stores unloaded first), and the time from
stopping the query to the end of its first batch at another parallelism (ours: restart
at Q; Spark's: ``spark._streamingCheckpointManager.repartition(location, Q)``, then
restart). Ratios are against Spark's numbers of the same run.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tools.demo import percentile

COLUMNS = [
    "system",
    "state",
    "records_per_s",
    "batch_p50_ms",
    "batch_p99_ms",
    "commit_p50_ms",
    "commit_p99_ms",
    "files_per_batch",
    "restore_s",
    "rescale_s",
]


def _write_inputs(directory: str, batches: int, rows: int, keys: int, first: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory, exist_ok=True)
    for b in range(first, first + batches):
        rng = random.Random(b)
        ks = [f"k{rng.randrange(keys):08d}" for _ in range(rows)]
        vs = [rng.randrange(1, 1000) for _ in range(rows)]
        path = os.path.join(directory, f"batch-{b:05d}.parquet")
        pq.write_table(pa.table({"k": ks, "v": pa.array(vs, pa.int64())}), path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))


def _files(root: str) -> set[str]:
    out: set[str] = set()
    for dirpath, _, names in os.walk(root):
        out.update(
            os.path.join(dirpath, n)
            for n in names
            if not n.endswith((".crc", ".db", "-wal", "-shm"))
        )
    return out


KINDS = ("changelog", "sink", "materialized")
"""Our store's file kinds (path components): segments, staged output, state tables."""


class _Counter:
    """Files that appeared under ``root`` since the last look (driver thread only)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.seen = _files(root)
        self.per_batch: list[int] = []
        self.by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)

    def look(self) -> None:
        now = _files(self.root)
        new = now - self.seen
        self.per_batch.append(len(new))
        if self.per_batch[1:]:  # the first batch (warm-up) is left out, as everywhere
            for kind in KINDS:
                self.by_kind[kind] += sum(1 for f in new if f"/{kind}/" in f)
        self.seen |= now

    def kinds_per_batch(self) -> dict[str, float]:
        """New files per batch of each kind, after the first batch."""
        n = max(1, len(self.per_batch) - 1)
        return {f"{k}_files_per_batch": round(v / n, 2) for k, v in self.by_kind.items()}


def _session() -> Any:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark-pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        )
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "1s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _run_query(
    spark: Any,
    inputs: str,
    checkpoint: str,
    each: Callable[[Any, int], None],
    transform: Callable[[Any], Any] | None = None,
) -> list[dict[str, Any]]:
    """Run the file source to its end; Spark's progress of every batch."""
    events = (
        spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1).parquet(inputs)
    )
    if transform is not None:
        events = transform(events)
    query = (
        events.writeStream.foreachBatch(each)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return [p for p in query.recentProgress if p["numInputRows"] or p["batchId"] == 0]


class _Ours:
    """Our StatefulStep with the count-and-sum processor."""

    def __init__(self, root: str, backend: str, parallelism: int) -> None:
        self.root = root
        self.backend = backend
        self.parallelism = parallelism
        self.counter = _Counter(os.path.join(root, "store"))

    def step(self, parallelism: int) -> Any:
        from coordinator.spark import stateful
        from tools.bench.spark_processors import CountSum

        return stateful(
            CountSum,
            key="k",
            values=["v"],
            output_schema="k string, v long, n long, total long",
            job="bench",
            operator="count-sum",
            store=os.path.join(self.root, "store"),
            output=os.path.join(self.root, "out"),
            state_backend=self.backend,
            parallelism=parallelism,
            local_dir=os.path.join(self.root, "local"),
            materialization_interval_s=10.0,
        )

    def run(
        self, spark: Any, inputs: str, parallelism: int, count: bool = True
    ) -> tuple[list[dict[str, Any]], Any]:
        step = self.step(parallelism)

        def each(df: Any, batch_id: int) -> None:
            step(df, batch_id)
            if count:
                self.counter.look()

        progress = _run_query(spark, inputs, os.path.join(self.root, "cp"), each)
        step.close()
        return progress, step

    def stop_servers(self) -> None:
        from coordinator.spark.server import stop_servers

        stop_servers(os.path.join(self.root, "local"))


def _spark_transform(events: Any) -> Any:
    from pyspark.sql.streaming.state import GroupStateTimeout

    from tools.bench.spark_processors import spark_count_sum

    return events.groupBy("k").applyInPandasWithState(
        spark_count_sum,
        "k string, v long, n long, total long",
        "n long, total long",
        "append",  # rows only for this batch's input, as ours: the query's output mode
        GroupStateTimeout.NoTimeout,
    )


class _Spark:
    """Spark's own state store with the same query."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.checkpoint = os.path.join(root, "cp")
        self.counter = _Counter(os.path.join(self.checkpoint, "state"))

    def run(self, spark: Any, inputs: str, count: bool = True) -> list[dict[str, Any]]:
        out = os.path.join(self.root, "out")

        def each(df: Any, batch_id: int) -> None:
            df.write.mode("append").parquet(out)
            if count:
                self.counter.look()

        return _run_query(spark, inputs, self.checkpoint, each, _spark_transform)


def _steady(progress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in progress if p["batchId"] > 0 and p["numInputRows"]]


def _case(
    system: str, state: str, progress: list[dict[str, Any]], commits: list[float], files: list[int]
) -> dict[str, Any]:
    steady = _steady(progress)
    durations = [float(p["durationMs"]["triggerExecution"]) for p in steady]
    rows = sum(int(p["numInputRows"]) for p in steady)
    return {
        "system": system,
        "state": state,
        "batches": len(steady),
        "records_per_s": round(rows / (sum(durations) / 1e3), 1) if durations else 0.0,
        "batch_p50_ms": percentile(durations, 0.5),
        "batch_p99_ms": percentile(durations, 0.99),
        "commit_p50_ms": round(percentile(commits, 0.5), 1),
        "commit_p99_ms": round(percentile(commits, 0.99), 1),
        "files_per_batch": round(sum(files[1:]) / max(1, len(files) - 1), 2),
    }


def _ours_commits(step: Any) -> list[float]:
    """Per batch: the ranges' persists (summed) plus the metadata record."""
    return [
        float(p["persist_ms"]) + float(p["commit_ms"])
        for p in step.progress
        if not p.get("replayed") and p["batch_id"] > 0
    ]


def _timed_restart(run: Callable[[], list[dict[str, Any]]]) -> float:
    started = time.monotonic()
    progress = run()
    first = progress[0]
    rest = sum(float(p["durationMs"]["triggerExecution"]) for p in progress if p is not first)
    return round(time.monotonic() - started - rest / 1e3, 3)


RESTART_ROWS = 200
"""Rows of the batch after a restart or rescale: small, so its time is the restore's."""


def run(quick: bool) -> dict[str, Any]:
    """Run both systems on the same input; cases and headline ratios."""
    # Spark's applyInPandasWithState calls pandas once per key and batch: the keys per
    # batch decide its throughput far more than the rows (see the module docstring).
    keys, rows, batches = (2_000, 10_000, 6) if quick else (20_000, 20_000, 10)
    p, q = 2, 4
    root = tempfile.mkdtemp(prefix="bench-spark-pipeline-")
    try:
        return _run(root, keys, rows, batches, p, q)
    finally:
        from coordinator.spark.server import stop_servers

        for sub in ("ours-rocksdb", "ours-heap"):
            stop_servers(os.path.join(root, sub, "local"))
        shutil.rmtree(root, ignore_errors=True)


def _run(root: str, keys: int, rows: int, batches: int, p: int, q: int) -> dict[str, Any]:
    spark = _session()
    spark.conf.set("spark.sql.shuffle.partitions", str(p))
    base = os.path.join(root, "in")
    _write_inputs(base, batches, rows, keys)
    cases: list[dict[str, Any]] = []

    def inputs(system: str) -> str:  # a file source's path is fixed by its checkpoint
        path = os.path.join(root, f"in-{system}")
        shutil.copytree(base, path)
        return path

    # -- Spark's own state store -----------------------------------------------------
    theirs = _Spark(os.path.join(root, "spark"))
    spark_in = inputs("spark")
    progress = theirs.run(spark, spark_in)
    commits = [float(x["stateOperators"][0]["commitTimeMs"]) for x in _steady(progress)]
    spark_case = _case("spark", "rocksdb (changelog)", progress, commits, theirs.counter.per_batch)
    time.sleep(3)  # its loaded state stores are unloaded (maintenance runs every second)
    _write_inputs(spark_in, 1, RESTART_ROWS, keys, first=batches)
    spark_case["restore_s"] = _timed_restart(lambda: theirs.run(spark, spark_in, count=False))
    _write_inputs(spark_in, 1, RESTART_ROWS, keys, first=batches + 1)
    started = time.monotonic()
    spark._streamingCheckpointManager.repartition(theirs.checkpoint, q)
    repartitioned = time.monotonic() - started
    restarted = _timed_restart(lambda: theirs.run(spark, spark_in, count=False))
    spark_case["rescale_s"] = round(repartitioned + restarted, 3)
    spark_case["repartition_s"] = round(repartitioned, 3)
    cases.append(spark_case)

    # -- ours ---------------------------------------------------------------------------
    for backend in ("rocksdb", "heap"):
        ours = _Ours(os.path.join(root, f"ours-{backend}"), backend, p)
        ours_in = inputs(f"ours-{backend}")
        progress, step = ours.run(spark, ours_in, p)
        case = _case("ours", backend, progress, _ours_commits(step), ours.counter.per_batch)
        case["restores_steady"] = sum(int(x.get("restores", 0)) for x in step.progress[1:])
        case.update(ours.counter.kinds_per_batch())
        ours.stop_servers()  # a restart on new executors: every range restores

        def again(parallelism: int, o: _Ours = ours, path: str = ours_in) -> list[dict[str, Any]]:
            return o.run(spark, path, parallelism, count=False)[0]

        _write_inputs(ours_in, 1, RESTART_ROWS, keys, first=batches)
        case["restore_s"] = _timed_restart(lambda: again(p))
        _write_inputs(ours_in, 1, RESTART_ROWS, keys, first=batches + 1)
        case["rescale_s"] = _timed_restart(lambda: again(q))
        cases.append(case)
    spark.stop()

    mine = next(c for c in cases if c["system"] == "ours" and c["state"] == "rocksdb")
    return {
        "cases": cases,
        "keys": keys,
        "rows_per_batch": rows,
        "parallelism": [p, q],
        "records_per_s": mine["records_per_s"],
        "spark_records_per_s": spark_case["records_per_s"],
        "batch_p50_ms": mine["batch_p50_ms"],
        "batch_p99_ms": mine["batch_p99_ms"],
        "spark_batch_p50_ms": spark_case["batch_p50_ms"],
        "spark_batch_p99_ms": spark_case["batch_p99_ms"],
        "commit_p50_ms": mine["commit_p50_ms"],
        "commit_p99_ms": mine["commit_p99_ms"],
        "spark_commit_p50_ms": spark_case["commit_p50_ms"],
        "spark_commit_p99_ms": spark_case["commit_p99_ms"],
        "files_per_batch": mine["files_per_batch"],
        "spark_files_per_batch": spark_case["files_per_batch"],
        "restore_s": mine["restore_s"],
        "spark_restore_s": spark_case["restore_s"],
        "rescale_s": mine["rescale_s"],
        "spark_rescale_s": spark_case["rescale_s"],
        "throughput_ratio": round(
            mine["records_per_s"] / max(spark_case["records_per_s"], 1e-9), 3
        ),
        **{k: v for k, v in mine.items() if k.endswith("_files_per_batch")},
        "files_ratio": round(mine["files_per_batch"] / max(spark_case["files_per_batch"], 1e-9), 3),
        "rescale_speedup": round(spark_case["rescale_s"] / max(mine["rescale_s"], 1e-9), 3),
    }
