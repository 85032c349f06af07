"""A SQL table sink through SQLAlchemy, committed like the file sink (two-phase).

Staged transactions are the file sink's (JSON lines in the state store, part of the
checkpoint); publishing one inserts its rows into the table *and* a marker row keyed by
the staged file's location into ``changelog_state_sink_commits``, in one database
transaction. A second publish of the same transaction (after a crash between commit and
notification, or on restore) finds the marker and inserts nothing: exactly once. Works
on any SQLAlchemy URL (SQLite, PostgreSQL through ``postgresql+psycopg://``).

A record becomes a row by column name (a dict) or by position (a list or tuple).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from coordinator.errors import SinkError
from coordinator.handles import SinkTransactionHandle
from coordinator.metadata import one_line, safe_url
from coordinator.sink import decode_lines
from dstl.errors import ConfigError

MARKERS = "changelog_state_sink_commits"

#: column types a table sink declares, by name
TYPES: dict[str, Any] = {
    "text": sa.Text,
    "bigint": sa.BigInteger,
    "double": lambda: sa.Float(53),
    "boolean": sa.Boolean,
    "json": sa.JSON,
}


@dataclass(frozen=True, slots=True)
class SqlSink:
    """Rows go to ``table`` at ``url``; ``columns`` are ``(name, type)`` pairs with a type
    from :data:`TYPES`. The table is created if it does not exist."""

    url: str
    table: str
    columns: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.columns:
            raise ConfigError("a SQL sink needs at least one column")
        for name, kind in self.columns:
            if kind not in TYPES:
                raise ConfigError(
                    f"SQL sink column {name!r}: type {kind!r} is not one of {', '.join(TYPES)}"
                )

    def publisher(self, storage_options: dict[str, Any]) -> SqlPublisher:
        return SqlPublisher(self)


class SqlPublisher:
    """Inserts committed transactions into the table. One connection per publish; the
    engine's pool is thread-safe, so the restore and the sink task may share it."""

    def __init__(self, sink: SqlSink) -> None:
        self._sink = sink
        self._names = [name for name, _ in sink.columns]
        connect_args = {"timeout": 30} if sink.url.startswith("sqlite") else {}
        md = sa.MetaData()
        self.table = sa.Table(sink.table, md, *(sa.Column(n, TYPES[t]()) for n, t in sink.columns))
        self.markers = sa.Table(
            MARKERS,
            md,
            sa.Column("txn", sa.String(1000), primary_key=True),
            sa.Column("table_name", sa.String(200), nullable=False),
            sa.Column("records", sa.Integer, nullable=False),
        )
        try:
            self.engine = sa.create_engine(sink.url, connect_args=connect_args)
            md.create_all(self.engine, checkfirst=True)
        except SQLAlchemyError as exc:
            raise SinkError(f"SQL sink {safe_url(sink.url)}: {one_line(exc)}") from exc

    def _rows(self, records: Sequence[Any]) -> list[dict[str, Any]]:
        rows = []
        for r in records:
            if isinstance(r, dict):
                rows.append({n: r.get(n) for n in self._names})
            elif isinstance(r, list | tuple) and len(r) == len(self._names):
                rows.append(dict(zip(self._names, r, strict=True)))
            else:
                raise SinkError(f"record {r!r} does not fit the columns {self._names}")
        return rows

    def publish(self, txn: SinkTransactionHandle, data: bytes) -> bool:
        rows = self._rows(decode_lines(data))
        marker = {"txn": txn.location, "table_name": self._sink.table, "records": len(rows)}
        try:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(self.markers).values(**marker))
                if rows:
                    conn.execute(sa.insert(self.table), rows)
        except IntegrityError as exc:
            if self.committed(txn):
                return False
            raise SinkError(f"SQL sink table {self._sink.table}: {one_line(exc)}") from exc
        except SQLAlchemyError as exc:
            raise SinkError(f"SQL sink {safe_url(self._sink.url)}: {one_line(exc)}") from exc
        return True

    def committed(self, txn: SinkTransactionHandle) -> bool:
        """Whether ``txn`` was published."""
        try:
            with self.engine.connect() as conn:
                found = conn.execute(
                    sa.select(self.markers.c.txn).where(self.markers.c.txn == txn.location)
                ).first()
        except SQLAlchemyError as exc:
            raise SinkError(f"SQL sink {safe_url(self._sink.url)}: {one_line(exc)}") from exc
        return found is not None

    def close(self) -> None:
        self.engine.dispose()
