"""Content hashes and the verified read; store-relative locations (a store can move)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dstl.errors import ConfigError, CorruptionError, StorageNotFoundError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle, handle_from_json, handle_to_json
from dstl.integrity import FileRef, content_hash, read_verified, verify_bytes
from dstl.layout import check_location, relative_of_url, segment_path

SEGMENT = segment_path("j", "w0-a0000", 1, "abc123")


def test_content_hash_is_sha256_hex() -> None:
    assert content_hash(b"abc") == hashlib.sha256(b"abc").hexdigest()
    assert content_hash(memoryview(b"abc")) == content_hash(b"abc")


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"hello worle", "content hash mismatch"),  # a flipped bit, same size
        (b"hello", "5 bytes"),  # truncated
        (b"", "0 bytes"),  # emptied
        (b"hello world!", "12 bytes"),  # appended to
    ],
)
def test_verify_bytes_refuses_anything_but_the_recorded_content(data: bytes, why: str) -> None:
    ref = FileRef("a/b", 11, content_hash(b"hello world"))
    verify_bytes(b"hello world", ref, "file:///s/a/b")
    with pytest.raises(CorruptionError) as info:
        verify_bytes(data, ref, "file:///s/a/b")
    assert why in str(info.value) and "file:///s/a/b" in str(info.value)


def test_a_record_without_a_hash_still_checks_the_size() -> None:
    legacy = FileRef("a/b", 3)
    verify_bytes(b"xyz", legacy, "u")  # no hash recorded: only the size is known
    with pytest.raises(CorruptionError):
        verify_bytes(b"xy", legacy, "u")


def test_file_ref_validates() -> None:
    with pytest.raises(ValueError):
        FileRef("", 1)
    with pytest.raises(ValueError):
        FileRef("a", -1)
    with pytest.raises(ValueError):
        FileRef("a", 1, "not-a-hash")


def test_read_verified_names_the_file(tmp_path: Path) -> None:
    fileio = FileIO(str(tmp_path))
    fileio.write_new("x/f", b"payload")
    good = FileRef("x/f", 7, content_hash(b"payload"))
    assert read_verified(fileio, good) == b"payload"
    (tmp_path / "x" / "f").write_bytes(b"pAyload")
    with pytest.raises(CorruptionError, match=f"file://{tmp_path}/x/f"):
        read_verified(fileio, good)
    (tmp_path / "x" / "f").unlink()
    with pytest.raises(StorageNotFoundError, match="x/f"):
        read_verified(fileio, good)


@pytest.mark.parametrize(
    "location", ["/etc/passwd", "../x", "a/../../x", "a//b", "a/./b", "", "jobs/j/.."]
)
def test_handles_refuse_locations_outside_the_store(location: str) -> None:
    with pytest.raises(ValueError):
        check_location(location)
    raw = handle_to_json(ChangelogHandle(SEGMENT, 0, "w", 0, 1, 1, 1))
    raw["location"] = location
    with pytest.raises(CorruptionError):  # a record from the metadata store: corrupt
        handle_from_json(raw)


def test_changelog_handle_round_trips_its_hash_and_reads_older_records() -> None:
    h = ChangelogHandle(SEGMENT, 0, "w", 0, 1, 1, 10, content_hash(b"s"))
    assert handle_from_json(handle_to_json(h)) == h
    assert h.file_refs() == [FileRef(SEGMENT, 10, content_hash(b"s"))]
    older = handle_to_json(h)
    del older["content_hash"]
    older["location"] = f"file:///old/root/{SEGMENT}"
    assert handle_from_json(older).file_refs() == [FileRef(older["location"], 10, "")]


def test_relative_of_url_finds_the_store_path_in_an_old_url() -> None:
    assert relative_of_url(f"file:///data/jobs/x/{SEGMENT}") == SEGMENT  # root itself has jobs/
    sp = f"savepoints/j/{7:016x}/{SEGMENT}"
    assert relative_of_url(f"s3://bucket/prefix/{sp}") == sp
    assert relative_of_url("file:///data/elsewhere.txt") is None


def test_fileio_relative_accepts_paths_urls_inside_and_urls_of_a_moved_store(
    tmp_path: Path,
) -> None:
    fileio = FileIO(str(tmp_path / "new"))
    assert fileio.relative(SEGMENT) == SEGMENT
    assert fileio.relative(fileio.url(SEGMENT)) == SEGMENT
    assert fileio.relative(f"file:///somewhere/old/{SEGMENT}") == SEGMENT
    for bad in ("/abs/path", "a/../../b", "file:///somewhere/not-a-store-file"):
        with pytest.raises(ConfigError):
            fileio.relative(bad)
