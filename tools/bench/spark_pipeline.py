"""spark-pipeline: the same keyed count-and-sum streaming query, our state vs Spark's own.

One local[2] session runs, on the same input (one Parquet file of random keys per
micro-batch, ``maxFilesPerTrigger=1``), and one after the other:

- **spark, defaults** (the headline peer): ``groupBy(k).applyInPandasWithState`` on Spark's
  RocksDB state store provider with changelog checkpointing, every other setting Spark's
  default: ``spark.sql.shuffle.partitions`` 200, so 200 state partitions; output appended
  as Parquet by ``foreachBatch``;
- **spark, same partitions**: the same query started with ``spark.sql.shuffle.partitions``
  set to our parallelism (P=2), beside the headline; the rescale is measured on it (the
  cheaper case for Spark: an offline rewrite of 2 partitions, not of 200);
- **ours** at our defaults (P=2 key-group ranges, 10 s materialization interval): a
  :class:`~coordinator.spark.StatefulStep` with RocksDB ranges (the headline) and heap
  ranges, on local disk + SQLite, output committed as Parquet.

Both emit one row per input row, ``(k, v, n, total)``. Spark's function is vectorized per
key and batch (pandas), but called once per key: with many distinct keys per batch it is
slow (measured here: ~3 ms per key on a loaded machine), so the keys per batch decide the
throughput ratio; the quick run has 2,000 keys (10,000 rows per batch), the full one
20,000. Restarts and rescales are timed on a batch of 200 rows. Per query: records/s and
batch duration from Spark's progress (``triggerExecution``; the first batch, JVM and worker
warm-up, left out), state commit time (ours: the ranges' changelog persists plus the
metadata record; Spark's: its operator's ``commitTimeMs``, summed over partitions).

Files per batch (the first batch left out), state and output apart:

- **state files**: Spark's: new files in the checkpoint's ``state/`` directory (changelog
  files, snapshot zips, SSTs, metadata; not its offset and commit logs, which both sides
  write). Ours: changelog segments and materialized files in the store, plus the
  checkpoint's metadata record counted as one write (a row in SQLite or PostgreSQL);
- **output files**: Spark's: the Parquet parts ``df.write`` appends per batch (one per
  non-empty partition). Ours: the tasks' staged parts in the store plus the parts the
  driver commits to the output directory.

Restore: the time from a restart to the end of its first batch (ours: state servers
stopped first, so every range restores; Spark's: a new query run loads every partition's
store from the checkpoint). Rescale: the time from a stopped query to the end of its first
batch at another parallelism (ours: restart at Q; Spark's:
``spark._streamingCheckpointManager.repartition(location, Q)``, then restart), query start
included on both sides, in the session the query ran in. ``rescale_s`` is the first one
(P->Q: what a user gets, one rescale per stop; Spark's offline job runs its code for the
first time in that JVM); ``rescale_warm_s`` the median of two more (Q->P, P->Q), which a
user does not get but which shows the fixed costs.
Ratios are against Spark's numbers of the same run.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tools.demo import percentile

COLUMNS = [
    "system",
    "state",
    "partitions",
    "records_per_s",
    "batch_p50_ms",
    "batch_p99_ms",
    "commit_p50_ms",
    "commit_p99_ms",
    "state_files_per_batch",
    "output_files_per_batch",
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
            if not n.endswith((".crc", ".db", "-wal", "-shm", "-journal"))
        )
    return out


class _Counter:
    """New files per batch under some roots, by kind (driver thread only).

    ``kinds`` maps a kind to ``(root, path fragment or "")``; a file is of the first kind
    whose root holds it and whose fragment its path contains.
    """

    def __init__(self, kinds: dict[str, tuple[str, str]]) -> None:
        self.kinds = kinds
        self.roots = sorted({root for root, _ in kinds.values()})
        self.seen = self._now()
        self.per_batch: list[dict[str, int]] = []

    def _now(self) -> set[str]:
        return set().union(*(_files(root) for root in self.roots))

    def look(self, extra: dict[str, int] | None = None) -> None:
        now = self._now()
        new = now - self.seen
        counts = dict.fromkeys(self.kinds, 0)
        for f in new:
            for kind, (root, fragment) in self.kinds.items():
                if f.startswith(root + os.sep) and fragment in f:
                    counts[kind] += 1
                    break
        for kind, n in (extra or {}).items():
            counts[kind] = counts.get(kind, 0) + n
        self.per_batch.append(counts)
        self.seen |= now

    def per_batch_of(self, *kinds: str) -> float:
        """New files of ``kinds`` per batch, the first batch (warm-up) left out."""
        steady = self.per_batch[1:]
        total = sum(c.get(k, 0) for c in steady for k in kinds)
        return round(total / max(1, len(steady)), 2)


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
        # Spark's state store as the issue has it: RocksDB with changelog checkpointing
        # (both off by default); everything else, shuffle partitions included, default
        .config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        )
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
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

    def __init__(self, root: str, backend: str) -> None:
        self.root = root
        self.backend = backend
        store, out = os.path.join(root, "store"), os.path.join(root, "out")
        self.counter = _Counter(
            {
                "changelog": (store, "/changelog/"),
                "materialized": (store, "/materialized/"),
                "staged": (store, "/sink/"),
                "committed": (out, ""),
            }
        )

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
        )

    def run(
        self, spark: Any, inputs: str, parallelism: int, count: bool = True
    ) -> tuple[list[dict[str, Any]], Any]:
        step = self.step(parallelism)

        def each(df: Any, batch_id: int) -> None:
            step(df, batch_id)
            if count:  # the batch's checkpoint record: one metadata write
                self.counter.look({"metadata": 0 if step.progress[-1]["replayed"] else 1})

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
        self.out = os.path.join(root, "out")
        self.counter = _Counter(
            {"state": (os.path.join(self.checkpoint, "state"), ""), "output": (self.out, "")}
        )

    def run(self, spark: Any, inputs: str, count: bool = True) -> list[dict[str, Any]]:
        def each(df: Any, batch_id: int) -> None:
            df.write.mode("append").parquet(self.out)
            if count:
                self.counter.look()

        return _run_query(spark, inputs, self.checkpoint, each, _spark_transform)


def _steady(progress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in progress if p["batchId"] > 0 and p["numInputRows"]]


def _case(
    system: str, state: str, partitions: int, progress: list[dict[str, Any]], commits: list[float]
) -> dict[str, Any]:
    steady = _steady(progress)
    durations = [float(p["durationMs"]["triggerExecution"]) for p in steady]
    rows = sum(int(p["numInputRows"]) for p in steady)
    return {
        "system": system,
        "state": state,
        "partitions": partitions,
        "batches": len(steady),
        "records_per_s": round(rows / (sum(durations) / 1e3), 1) if durations else 0.0,
        "batch_p50_ms": percentile(durations, 0.5),
        "batch_p99_ms": percentile(durations, 0.99),
        "commit_p50_ms": round(percentile(commits, 0.5), 1),
        "commit_p99_ms": round(percentile(commits, 0.99), 1),
    }


def _ours_commits(step: Any) -> list[float]:
    """Per batch: the ranges' persists (summed) plus the metadata record."""
    return [
        float(p["persist_ms"]) + float(p["commit_ms"])
        for p in step.progress
        if not p.get("replayed") and p["batch_id"] > 0
    ]


def _timed_restart(run: Callable[[], list[dict[str, Any]]]) -> float:
    """Seconds from starting ``run`` to the end of its first batch."""
    started = time.monotonic()
    progress = run()
    first = progress[0]
    rest = sum(float(p["durationMs"]["triggerExecution"]) for p in progress if p is not first)
    return round(time.monotonic() - started - rest / 1e3, 3)


RESTART_ROWS = 200
"""Rows of the batch after a restart or rescale: small, so its time is the restore's."""


class _Inputs:
    """One copy of the input per query (a file source's path is fixed by its checkpoint),
    and the one extra small batch each restart or rescale gets."""

    def __init__(self, root: str, keys: int, rows: int, batches: int) -> None:
        self.root = root
        self.keys = keys
        self.batches = batches
        self.base = os.path.join(root, "in")
        _write_inputs(self.base, batches, rows, keys)
        self.extra: dict[str, int] = {}

    def copy(self, name: str, batches: int | None = None) -> str:
        """A copy of the first ``batches`` (default: all) batches for query ``name``."""
        path = os.path.join(self.root, f"in-{name}")
        os.makedirs(path)
        for file in sorted(os.listdir(self.base))[:batches]:
            shutil.copy2(os.path.join(self.base, file), path)
        self.extra[path] = 0
        return path

    def one_more(self, path: str) -> None:
        _write_inputs(path, 1, RESTART_ROWS, self.keys, first=self.batches + self.extra[path])
        self.extra[path] += 1


def _spark_case(
    spark: Any,
    inputs: _Inputs,
    root: str,
    partitions: int | None,
    rescale_to: int | None,
    batches: int | None = None,
) -> dict[str, Any]:
    """Spark's query with ``partitions`` shuffle partitions (None: its default) on the first
    ``batches`` batches (None: all)."""
    key = "spark.sql.shuffle.partitions"
    if partitions is None:
        spark.conf.unset(key)
    else:
        spark.conf.set(key, str(partitions))
    theirs = _Spark(root)
    path = inputs.copy(os.path.basename(root), batches)
    progress = theirs.run(spark, path)
    spark.conf.unset(key)  # a restarted query takes its partitions from its checkpoint
    operator = progress[-1]["stateOperators"][0]
    commits = [float(x["stateOperators"][0]["commitTimeMs"]) for x in _steady(progress)]
    used = int(operator.get("numShufflePartitions") or partitions or 200)
    case = _case("spark", "rocksdb (changelog)", used, progress, commits)
    case["state_files_per_batch"] = theirs.counter.per_batch_of("state")
    case["output_files_per_batch"] = theirs.counter.per_batch_of("output")
    inputs.one_more(path)
    case["restore_s"] = _timed_restart(lambda: theirs.run(spark, path, count=False))
    if rescale_to is not None:
        times, repartitions = [], []
        for target in (rescale_to, used, rescale_to):
            inputs.one_more(path)
            started = time.monotonic()
            spark._streamingCheckpointManager.repartition(theirs.checkpoint, target)
            repartitions.append(time.monotonic() - started)
            restarted = _timed_restart(lambda: theirs.run(spark, path, count=False))
            times.append(repartitions[-1] + restarted)
        case.update(_rescales(times))
        case["repartition_s"] = round(repartitions[0], 3)
        case["repartition_warm_s"] = round(statistics.median(repartitions[1:]), 3)
    return case


def _ours_case(
    spark: Any, inputs: _Inputs, root: str, backend: str, p: int, q: int
) -> dict[str, Any]:
    ours = _Ours(root, backend)
    path = inputs.copy(os.path.basename(root))
    progress, step = ours.run(spark, path, p)
    case = _case("ours", backend, p, progress, _ours_commits(step))
    c = ours.counter
    case["state_files_per_batch"] = c.per_batch_of("changelog", "materialized", "metadata")
    case["output_files_per_batch"] = c.per_batch_of("staged", "committed")
    for kind in ("changelog", "materialized", "metadata", "staged", "committed"):
        case[f"{kind}_files_per_batch"] = c.per_batch_of(kind)
    case["restores_steady"] = sum(int(x.get("restores", 0)) for x in step.progress[1:])
    ours.stop_servers()  # a restart on new executors: every range restores

    def again(parallelism: int) -> list[dict[str, Any]]:
        return ours.run(spark, path, parallelism, count=False)[0]

    inputs.one_more(path)
    case["restore_s"] = _timed_restart(lambda: again(p))
    times = []
    for target in (q, p, q):
        inputs.one_more(path)
        times.append(_timed_restart(lambda t=target: again(t)))  # type: ignore[misc]
    case.update(_rescales(times))
    ours.stop_servers()
    return case


def _rescales(times: list[float]) -> dict[str, Any]:
    """The first rescale (what a user gets: one per stop) and the later ones' median."""
    return {
        "rescale_s": round(times[0], 3),
        "rescale_warm_s": round(statistics.median(times[1:]), 3),
        "rescale_runs_s": [round(t, 3) for t in times],
    }


def run(quick: bool) -> dict[str, Any]:
    """Run both systems on the same input; cases and headline ratios."""
    # Spark's applyInPandasWithState calls pandas once per key and batch: the keys per
    # batch decide its throughput far more than the rows (see the module docstring).
    keys, rows, batches = (2_000, 10_000, 6) if quick else (20_000, 20_000, 10)
    root = tempfile.mkdtemp(prefix="bench-spark-pipeline-")
    try:
        return _run(root, keys, rows, batches, 2, 4)
    finally:
        from coordinator.spark.server import stop_servers

        for sub in ("ours-rocksdb", "ours-heap"):
            stop_servers(os.path.join(root, sub, "local"))
        shutil.rmtree(root, ignore_errors=True)


def _run(root: str, keys: int, rows: int, batches: int, p: int, q: int) -> dict[str, Any]:
    spark = _session()
    inputs = _Inputs(root, keys, rows, batches)
    # at 200 partitions a batch takes ~50 s here (quick sizes): 3 steady batches are plenty
    default = _spark_case(spark, inputs, os.path.join(root, "spark-default"), None, None, 4)
    same = _spark_case(spark, inputs, os.path.join(root, "spark-same"), p, q)
    same["state"] += ", same partitions"
    cases = [default, same]
    for backend in ("rocksdb", "heap"):
        cases.append(
            _ours_case(spark, inputs, os.path.join(root, f"ours-{backend}"), backend, p, q)
        )
    spark.stop()

    mine = cases[2]  # ours, RocksDB ranges: the state store Spark's is compared with
    return {
        "cases": cases,
        "keys": keys,
        "rows_per_batch": rows,
        "parallelism": [p, q],
        "spark_partitions": default["partitions"],
        "records_per_s": mine["records_per_s"],
        "spark_records_per_s": default["records_per_s"],
        "batch_p50_ms": mine["batch_p50_ms"],
        "batch_p99_ms": mine["batch_p99_ms"],
        "spark_batch_p50_ms": default["batch_p50_ms"],
        "spark_batch_p99_ms": default["batch_p99_ms"],
        "commit_p50_ms": mine["commit_p50_ms"],
        "commit_p99_ms": mine["commit_p99_ms"],
        "spark_commit_p50_ms": default["commit_p50_ms"],
        "spark_commit_p99_ms": default["commit_p99_ms"],
        "files_per_batch": mine["state_files_per_batch"],
        "spark_files_per_batch": default["state_files_per_batch"],
        "output_files_per_batch": mine["output_files_per_batch"],
        "spark_output_files_per_batch": default["output_files_per_batch"],
        "restore_s": mine["restore_s"],
        "spark_restore_s": default["restore_s"],
        # the rescale at the same partitions (2 -> 4): the cheaper one for Spark
        "rescale_s": mine["rescale_s"],
        "spark_rescale_s": same["rescale_s"],
        "rescale_warm_s": mine["rescale_warm_s"],
        "spark_rescale_warm_s": same["rescale_warm_s"],
        "spark_repartition_s": same["repartition_s"],
        "throughput_ratio": _ratio(mine["records_per_s"], default["records_per_s"]),
        "files_ratio": _ratio(mine["state_files_per_batch"], default["state_files_per_batch"]),
        "rescale_speedup": _ratio(same["rescale_s"], mine["rescale_s"]),
        "rescale_warm_speedup": _ratio(same["rescale_warm_s"], mine["rescale_warm_s"]),
        "same_partitions": {
            "spark_records_per_s": same["records_per_s"],
            "spark_batch_p99_ms": same["batch_p99_ms"],
            "spark_files_per_batch": same["state_files_per_batch"],
            "spark_output_files_per_batch": same["output_files_per_batch"],
            "spark_restore_s": same["restore_s"],
            "throughput_ratio": _ratio(mine["records_per_s"], same["records_per_s"]),
            "files_ratio": _ratio(mine["state_files_per_batch"], same["state_files_per_batch"]),
        },
    }


def _ratio(a: float, b: float) -> float:
    return round(a / max(b, 1e-9), 3)
