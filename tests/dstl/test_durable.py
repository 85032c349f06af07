"""dstl._durable.write_new: a new local file published durably in one GIL release, and
FileIO's local writes through it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dstl import FileIO
from dstl import _durable as durable
from dstl._durable import write_new
from dstl.errors import StorageConflictError, StorageError


@pytest.mark.parametrize("make", [bytes, bytearray, memoryview])
def test_writes_the_bytes_and_leaves_only_the_file(tmp_path: Path, make: type) -> None:
    data = os.urandom(3 << 20)
    write_new(str(tmp_path), ".seg.tmp", "seg", make(data))
    assert (tmp_path / "seg").read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["seg"]


def test_empty_file(tmp_path: Path) -> None:
    write_new(str(tmp_path), ".e.tmp", "e", b"")
    assert (tmp_path / "e").read_bytes() == b""


def test_never_replaces_an_existing_file(tmp_path: Path) -> None:
    (tmp_path / "seg").write_bytes(b"old")
    with pytest.raises(FileExistsError) as info:
        write_new(str(tmp_path), ".seg.tmp", "seg", b"new")
    assert info.value.filename == f"{tmp_path}/seg"
    assert (tmp_path / "seg").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["seg"]


def test_missing_directory_names_the_directory(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError) as info:
        write_new(missing, ".a.tmp", "a", b"x")
    assert info.value.filename == missing


def test_refuses_paths_as_names_and_non_buffers(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_new(str(tmp_path), ".a.tmp", "sub/a", b"x")
    with pytest.raises(ValueError):
        write_new(str(tmp_path), "../a.tmp", "a", b"x")
    with pytest.raises(TypeError):
        write_new(str(tmp_path), ".a.tmp", "a", 12345)
    with pytest.raises(TypeError):
        write_new(str(tmp_path), ".a.tmp", "a")  # type: ignore[call-arg]
    assert list(tmp_path.iterdir()) == []


def test_a_failure_mid_write_leaves_nothing(tmp_path: Path) -> None:
    # A file-size limit makes write() fail with EFBIG after the temporary file exists
    # (Python ignores SIGXFSZ). In a child process: the limit is per process.
    script = textwrap.dedent(
        f"""
        import errno, resource
        from dstl._durable import write_new
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            write_new({str(tmp_path)!r}, ".big.tmp", "big", b"x" * 100_000)
        except OSError as exc:
            assert exc.errno == errno.EFBIG, exc
            assert exc.filename.endswith("/.big.tmp"), exc.filename
        else:
            raise AssertionError("the write should have failed")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2])
    assert list(tmp_path.iterdir()) == []


def test_fileio_creates_directories_and_refuses_overwrites(tmp_path: Path) -> None:
    fileio = FileIO(str(tmp_path))
    fileio.write_new("a/b/c.parquet", b"one")
    assert fileio.read("a/b/c.parquet") == b"one"
    fileio.write_new("a/b/d.parquet", b"two")  # the directory exists now
    with pytest.raises(StorageConflictError):
        fileio.write_new("a/b/c.parquet", b"three")
    assert fileio.read("a/b/c.parquet") == b"one"
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["c.parquet", "d.parquet"]


@pytest.mark.skipif(not durable.NATIVE, reason="the Python fallback makes os.* calls")
def test_fileio_local_writes_make_no_python_level_system_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each os.* call releases and retakes the GIL: a forced switch of a busy task thread
    # per call. The local write must stay one C call (directories aside).
    fileio = FileIO(str(tmp_path))
    fileio.write_new("d/first", b"creates d")

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Python-level system call in FileIO's local write")

    for name in ("open", "write", "fsync", "close", "link", "unlink", "makedirs", "urandom"):
        monkeypatch.setattr(os, name, forbidden)
    fileio.write_new("d/second", b"x" * 100_000)
    monkeypatch.undo()
    assert (tmp_path / "d" / "second").read_bytes() == b"x" * 100_000


def test_fileio_translates_write_failures(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    fileio = FileIO(str(tmp_path))
    with pytest.raises(StorageError):
        fileio.write_new("file/under-a-file", b"x")  # the "directory" is a file
