"""The per-record path's Python calls, counted (no timing): a value state with a default
costs exactly the calls of one without, in every store, logged or not.

A default used to be a wrapper object (``value()`` and ``update()`` one Python call
more each, per record); the stores' raw value states now read the default themselves
(``with_default``, see :func:`backends.wrappers.wrap`).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from backends import ValueStateDescriptor, restore_into
from backends.serializers import INT64
from backends.wrappers import DefaultValueState
from tests.backends.conftest import Factory
from tests.backends.helpers import dump


def python_calls(fn: Callable[[], object]) -> int:
    """How many Python functions (frames) ``fn`` runs, itself included."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    # A collection during fn would count the finalizers it runs (an extra call that
    # depends on what earlier tests left behind, not on fn).
    enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if enabled:
            gc.enable()
    return calls


def test_a_default_costs_no_extra_python_call(backend: Any) -> None:
    plain = backend.get_state(ValueStateDescriptor("plain", INT64))
    counted = backend.get_state(ValueStateDescriptor("counted", INT64, default=0))
    assert not isinstance(counted, DefaultValueState)
    backend.set_current_key("absent")
    assert counted.value() == 0 and plain.value() is None

    for key in ("a", "b", "a"):  # absent, then present
        backend.set_current_key(key)
        with_default = python_calls(lambda: counted.update(counted.value() + 1))
        without = python_calls(lambda: plain.update((plain.value() or 0) + 1))
        assert with_default == without
    backend.set_current_key("a")
    assert (counted.value(), plain.value()) == (2, 2)
    counted.clear()
    assert counted.value() == 0


def test_a_defaulted_state_logs_its_writes(factory: Factory, store_kind: str) -> None:
    """The view shares the logged state's buffer: restore sees its writes, in order."""
    b = factory.logged(store_kind)
    counted = b.get_state(ValueStateDescriptor("counted", INT64, default=0))
    assert b.get_state(ValueStateDescriptor("counted", INT64, default=0)) is counted
    for key in ("x", "y", "x", "z"):
        b.set_current_key(key)
        counted.update(counted.value() + 1)
    b.set_current_key("z")
    counted.clear()
    handle = b.checkpoint(1).result(timeout=30)
    fresh = factory.store(store_kind)
    restore_into(fresh, factory.fileio, [handle])
    assert dump(fresh) == dump(b.inner)
    fresh.set_current_key("x")
    assert fresh.get_state(ValueStateDescriptor("counted", INT64, default=0)).value() == 2
    fresh.set_current_key("z")
    assert fresh.get_state(ValueStateDescriptor("counted", INT64, default=0)).value() == 0


def test_a_stored_none_reads_as_the_default(factory: Factory, store_kind: str) -> None:
    """As with the wrapper it replaces: a value that is None reads as the default."""
    from backends.serializers import PICKLE

    for b in (factory.store(store_kind), factory.logged(store_kind)):
        s = b.get_state(ValueStateDescriptor("p", PICKLE, default="d"))
        b.set_current_key("k")
        s.update(None)
        assert s.value() == "d"
        s.update("x")
        assert s.value() == "x"
