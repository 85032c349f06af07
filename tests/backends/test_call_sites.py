"""Hot paths never call a callable through an instance slot (``self._slot(...)``).

CPython 3.11 compiles that to LOAD_METHOD, which it cannot specialize when the name is
an instance attribute: every call pays a generic type lookup (~20 ns on the logged
per-record path, measured with ``python -m tools.bench run state-ops``). Loading the
callable into a local first is a specialized attribute load. This test reads the
bytecode, so it needs no timing.
"""

from __future__ import annotations

import dis
import inspect
import sys
import types

import pytest

import backends.changelog
import backends.heap
import backends.rocksdb
import backends.wrappers

MODULES = [backends.changelog, backends.heap, backends.rocksdb, backends.wrappers]


def _slots(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
    return names


def _slotted_classes() -> list[type]:
    return [
        cls
        for module in MODULES
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and _slots(cls)
    ]


def _is_method_load(ins: dis.Instruction) -> bool:
    # 3.12 folded LOAD_METHOD into LOAD_ATTR, with the low bit of its argument set.
    if ins.opname == "LOAD_METHOD":
        return True
    return ins.opname == "LOAD_ATTR" and sys.version_info >= (3, 12) and bool((ins.arg or 0) & 1)


def _calls_through_slots(cls: type) -> list[str]:
    slots = _slots(cls)
    found = []
    for name, fn in vars(cls).items():
        if not isinstance(fn, types.FunctionType):
            continue
        previous = None
        for ins in dis.get_instructions(fn):
            if (
                _is_method_load(ins)
                and ins.argval in slots
                and previous is not None
                and previous.opname == "LOAD_FAST"
                and previous.argval == "self"
            ):
                found.append(f"{cls.__qualname__}.{name}: self.{ins.argval}(...)")
            previous = ins
    return found


def test_the_check_sees_the_pattern() -> None:
    class Bad:
        __slots__ = ("_f",)

        def call(self) -> None:
            self._f()

    assert _calls_through_slots(Bad) == [
        "test_the_check_sees_the_pattern.<locals>.Bad.call: self._f(...)"
    ]


@pytest.mark.parametrize("cls", _slotted_classes(), ids=lambda c: c.__qualname__)
def test_no_call_through_an_instance_slot(cls: type) -> None:
    assert _calls_through_slots(cls) == []
