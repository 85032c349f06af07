"""Random programs against the C modules and their Python twins, side by side.

A program is data: a buffer's constructor arguments, then operations (appends of every
kind, take, heap state writes, key attribute changes and deletes, pack_*) whose
arguments are drawn from a wide set of values, including objects whose ``__index__``,
``__float__``, ``__hash__`` or ``__eq__`` raise, return the wrong type, or change the
buffer, the key or the table while the C code is working. Each program runs on a C world
and on a Python world built from the same description; every step must end the same way
(the same result, or an exception of the same type), the tables must hold the same
things, and every ``take()`` the same bytes.

Run in a child process (tests/native/test_fuzz.py), so a crash of the C code fails the
test instead of killing pytest; also ``python -m tests.native.fuzz EXAMPLES`` (make
test-asan runs it under AddressSanitizer).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KINDS = (-1, 0, 1, 2, 3)  # KIND_NONE, BYTES, INT64, FLOAT64, STR


class Evil:
    """A value whose conversions run Python code (``action`` on the world) and may return
    anything. Built per world from the same description, so both worlds see the same."""

    def __init__(self, world: World, desc: tuple[Any, ...]) -> None:
        self.world, self.desc = world, desc

    def _act(self) -> Any:
        action, result = self.desc[1], self.desc[2]
        self.world.act(action)
        if result == "raise":
            raise ValueError("evil")
        return self.world.build(result)

    def __index__(self) -> Any:
        return self._act()

    def __float__(self) -> Any:
        return self._act()

    def __hash__(self) -> int:
        if self.desc[3]:
            self._act()
        return 7

    def __eq__(self, other: object) -> bool:
        if self.desc[3]:
            self._act()
        return self is other

    def __repr__(self) -> str:
        return f"Evil{self.desc!r}"


class BytesSub(bytes):
    def __bytes__(self) -> bytes:
        return b"not the data"


class StrSub(str):
    pass


plain = st.one_of(
    st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([0, 1, -1, 127, 128, -129, (1 << 31) - 1, 1 << 31, (1 << 63) - 1, 1 << 63]),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["\ud800", "é", "k"]),
    st.binary(max_size=10),
    st.none(),
)
ACTIONS = ("none", "take", "append", "switch_key", "del_key", "clear_table", "gc")
leaf = st.one_of(
    st.tuples(st.just("plain"), plain),
    st.tuples(st.just("bytes_sub"), st.binary(max_size=6)),
    st.tuples(st.just("str_sub"), st.text(max_size=4)),
    st.tuples(
        st.just("evil"),
        st.sampled_from(ACTIONS),
        st.one_of(st.just("raise"), st.tuples(st.just("plain"), plain)),
        st.booleans(),
    ),
)
values = st.one_of(leaf, st.tuples(st.just("list"), st.lists(leaf, max_size=5)))


def mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` (a plain value) three times in four, any value otherwise."""
    good_desc = st.tuples(st.just("plain"), good)
    return st.one_of(good_desc, good_desc, good_desc, values)


record = st.tuples(
    mostly(st.integers(-128, 127)),
    mostly(st.binary(max_size=6)),
    mostly(st.integers(-(1 << 31), (1 << 31) - 1)),
    values,
    values,
)
ops = st.one_of(
    st.tuples(st.sampled_from(["append", "append_typed", "append_typed_list"]), record),
    st.tuples(st.just("take")),
    st.tuples(
        st.sampled_from(["update", "add", "replace", "put"]),
        st.sampled_from([0, 1]),
        values,
        values,
    ),
    st.tuples(
        st.just("set_key"),
        st.sampled_from(["current_key", "current_key_bytes", "current_key_group"]),
        values,
    ),
    st.tuples(
        st.just("del_key"),
        st.sampled_from(["current_key", "current_key_bytes", "current_key_group"]),
    ),
    st.tuples(st.sampled_from(["pack_int64", "pack_float64"]), values),
    st.tuples(st.just("write_new"), values, values, values),
)


@dataclass
class World:
    """One implementation's objects, and how to build and canonicalize values for it."""

    impl: str
    records: Any = None
    heapstate: Any = None
    durable: Any = None
    buffer: Any = None
    ctx: Any = None
    tables: list[dict[Any, Any]] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    directory: str = ""

    def __post_init__(self) -> None:
        self.records = importlib.import_module(f"dstl._records_{self.impl}")
        self.heapstate = importlib.import_module(f"backends._heapstate_{self.impl}")
        self.durable = importlib.import_module(f"dstl._durable_{self.impl}")
        self.directory = tempfile.mkdtemp(prefix=f"fuzz-{self.impl}-")

    def build(self, desc: Any) -> Any:
        tag = desc[0]
        if tag == "plain":
            return desc[1]
        if tag == "bytes_sub":
            return BytesSub(desc[1])
        if tag == "str_sub":
            return StrSub(desc[1])
        if tag == "list":
            return [self.build(d) for d in desc[1]]
        return Evil(self, desc)

    def act(self, action: str) -> None:
        if action == "take" and self.buffer is not None:
            self.buffer.take()
        elif action == "append" and self.buffer is not None:
            self.buffer.append(1, b"inner", 0, None, None)
        elif action == "switch_key" and self.ctx is not None:
            self.ctx.current_key, self.ctx.current_key_bytes = "s", b"s"
            self.ctx.current_key_group = 2
        elif action == "del_key" and self.ctx is not None:
            if hasattr(self.ctx, "current_key"):
                del self.ctx.current_key
        elif action == "clear_table":
            for t in self.tables:
                t.clear()
        elif action == "gc":
            gc.collect()

    def start(self, args: tuple[Any, ...], logged: list[int]) -> Any:
        try:
            self.buffer = self.records.RecordColumns(*[self.build(a) for a in args])
        except Exception as exc:
            return ("raised", type(exc).__name__)
        self.ctx = self.heapstate.KeyContext()
        self.ctx.current_key, self.ctx.current_key_bytes, self.ctx.current_key_group = "k", b"k", 1
        self.tables = [{} for _ in range(8)]
        for i, cls in enumerate(("HeapValue", "HeapList", "HeapMap", "HeapList")):
            for j, log in enumerate((False, True)):
                t = self.tables[2 * i + j]
                make = getattr(self.heapstate, cls)
                log = log and bool(logged[i])
                self.states.append(
                    make(self.ctx, t, self.buffer, 5, self.buffer.take)
                    if log
                    else make(self.ctx, t)
                )
        return "made"

    def run(self, op: tuple[Any, ...]) -> Any:
        name = op[0]
        try:
            if name in ("append", "append_typed", "append_typed_list"):
                return getattr(self.buffer, name)(*[self.build(a) for a in op[1]])
            if name == "take":
                return self.buffer.take()
            if name in ("update", "add", "replace", "put"):
                base = {"update": 0, "add": 2, "replace": 6, "put": 4}[name]
                state = self.states[base + op[1]]
                args = (
                    (self.build(op[2]), self.build(op[3]))
                    if name == "put"
                    else (self.build(op[2]),)
                )
                return getattr(state, name)(*args)
            if name == "set_key":
                return setattr(self.ctx, op[1], self.build(op[2]))
            if name == "del_key":
                return delattr(self.ctx, op[1])
            if name in ("pack_int64", "pack_float64"):
                return getattr(self.records, name)(self.build(op[1]))
            if name == "write_new":
                return self.durable.write_new(self.directory, *[self.build(a) for a in op[1:]])
        except Exception as exc:
            return ("raised", type(exc).__name__)
        raise AssertionError(f"unknown op {op!r}")

    def canon(self, obj: Any) -> Any:
        """``obj`` with this world's Evil objects replaced by their descriptions."""
        if isinstance(obj, Evil):
            return ("evil", obj.desc)
        if isinstance(obj, dict):
            return sorted(((repr(self.canon(k)), self.canon(v)) for k, v in obj.items()), key=repr)
        if isinstance(obj, list | tuple):
            return [self.canon(x) for x in obj]
        if isinstance(obj, float) and obj != obj:
            return "nan"
        return obj

    def snapshot(self) -> Any:
        return (
            self.canon(self.tables),
            None if self.buffer is None else len(self.buffer),
            sorted(os.listdir(self.directory)),
        )


args_of_buffer = st.one_of(
    st.tuples(
        *[
            st.tuples(st.just("plain"), s)
            for s in (
                st.integers(1, 40),
                st.sampled_from([1, 64, 1 << 20]),
                st.sampled_from(KINDS),
                st.sampled_from(KINDS[1:]),
            )
        ]
    ),
    st.tuples(
        mostly(st.integers(-1, 40)),
        mostly(st.sampled_from([0, 1, 64, 1 << 20])),
        mostly(st.sampled_from(KINDS)),
        mostly(st.sampled_from(KINDS)),
    ),
)


def check(buffer_args: tuple[Any, ...], logged: list[int], program: list[tuple[Any, ...]]) -> None:
    """Run ``program`` on a C and a Python world: every step must end the same way."""
    c, py = World("c"), World("py")
    assert c.canon(c.start(buffer_args, logged)) == py.canon(py.start(buffer_args, logged))
    if c.buffer is None:
        return
    for step, op in enumerate(program):
        got_c, got_py = c.canon(c.run(op)), py.canon(py.run(op))
        assert got_c == got_py, f"step {step} {op!r}: C {got_c!r} != Python {got_py!r}"
        assert c.snapshot() == py.snapshot(), f"after step {step} {op!r}"
    assert c.canon(c.buffer.take()) == py.canon(py.buffer.take())


def main(examples: int) -> None:
    """Fuzz ``examples`` programs (a falsifying one is printed and raised)."""
    test = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(
        given(
            args_of_buffer,
            st.lists(st.integers(0, 1), min_size=4, max_size=4),
            st.lists(ops, min_size=5, max_size=40),
        )(check)
    )
    test()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
