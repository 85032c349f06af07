"""SST files of a bulk load written on two cores (:func:`backends.rocksload.write_ssts`):
the upper half by a forked child, and whatever the child does not deliver (it fails, is
stuck, or cannot be forked) by the caller, so the load is the same either way."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pytest
import rocksdict

from backends import rocksload
from backends.rocksdb import ingest_writer_options

ROWS = 1000
EXPECTED = [(b"k%06d" % i, b"v%d" % i) for i in range(ROWS)]


def _rows() -> tuple[pa.Array, pa.Array]:
    keys, values = zip(*EXPECTED, strict=True)
    return pa.array(keys, pa.binary()), pa.array(values, pa.binary())


def _ingested(tmp_path: Path, paths: list[str]) -> list[tuple[bytes, bytes]]:
    """Every row of ``paths``, ingested in one call into a fresh database, in order."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rocksdict.Rdict(str(tmp_path / "db"), opts)
    try:
        db.ingest_external_file(paths, rocksdict.IngestExternalFileOptions())
        return cast(list[tuple[bytes, bytes]], list(db.items()))  # raw mode: bytes
    finally:
        db.close()


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads of ROWS rows are split (the real threshold is far larger)."""
    monkeypatch.setattr(rocksload, "FORK_MIN_ROWS", 64)


@pytest.fixture
def writers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """Which process wrote each file: path -> pid (recorded by the writer itself, in a
    file beside it, since a child's memory does not reach the parent)."""
    original = rocksload._write_sst

    def recording(path: str, *args: Any) -> None:
        original(path, *args)
        Path(path + ".pid").write_text(str(os.getpid()))

    monkeypatch.setattr(rocksload, "_write_sst", recording)

    class Writers(dict[str, int]):
        def __missing__(self, path: str) -> int:
            return int(Path(path + ".pid").read_text())

    return Writers()


def _never_ends(*args: Any) -> None:  # pragma: no cover - a child's, until it is killed
    signal.pause()
    os._exit(0)


def _record_forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the children write_ssts forks from now on."""
    forked: list[int] = []
    fork_writer = rocksload._fork_writer

    def recording(*args: Any) -> int | None:
        pid = fork_writer(*args)
        assert pid is not None
        forked.append(pid)
        return pid

    monkeypatch.setattr(rocksload, "_fork_writer", recording)
    return forked


def _write(tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    out.mkdir()
    return rocksload.write_ssts(str(out), *_rows(), ingest_writer_options())


def test_a_small_load_is_one_file_from_the_caller(tmp_path: Path, writers: dict[str, int]) -> None:
    paths = _write(tmp_path)
    assert len(paths) == 1 and writers[paths[0]] == os.getpid()
    assert _ingested(tmp_path, paths) == EXPECTED


@pytest.mark.usefixtures("split")
def test_a_large_load_is_two_files_the_upper_half_from_a_child(
    tmp_path: Path, writers: dict[str, int]
) -> None:
    """Two files of disjoint, ordered key ranges (RocksDB ingests them in one call),
    the lower half written by the caller, the upper by another process."""
    paths = _write(tmp_path)
    assert len(paths) == 2
    assert writers[paths[0]] == os.getpid()
    assert writers[paths[1]] != os.getpid()
    assert _ingested(tmp_path, paths) == EXPECTED


@pytest.mark.usefixtures("split")
def test_a_failed_child_leaves_its_half_to_the_caller(
    tmp_path: Path,
    writers: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(rocksload, "_child", lambda *args: os._exit(3))
    with caplog.at_level(logging.WARNING, logger="backends.rocksload"):
        paths = _write(tmp_path)
    assert "exited 3" in caplog.text
    assert [writers[p] for p in paths] == [os.getpid(), os.getpid()]
    assert _ingested(tmp_path, paths) == EXPECTED


@pytest.mark.usefixtures("split")
def test_a_stuck_child_is_killed_and_reaped(
    tmp_path: Path, writers: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child still running past its deadline (here: one that never writes) is killed
    and reaped; the caller writes its half."""
    forked = _record_forks(monkeypatch)
    monkeypatch.setattr(rocksload, "_child", _never_ends)
    monkeypatch.setattr(rocksload, "_child_deadline_s", lambda own_s: 0.05)
    paths = _write(tmp_path)
    assert [writers[p] for p in paths] == [os.getpid(), os.getpid()]
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(forked[0], os.WNOHANG)
    assert _ingested(tmp_path, paths) == EXPECTED


@pytest.mark.usefixtures("split")
def test_a_failed_fork_writes_both_halves_here(
    tmp_path: Path,
    writers: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    with caplog.at_level(logging.WARNING, logger="backends.rocksload"):
        paths = _write(tmp_path)
    assert "fork failed" in caplog.text
    assert [writers[p] for p in paths] == [os.getpid(), os.getpid()]
    assert _ingested(tmp_path, paths) == EXPECTED


@pytest.mark.usefixtures("split")
def test_a_failing_caller_kills_and_reaps_its_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's own half fails: the error is raised, and the child (here: one that
    would never end) is killed and reaped first."""
    forked = _record_forks(monkeypatch)

    def failing(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rocksload, "_child", _never_ends)
    monkeypatch.setattr(rocksload, "_write_sst", failing)
    with pytest.raises(OSError, match="No space"):
        _write(tmp_path)
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)
