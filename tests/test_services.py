"""Smoke tests: each service fixture works against the real thing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.services import PostgresServer, S3Bucket, S3Endpoint

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.mark.s3
def test_s3_roundtrip_with_s3fs(s3_endpoint: S3Endpoint, s3_bucket: S3Bucket) -> None:
    import s3fs

    assert s3_endpoint.endpoint_url.startswith("http://127.0.0.1:")
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"
    assert "region_name" not in s3_bucket.storage_options
    assert s3_bucket.storage_options["client_kwargs"] == {"endpoint_url": s3_endpoint.endpoint_url}

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_bucket.storage_options)
    path = f"{s3_bucket.url}/dir/hello.bin"
    payload = b"\x00hello s3\xff" * 1000
    with fs.open(path, "wb") as f:
        f.write(payload)
    with fs.open(path, "rb") as f:
        assert f.read() == payload
    assert fs.ls(f"{s3_bucket.name}/dir") == [f"{s3_bucket.name}/dir/hello.bin"]
    # conditional create refuses to overwrite (the publish primitive the DSTL relies on)
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"other", mode="create")


@pytest.mark.s3
def test_s3_buckets_are_fresh_per_test(s3_endpoint: S3Endpoint, s3_bucket: S3Bucket) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_bucket.storage_options)
    assert fs.ls(s3_bucket.name) == []
    # new buckets can be made through s3fs too (no region_name in storage_options)
    other = f"{s3_bucket.name}-x"
    fs.mkdir(other)
    fs.pipe_file(f"{other}/k", b"v")
    assert fs.cat_file(f"{other}/k") == b"v"
    fs.rm(other, recursive=True)


@pytest.mark.postgres
def test_postgres_table_insert_select(postgres_server: PostgresServer, postgres_url: str) -> None:
    import sqlalchemy as sa

    assert postgres_url.startswith(
        f"postgresql+psycopg://postgres@127.0.0.1:{postgres_server.port}/"
    )
    engine = sa.create_engine(postgres_url)
    try:
        meta = sa.MetaData()
        t = sa.Table(
            "items",
            meta,
            sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("payload", sa.LargeBinary, nullable=False),
        )
        meta.create_all(engine)
        with engine.begin() as conn:
            conn.execute(t.insert(), [{"id": i, "payload": bytes([i]) * 3} for i in range(5)])
        with engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.id, t.c.payload).order_by(t.c.id)).all()
            version = conn.execute(sa.text("SHOW server_version")).scalar_one()
        assert [(r.id, bytes(r.payload)) for r in rows] == [(i, bytes([i]) * 3) for i in range(5)]
        assert str(version).split(".")[0] == postgres_server.version
    finally:
        engine.dispose()


# no explicit marker: the conftest hook adds `postgres` (checked below)
def test_postgres_databases_are_fresh_per_test(postgres_url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(postgres_url)
    try:
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


@pytest.mark.spark
def test_spark_count_and_reads_pyarrow_parquet(spark: SparkSession, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert spark.range(10).count() == 10
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"

    table = pa.table(
        {
            "k": pa.array([3, 1, 2], pa.int64()),
            "v": pa.array([b"c", b"a", b"b"], pa.binary()),
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, compression="zstd")
    df = spark.read.parquet(str(path))
    assert df.count() == 3
    assert [(r.k, bytes(r.v)) for r in df.orderBy("k").collect()] == [
        (1, b"a"),
        (2, b"b"),
        (3, b"c"),
    ]
    # a shuffle in the JVM, and Python workers (the venv's interpreter) through the RDD API
    assert df.groupBy().sum("k").collect()[0][0] == 6
    assert df.rdd.map(lambda r: r.k * 2).sum() == 12


def test_fixture_markers_are_applied(request: pytest.FixtureRequest) -> None:
    """The conftest hook marks tests by the service fixtures they use."""
    session_items = request.session.items
    by_name = {item.name: item for item in session_items}
    unmarked = by_name.get("test_postgres_databases_are_fresh_per_test")
    if unmarked is not None:  # absent when deselected (-k / -m)
        assert unmarked.get_closest_marker("postgres") is not None
