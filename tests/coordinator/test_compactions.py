"""The registry of offline compactions, on SQLite and on a real PostgreSQL server.

A registered compaction's files are referenced until a completed checkpoint decides on
it: adopted (the checkpoint references them) or superseded (its files are released like
a subsumed checkpoint's). A compaction that a newer record supersedes registers nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from coordinator.errors import CompactionSupersededError
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl.handles import ChangelogHandle

JOB = "job"


@pytest.fixture
def store(metadata_url: str) -> Iterator[MetadataStore]:
    s = MetadataStore(metadata_url)
    s.start_attempt(JOB)
    yield s
    s.close()


def _log(writer: str, start: int, end: int) -> ChangelogHandle:
    return ChangelogHandle(
        f"jobs/{JOB}/changelog/w/{start:016x}-a.parquet", 0, writer, start, end, 1, 9
    )


def _mat(writer: str, sqn: int, tag: str, kind: str = "materialized") -> MaterializationHandle:
    f = StateFileHandle(
        f"jobs/{JOB}/{kind}/op/0000/{sqn:016x}-{tag}/count.kg0000-0080.parquet",
        10,
        "sha256:" + "0" * 64,
    )
    return MaterializationHandle(writer, sqn, 0, 128, "heap-parquet", (f,))


def _cp(
    cid: int,
    base: tuple[MaterializationHandle, ...],
    logs: tuple[ChangelogHandle, ...],
    subtasks: int = 1,
) -> CompletedCheckpoint:
    states = tuple(
        SubtaskState("op", i, (KeyedStateHandle("w", 0, 128, "str", 128, base, logs),))
        for i in range(subtasks)
    )
    return CompletedCheckpoint(JOB, cid, "checkpoint", 1.0, 2.0, states)


def test_an_adopted_compaction_is_decided_by_the_checkpoint_that_references_it(
    store: MetadataStore,
) -> None:
    store.record_completed(_cp(1, (), (_log("w", 0, 5),)), retain=1)
    x = _mat("w", 5, "c1", "compacted")
    cid = store.register_compaction(JOB, 1, {("op", 0): x})
    [pending] = store.pending_compactions(JOB, "op", 0)
    assert (pending.compaction_id, pending.source_checkpoint_id, pending.handle) == (cid, 1, x)
    assert store.pending_compactions(JOB, "op", 0, after_id=cid) == []
    assert x.files()[0] in store.referenced_files()
    assert store.unreferenced(x.files()) == []
    # the task adopted it: checkpoint 2 rests on it, checkpoint 1's log is released
    retention = store.record_completed(_cp(2, (x,), (_log("w", 5, 8),)), retain=1)
    assert retention.released == [_log("w", 0, 5).location]
    assert store.pending_compactions(JOB) == []
    assert x.files()[0] in store.referenced_files()  # through checkpoint 2 now


def test_a_compaction_older_than_the_newest_record_registers_nothing(
    store: MetadataStore,
) -> None:
    store.record_completed(_cp(1, (), (_log("w", 0, 5),)), retain=2)
    store.record_completed(_cp(2, (_mat("w", 8, "m"),), (_log("w", 8, 9),)), retain=2)
    with pytest.raises(CompactionSupersededError, match="older than the current materialization"):
        store.register_compaction(JOB, 1, {("op", 0): _mat("w", 5, "c1", "compacted")})
    assert store.pending_compactions(JOB) == []
    assert not any("compacted" in f for f in store.referenced_files())


def test_a_superseded_compaction_is_released_by_the_next_checkpoint(store: MetadataStore) -> None:
    store.record_completed(_cp(1, (), (_log("w", 0, 5),)), retain=1)
    x = _mat("w", 5, "c1", "compacted")
    store.register_compaction(JOB, 1, {("op", 0): x})
    # still undecided: the job's state has not moved past it
    assert store.record_completed(_cp(2, (), (_log("w", 0, 7),)), retain=1).released == []
    assert len(store.pending_compactions(JOB)) == 1
    # the job materialized on its own meanwhile (it never saw the compaction)
    retention = store.record_completed(_cp(3, (_mat("w", 9, "m"),), ()), retain=1)
    assert x.files()[0] in retention.released
    assert store.pending_compactions(JOB) == []


def test_newest_source_wins_and_rescaled_subtasks_are_dropped(store: MetadataStore) -> None:
    store.record_completed(_cp(1, (), (_log("w", 0, 5),), subtasks=2), retain=3)
    store.record_completed(_cp(2, (), (_log("w", 0, 7),), subtasks=2), retain=3)
    newer = {("op", i): _mat("w", 7, f"n{i}", "compacted") for i in range(2)}
    store.register_compaction(JOB, 2, newer)
    with pytest.raises(CompactionSupersededError, match="is as new"):
        store.register_compaction(JOB, 1, {("op", 1): _mat("w", 5, "o", "compacted")})
    # the job came back with one subtask: the row of subtask 1 has nobody to adopt it
    retention = store.record_completed(_cp(3, (), (_log("w", 0, 9),), subtasks=1), retain=3)
    assert retention.released == newer[("op", 1)].files()
    assert [(c.operator, c.subtask) for c in store.pending_compactions(JOB)] == [("op", 0)]


def test_unknown_job_is_not_found(store: MetadataStore) -> None:
    from dstl.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError):
        store.register_compaction("nope", 1, {("op", 0): _mat("w", 1, "x", "compacted")})


def test_a_v3_database_gets_the_compaction_registry(metadata_url: str) -> None:
    import sqlalchemy as sa

    from coordinator.metadata import SCHEMA_VERSION, create_schema

    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:  # exactly what v3 code created, with a v3 record in it
        create_schema(conn, 3)
        assert not sa.inspect(conn).has_table("compactions")
        conn.execute(
            sa.text(
                "INSERT INTO jobs (job_id, created_at, attempt, last_checkpoint_id, status) "
                "VALUES ('job', 1.0, 0, 1, 'running')"
            )
        )
    engine.dispose()
    store = MetadataStore(metadata_url, create=False)
    store.record_completed(_cp(1, (), (_log("w", 0, 5),)), retain=1)
    store.register_compaction(JOB, 1, {("op", 0): _mat("w", 5, "c", "compacted")})
    assert len(store.pending_compactions(JOB)) == 1
    store.close()
    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:
        version = conn.execute(sa.text("SELECT version FROM schema_version")).scalar()
        assert version == SCHEMA_VERSION == 4
        assert sa.inspect(conn).has_table("compaction_refs")
    engine.dispose()


def test_the_record_that_reserves_the_next_id_finds_the_undecided_compactions(
    store: MetadataStore,
) -> None:
    """What the coordinator's next trigger offers the tasks without a lookup of its own."""
    reserved = store.next_checkpoint_id(JOB)
    _, reserved, found = store.record_completed_and_reserve(
        _cp(reserved, (), (_log("w", 0, 5),)), 1
    )
    assert found == []
    x = _mat("w", 5, "c1", "compacted")
    cid = store.register_compaction(JOB, 1, {("op", 0): x})
    _, reserved, found = store.record_completed_and_reserve(
        _cp(reserved, (), (_log("w", 0, 6),)), 1
    )
    assert [(c.compaction_id, c.handle) for c in found] == [(cid, x)]
    _, reserved, found = store.record_completed_and_reserve(
        _cp(reserved, (), (_log("w", 0, 7),)), 1, compactions_after=cid
    )
    assert found == []  # offered already
    _, reserved, found = store.record_completed_and_reserve(
        _cp(reserved, (x,), (_log("w", 5, 8),)), 1
    )
    assert found == [] and reserved == 5  # adopted: decided by this very record
