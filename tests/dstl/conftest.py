"""Fixtures of the DSTL tests: ``fileio`` (a FileIO over the test's temporary directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstl import FileIO


@pytest.fixture
def fileio(tmp_path: Path) -> FileIO:
    return FileIO(str(tmp_path))
