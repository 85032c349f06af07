"""The metadata store on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

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


def test_missing_checkpoint_is_a_clear_error(store: MetadataStore) -> None:
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 42 does not exist"):
        store.get(None, 42)


def test_opening_a_missing_sqlite_store_does_not_create_it(tmp_path: Any) -> None:
    with pytest.raises(MetadataNotFoundError):
        MetadataStore(f"sqlite:///{tmp_path}/nope.db", create=False)
    assert not (tmp_path / "nope.db").exists()
