"""The FileIO contract, run against every store: memory://, local file:// and real S3.

A new storage implementation inherits this whole suite by adding a parameter.
"""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from pathlib import Path

import pytest

from dstl import ChangelogStorage, FileIO, read_changes
from dstl.errors import (
    ConfigError,
    CorruptionError,
    StorageConflictError,
    StorageError,
    StorageNotFoundError,
)
from dstl.handles import handle_to_json

STORES = ["memory", "file", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(params=STORES)
def fileio(request: pytest.FixtureRequest, tmp_path: Path) -> FileIO:
    kind = request.param
    if kind == "memory":
        return FileIO(f"memory://contract-{uuid.uuid4().hex}")
    if kind == "file":
        return FileIO(f"file://{tmp_path}/store")
    bucket = request.getfixturevalue("s3_bucket")
    return FileIO(f"{bucket.url}/root", bucket.storage_options)


def test_write_once_then_read(fileio: FileIO) -> None:
    fileio.write_new("a/b/c.bin", b"hello")
    assert fileio.read("a/b/c.bin") == b"hello"
    assert fileio.exists("a/b/c.bin")
    assert fileio.size("a/b/c.bin") == 5
    with pytest.raises(StorageConflictError, match=r"c\.bin"):
        fileio.write_new("a/b/c.bin", b"other")
    assert fileio.read("a/b/c.bin") == b"hello"  # never overwritten


def test_empty_and_large_files(fileio: FileIO) -> None:
    big = os.urandom(3 * 1024 * 1024 + 17)
    fileio.write_new("big", big)
    fileio.write_new("empty", b"")
    assert fileio.read("big") == big
    assert fileio.read("empty") == b""


def test_read_range(fileio: FileIO) -> None:
    fileio.write_new("r", bytes(range(100)))
    assert fileio.read_range("r", 10, 5) == bytes(range(10, 15))
    assert fileio.read_range("r", 95, 5) == bytes(range(95, 100))
    with pytest.raises(CorruptionError, match="short read"):
        fileio.read_range("r", 98, 5)


def test_missing_files_raise_not_found(fileio: FileIO) -> None:
    assert not fileio.exists("nope")
    for call in (
        lambda: fileio.read("nope"),
        lambda: fileio.read_range("nope", 0, 1),
        lambda: fileio.size("nope"),
    ):
        with pytest.raises(StorageNotFoundError, match="nope"):
            call()


def test_list_is_recursive_sorted_and_sized(fileio: FileIO) -> None:
    assert fileio.list("") == [] or all(not f.path.endswith("/") for f in fileio.list(""))
    assert fileio.list("missing/prefix") == []
    for name in ("p/2", "p/10", "p/q/1", "other/x"):
        fileio.write_new(name, name.encode())
    listed = fileio.list("p")
    assert [f.path for f in listed] == ["p/10", "p/2", "p/q/1"]  # store-relative, sorted
    assert [f.size for f in listed] == [4, 3, 5]
    assert all(fileio.relative(f.path).startswith("p/") for f in listed)


def test_delete_many_deletes_exactly_the_paths_given(fileio: FileIO) -> None:
    for i in range(5):
        fileio.write_new(f"m/{i}", b"x")
    fileio.write_new("m/sub/keep", b"k")
    assert fileio.delete_many(["m/0", "m/2", "m/4", "m/missing"]) == ()
    assert [fileio.relative(f.path) for f in fileio.list("m")] == ["m/1", "m/3", "m/sub/keep"]
    assert fileio.delete_many([]) == ()
    ((bad, error),) = fileio.delete_many(["../outside", fileio.url("m/1")])
    assert bad == "../outside" and isinstance(error, ConfigError)
    assert [fileio.relative(f.path) for f in fileio.list("m")] == ["m/3", "m/sub/keep"]


def test_delete_is_tolerant_of_missing(fileio: FileIO) -> None:
    fileio.write_new("d/1", b"x")
    fileio.write_new("d/2", b"y")
    fileio.write_new("d/sub/3", b"z")
    assert fileio.delete("d/1") is True
    assert not fileio.exists("d/1")
    fileio.delete("d/1")  # already gone: no error
    fileio.delete("never/existed")
    fileio.delete_tree("d")
    assert fileio.list("d") == []
    fileio.delete_tree("d")  # missing prefix: no error
    fileio.write_new("d/1", b"again")  # the name is free again
    assert fileio.read("d/1") == b"again"


def test_pickle_round_trip(fileio: FileIO) -> None:
    fileio.write_new("pk", b"data")
    clone = pickle.loads(pickle.dumps(fileio))
    assert clone.root_url == fileio.root_url and clone.scheme == fileio.scheme
    assert clone.read("pk") == b"data"
    clone.write_new("pk2", b"more")
    assert fileio.read("pk2") == b"more"


def test_urls_and_relative_paths(fileio: FileIO) -> None:
    url = fileio.url("x/y")
    assert url == fileio.root_url + "/x/y"
    assert url.startswith(f"{fileio.scheme}://")
    assert fileio.relative(url) == "x/y"
    fileio.write_new(url, b"absolute urls inside the root are accepted")
    assert fileio.read("x/y").startswith(b"absolute")
    with pytest.raises(ConfigError):
        fileio.relative("s3://elsewhere/x")
    with pytest.raises(ConfigError):
        fileio.read("../escape")


def test_changelog_round_trip_on_every_store(fileio: FileIO) -> None:
    with ChangelogStorage(fileio, "job", "w0") as storage:
        writers = [storage.create_writer(f"w{i}") for i in range(3)]
        for i, w in enumerate(writers):
            w.append(i, "s", 1, b"k", None, f"v{i}".encode())
        handles = [w.persist(0, 1).result(timeout=30) for w in writers]
    for i, hs in enumerate(handles):
        values = [v for t in read_changes(fileio, hs) for v in t["value"].to_pylist()]
        assert values == [f"v{i}".encode()]
        assert all(fileio.exists(fileio.relative(h.location)) for h in hs)


def test_local_write_of_a_non_buffer_fails_and_leaves_nothing(tmp_path: Path) -> None:
    # (a failure in the middle of the write: tests/dstl/test_durable.py)
    fileio = FileIO(str(tmp_path))
    fileio.write_new("t/first", b"")
    with pytest.raises(StorageError):
        fileio.write_new("t/a", 12345)  # type: ignore[arg-type]
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["first"]


def test_credentials_in_a_url_are_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as info:
        FileIO("s3://AKIAXXLEAKED:supersecretvalue@bucket/root")
    assert "supersecretvalue" not in str(info.value)
    assert "AKIAXXLEAKED" not in str(info.value)


@pytest.mark.s3
def test_s3_credentials_never_reach_handles_urls_reprs_or_logs(
    s3_bucket: object, caplog: pytest.LogCaptureFixture
) -> None:
    key, secret = "AKIDLEAKCHECK0001", "s3cr3t-LEAK-CHECK-value"  # moto accepts any
    options = {**s3_bucket.storage_options, "key": key, "secret": secret}  # type: ignore[attr-defined]
    fileio = FileIO(f"{s3_bucket.url}/root", options)  # type: ignore[attr-defined]
    caplog.set_level(logging.DEBUG, logger="dstl")
    with ChangelogStorage(fileio, "job", "w0") as storage:
        w = storage.create_writer("a")
        w.append(0, "s", 1, b"k", None, b"v")
        (handle,) = w.persist(0, 1).result(timeout=30)
        w.truncate(w.next_sqn())
    with pytest.raises(StorageNotFoundError) as missing:
        fileio.read("missing")
    texts = [
        repr(fileio),
        str(fileio.root_url),
        fileio.url("x"),
        repr(handle),
        str(handle_to_json(handle)),
        str(missing.value),
        *(r.getMessage() for r in caplog.records),
    ]
    assert any("segment" in r.getMessage() for r in caplog.records)  # we did log
    for text in texts:
        assert key not in text and secret not in text, text
