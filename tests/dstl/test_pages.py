"""Transparent huge pages are off while a changelog storage is open (dstl/pages.py): a
barrier's encoding faulted in 2 MiB pages the kernel zeroed first (issue 16)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstl import ChangelogStorage, FileIO, pages
from dstl.encoder import SegmentEncoder

pytestmark = pytest.mark.skipif(
    pages.huge_pages_disabled() is None, reason="no prctl(PR_GET_THP_DISABLE) here"
)


def _status_thp(pid: int) -> bool:
    """Whether ``/proc/<pid>/status`` says the process may use huge pages."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("THP_enabled:"):
            return line.split()[1] == "1"
    raise AssertionError("no THP_enabled line")


@pytest.fixture(autouse=True)
def _pages_on() -> None:
    assert pages.huge_pages_disabled() is False, "the test process starts with huge pages on"


def test_small_pages_counts_its_users_and_the_last_turns_them_back_on() -> None:
    with pages.small_pages():
        assert pages.huge_pages_disabled() is True
        with pages.small_pages():
            assert pages.huge_pages_disabled() is True
        assert pages.huge_pages_disabled() is True  # the first user is still in
    assert pages.huge_pages_disabled() is False


def test_a_process_that_had_them_off_keeps_them_off() -> None:
    pages.disable_huge_pages()
    try:
        with pages.small_pages():
            assert pages.huge_pages_disabled() is True
        assert pages.huge_pages_disabled() is True
    finally:
        pages._prctl(pages.PR_SET_THP_DISABLE, 0)


def test_an_open_storage_and_its_segment_encoder_run_without_huge_pages(fileio: FileIO) -> None:
    with ChangelogStorage(fileio, "job", "w0") as storage:
        assert pages.huge_pages_disabled() is True
        pid = storage._encoder.pid
        assert pid is not None
        assert not _status_thp(pid)  # the helper's own, whoever started it
    assert pages.huge_pages_disabled() is False


def test_a_segment_encoder_turns_them_off_for_itself() -> None:
    encoder = SegmentEncoder()  # started while this process has them on
    try:
        encoder.start()
        assert encoder.wait_ready(60)
        assert encoder.pid is not None and not _status_thp(encoder.pid)
        assert pages.huge_pages_disabled() is False
    finally:
        encoder.close()
