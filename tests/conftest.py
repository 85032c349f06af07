"""Root fixtures: real services on 127.0.0.1 (see tests/services.py).

- ``s3_endpoint`` (session): moto's S3 server; ``.endpoint_url``, ``.storage_options``.
- ``s3_bucket`` (function): ``S3Bucket(url="s3://<fresh bucket>", storage_options=...)``.
- ``postgres_server`` (session): a scratch PostgreSQL cluster (``PostgresServer``).
- ``postgres_url`` (function): SQLAlchemy URL of a fresh database on it.
- ``spark`` (session): a local[2] SparkSession.

A service that cannot start fails the test with ``ServiceStartError`` (never a skip).
Tests that use these fixtures get the ``s3`` / ``postgres`` / ``spark`` marker automatically.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.services import (
    PostgresServer,
    S3Bucket,
    S3Endpoint,
    postgres_database,
    postgres_server_proc,
    s3_bucket_on,
    s3_server,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# fixture name -> marker it implies
FIXTURE_MARKERS = {
    "s3_endpoint": "s3",
    "s3_bucket": "s3",
    "postgres_server": "postgres",
    "postgres_url": "postgres",
    "spark": "spark",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in names and item.get_closest_marker(marker) is None:
                item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint: S3Endpoint) -> Iterator[S3Bucket]:
    with s3_bucket_on(s3_endpoint) as bucket:
        yield bucket


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with postgres_server_proc() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    with postgres_database(postgres_server) as url:
        yield url


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    with spark_session() as session:
        yield session
