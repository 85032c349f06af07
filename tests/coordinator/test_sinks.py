"""Two-phase commit sinks: staged per checkpoint, published once, idempotent on restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from coordinator.errors import SinkError
from coordinator.sink import (
    CollectSink,
    FileSink,
    TransactionalSink,
    publish_staged,
    read_output,
)
from coordinator.sql_sink import SqlSink
from dstl.errors import ConfigError
from dstl.fileio import FileIO

COLUMNS = (("name", "text"), ("n", "bigint"), ("extra", "json"))


@pytest.fixture(params=["sqlite", "postgres"])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/out.db"
    return str(request.getfixturevalue("postgres_url"))


def _rows(url: str, table: str = "out") -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(tuple(r) for r in conn.execute(sa.text(f"SELECT name, n FROM {table}")))
    finally:
        engine.dispose()


def test_sql_sink_commits_each_transaction_once(tmp_path: Path, sql_url: str) -> None:
    state = FileIO(str(tmp_path / "store"))
    spec = SqlSink(sql_url, "out", COLUMNS)
    sink = TransactionalSink(state, spec.publisher({}), "job", "out", 0)
    sink.write([["a", 1, {"k": 1}], {"name": "b", "n": 2, "extra": None}])
    (first,) = sink.pre_commit(1)
    sink.write([["c", 3, None]])
    staged = sink.pre_commit(2)
    assert [t.checkpoint_id for t in staged] == [1, 2]  # 1 is not committed yet
    assert _rows(sql_url) == []  # staged only: nothing visible
    sink.commit_up_to(1)
    assert [r[1] for r in _rows(sql_url)] == [1, 2]
    # a restore commits what the checkpoint staged again: a no-op for what landed
    again = spec.publisher({})
    assert publish_staged(state, again, first) is False
    assert publish_staged(state, again, staged[1]) is True
    assert publish_staged(state, again, staged[1]) is False
    again.close()
    sink.publisher.close()
    assert [r[1] for r in _rows(sql_url)] == [1, 2, 3]


def test_sql_sink_rejects_a_record_that_does_not_fit(tmp_path: Path) -> None:
    state = FileIO(str(tmp_path / "store"))
    spec = SqlSink(f"sqlite:///{tmp_path}/o.db", "out", COLUMNS)
    sink = TransactionalSink(state, spec.publisher({}), "job", "out", 0)
    sink.write([["only", "two"]])
    sink.pre_commit(1)
    with pytest.raises(SinkError, match="does not fit"):
        sink.commit_up_to(1)
    with pytest.raises(ConfigError, match="type 'varchar'"):
        SqlSink("sqlite://", "t", (("a", "varchar"),))


def test_unreachable_database_is_a_sink_error() -> None:
    with pytest.raises(SinkError, match="SQL sink"):
        SqlSink("postgresql+psycopg://nobody@127.0.0.1:1/none", "t", COLUMNS).publisher({})


def test_file_and_collect_sinks_publish_once(tmp_path: Path) -> None:
    state = FileIO(str(tmp_path / "store"))
    collect = CollectSink()
    for i, factory in enumerate((FileSink(str(tmp_path / "out")), collect)):
        sink = TransactionalSink(state, factory.publisher({}), "job", f"s{i}", 0)
        sink.write([[1], [2]])
        (txn,) = sink.pre_commit(7)
        sink.commit_up_to(7)
        assert publish_staged(state, factory.publisher({}), txn) is False
    assert read_output(FileIO(str(tmp_path / "out"))) == [[1], [2]]
    assert collect.records == [[1], [2]]
