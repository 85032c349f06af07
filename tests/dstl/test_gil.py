"""Shorter GIL slices: counted, and the previous interval put back by the last user."""

from __future__ import annotations

import sys

import pytest

from dstl.gil import GIL_SLICE_S, short_gil_slices


def test_short_gil_slices_are_counted_and_restored() -> None:
    before = sys.getswitchinterval()
    with short_gil_slices():
        assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SLICE_S))
        with short_gil_slices():
            pass
        assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SLICE_S))
    assert sys.getswitchinterval() == before


def test_an_error_in_the_body_restores_the_interval() -> None:
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), short_gil_slices():
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == before
