"""Compaction directories are store files: moved stores resolve them, sweeps see them."""

from __future__ import annotations

import pytest

from dstl import layout
from dstl.errors import ConfigError


def test_compaction_files_have_the_shape_of_store_files() -> None:
    directory = layout.compaction_dir("job", "op", 3, 17, "ab12")
    assert directory == "jobs/job/compacted/op/0003/0000000000000011-ab12"
    path = layout.state_file_path(directory, "count.kg0000-0040.parquet")
    assert layout.is_store_file(path)
    assert layout.relative_of_url(f"file:///old/root/{path}") == path
    with pytest.raises(ConfigError):
        layout.compaction_dir("job", "op", 0, 1, "../x")
