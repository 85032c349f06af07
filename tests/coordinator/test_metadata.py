"""The metadata store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from backends.handles import KeyedStateHandle
from coordinator.metadata import CompletedCheckpoint, MetadataStore, SubtaskState
from dstl.errors import CheckpointNotFoundError, MetadataNotFoundError
from dstl.handles import ChangelogHandle


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[MetadataStore]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/m.db"
    else:
        url = request.getfixturevalue("postgres_url")
    s = MetadataStore(url)
    yield s
    s.close()


def _cp(job: str, cid: int, files: list[str]) -> CompletedCheckpoint:
    logs = tuple(ChangelogHandle(f, 0, "w", i, i + 1, 1, 10) for i, f in enumerate(files))
    handle = KeyedStateHandle("w", 0, 128, "str", 128, (), logs)
    return CompletedCheckpoint(
        job,
        cid,
        "checkpoint",
        1.0,
        2.0,
        (SubtaskState("op", 0, (handle,)), SubtaskState("src", 0, offset=cid * 10)),
    )


def test_ids_increase_across_restarts(store: MetadataStore) -> None:
    assert store.start_attempt("j") == 0
    assert [store.next_checkpoint_id("j") for _ in range(3)] == [1, 2, 3]
    reopened = MetadataStore(store.url)
    assert reopened.start_attempt("j") == 1
    assert reopened.next_checkpoint_id("j") == 4
    reopened.close()


def test_retention_releases_only_unreferenced_files(store: MetadataStore) -> None:
    store.start_attempt("j")
    assert store.add_completed(_cp("j", 1, ["s1", "s2"]), retain=1) == []
    # Checkpoint 2 keeps s2 and adds s3: only s1 is released when 1 is subsumed.
    assert store.add_completed(_cp("j", 2, ["s2", "s3"]), retain=1) == ["s1"]
    assert [c.checkpoint_id for c in store.list("j")] == [2]
    latest = store.latest("j")
    assert latest is not None and latest.source_offsets == {"src/0": 20}
    assert latest.subtasks[0].handles[0].changelog[0].location == "s2"


def test_files_shared_with_another_job_are_not_released(store: MetadataStore) -> None:
    store.start_attempt("old")
    store.start_attempt("new")
    store.add_completed(_cp("old", 1, ["shared"]), retain=1)
    store.add_completed(_cp("new", 1, ["shared", "n1"]), retain=1)
    assert store.add_completed(_cp("new", 2, ["n2"]), retain=1) == ["n1"]


def test_files_shared_by_several_expired_checkpoints_are_released_once(
    store: MetadataStore,
) -> None:
    store.start_attempt("j")
    for cid, files in ((1, ["a", "b"]), (2, ["b", "c"]), (3, ["c", "d"])):
        assert store.add_completed(_cp("j", cid, files), retain=3) == []
    # 4 expires 1, 2 and 3 at once: "b" is referenced only by expired ones, "d" still by 4
    assert store.add_completed(_cp("j", 4, ["d", "e"]), retain=1) == ["a", "b", "c"]
    assert store.unreferenced(["a", "b", "c", "d", "e"]) == ["a", "b", "c"]


def test_a_record_runs_as_many_statements_for_many_files_as_for_few(
    store: MetadataStore,
) -> None:
    """The driver gives the GIL up at every statement it steps (and every row it
    fetches), and a busy task thread holds it a switch interval before handing it back:
    the coordinator's commit must not take one step per file."""
    steps: list[bool] = []  # per statement: whether the driver steps it once per row
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: steps.append(a[5]))

    def record(files: list[str]) -> int:
        steps.clear()
        _, reserved[0], _ = store.record_completed_and_reserve(_cp("j", reserved[0], files), 1)
        assert not any(steps)
        return len(steps)

    store.start_attempt("j")
    reserved = [store.next_checkpoint_id("j")]
    few = [record(["f1", "f2"]), record(["f2", "f3"])]
    many = [f"m{i}" for i in range(500)]
    assert record(many) == few[1]
    assert record([*many[:250], "x"]) == few[1]
    assert reserved == [5]
    assert store.unreferenced(many) == many[250:]
    latest = store.latest("j")
    assert latest is not None and latest.checkpoint_id == 4 and len(latest.files()) == 251


def test_missing_checkpoint_is_a_clear_error(store: MetadataStore) -> None:
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 42 does not exist"):
        store.get(None, 42)


def test_opening_a_missing_sqlite_store_does_not_create_it(tmp_path: Any) -> None:
    with pytest.raises(MetadataNotFoundError):
        MetadataStore(f"sqlite:///{tmp_path}/nope.db", create=False)
    assert not (tmp_path / "nope.db").exists()


def test_a_v1_database_migrates_in_place(metadata_url: str) -> None:
    import sqlalchemy as sa

    from coordinator.metadata import SCHEMA_VERSION, create_schema

    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:  # exactly what the v1 code created, with v1 data in it
        create_schema(conn, 1)
        assert "status" not in {c["name"] for c in sa.inspect(conn).get_columns("jobs")}
    engine.dispose()
    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO jobs (job_id, created_at, attempt, last_checkpoint_id) "
                "VALUES ('old', 1.0, 2, 7)"
            )
        )
    engine.dispose()
    store = MetadataStore(metadata_url, create=False)  # the CLI's way of opening migrates too
    assert store.job_status("old") == "running"  # the v2 column, defaulted for old rows
    assert store.start_attempt("old") == 3
    assert store.next_checkpoint_id("old") == 8  # ids continue across the migration
    store.add_completed(_cp("old", 8, ["f"]), retain=1)
    store.set_job_status("old", "finished")
    assert store.job_status("old") == "finished"
    store.close()
    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:
        assert (
            conn.execute(sa.text("SELECT version FROM schema_version")).scalar() == SCHEMA_VERSION
        )
        indexes = {i["name"] for i in sa.inspect(conn).get_indexes("checkpoints")}
        assert "ix_checkpoints_kind" in indexes
    engine.dispose()


def test_a_v2_database_gets_store_relative_locations(metadata_url: str) -> None:
    """v3 makes locations relative to the store root, so a copied store still restores."""
    import json

    import sqlalchemy as sa

    from coordinator.metadata import create_schema

    old_root = "file:///old/place/store"
    seg = f"jobs/old/changelog/w0-a0000/{1:016x}-abc123.parquet"
    weird = "file:///elsewhere/not-a-store-file"
    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:  # a v2 record, as v2 code wrote it: absolute URLs
        create_schema(conn, 2)
        conn.execute(
            sa.text(
                "INSERT INTO jobs (job_id, created_at, attempt, last_checkpoint_id, status) "
                "VALUES ('old', 1.0, 0, 1, 'finished')"
            )
        )
        conn.execute(
            sa.text("INSERT INTO checkpoints VALUES ('old', 1, 'checkpoint', 1.0, 2.0, '{}', '{}')")
        )
        handles = [
            {"type": "changelog", "v": 1, "location": f"{old_root}/{seg}", "block": 0,
             "writer_id": "w", "sqn_start": 0, "sqn_end": 1, "rows": 1, "size_bytes": 10},
            {"type": "changelog", "v": 1, "location": weird, "block": 0,
             "writer_id": "w", "sqn_start": 1, "sqn_end": 2, "rows": 1, "size_bytes": 10},
        ]  # fmt: skip
        state = json.dumps({"handles": handles, "offset": None, "stats": {}})
        conn.execute(
            sa.text("INSERT INTO subtask_states VALUES ('old', 1, 'op', 0, :s)"), {"s": state}
        )
        for location in (f"{old_root}/{seg}", weird):
            conn.execute(sa.text("INSERT INTO file_refs VALUES ('old', 1, :l)"), {"l": location})
    engine.dispose()
    store = MetadataStore(metadata_url, create=False)
    assert store.get("old", 1).files() == [seg, weird]  # a URL of no store file is kept
    assert store.referenced_files() == {seg, weird}
    store.close()


def test_a_newer_schema_is_refused(metadata_url: str) -> None:
    import sqlalchemy as sa

    from coordinator.errors import SchemaVersionError

    MetadataStore(metadata_url).close()
    engine = sa.create_engine(metadata_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE schema_version SET version = 99"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match="version 99 is newer than this code"):
        MetadataStore(metadata_url)


def test_job_status_and_unreferenced(store: MetadataStore) -> None:
    from dstl.errors import MetadataStoreError

    store.start_attempt("j")
    assert store.job_status("j") == "running" and store.job_status("nope") is None
    with pytest.raises(MetadataStoreError, match="unknown job status"):
        store.set_job_status("j", "sleeping")
    store.add_completed(_cp("j", 1, ["a", "b"]), retain=1)
    assert store.unreferenced(["a", "c", "b", "d"]) == ["c", "d"]
    assert store.job_ids() == ["j"]
    retention = store.record_completed(_cp("j", 2, ["b"]), retain=1)
    assert retention.removed_ids == (1,) and retention.released == ["a"]


def test_a_fresh_reader_decodes_every_coordinator_handle(tmp_path: Any) -> None:
    # Regression: readers that import only the metadata store (statectl, Spark jobs) could
    # not decode channel-state handles: their type was registered by the runtime only.
    import subprocess
    import sys
    from pathlib import Path

    from coordinator.handles import ChannelStateHandle, SinkTransactionHandle

    url = f"sqlite:///{tmp_path}/m.db"
    store = MetadataStore(url)
    store.start_attempt("j")
    handles = (
        ChannelStateHandle("file:///s/c.bin", 1, "op", 0, 3, 10),
        SinkTransactionHandle("file:///s/t.jsonl", 1, 0, 3, 10),
    )
    store.add_completed(
        CompletedCheckpoint("j", 1, "checkpoint", 1.0, 2.0, (SubtaskState("op", 0, handles),)), 1
    )
    store.close()
    code = (
        "import sys; from coordinator.metadata import MetadataStore; "
        "print(len(MetadataStore(sys.argv[1]).get('j', 1).files()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, url],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2"


def test_processes_opening_a_fresh_postgres_database_at_once_all_succeed(
    postgres_url: str,
) -> None:
    """Concurrent first opens of a shared database create the schema exactly once."""
    import threading

    n = 6
    gate = threading.Barrier(n)
    errors: list[BaseException] = []

    def open_store() -> None:
        gate.wait()
        try:
            MetadataStore(postgres_url).close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store = MetadataStore(postgres_url)
    try:
        assert store.start_attempt("job") == 0
        assert store.next_checkpoint_id("job") == 1
    finally:
        store.close()
