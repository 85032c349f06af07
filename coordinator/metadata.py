"""The metadata store: completed checkpoints and file references, on SQLAlchemy.

SQLite file by default, PostgreSQL (``postgresql+psycopg://``) when several processes or
machines share it. The schema is versioned: :data:`MIGRATIONS` lists the steps from an
empty database to :data:`SCHEMA_VERSION`; opening a newer schema than this code knows is
an error, never a silent downgrade.

File references are global across jobs (a restored job references its predecessor's
files): a file is released exactly when no checkpoint row references it any more, and
releasing happens in the same transaction that records the checkpoint that subsumes it.
Deleting the bytes is the caller's job, afterwards.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from backends.handles import MaterializationHandle
from coordinator import compactions as compaction_registry
from coordinator.compactions import RegisteredCompaction
from coordinator.errors import (
    CompactionSupersededError,
    RecordSupersededError,
    SchemaVersionError,
)
from coordinator.handles import handle_from_json, handle_to_json
from dstl.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptionError,
    MetadataCorruptError,
    MetadataNotFoundError,
    MetadataStoreError,
    StateBackendError,
)
from dstl.integrity import FileRef
from dstl.layout import relative_of_url

SCHEMA_VERSION = 4

_md = sa.MetaData()

schema_version = sa.Table("schema_version", _md, sa.Column("version", sa.Integer, nullable=False))

jobs = sa.Table(
    "jobs",
    _md,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("last_checkpoint_id", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(20), nullable=False, server_default="running"),  # v2
)

checkpoints = sa.Table(
    "checkpoints",
    _md,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("checkpoint_id", sa.BigInteger, primary_key=True),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("triggered_at", sa.Float, nullable=False),
    sa.Column("completed_at", sa.Float, nullable=False),
    sa.Column("source_offsets", sa.Text, nullable=False),
    sa.Column("stats", sa.Text, nullable=False),
)

subtask_states = sa.Table(
    "subtask_states",
    _md,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("checkpoint_id", sa.BigInteger, primary_key=True),
    sa.Column("operator", sa.String(200), primary_key=True),
    sa.Column("subtask", sa.Integer, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
)

file_refs = sa.Table(
    "file_refs",
    _md,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("checkpoint_id", sa.BigInteger, primary_key=True),
    sa.Column("location", sa.String(1000), primary_key=True),
    sa.Index("ix_file_refs_location", "location"),
)


# Version 1's ``jobs`` table, frozen: migration 1 must create exactly what v1 code created,
# whatever the current table definitions say.
_v1_md = sa.MetaData()
_v1_jobs = sa.Table(
    "jobs",
    _v1_md,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("last_checkpoint_id", sa.BigInteger, nullable=False),
)

JOB_STATUSES = ("running", "finished", "failed")
ix_checkpoints_kind = sa.Index(
    "ix_checkpoints_kind", checkpoints.c.job_id, checkpoints.c.kind, checkpoints.c.checkpoint_id
)


def _migrate_to_1(conn: Connection) -> None:
    _v1_jobs.create(conn, checkfirst=True)
    for table in (checkpoints, subtask_states, file_refs):
        table.create(conn, checkfirst=True)


def _migrate_to_2(conn: Connection) -> None:
    """v2: ``jobs.status`` (running/finished/failed) and an index for retention by kind."""
    conn.execute(
        sa.text("ALTER TABLE jobs ADD COLUMN status VARCHAR(20) NOT NULL DEFAULT 'running'")
    )
    ix_checkpoints_kind.create(conn, checkfirst=True)


def _relativized(value: Any) -> Any:
    """``value`` (decoded handle JSON) with absolute ``location`` URLs made store-relative."""
    if isinstance(value, list):
        return [_relativized(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _relativized(v) for k, v in value.items()}
    location = out.get("location")
    if isinstance(location, str) and "://" in location:
        out["location"] = relative_of_url(location) or location
    return out


def _migrate_to_3(conn: Connection) -> None:
    """v3: file locations relative to the store root, so a store can be copied or moved.

    Rewrites every handle's absolute URL in ``subtask_states`` and ``file_refs`` to its
    store-relative tail (:func:`dstl.layout.relative_of_url`); a URL without the shape of
    a store file is kept (:meth:`dstl.fileio.FileIO.relative` still reads it in place).
    """
    rows = conn.execute(
        sa.select(
            subtask_states.c.job_id,
            subtask_states.c.checkpoint_id,
            subtask_states.c.operator,
            subtask_states.c.subtask,
            subtask_states.c.state,
        )
    ).all()
    for job_id, checkpoint_id, operator, subtask, text in rows:
        if "://" not in text:
            continue
        raw = json.loads(text)
        raw["handles"] = _relativized(raw.get("handles", []))
        conn.execute(
            sa.update(subtask_states)
            .where(
                subtask_states.c.job_id == job_id,
                subtask_states.c.checkpoint_id == checkpoint_id,
                subtask_states.c.operator == operator,
                subtask_states.c.subtask == subtask,
            )
            .values(state=json.dumps(raw, sort_keys=True))
        )
    urls = conn.execute(
        sa.select(file_refs.c.location).where(file_refs.c.location.like("%://%")).distinct()
    ).all()
    for (url,) in urls:
        moved = relative_of_url(url)
        if moved is not None:
            conn.execute(
                sa.update(file_refs).where(file_refs.c.location == url).values(location=moved)
            )


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _migrate_to_1,
    2: _migrate_to_2,
    3: _migrate_to_3,
    4: compaction_registry.migrate_to_4,
}


def create_schema(conn: Connection, version: int) -> None:
    """Run the migrations from an empty database up to ``version`` and record it.

    :class:`MetadataStore` calls this with :data:`SCHEMA_VERSION`; tests call it with an
    older version to build a database exactly as older code did.
    """
    schema_version.create(conn, checkfirst=True)
    for v in range(1, version + 1):
        MIGRATIONS[v](conn)
    conn.execute(sa.delete(schema_version))
    conn.execute(sa.insert(schema_version).values(version=version))


@dataclass(frozen=True, slots=True)
class SubtaskState:
    """What one operator subtask acknowledged: its handles, source offset and statistics."""

    operator: str
    subtask: int
    handles: tuple[Any, ...] = ()
    offset: Any = None
    stats: dict[str, Any] = field(default_factory=dict)

    def files(self) -> list[str]:
        """Every durable file the subtask's handles reference."""
        return [r.location for r in self.file_refs()]

    def file_refs(self) -> list[FileRef]:
        """Every durable file the subtask's handles reference, with size and hash."""
        out: dict[str, FileRef] = {}
        for h in self.handles:
            for r in h.file_refs():
                out.setdefault(r.location, r)
        return list(out.values())

    def to_json(self) -> str:
        """JSON text for the ``subtask_states`` row."""
        return json.dumps(
            {
                "handles": [handle_to_json(h) for h in self.handles],
                "offset": self.offset,
                "stats": self.stats,
            },
            sort_keys=True,
        )

    @classmethod
    def from_row(cls, operator: str, subtask: int, text: str) -> SubtaskState:
        """Inverse of :meth:`to_json`; a damaged row is a :class:`MetadataCorruptError`."""
        try:
            raw = json.loads(text)
            stats = raw.get("stats", {})
            if not isinstance(raw["handles"], list) or not isinstance(stats, dict):
                raise TypeError("handles must be a list and stats an object")
            return cls(
                operator,
                subtask,
                tuple(handle_from_json(h) for h in raw["handles"]),
                raw.get("offset"),
                stats,
            )
        except (ValueError, KeyError, TypeError, AttributeError, CorruptionError) as exc:
            raise MetadataCorruptError(
                f"damaged state record of {operator}/{subtask} ({one_line(exc)})"
            ) from exc


@dataclass(frozen=True, slots=True)
class CompletedCheckpoint:
    """A completed checkpoint (or savepoint) as recorded in the metadata store."""

    job_id: str
    checkpoint_id: int
    kind: str
    triggered_at: float
    completed_at: float
    subtasks: tuple[SubtaskState, ...]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def source_offsets(self) -> dict[str, Any]:
        """Offsets of every source subtask, by ``operator/subtask``."""
        return {
            f"{s.operator}/{s.subtask}": s.offset for s in self.subtasks if s.offset is not None
        }

    def states_of(self, operator: str) -> list[SubtaskState]:
        """The subtask states of one operator, by subtask index."""
        return sorted((s for s in self.subtasks if s.operator == operator), key=lambda s: s.subtask)

    def files(self) -> list[str]:
        """Every durable file the checkpoint references."""
        return [r.location for r in self.file_refs()]

    def file_refs(self) -> list[FileRef]:
        """Every durable file the checkpoint references, with size and content hash."""
        out: dict[str, FileRef] = {}
        for s in self.subtasks:
            for r in s.file_refs():
                out.setdefault(r.location, r)
        return list(out.values())


def _keyed(cp: CompletedCheckpoint) -> dict[tuple[str, int], Any]:
    """``(operator, subtask) -> KeyedStateHandle`` of ``cp``."""
    return compaction_registry.keyed_handles(
        (s.operator, s.subtask, s.handles) for s in cp.subtasks
    )


def _lock_job(conn: Connection, job_id: str) -> bool:
    """Take the job's row lock for the rest of the transaction (a no-op update: SQLite
    then holds its write lock, PostgreSQL the row's); False for an unknown job."""
    done = conn.execute(
        sa.update(jobs).where(jobs.c.job_id == job_id).values(attempt=jobs.c.attempt)
    )
    return bool(done.rowcount)


_ROWS_PER_INSERT = 2000  # well below SQLite's bound parameters per statement (32766)


def _insert_rows(conn: Connection, table: sa.Table, rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert ``rows`` (values of every column of ``table``, in order): one multi-row
    ``INSERT`` per :data:`_ROWS_PER_INSERT` rows, handed to the driver as it is (no
    statement compiled per call: a multi-row ``sa.insert().values()`` is compiled anew
    each time, most of a record's CPU). The driver gives the GIL up and takes it back
    at every statement it steps, so one statement per table, not one per row."""
    if not rows:
        return
    mark = {"qmark": "?", "format": "%s", "pyformat": "%s"}.get(conn.dialect.paramstyle)
    names = [c.name for c in table.columns]
    if mark is None:  # a driver with another parameter style: SQLAlchemy renders it
        conn.execute(sa.insert(table), [dict(zip(names, r, strict=True)) for r in rows])
        return
    one = "(" + ", ".join([mark] * len(names)) + ")"
    head = f"INSERT INTO {table.name} ({', '.join(names)}) VALUES "
    for start in range(0, len(rows), _ROWS_PER_INSERT):
        chunk = rows[start : start + _ROWS_PER_INSERT]
        conn.exec_driver_sql(
            head + ", ".join([one] * len(chunk)), tuple(v for r in chunk for v in r)
        )


# The record's statements, built once (building one costs more CPU than running it).
_NEXT_ID = (
    sa.update(jobs)
    .where(jobs.c.job_id == sa.bindparam("job"))
    .values(last_checkpoint_id=jobs.c.last_checkpoint_id + 1)
    .returning(jobs.c.last_checkpoint_id)
)
_NEWEST = sa.select(sa.func.max(checkpoints.c.checkpoint_id)).where(
    checkpoints.c.job_id == sa.bindparam("job")
)
_EXPIRED = (
    sa.select(checkpoints.c.checkpoint_id)
    .where(checkpoints.c.job_id == sa.bindparam("job"), checkpoints.c.kind == "checkpoint")
    .order_by(checkpoints.c.checkpoint_id.desc())
    .offset(sa.bindparam("retain", type_=sa.Integer))
)
_f, _g = file_refs.alias("f"), file_refs.alias("g")
_IDS: sa.BindParameter[list[int]] = sa.bindparam("ids", expanding=True)
_RELEASED = (  # files of checkpoints ``ids`` nothing else references
    sa.select(_f.c.location)
    .distinct()
    .where(
        _f.c.job_id == sa.bindparam("job"),
        _f.c.checkpoint_id.in_(_IDS),
        ~sa.select(_g.c.location)
        .where(
            _g.c.location == _f.c.location,
            sa.not_(sa.and_(_g.c.job_id == sa.bindparam("job"), _g.c.checkpoint_id.in_(_IDS))),
        )
        .exists(),
        ~sa.select(compaction_registry.compaction_refs.c.location)
        .where(compaction_registry.compaction_refs.c.location == _f.c.location)
        .exists(),
    )
)
_DELETES = [
    sa.delete(t).where(t.c.job_id == sa.bindparam("job"), t.c.checkpoint_id.in_(_IDS))
    for t in (file_refs, subtask_states, checkpoints)
]

MAX_ID = (1 << 63) - 1
"""The largest checkpoint id the schema holds (a signed 64-bit ``BIGINT``)."""


def _checkpoint_of(row: Any, subtasks: tuple[SubtaskState, ...]) -> CompletedCheckpoint:
    """A ``checkpoints`` row as a record; a damaged row is a :class:`MetadataCorruptError`."""
    try:
        stats = json.loads(row.stats)
        if not isinstance(stats, dict):
            raise TypeError("stats must be an object")
        return CompletedCheckpoint(
            str(row.job_id),
            int(row.checkpoint_id),
            str(row.kind),
            float(row.triggered_at),
            float(row.completed_at),
            subtasks,
            stats,
        )
    except (ValueError, TypeError) as exc:
        raise MetadataCorruptError(
            f"damaged record of checkpoint {row.checkpoint_id} of job {row.job_id} ({exc})"
        ) from exc


@dataclass(frozen=True, slots=True)
class Retention:
    """What recording a checkpoint removed: checkpoint ids and now unreferenced files."""

    removed_ids: tuple[int, ...]
    released: list[str]


_SQLITE_DAMAGED = ("file is not a database", "database disk image is malformed", "malformed")
_SECRET_KEYS = re.compile(r"pass|secret|token|credential|key", re.IGNORECASE)


def safe_url(url: str) -> str:
    """``url`` with its password and secret-looking query values replaced by ``***``.

    For every error and log line that names a metadata store: a password belongs in the
    URL's user info or in a query parameter (``?password=...``), and neither is printed.
    """
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return "<an unparsable URL>"  # no telling which part of it is a secret
    query = {k: ("***" if _SECRET_KEYS.search(k) else v) for k, v in parsed.query.items()}
    if parsed.password is not None:
        parsed = parsed.set(password="***")
    return parsed.set(query=query).render_as_string(hide_password=False)


def url_secrets(url: str) -> list[str]:
    """The password and secret-looking query values of ``url`` (to mask them anywhere)."""
    try:
        parsed = sa.engine.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return [url]  # unparsable: all of it may be a secret
    secrets = [str(v) for k, v in parsed.query.items() if _SECRET_KEYS.search(k)]
    if parsed.password:
        secrets.append(str(parsed.password))
    return [s for s in secrets if s]


def safe_text(text: str, url: str) -> str:
    """``text`` (a driver's error message) with the secrets of ``url`` replaced by ``***``."""
    for secret in sorted(url_secrets(url), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def one_line(exc: BaseException) -> str:
    """An error as one line: drivers' multi-line messages and doc links folded away."""
    lines = [
        ln.strip()
        for ln in str(exc).splitlines()
        if ln.strip() and not ln.startswith("(Background")
    ]
    return " ".join(lines) or type(exc).__name__


SCHEMA_LOCK = 0x5354_4154_4531  # PostgreSQL advisory lock key held while checking the schema


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")  # a completed checkpoint must survive power loss
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


class MetadataStore:
    """Completed checkpoints, job records and file references in one SQL database.

    Thread-safe: each method runs in its own transaction on a pooled connection; no
    mutable state besides the engine. ``create=False`` opens only an existing store
    (what the CLI does) and raises :class:`MetadataStoreError` otherwise. The URL's
    password never appears in an error or log line (:func:`safe_url`).
    """

    def __init__(self, url: str, create: bool = True) -> None:
        self.url = url
        try:
            engine_url = sa.engine.make_url(url)
        except (sa.exc.ArgumentError, ValueError) as exc:  # ValueError: a non-numeric port
            raise ConfigError(f"invalid metadata URL {safe_url(url)}: {exc}") from exc
        self._sqlite = engine_url.get_backend_name() == "sqlite"
        if self._sqlite and engine_url.database and engine_url.database != ":memory:":
            path = engine_url.database
            if not create and not os.path.exists(path):
                raise MetadataNotFoundError(f"no metadata store at {path}")
            if create:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            self.engine: Engine = sa.create_engine(url, future=True, pool_pre_ping=not self._sqlite)
        except (sa.exc.ArgumentError, ImportError) as exc:  # unknown dialect, missing driver
            raise ConfigError(
                f"cannot open metadata store {safe_url(url)}: {safe_text(str(exc), url)}"
            ) from exc
        if self._sqlite:
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._ensure_schema(create)

    @classmethod
    def for_local_store(cls, store_dir: str, create: bool = True) -> MetadataStore:
        """The default SQLite store inside a local store directory."""
        return cls(
            "sqlite:///" + os.path.join(os.path.abspath(store_dir), "metadata.db"), create=create
        )

    def close(self) -> None:
        """Release pooled connections."""
        self.engine.dispose()

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except StateBackendError:
            raise
        except sa.exc.SQLAlchemyError as exc:
            text = safe_text(f"{exc.__class__.__name__}: {exc}", self.url)
            if self._sqlite and any(m in text for m in _SQLITE_DAMAGED):
                raise MetadataCorruptError(
                    f"metadata store {self._safe_url()} is damaged or not a database ({text})"
                ) from exc
            raise MetadataStoreError(f"metadata store {self._safe_url()} failed: {text}") from exc

    def _safe_url(self) -> str:
        return safe_url(self.url)

    def _ensure_schema(self, create: bool) -> None:
        with self._tx() as conn:
            if conn.dialect.name == "postgresql":
                # Processes sharing a database open it at once: one creates or migrates
                # the schema, the others wait here and then find it current.
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEMA_LOCK})
            insp = sa.inspect(conn)
            current = 0
            if insp.has_table("schema_version"):
                row = conn.execute(sa.select(schema_version.c.version)).first()
                current = int(row[0]) if row else 0
            if current > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"metadata schema version {current} is newer than this code ({SCHEMA_VERSION})"
                )
            if current == SCHEMA_VERSION:
                return
            if current == 0:
                if not create and self._sqlite:  # the file is there, and not ours
                    raise MetadataCorruptError(f"{self._safe_url()} is not a metadata store")
                if not create:
                    raise MetadataNotFoundError(f"{self._safe_url()} holds no metadata store")
                create_schema(conn, SCHEMA_VERSION)
                return
            # In place, in this one transaction (PostgreSQL and SQLite both have
            # transactional DDL): a failed step leaves the old version intact.
            for version in range(current + 1, SCHEMA_VERSION + 1):
                MIGRATIONS[version](conn)
            conn.execute(sa.update(schema_version).values(version=SCHEMA_VERSION))

    # -- jobs and checkpoint ids ------------------------------------------------------
    def start_attempt(self, job_id: str) -> int:
        """Register a (re)start of ``job_id``; returns its attempt number (0 first)."""
        with self._tx() as conn:
            row = conn.execute(sa.select(jobs.c.attempt).where(jobs.c.job_id == job_id)).first()
            if row is None:
                conn.execute(
                    sa.insert(jobs).values(
                        job_id=job_id, created_at=time.time(), attempt=0, last_checkpoint_id=0
                    )
                )
                return 0
            attempt = int(row[0]) + 1
            conn.execute(
                sa.update(jobs)
                .where(jobs.c.job_id == job_id)
                .values(attempt=attempt, status="running")
            )
            return attempt

    def set_job_status(self, job_id: str, status: str) -> None:
        """Record how the job's latest attempt ended (``running``/``finished``/``failed``)."""
        if status not in JOB_STATUSES:
            raise MetadataStoreError(f"unknown job status {status!r}: use one of {JOB_STATUSES}")
        with self._tx() as conn:
            conn.execute(sa.update(jobs).where(jobs.c.job_id == job_id).values(status=status))

    def job_status(self, job_id: str) -> str | None:
        """The job's status, or None for an unknown job."""
        with self._tx() as conn:
            row = conn.execute(sa.select(jobs.c.status).where(jobs.c.job_id == job_id)).first()
            return None if row is None else str(row[0])

    def job_ids(self) -> builtins.list[str]:
        """Every job the store knows, sorted."""
        with self._tx() as conn:
            return [r[0] for r in conn.execute(sa.select(jobs.c.job_id).order_by(jobs.c.job_id))]

    def next_checkpoint_id(self, job_id: str) -> int:
        """Reserve the next checkpoint id: strictly increasing, never reused, across restarts."""
        with self._tx() as conn:
            return self._next_id(conn, job_id)

    def reserve_checkpoint(
        self, job_id: str, compactions_after: int
    ) -> tuple[int, builtins.list[RegisteredCompaction]]:
        """The next checkpoint id (as :meth:`next_checkpoint_id`) and, in the same
        transaction, the job's undecided compactions with an id above
        ``compactions_after`` (as :meth:`pending_compactions`): what the coordinator asks
        once per trigger, so no task looks compactions up at its barrier."""
        with self._tx() as conn:
            checkpoint_id = self._next_id(conn, job_id)
            return checkpoint_id, compaction_registry.pending(conn, job_id, None, compactions_after)

    @staticmethod
    def _next_id(conn: Connection, job_id: str) -> int:
        row = conn.execute(_NEXT_ID, {"job": job_id}).first()
        if row is None:
            raise MetadataStoreError(f"unknown job {job_id!r}: call start_attempt first")
        return int(row[0])

    # -- completed checkpoints --------------------------------------------------------
    def add_completed(self, checkpoint: CompletedCheckpoint, retain: int) -> list[str]:
        """Record ``checkpoint`` and apply retention; returns the released files.

        See :meth:`record_completed`; the caller deletes the returned files afterwards.
        """
        return self.record_completed(checkpoint, retain).released

    def record_completed(self, checkpoint: CompletedCheckpoint, retain: int) -> Retention:
        """Record ``checkpoint`` and apply retention, in one transaction.

        Keeps the newest ``retain`` regular checkpoints of the job (savepoints are never
        removed here). Returns the removed checkpoint ids and the files no longer
        referenced by any checkpoint of any job: the caller deletes them after this returns.
        """
        with self._tx() as conn:
            return self._record(conn, checkpoint, retain, reserve=False)[0]

    def record_completed_and_reserve(
        self, checkpoint: CompletedCheckpoint, retain: int, compactions_after: int = 0
    ) -> tuple[Retention, int, builtins.list[RegisteredCompaction]]:
        """:meth:`record_completed`, and in the same transaction reserve the job's next
        checkpoint id (:meth:`next_checkpoint_id`) and look up the job's undecided
        compactions with an id above ``compactions_after`` (as
        :meth:`pending_compactions`): the coordinator's next trigger then reads and writes
        nothing (one commit, one sync to disk, per checkpoint)."""
        with self._tx() as conn:
            retention, next_id, undecided = self._record(conn, checkpoint, retain, reserve=True)
            assert next_id is not None
            return retention, next_id, [c for c in undecided if c.compaction_id > compactions_after]

    def _record(
        self, conn: Connection, cp: CompletedCheckpoint, retain: int, reserve: bool
    ) -> tuple[Retention, int | None, builtins.list[RegisteredCompaction]]:
        """The coordinator's commit, on its critical path: a dozen statements, each
        stepped once (rows come back only for what is released), because the driver
        gives the GIL up at every step and a busy task thread holds it a switch
        interval before it hands it back; the files are listed once.

        Records land with increasing ids: a record below the job's newest one (a
        savepoint ``statectl`` took and recorded after this checkpoint's id was
        reserved) is refused with :class:`RecordSupersededError`, writing nothing; the
        job's row lock is held from the first statement on, so the check holds until
        the commit."""
        if retain < 1:
            raise MetadataStoreError("retain must be >= 1")
        next_id = None
        if reserve:  # the job's row lock as well (see _lock_job)
            next_id = self._next_id(conn, cp.job_id)
        else:
            _lock_job(conn, cp.job_id)
        newest = conn.execute(_NEWEST, {"job": cp.job_id}).scalar()
        if newest is not None and int(newest) >= cp.checkpoint_id:
            raise RecordSupersededError(
                f"checkpoint {cp.checkpoint_id} of job {cp.job_id} not recorded: "
                f"{newest} is recorded already"
            )
        files = cp.files()
        self._insert(conn, cp, files)
        found = conn.execute(_EXPIRED, {"job": cp.job_id, "retain": retain})
        expired = [int(r[0]) for r in found]
        released = set(self._remove(conn, cp.job_id, expired))
        decided, undecided = compaction_registry.decide(conn, cp.job_id, _keyed(cp), set(files))
        released.update(self._unreferenced(conn, decided))
        return Retention(tuple(sorted(expired)), sorted(released)), next_id, undecided

    def record_savepoint(self, savepoint: CompletedCheckpoint) -> None:
        """Record a savepoint made outside the coordinator (``statectl savepoint``).

        One transaction, no retention: a savepoint never expires a checkpoint and is
        never expired itself. Its id must come from :meth:`next_checkpoint_id`.
        """
        if savepoint.kind != "savepoint":
            raise MetadataStoreError(f"record_savepoint: kind {savepoint.kind!r}")
        with self._tx() as conn:
            self._insert(conn, savepoint, savepoint.files())

    @staticmethod
    def _insert(conn: Connection, cp: CompletedCheckpoint, files: Sequence[str]) -> None:
        """Insert the rows of ``cp``: checkpoint, subtask states, file references
        (``files``: ``cp.files()``)."""
        _insert_rows(
            conn,
            checkpoints,
            [
                (
                    cp.job_id,
                    cp.checkpoint_id,
                    cp.kind,
                    cp.triggered_at,
                    cp.completed_at,
                    json.dumps(cp.source_offsets, sort_keys=True),
                    json.dumps(cp.stats, sort_keys=True),
                )
            ],
        )
        _insert_rows(
            conn,
            subtask_states,
            [
                (cp.job_id, cp.checkpoint_id, s.operator, s.subtask, s.to_json())
                for s in cp.subtasks
            ],
        )
        _insert_rows(conn, file_refs, [(cp.job_id, cp.checkpoint_id, f) for f in files])

    def _remove(self, conn: Connection, job_id: str, ids: Sequence[int]) -> list[str]:
        """Delete the records of checkpoints ``ids``; returns their files that nothing
        else references (no other checkpoint, no undecided compaction). Those are found
        in one query before the deletes, so only they come back as rows."""
        if not ids:
            return []
        released = [r[0] for r in conn.execute(_RELEASED, {"job": job_id, "ids": list(ids)})]
        for delete in _DELETES:
            conn.execute(delete, {"job": job_id, "ids": list(ids)})
        return sorted(released)

    @staticmethod
    def _unreferenced(conn: Connection, candidates: Iterable[str]) -> list[str]:
        """Those of ``candidates`` no checkpoint and no undecided compaction references."""
        wanted = sorted(set(candidates))
        if not wanted:
            return []
        still = {
            r[0]
            for r in conn.execute(
                sa.select(file_refs.c.location).where(file_refs.c.location.in_(wanted))
            )
        }
        still |= compaction_registry.referenced(conn, wanted)
        return sorted(set(wanted) - still)

    def remove_checkpoint(self, job_id: str, checkpoint_id: int) -> list[str]:
        """Delete one checkpoint's record; returns the files nothing references any more."""
        with self._tx() as conn:
            return self._remove(conn, job_id, [checkpoint_id])

    def _load(self, conn: Connection, row: Any) -> CompletedCheckpoint:
        subtasks = tuple(
            SubtaskState.from_row(r.operator, r.subtask, r.state)
            for r in conn.execute(
                sa.select(subtask_states)
                .where(
                    subtask_states.c.job_id == row.job_id,
                    subtask_states.c.checkpoint_id == row.checkpoint_id,
                )
                .order_by(subtask_states.c.operator, subtask_states.c.subtask)
            )
        )
        return _checkpoint_of(row, subtasks)

    def get(self, job_id: str | None, checkpoint_id: int) -> CompletedCheckpoint:
        """One checkpoint; :class:`CheckpointNotFoundError` if there is none with that id."""
        if not 0 <= checkpoint_id <= MAX_ID:  # SQL's BIGINT: no such id can exist
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id} does not exist")
        with self._tx() as conn:
            query = sa.select(checkpoints).where(checkpoints.c.checkpoint_id == checkpoint_id)
            if job_id is not None:
                query = query.where(checkpoints.c.job_id == job_id)
            rows = conn.execute(query).all()
            if not rows:
                raise CheckpointNotFoundError(
                    f"checkpoint {checkpoint_id} does not exist in {self._safe_url()}"
                )
            if len(rows) > 1:
                raise CheckpointNotFoundError(
                    f"checkpoint {checkpoint_id} exists in several jobs: name one with --job"
                )
            return self._load(conn, rows[0])

    def latest(self, job_id: str, kind: str | None = None) -> CompletedCheckpoint | None:
        """The newest completed checkpoint or savepoint of ``job_id`` (only of ``kind``,
        ``"checkpoint"`` or ``"savepoint"``, if given), if any."""
        query = sa.select(checkpoints).where(checkpoints.c.job_id == job_id)
        if kind is not None:
            query = query.where(checkpoints.c.kind == kind)
        with self._tx() as conn:
            row = conn.execute(query.order_by(checkpoints.c.checkpoint_id.desc()).limit(1)).first()
            return None if row is None else self._load(conn, row)

    def list(self, job_id: str | None = None) -> list[CompletedCheckpoint]:
        """Every retained checkpoint (all jobs unless ``job_id``), oldest first, without states."""
        with self._tx() as conn:
            query = sa.select(checkpoints).order_by(
                checkpoints.c.job_id, checkpoints.c.checkpoint_id
            )
            if job_id is not None:
                query = query.where(checkpoints.c.job_id == job_id)
            return [_checkpoint_of(r, ()) for r in conn.execute(query)]

    def unreferenced(self, files: Sequence[str]) -> builtins.list[str]:
        """Those of ``files`` that no retained checkpoint or savepoint references (nor an
        undecided offline compaction)."""
        if not files:
            return []
        with self._tx() as conn:
            return self._unreferenced(conn, files)

    def referenced_files(self) -> set[str]:
        """Every file any retained checkpoint (or undecided compaction) references (for
        the orphan sweep)."""
        with self._tx() as conn:
            found = {r[0] for r in conn.execute(sa.select(file_refs.c.location).distinct())}
            return found | compaction_registry.all_referenced(conn)

    # -- offline compactions (see coordinator.compactions) ------------------------------
    def register_compaction(
        self,
        job_id: str,
        source_checkpoint_id: int,
        proposals: Mapping[tuple[str, int], MaterializationHandle],
    ) -> int:
        """Register a compaction of checkpoint ``source_checkpoint_id``: per ``(operator,
        subtask)`` the materialization that is to replace its base. Returns its id.

        One transaction, holding the job's row lock (no checkpoint is recorded meanwhile):
        raises :class:`CompactionSupersededError`, registering nothing, if the job's newest
        record rests on newer state for any of them, or another undecided compaction of a
        source at least as new exists for one.
        """
        with self._tx() as conn:
            if not _lock_job(conn, job_id):
                raise CheckpointNotFoundError(f"unknown job {job_id!r}")
            row = conn.execute(
                sa.select(checkpoints)
                .where(checkpoints.c.job_id == job_id)
                .order_by(checkpoints.c.checkpoint_id.desc())
                .limit(1)
            ).first()
            latest = {} if row is None else _keyed(self._load(conn, row))
            compaction_id, why = compaction_registry.register(
                conn, job_id, source_checkpoint_id, latest, proposals, time.time()
            )
        if compaction_id is None:
            raise CompactionSupersededError(
                f"compaction of checkpoint {source_checkpoint_id} of job {job_id} registered "
                f"nothing: {why}"
            )
        return compaction_id

    def pending_compactions(
        self,
        job_id: str,
        operator: str | None = None,
        subtask: int | None = None,
        after_id: int = 0,
    ) -> builtins.list[RegisteredCompaction]:
        """Undecided compactions of ``job_id`` (of one subtask if ``operator`` and
        ``subtask`` are given) with an id above ``after_id``, newest source first."""
        slot = None if operator is None or subtask is None else (operator, subtask)
        with self._tx() as conn:
            return compaction_registry.pending(conn, job_id, slot, after_id)
