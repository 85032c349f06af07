"""The ``changelog-state`` Spark data source on a real local Spark session.

The DataFrame of a state equals the state the job had at that checkpoint: heap and
RocksDB stores, changelog on and off, after a rescale (three subtasks restored from two
writers' logs and materializations), a real pipeline at every retained checkpoint, and
an S3 store read through our FileIO inside the tasks. Pickled values stay bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.restore import restore_changelog_backend
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import MetadataStore
from tests.backends.helpers import ALL, workload
from tests.services import S3Bucket
from tests.tools.spark_store import Recorder, df_dump
from tools.demo_job import DemoConfig, offsets_of, pipeline, reference
from tools.spark import register

EVERY_STATE = [d.name for d in ALL] + ["__timers__.event"]
SOME_STATES = ["count", "items", "pair", "ttl_map", "ttl_list"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Recorder]]:
    """One store, five jobs: {heap,rocksdb} x {changelog, full} and a rescaled one."""
    root = tmp_path_factory.mktemp("spark-read") / "store"
    jobs: dict[str, Recorder] = {}
    for kind in ("heap", "rocksdb"):
        for changelog in (True, False):
            rec = Recorder(root, f"{kind}-{'log' if changelog else 'full'}", kind, changelog)
            for i in range(2):
                workload(rec.live(i), 100 + i, 900, rec.factory.clock)
            if changelog:
                rec.materialize(0)
            for i in range(2):
                workload(rec.live(i), 200 + i, 600, rec.factory.clock)
            rec.checkpoint()
            jobs[rec.job] = rec
    rec = Recorder(root, "rescaled", "heap", True)
    for i, b in enumerate(rec.backends):
        workload(b, 300 + i, 700, rec.factory.clock)
    rec.materialize(1)
    for i, b in enumerate(rec.backends):
        workload(b, 400 + i, 400, rec.factory.clock)
    old = [h.handles[0] for h in rec.checkpoint().subtasks]
    rec.backends = [rec.new_backend(s, 3, "a1") for s in range(3)]
    for s, b in enumerate(rec.backends):
        restore_changelog_backend(b, rec.fileio, old)
        workload(b, 500 + s, 300, rec.factory.clock)
    rec.checkpoint()
    jobs["rescaled"] = rec
    yield jobs
    for r in jobs.values():
        r.close()


def _read(spark: Any, root: Path, **options: Any) -> Any:
    register(spark)
    reader = spark.read.format("changelog-state").option("store", str(root))
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load()


@pytest.mark.parametrize(
    ("job", "states"),
    [
        ("heap-log", EVERY_STATE),
        ("heap-full", SOME_STATES),
        ("rocksdb-log", SOME_STATES),
        ("rocksdb-full", SOME_STATES),
        ("rescaled", [*SOME_STATES, "__timers__.event"]),
    ],
)
def test_every_state_equals_the_checkpointed_state(
    spark: Any, recorded: dict[str, Recorder], job: str, states: list[str]
) -> None:
    rec = recorded[job]
    cid = max(rec.expected)
    expected = rec.expected[cid]
    metas = rec.backends[0].inner.state_metas()
    for state in states:
        df = _read(spark, rec.root, job=job, checkpoint=cid, operator="op", state=state)
        got = df_dump(metas[state], df.collect(), rec.clock_at[cid])
        assert got == expected.get(state, {}), f"{job}: state {state}"


def test_columns_are_typed_and_pickle_stays_bytes(
    spark: Any, recorded: dict[str, Recorder]
) -> None:
    rec = recorded["heap-log"]
    schema = {
        s: _read(spark, rec.root, job="heap-log", state=s).schema.simpleString()
        for s in ("count", "blob", "pair", "ttl_list", "prices", "mean")
    }
    assert schema == {
        "count": "struct<key_group:int,key:string,value:bigint>",
        "blob": "struct<key_group:int,key:string,value:binary>",
        "pair": "struct<key_group:int,key:string,value:struct<f0:string,f1:bigint>>",
        "ttl_list": "struct<key_group:int,key:string,value:array<string>,"
        "ttl_timestamp:array<bigint>>",
        "prices": "struct<key_group:int,key:string,user_key:string,value:double>",
        "mean": "struct<key_group:int,key:string,value:struct<f0:bigint,f1:double>>",
    }
    blob = _read(spark, rec.root, job="heap-log", state="blob").first()
    assert isinstance(blob.value, bytes | bytearray)
    assert pickle.loads(blob.value)["t"] == (1, "x")  # the test trusts its own pickles


def test_partitions_follow_key_groups(spark: Any, recorded: dict[str, Recorder]) -> None:
    rec = recorded["rescaled"]
    meta = rec.backends[0].inner.state_metas()["count"]
    one = _read(spark, rec.root, job="rescaled", state="count", rowsPerPartition=1_000_000)
    many = _read(spark, rec.root, job="rescaled", state="count", rowsPerPartition=3)
    assert one.rdd.getNumPartitions() == 3 < many.rdd.getNumPartitions()  # one per subtask
    assert df_dump(meta, many.collect()) == df_dump(meta, one.collect())
    groups = many.groupBy("key_group").count().collect()
    assert len(groups) == len({r.key_group for r in one.collect()})


def test_a_running_pipeline_at_every_retained_checkpoint(spark: Any, tmp_path: Path) -> None:
    root = tmp_path / "store"
    config = DemoConfig(events_per_source=3000, users=120, rate_per_source=6000.0)
    options = RuntimeOptions(
        store_url=str(root),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=3),
        materialization_interval_s=0.15,
        source_batch=64,
    )
    EmbeddedRuntime(pipeline(config, str(tmp_path / "out")), options).run()
    with MetadataStore.for_local_store(str(root), create=False) as store:
        retained = [store.get("demo", c.checkpoint_id) for c in store.list("demo")]
    assert len(retained) == 3
    for cp in retained:
        _, state = reference(config, offsets_of(cp.source_offsets, config))
        names = ["count", "by_category", "recent_items"] if cp is retained[-1] else ["count"]
        for name in names:
            df = _read(spark, root, checkpoint=cp.checkpoint_id, state=name)
            rows = df.collect()
            if name == "by_category":
                got: dict[Any, Any] = {}
                for r in rows:
                    got.setdefault(r.key, {})[r.user_key] = r.value
            else:
                got = {r.key: list(r.value) if name == "recent_items" else r.value for r in rows}
            assert got == state[name], f"checkpoint {cp.checkpoint_id} state {name}"


def test_an_s3_store(spark: Any, s3_bucket: S3Bucket, tmp_path: Path) -> None:
    config = DemoConfig(events_per_source=1500, users=60, rate_per_source=None)
    metadata = f"sqlite:///{tmp_path}/metadata.db"
    options = RuntimeOptions(
        store_url=s3_bucket.url,
        metadata_url=metadata,
        storage_options=s3_bucket.storage_options,
        checkpoint=CheckpointOptions(interval_s=0.1, retain=1),
        materialization_interval_s=0.3,
    )
    EmbeddedRuntime(pipeline(config, str(tmp_path / "out")), options).run()
    endpoint = s3_bucket.storage_options["client_kwargs"]["endpoint_url"]
    extra = {
        f"storage.{k}": v for k, v in s3_bucket.storage_options.items() if k != "client_kwargs"
    }
    df = (
        spark.read.format("changelog-state")
        .option("store", s3_bucket.url)
        .option("metadata", metadata)
        .option("storage.client_kwargs.endpoint_url", endpoint)
        .options(**{k: str(v) for k, v in extra.items()})
        .option("state", "count")
        .load()
    )
    _, state = reference(config)
    assert {r.key: r.value for r in df.collect()} == state["count"]


def test_errors_name_what_is_wrong(spark: Any, recorded: dict[str, Recorder]) -> None:
    root = recorded["heap-log"].root
    with pytest.raises(
        Exception, match=r"holds jobs .*heap-log.*: give --job \(Spark: option job\)"
    ):
        _read(spark, root, state="count").schema  # noqa: B018
    with pytest.raises(Exception, match="has no state 'nope'"):
        _read(spark, root, job="heap-log", state="nope").schema  # noqa: B018
    with pytest.raises(Exception, match="unknown option"):
        _read(spark, root, job="heap-log", state="count", chekpoint=3).schema  # noqa: B018
