"""Shorter GIL slices: counted, and the previous interval put back by the last user."""

from __future__ import annotations

import sys

import pytest

from dstl.gil import CHECKPOINT_GIL_SLICE_S, GIL_SLICE_S, short_gil_slices


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


def test_the_shortest_slice_asked_for_holds_until_its_user_leaves() -> None:
    before = sys.getswitchinterval()
    outer = short_gil_slices()
    outer.__enter__()
    with short_gil_slices(CHECKPOINT_GIL_SLICE_S):
        assert sys.getswitchinterval() == pytest.approx(CHECKPOINT_GIL_SLICE_S)
    assert sys.getswitchinterval() == pytest.approx(min(before, GIL_SLICE_S))
    with short_gil_slices(CHECKPOINT_GIL_SLICE_S):
        outer.__exit__(None, None, None)  # the longer one leaves first
        assert sys.getswitchinterval() == pytest.approx(CHECKPOINT_GIL_SLICE_S)
    assert sys.getswitchinterval() == before
