"""Each way the C extensions could crash the interpreter from Python: now a Python exception.

Issue 17 found these crashes (the first five) from plain Python code; the rest come from
reviewing every entry point for the same kinds of bug. Each case runs in a child process
(tests/native/child.py), against the C modules and against their Python twins, which
must behave the same. The snippets name the modules through placeholders, so the same
code can be pointed at an older build to show the crash.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.native.child import impl_params, run_child


def _run(code: str, impl: str) -> str:
    return run_child(
        code,
        records=f"dstl._records_{impl}",
        heapstate=f"backends._heapstate_{impl}",
        durable=f"dstl._durable_{impl}",
    )


def _heap(code: str, impl: str) -> str:
    """``code`` after CTX: a key context and the heap state and record buffer types."""
    return _run(CTX + textwrap.dedent(code), impl)


pytestmark = pytest.mark.parametrize("impl", impl_params())

# A heap state's key context, at key "k" (bytes b"k") in key group 1.
CTX = """
from {heapstate} import HeapList, HeapMap, HeapValue, KeyContext
from {records} import KIND_BYTES, KIND_INT64, KIND_NONE, KIND_STR, RecordColumns

def context():
    ctx = KeyContext()
    ctx.current_key, ctx.current_key_bytes, ctx.current_key_group = "k", b"k", 1
    return ctx
"""


def test_a_buffer_made_without_init_refuses_to_be_made(impl: str) -> None:
    # Issue 17: RecordColumns.__new__ without __init__ left a buffer with no rows
    # allocated; appending to it wrote past the heap block.
    _run(
        """
        from {records} import KIND_INT64, KIND_NONE, RecordColumns
        try:
            rc = RecordColumns.__new__(RecordColumns)
            for i in range(10_000):
                rc.append(1, b"key", 0, None, b"value")
        except TypeError as exc:
            print("refused:", exc)
        else:
            raise AssertionError("a buffer made without its arguments took records")
        rc = RecordColumns.__new__(RecordColumns, 4, 1 << 20, KIND_NONE, KIND_INT64)
        for i in range(10_000):  # made whole by __new__ alone
            rc.append_typed(1, b"key", 0, None, i)
        assert len(rc) == 10_000
        """,
        impl,
    )


def test_a_second_init_changes_nothing(impl: str) -> None:
    # Issue 17: a refused second __init__ had already switched the buffer to a user-key
    # column whose offsets for the earlier rows were never written: garbage reached Arrow.
    _run(
        """
        from {records} import KIND_INT64, KIND_NONE, KIND_STR, RecordColumns
        from dstl.buffer import _binary_column
        rc = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
        rc.append_typed(1, b"k0", 0, None, 5)
        try:
            rc.__init__(8, 1 << 20, KIND_STR, KIND_INT64)
        except (TypeError, RuntimeError):
            pass
        try:
            rc.append_typed(1, b"k1", 0, "u", 6)
        except TypeError:
            pass
        else:
            raise AssertionError("a user key went into a buffer without that column")
        rows, _, _, key_offsets, key_data, user_keys, values = rc.take()
        assert rows == 1 and user_keys is None, (rows, user_keys)
        _binary_column(rows, values).validate(full=True)
        _binary_column(rows, (0, None, key_offsets, key_data)).validate(full=True)
        """,
        impl,
    )


def test_a_deleted_key_attribute_is_an_attribute_error(impl: str) -> None:
    # Issue 17: `del backend.current_key_bytes` (or either other key attribute) left
    # NULL in the struct the C writes read: a NULL dereference on the next write.
    _heap(
        """
        for attr in ("current_key", "current_key_bytes", "current_key_group"):
            for logged in (False, True):
                ctx = context()
                records = RecordColumns(8, 1 << 20, KIND_STR, KIND_INT64)
                states = (
                    [HeapValue(ctx, {}, records, 1, print), HeapMap(ctx, {}, records, 3, print)]
                    if logged
                    else [HeapValue(ctx, {}), HeapList(ctx, {}), HeapMap(ctx, {})]
                )
                delattr(ctx, attr)
                for state in states:
                    try:
                        state.put("u", 1) if isinstance(state, HeapMap) else (
                            state.update(1) if isinstance(state, HeapValue) else state.add(1)
                        )
                    except AttributeError:
                        pass
                    else:
                        raise AssertionError(f"wrote without {attr}")
                    assert state._table == {}
                assert len(records) == 0
        """,
        impl,
    )


def test_a_map_key_whose_eq_drops_the_entry_being_written(impl: str) -> None:
    # Issue 17: the map put held a borrowed reference to the current key's map while
    # PyDict_SetItem called the user key's __eq__ (a hash collision), and that __eq__
    # removed the map from the table: the insert went into freed memory.
    _heap(
        """
        import gc

        class Key(bytes):  # bytes: a user key the log (KIND_BYTES) takes too
            armed = False
            def __hash__(self):
                return 7
            def __eq__(self, other):
                if Key.armed:
                    Key.armed = False
                    [{} for _ in range(200)]  # fills the dict free list: the map is freed
                    table[1].clear()  # the map of "k" loses its last reference but ours
                    gc.collect()
                return self is other

        for logged in (False, True):
            table = {}
            records = RecordColumns(8, 1 << 20, KIND_BYTES, KIND_INT64)
            m = HeapMap(context(), table, records, 3, print) if logged else HeapMap(context(), table)
            m.put(Key(b"a"), 1)
            Key.armed = True
            m.put(Key(b"b"), 2)  # collides with "a": a.__eq__(b) runs inside the insert
            assert table == {1: {}}, table  # the put landed in the map it had, now detached
            m.put(Key(b"c"), 3)
            assert [bytes(k) for k in table[1]["k"]] == [b"c"]
        """,
        impl,
    )


def test_a_map_key_whose_hash_drops_the_entry_being_written(impl: str) -> None:
    # The same use after free through __hash__, which PyDict_SetItem calls first.
    _heap(
        """
        import gc

        class Key(bytes):
            calls = 0
            drop_at = 0
            def __hash__(self):
                Key.calls += 1
                if Key.calls == Key.drop_at:
                    [{} for _ in range(200)]
                    table[1].clear()
                    gc.collect()
                return 7

        for logged in (False, True):
            table = {}
            records = RecordColumns(8, 1 << 20, KIND_BYTES, KIND_INT64)
            m = HeapMap(context(), table, records, 3, print) if logged else HeapMap(context(), table)
            m.put(Key(b"a"), 1)
            # the hash call inside the map's insert (after the log's own check, if logged)
            Key.calls, Key.drop_at = 0, 2 if logged else 1
            m.put(Key(b"b"), 2)
            assert table == {1: {}}, table
        """,
        impl,
    )


def test_bytes_paths_in_the_durable_writers_errors(impl: str) -> None:
    # Issue 17: the error path formatted the directory and file names as str; bytes
    # names (which the call accepts) crashed it.
    _run(
        """
        import os, tempfile
        from {durable} import write_new
        d = tempfile.mkdtemp()
        write_new(d.encode(), b".a.tmp", b"a", b"x")
        for tmp, name, failing in ((b".b.tmp", b"a", b"a"), (b"keep", b"c", b"keep")):
            open(os.path.join(d, "keep"), "wb").close()  # a temp name that exists
            try:
                write_new(d.encode(), tmp, name, b"y")
            except FileExistsError as exc:
                assert exc.filename == d.encode() + b"/" + failing, exc.filename
            else:
                raise AssertionError("overwrote")
            try:  # a str directory names a str path whatever the names were
                write_new(d, tmp, name, b"y")
            except FileExistsError as exc:
                assert exc.filename == d + "/" + failing.decode(), exc.filename
        assert sorted(os.listdir(d)) == ["a", "keep"]
        try:
            write_new(d.encode() + b"/missing", b".t", b"n", b"x")
        except FileNotFoundError as exc:
            assert exc.filename == d.encode() + b"/missing"
        """,
        impl,
    )


def test_a_state_before_or_after_init(impl: str) -> None:
    # Objects made without __init__ and a second __init__: the C states check both.
    _heap(
        """
        writes = {
            HeapValue: lambda s: s.update(1),
            HeapList: lambda s: s.add(1),
            HeapMap: lambda s: s.put("u", 1),
        }
        for cls, write in writes.items():
            state = cls.__new__(cls)
            try:
                write(state)
            except RuntimeError:
                pass
            else:
                raise AssertionError("a state without __init__ wrote")
            table = {}
            state = cls(context(), table)
            try:
                state.__init__(context(), {})
            except RuntimeError:
                pass
            else:
                raise AssertionError("initialized twice")
            assert state._table is table
        try:
            KeyContext.__new__(KeyContext).current_key  # set to None by __new__
        except AttributeError:
            raise AssertionError("a key context without its attributes")
        """,
        impl,
    )


def test_entries_of_the_wrong_type_in_the_table(impl: str) -> None:
    # The table is readable (and so writable) from Python: the C writes check what
    # they find in it (they reached PyList_Append / PyDict_SetItem with anything).
    _heap(
        """
        cases = [
            (HeapValue, {1: "not a dict"}, lambda s: s.update(1)),
            (HeapList, {1: {"k": "not a list"}}, lambda s: s.add(1)),
            (HeapList, {1: {"k": None}}, lambda s: s.add(1)),
            (HeapMap, {1: {"k": ["not a dict"]}}, lambda s: s.put("u", 1)),
        ]
        for cls, table, write in cases:
            try:
                write(cls(context(), table))
            except TypeError:
                pass
            else:
                raise AssertionError((cls, table))
        """,
        impl,
    )


def test_key_attributes_of_any_type(impl: str) -> None:
    # The key attributes are plain writable slots: anything Python puts there is
    # refused with an exception (or stored, as a dict would), never trusted.
    _heap(
        """
        records = RecordColumns(8, 1 << 20, KIND_NONE, KIND_INT64)
        for attr, value in (("current_key_bytes", 5), ("current_key_bytes", "str"),
                            ("current_key_group", "x"), ("current_key_group", 1 << 40),
                            ("current_key", [1]), ("current_key_group", None)):
            ctx = context()
            setattr(ctx, attr, value)
            state = HeapValue(ctx, {}, records, 1, print)
            try:
                state.update(1)
            except (TypeError, OverflowError):
                pass
            else:
                raise AssertionError((attr, value))
            assert state._table == {} and len(records) == 0
        """,
        impl,
    )


def test_python_code_that_reenters_the_buffer_during_an_append(impl: str) -> None:
    # Converting a part runs Python code (__index__, __float__), which may use the same
    # buffer: the append must see the buffer as that code left it.
    _run(
        """
        import gc
        from {records} import KIND_INT64, KIND_NONE, RecordColumns
        from dstl.buffer import _binary_column
        rc = RecordColumns(2, 1 << 20, KIND_NONE, KIND_INT64)

        class Sneaky:
            def __index__(self):
                for i in range(5000):  # grows the buffer past its rows
                    rc.append_typed(2, b"inner", 0, None, i)
                rc.take()  # and empties it under the outer append
                gc.collect()
                return 7

        class ShrinksTheList:
            def __index__(self):
                items.clear()
                gc.collect()
                return 8

        assert not rc.append_typed(1, b"outer", 0, None, Sneaky())
        items = [ShrinksTheList(), 1, 2, 3]
        assert rc.append_typed_list(1, b"list", 0, None, items)
        rows, _, ops, key_offsets, key_data, _, values = rc.take()
        assert (rows, key_data) == (2, b"outerlist"), (rows, key_data)
        _binary_column(rows, values).validate(full=True)
        assert values[3][:8] == (7).to_bytes(8, "little")
        assert len(values[3]) == 8 + 4 * 12  # the list as it was when the call began
        """,
        impl,
    )


def test_python_code_that_reenters_a_heap_state_during_a_write(impl: str) -> None:
    # Hashing keys, converting the value and flush() run Python code that may switch
    # the key, clear the table, write through the same state or drop the buffer.
    _heap(
        """
        import gc
        table = {}
        records = RecordColumns(1, 1 << 20, KIND_NONE, KIND_INT64)
        ctx = context()
        flushes = []

        class Sneaky:
            def __index__(self):
                ctx.current_key, ctx.current_key_bytes, ctx.current_key_group = "o", b"o", 2
                table.clear()
                state.update(9)  # nested write of the same state, which flushes
                gc.collect()
                return 5

        def flush():
            flushes.append(records.take())
            if len(flushes) == 1:  # the nested write's
                del ctx.current_key
                table.clear()
            gc.collect()

        state = HeapValue(ctx, table, records, 1, flush)
        value = Sneaky()
        state.update(value)  # written under the key it began with
        assert table == {1: {"k": value}}, table
        assert [(f[0], f[4]) for f in flushes] == [(1, b"o"), (1, b"k")], flushes
        """,
        impl,
    )


def test_a_framed_list_over_2_gib_is_refused_before_it_is_copied(impl: str) -> None:
    # The length of a list's framing is summed over its elements: refused once it
    # passes the buffer's 2 GiB limit (before any sum can overflow or memory is used).
    _run(
        """
        from {records} import KIND_BYTES, KIND_NONE, RecordColumns
        big = bytes(128 << 20)
        rc = RecordColumns(8, 1 << 40, KIND_NONE, KIND_BYTES)
        try:
            rc.append_typed_list(1, b"k", 0, None, [big] * 17)
        except OverflowError:
            pass
        else:
            raise AssertionError("framed more than 2 GiB")
        assert len(rc) == 0
        """,
        impl,
    )


def test_parts_that_change_the_list_while_their_buffers_are_taken(impl: str) -> None:
    # exchange() takes a buffer of each part; since 3.12 a Python class can provide one
    # (__buffer__), and that code could shrink the list being walked.
    _run(
        """
        import os, struct, sys
        from {durable} import exchange
        if sys.version_info < (3, 12):
            sys.exit(0)  # no Python-level buffers before 3.12
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        for fd in (request_w, reply_r):
            os.set_blocking(fd, False)
        os.write(reply_w, struct.pack("<qq", 0, 3) + b"abc")
        parts = []

        class Shrinks:
            def __buffer__(self, flags):
                parts.clear()
                return memoryview(b"first")

        parts.extend([Shrinks()] + [b"x" * 10] * 100)
        assert exchange(request_w, reply_r, parts, 0, 5.0) == (0, b"abc")
        assert os.read(request_r, 10_000) == b"first" + b"x" * 1000
        """,
        impl,
    )
