"""Offline compactions registered in the metadata store, until the pipeline decides on them.

An offline compaction (``statectl compact``, :mod:`tools.spark.compact`) folds a
checkpoint's materialized tables and log into new ones and registers one row per operator
subtask: a :class:`~backends.handles.MaterializationHandle` that covers every writer the
subtask's state was built from, and the files it references. Life of a row::

    register   one transaction, checked against the job's newest record: refused
               (CompactionSupersededError, nothing written) if that rests on newer state
      -> the running job's task sees it at a barrier and adopts it (its checkpoints
         reference the handle from then on) or refuses it (its state moved past it)
      -> a completed checkpoint decides, in the transaction that records it: the row goes
         when the checkpoint references every file of it (adopted), or rests on newer
         state or another layout (superseded: its files are released like a subsumed
         checkpoint's, and deleted by the coordinator)

While a row exists, its files count as referenced for retention, :meth:`unreferenced` and
the orphan sweep, so a registered compaction's files never go away under a task about to
adopt it; after it was adopted, the checkpoints that reference it own them. A row of a job
that never runs again stays (its files too) until that job runs.

Why rows and not a checkpoint record: a compaction of checkpoint C finishes while the job
has completed newer checkpoints; a record with a higher id than those but the state of C
would be restored as the latest and replay the sources from C's offsets.

Tables are defined on their own ``MetaData``; :mod:`coordinator.metadata` creates them in
schema migration 4 and calls these functions inside its transactions. Pure SQL helpers:
no state, any thread.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from backends.handles import KeyedStateHandle, MaterializationHandle, replacement_problem
from dstl.errors import CorruptionError, MetadataCorruptError
from dstl.handles import handle_from_json, handle_to_json

_cmd = sa.MetaData()

compactions = sa.Table(
    "compactions",
    _cmd,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("compaction_id", sa.BigInteger, primary_key=True),
    sa.Column("operator", sa.String(200), primary_key=True),
    sa.Column("subtask", sa.Integer, primary_key=True),
    sa.Column("source_checkpoint_id", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("handle", sa.Text, nullable=False),
)

compaction_refs = sa.Table(
    "compaction_refs",
    _cmd,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("compaction_id", sa.BigInteger, primary_key=True),
    sa.Column("operator", sa.String(200), primary_key=True),
    sa.Column("subtask", sa.Integer, primary_key=True),
    sa.Column("location", sa.String(1000), primary_key=True),
    sa.Index("ix_compaction_refs_location", "location"),
)

Slot = tuple[str, int]
"""An operator subtask: ``(operator, subtask)``."""


@dataclass(frozen=True, slots=True)
class RegisteredCompaction:
    """One subtask's part of a registered, undecided compaction."""

    job_id: str
    compaction_id: int
    operator: str
    subtask: int
    source_checkpoint_id: int
    created_at: float
    handle: MaterializationHandle


def migrate_to_4(conn: Connection) -> None:
    """v4: the registry of offline compactions (``compactions``, ``compaction_refs``)."""
    for table in (compactions, compaction_refs):
        table.create(conn, checkfirst=True)


def keyed_handles(
    subtasks: Iterable[tuple[str, int, Sequence[object]]],
) -> dict[Slot, KeyedStateHandle]:
    """``(operator, subtask) -> keyed state handle`` of a checkpoint's subtask states."""
    out: dict[Slot, KeyedStateHandle] = {}
    for operator, subtask, handles in subtasks:
        for h in handles:
            if isinstance(h, KeyedStateHandle):
                out.setdefault((operator, subtask), h)
    return out


def superseded(handle: MaterializationHandle, state: KeyedStateHandle | None) -> str | None:
    """Why ``handle`` can no longer replace the base of ``state`` (None: it still can)."""
    if state is None:
        return "the job no longer has this subtask (it was rescaled)"
    return replacement_problem(handle, state.key_group_range, state.materialized, state.changelog)


def _row(r: sa.Row[tuple[object, ...]]) -> RegisteredCompaction:
    try:
        handle = handle_from_json(json.loads(str(r.handle)))
        if not isinstance(handle, MaterializationHandle):
            raise TypeError(f"a {type(handle).__name__}, not a materialization")
    except (ValueError, TypeError, CorruptionError) as exc:
        raise MetadataCorruptError(
            f"damaged compaction record {r.compaction_id} of {r.operator}/{r.subtask} ({exc})"
        ) from exc
    return RegisteredCompaction(
        str(r.job_id),
        int(str(r.compaction_id)),
        str(r.operator),
        int(str(r.subtask)),
        int(str(r.source_checkpoint_id)),
        float(str(r.created_at)),
        handle,
    )


_PENDING_ORDER = (
    compactions.c.source_checkpoint_id.desc(),
    compactions.c.compaction_id.desc(),
    compactions.c.operator,
    compactions.c.subtask,
)
_PENDING = (
    sa.select(compactions)
    .where(
        compactions.c.job_id == sa.bindparam("job"),
        compactions.c.compaction_id > sa.bindparam("after", type_=sa.BigInteger),
    )
    .order_by(*_PENDING_ORDER)
)


def pending(
    conn: Connection,
    job_id: str,
    slot: Slot | None = None,
    after_id: int = 0,
) -> list[RegisteredCompaction]:
    """Undecided rows of ``job_id`` (of one subtask if ``slot``) with an id above
    ``after_id``: the newest source checkpoint first."""
    if slot is None:  # every record asks: the statement is built once
        return [_row(r) for r in conn.execute(_PENDING, {"job": job_id, "after": after_id})]
    query = sa.select(compactions).where(
        compactions.c.job_id == job_id,
        compactions.c.compaction_id > after_id,
        compactions.c.operator == slot[0],
        compactions.c.subtask == slot[1],
    )
    return [_row(r) for r in conn.execute(query.order_by(*_PENDING_ORDER))]


def register(
    conn: Connection,
    job_id: str,
    source_checkpoint_id: int,
    latest: Mapping[Slot, KeyedStateHandle],
    proposals: Mapping[Slot, MaterializationHandle],
    now: float,
) -> tuple[int | None, str]:
    """Insert ``proposals`` as one compaction unless ``latest`` (the job's newest record's
    keyed state) or an undecided compaction of a source at least as new supersedes one
    of them: ``(compaction id, "")``, or ``(None, why)`` and nothing inserted.

    The caller holds the job's row lock, so no checkpoint is recorded meanwhile.
    """
    for slot, handle in sorted(proposals.items()):
        why = superseded(handle, latest.get(slot))
        if why is not None:
            return None, f"{slot[0]}/{slot[1]}: {why}"
    for other in pending(conn, job_id):
        if (other.operator, other.subtask) in proposals and (
            other.source_checkpoint_id >= source_checkpoint_id
        ):
            return None, (
                f"{other.operator}/{other.subtask}: compaction {other.compaction_id} of "
                f"checkpoint {other.source_checkpoint_id} is as new and not yet adopted"
            )
    top = conn.execute(
        sa.select(sa.func.max(compactions.c.compaction_id)).where(compactions.c.job_id == job_id)
    ).scalar()
    compaction_id = int(top or 0) + 1
    conn.execute(
        sa.insert(compactions),
        [
            {
                "job_id": job_id,
                "compaction_id": compaction_id,
                "operator": operator,
                "subtask": subtask,
                "source_checkpoint_id": source_checkpoint_id,
                "created_at": now,
                "handle": json.dumps(handle_to_json(handle), sort_keys=True),
            }
            for (operator, subtask), handle in sorted(proposals.items())
        ],
    )
    refs = [
        {
            "job_id": job_id,
            "compaction_id": compaction_id,
            "operator": operator,
            "subtask": subtask,
            "location": f,
        }
        for (operator, subtask), handle in sorted(proposals.items())
        for f in sorted(set(handle.files()))
    ]
    if refs:
        conn.execute(sa.insert(compaction_refs), refs)
    return compaction_id, ""


def decide(
    conn: Connection, job_id: str, state: Mapping[Slot, KeyedStateHandle], files: set[str]
) -> tuple[list[str], list[RegisteredCompaction]]:
    """Drop the rows a newly recorded checkpoint (its keyed ``state`` and ``files``)
    decides; returns the dropped rows' files that no checkpoint references (candidates:
    the caller removes those another row still references), and the rows left undecided
    (as :func:`pending` orders them)."""
    dropped: list[RegisteredCompaction] = []
    kept: list[RegisteredCompaction] = []
    for row in pending(conn, job_id):
        adopted = set(row.handle.files()) <= files
        if adopted or superseded(row.handle, state.get((row.operator, row.subtask))):
            dropped.append(row)
        else:
            kept.append(row)
    released: set[str] = set()
    for row in dropped:
        for table in (compactions, compaction_refs):
            conn.execute(
                sa.delete(table).where(
                    table.c.job_id == job_id,
                    table.c.compaction_id == row.compaction_id,
                    table.c.operator == row.operator,
                    table.c.subtask == row.subtask,
                )
            )
        released.update(f for f in row.handle.files() if f not in files)
    return sorted(released), kept


def referenced(conn: Connection, locations: Iterable[str]) -> set[str]:
    """Those of ``locations`` an undecided compaction references."""
    wanted = sorted(set(locations))
    if not wanted:
        return set()
    return {
        r[0]
        for r in conn.execute(
            sa.select(compaction_refs.c.location)
            .where(compaction_refs.c.location.in_(wanted))
            .distinct()
        )
    }


def all_referenced(conn: Connection) -> set[str]:
    """Every file an undecided compaction references."""
    return {r[0] for r in conn.execute(sa.select(compaction_refs.c.location).distinct())}
