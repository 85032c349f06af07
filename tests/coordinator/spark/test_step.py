"""Streaming queries with a StatefulStep on the session's local[2] Spark.

File-source queries (one JSON file per micro-batch, ``availableNow``) are compared with a
failure-free computation: the committed output and the final checkpointed state.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from backends.keygroups import key_group_for
from coordinator.metadata import MetadataStore
from coordinator.spark import StatefulStep, stateful
from coordinator.spark.partitioning import partition_values, spark_hash_int, with_key_group
from coordinator.spark.server import live_servers, stop_servers
from dstl.errors import MetadataStoreError, SchemaMismatchError, StateBackendError
from dstl.fileio import FileIO
from tests.coordinator.spark.jobs import OUTPUT, Counts, Sessions, key_of, reference
from tests.services import S3Bucket
from tools.restore import plan_restore, restore_operator

JOB = "step-test"


@pytest.fixture
def local_dir(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "local")
    yield path
    stop_servers(path)


def write_inputs(directory: Path, batches: list[range], start: int = 0) -> None:
    """One JSON file per batch, modification times in batch order."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, values in enumerate(batches, start):
        path = directory / f"part-{i:05d}.json"
        path.write_text("".join(json.dumps({"k": key_of(v), "v": v}) + "\n" for v in values))
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))


def run_query(
    spark: SparkSession, inputs: Path, checkpoint: Path, step: Any
) -> list[BaseException]:
    """Run the file source to its end (one file per batch); the step's errors, if any."""
    errors: list[BaseException] = []

    def each(df: DataFrame, batch_id: int) -> None:
        try:
            step(df, batch_id)
        except BaseException as exc:
            errors.append(exc)
            raise

    events = (
        spark.readStream.schema("k string, v long")
        .option("maxFilesPerTrigger", 1)
        .json(str(inputs))
    )
    query = (
        events.writeStream.foreachBatch(each)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination()
    except Exception:
        if not errors:
            raise
    return errors


def committed(output: str, storage_options: dict[str, Any] | None = None) -> set[tuple[Any, ...]]:
    io = FileIO(output, storage_options)
    rows: set[tuple[Any, ...]] = set()
    for info in io.list(""):
        data = io.read(io.relative(info.path))
        rows.update(tuple(r.values()) for r in pq.read_table(pa_buffer(data)).to_pylist())
    return rows


def pa_buffer(data: bytes) -> Any:
    import pyarrow as pa

    return pa.py_buffer(data)


def final_state(
    store: str, metadata: MetadataStore, options: dict[str, Any] | None = None
) -> dict[str, tuple[int, int]]:
    latest = metadata.latest(JOB)
    assert latest is not None
    plan = plan_restore(latest, "/nonexistent")
    snapshot = restore_operator(FileIO(store, options), plan.operators["counts"])
    merged: dict[str, dict[Any, Any]] = {}
    for name, table in snapshot.tables.items():
        merged[name] = {k: v for entries in table.values() for k, v in entries.items()}
    return {k: (merged["n"][k], merged["total"][k]) for k in merged["n"]}


def make_step(store: str, local_dir: str, **kw: Any) -> StatefulStep:
    settings: dict[str, Any] = {
        "key": "k",
        "values": ["v"],
        "output_schema": OUTPUT,
        "job": JOB,
        "operator": "counts",
        "store": store,
        "order_by": "v",
        "local_dir": local_dir,
        "server_idle_timeout_s": 60.0,
        "materialization_interval_s": 1.0,
    }
    settings.update(kw)
    return stateful(Counts, **settings)


def test_key_groups_computed_by_spark_are_ours(spark: SparkSession) -> None:
    strings = ["", "a", "user-00001", "üñí©ødé 😀", *[f"k{i}" for i in range(300)]]
    numbers = [0, 1, -1, 2**63 - 1, -(2**63), *range(-150, 150, 7), 10**12]
    df = spark.createDataFrame([(s,) for s in strings], "s string")
    got = {r["s"]: r["kg"] for r in with_key_group(df, "s", "str", 128, "kg").collect()}
    assert got == {s: key_group_for(s.encode(), 128) for s in strings}
    df = spark.createDataFrame([(n,) for n in numbers], "n long")
    got = {r["n"]: r["kg"] for r in with_key_group(df, "n", "int64", 4096, "kg").collect()}
    assert got == {n: key_group_for(struct.pack("<q", n), 4096) for n in numbers}
    # the partition placement: Spark's hash of an int column, computed in Python
    ints = spark.range(-300, 700).select(F.col("id").cast("int").alias("i"))
    hashed = ints.select("i", F.hash("i").alias("h")).collect()
    assert {r["i"]: r["h"] for r in hashed} == {r["i"]: spark_hash_int(r["i"]) for r in hashed}
    for parallelism in (1, 2, 3, 7, 128):
        values = partition_values(parallelism)
        placed = spark.createDataFrame([(v,) for v in values], "v int").select(
            F.pmod(F.hash("v"), F.lit(parallelism)).alias("p")
        )
        assert [r["p"] for r in placed.collect()] == list(range(parallelism))


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_query_matches_a_failure_free_run(
    spark: SparkSession, tmp_path: Path, local_dir: str, backend: str
) -> None:
    batches = [range(i * 400, (i + 1) * 400) for i in range(5)]
    write_inputs(tmp_path / "in", batches)
    store, output = str(tmp_path / "store"), str(tmp_path / "out")
    step = make_step(store, local_dir, output=output, state_backend=backend, parallelism=2)
    assert run_query(spark, tmp_path / "in", tmp_path / "cp", step) == []
    expected_rows, expected_state = reference(range(2000))
    assert committed(output) == expected_rows
    assert final_state(store, step.metadata) == expected_state
    assert [p["batch_id"] for p in step.progress] == [0, 1, 2, 3, 4]
    assert sum(p["restores"] for p in step.progress) == 0  # state stayed on the host
    assert len(live_servers(local_dir)) == 1
    # both ranges' changelog went into one segment per batch (the DSTL's batching)
    checkpoints = [step.metadata.get(JOB, b) for b in (3, 4)]
    for cp in checkpoints:
        segments = {
            c.location for s in cp.subtasks for h in s.handles for c in getattr(h, "changelog", ())
        }
        assert cp.stats["files_new"] <= 1 + 2 + 2 * 8  # segment, 2 parts, materializations
        assert segments
    step.close()


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_restart_at_another_parallelism(
    spark: SparkSession, tmp_path: Path, local_dir: str, backend: str
) -> None:
    store, output = str(tmp_path / "store"), str(tmp_path / "out")
    write_inputs(tmp_path / "in", [range(i * 300, (i + 1) * 300) for i in range(3)])
    two = make_step(store, local_dir, output=output, state_backend=backend, parallelism=2)
    assert run_query(spark, tmp_path / "in", tmp_path / "cp", two) == []
    two.close()
    write_inputs(tmp_path / "in", [range(i * 300, (i + 1) * 300) for i in range(3, 6)], start=3)
    three = make_step(store, local_dir, output=output, state_backend=backend, parallelism=3)
    assert run_query(spark, tmp_path / "in", tmp_path / "cp", three) == []
    assert [p["batch_id"] for p in three.progress] == [3, 4, 5]
    assert [p["restores"] for p in three.progress] == [3, 0, 0]  # each range once
    latest = three.metadata.latest(JOB)
    assert latest is not None and latest.stats["parallelism"] == 3
    expected_rows, expected_state = reference(range(1800))
    assert committed(output) == expected_rows
    assert final_state(store, three.metadata) == expected_state
    three.close()


def test_event_time_timers_fire_from_the_watermark(
    spark: SparkSession, tmp_path: Path, local_dir: str
) -> None:
    # every value v is an event at v ms; a key's session closes 1000 ms after its last
    # event once the watermark (largest event time of earlier batches - 200 ms) passes it
    batches = [range(0, 500), range(500, 1000), range(3000, 3001), range(5000, 5001)]
    write_inputs(tmp_path / "in", batches)
    got: list[tuple[int, list[Any]]] = []
    step = stateful(
        Sessions,
        key="k",
        values=["v"],
        output_schema=OUTPUT,
        job=JOB,
        operator="sessions",
        store=str(tmp_path / "store"),
        order_by="v",
        event_time="v",
        watermark_delay_ms=200,
        local_dir=local_dir,
        on_output=lambda df, b: got.append((b, sorted(tuple(r) for r in df.collect()))),
    )
    assert run_query(spark, tmp_path / "in", tmp_path / "cp", step) == []
    closed = {b: [r for r in rows if r[1] == 0] for b, rows in got}
    assert closed[0] == [] and closed[1] == [] and closed[2] == []
    # batch 3's watermark is 3000 - 200: every key whose last event was < 1000 closes,
    # with its events of 0..999; not k003 (3000 moved its timer) nor k005 (batch 3's own
    # event 5000 moved it: a batch's rows are processed before its timers fire)
    open_keys = {"k003", "k005"}
    assert sorted(r[0] for r in closed[3]) == sorted({key_of(v) for v in range(37)} - open_keys)
    assert sum(r[2] for r in closed[3]) == 1000 - len(range(3, 1000, 37)) - len(range(5, 1000, 37))
    assert step.metadata.get(JOB, 3).stats["watermark_ms"] == 2800
    # processing-time timers: each key reported once, in a later batch than its first event
    reported = [r[0] for _, rows in got for r in rows if r[1] == -1]
    assert sorted(reported) == sorted({key_of(v) for v in range(37)})
    step.close()


def test_rate_source_on_s3_and_postgres(
    spark: SparkSession, tmp_path: Path, local_dir: str, s3_bucket: S3Bucket, postgres_url: str
) -> None:
    options = s3_bucket.storage_options
    store, output = s3_bucket.url + "/state", s3_bucket.url + "/out"
    step = make_step(
        store, local_dir, output=output, metadata=postgres_url, storage_options=options,
        state_backend="rocksdb", parallelism=2,
    )  # fmt: skip
    events = (
        spark.readStream.format("rate").option("rowsPerSecond", 400).load()
        .select(F.concat(F.lit("k"), F.lpad((F.col("value") % 37).cast("string"), 3, "0")).alias("k"),
                F.col("value").alias("v"))
    )  # fmt: skip
    query = (
        events.writeStream.foreachBatch(step)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    try:
        while len(step.progress) < 4 and query.exception() is None:
            query.awaitTermination(0.5)
    finally:
        query.stop()
    assert query.exception() is None
    rows = committed(output, options)
    values = sorted(r[1] for r in rows)
    assert values == list(range(len(values))) and values  # a prefix, each value once
    expected_rows, expected_state = reference(values)
    assert rows == expected_rows
    latest = step.metadata.latest(JOB)
    assert latest is not None
    # the output of the latest checkpoint's batch is committed, no later batch's
    assert max(p["batch_id"] for p in step.progress) == latest.checkpoint_id
    assert final_state(store, step.metadata, options) == expected_state
    step.close()


def test_clear_errors_and_nothing_committed(
    spark: SparkSession, tmp_path: Path, local_dir: str
) -> None:
    store = str(tmp_path / "store")
    write_inputs(tmp_path / "in", [range(0, 100), range(100, 200)])
    first = make_step(store, local_dir)
    assert run_query(spark, tmp_path / "in", tmp_path / "cp", first) == []
    first.close()

    # the key column changed type: refused before any task runs
    write_inputs(tmp_path / "in", [range(200, 300)], start=2)
    int_keys = make_step(store, local_dir, key="v", values=["k"])
    errors = run_query(spark, tmp_path / "in", tmp_path / "cp", int_keys)
    assert len(errors) == 1 and isinstance(errors[0], SchemaMismatchError)
    assert "\n" not in str(errors[0]) and "str" in str(errors[0])
    latest = int_keys.metadata.latest(JOB)
    assert latest is not None and latest.checkpoint_id == 1  # nothing recorded
    int_keys.close()

    # a referenced file is gone, and the ranges must be rebuilt (a new server)
    stop_servers(local_dir)
    fileio = FileIO(store)
    segment = next(f for f in latest.files() if "/changelog/" in f)
    fileio.delete(segment)
    again = make_step(store, local_dir)
    errors = run_query(spark, tmp_path / "in", tmp_path / "cp", again)
    assert len(errors) == 1 and isinstance(errors[0], StateBackendError)
    assert "\n" not in str(errors[0]) and segment in str(errors[0])
    after = again.metadata.latest(JOB)
    assert after is not None and after.checkpoint_id == 1
    again.close()

    # a metadata store that does not answer: one line at construction
    with pytest.raises(MetadataStoreError) as info:
        make_step(store, local_dir, metadata="postgresql+psycopg://u:secret@127.0.0.1:9/db")
    assert "\n" not in str(info.value) and "secret" not in str(info.value)
