"""Fixtures of the materializer tests: the backends tests' store factory, shared, and a
changelog storage on a local store."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from dstl import ChangelogStorage, FileIO
from tests.backends.conftest import factory  # noqa: F401 - re-exported as a fixture


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[tuple[FileIO, ChangelogStorage]]:
    """A local store under ``tmp_path/store`` and writer ``w0``'s changelog storage of job
    ``job`` on it (closed after the test)."""
    fileio = FileIO(str(tmp_path / "store"))
    with ChangelogStorage(fileio, "job", "w0") as st:
        yield fileio, st
