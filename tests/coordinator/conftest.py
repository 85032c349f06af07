"""Fixtures of the coordinator tests: a metadata URL on SQLite and on real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", "postgres"])
def metadata_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty metadata database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/metadata.db"
    return str(request.getfixturevalue("postgres_url"))
