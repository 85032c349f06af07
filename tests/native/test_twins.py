"""The Python record buffer (dstl._records_py) writes the C buffer's bytes exactly.

Changelog segments and their Arrow columns come from these bytes, so a store written by
one implementation must read the same with the other: every ``take()`` must be equal,
validity bitmaps included, over several fill-and-take rounds (a buffer is reused).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.native.child import has_c

pytestmark = pytest.mark.skipif(not has_c(), reason="C extensions not built")

KIND_VALUES: dict[int, st.SearchStrategy[Any]] = {
    0: st.binary(max_size=12),
    1: st.integers(-(1 << 63), (1 << 63) - 1),
    2: st.floats(allow_nan=True),
    3: st.text(max_size=8),
}


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_python_buffer_takes_the_c_buffers_bytes(data: st.DataObject) -> None:
    from dstl import _records_c, _records_py

    uk_kind = data.draw(st.sampled_from([-1, 0, 1, 2, 3]))
    value_kind = data.draw(st.sampled_from([0, 1, 2, 3]))
    capacity, max_bytes = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 400))
    buffers = [
        m.RecordColumns(capacity, max_bytes, uk_kind, value_kind) for m in (_records_c, _records_py)
    ]
    for _round in range(data.draw(st.integers(1, 3))):
        for _ in range(data.draw(st.integers(0, 40))):
            how = data.draw(st.sampled_from(["append", "append_typed", "append_typed_list"]))
            head = (
                data.draw(st.integers(-128, 127)),
                data.draw(st.binary(max_size=6)),
                data.draw(st.integers(-(1 << 31), (1 << 31) - 1)),
            )
            if uk_kind == -1:
                uk = None
            elif how == "append":
                uk = data.draw(st.none() | st.binary(max_size=6))
            else:
                uk = data.draw(KIND_VALUES[uk_kind])
            if how == "append":
                value = data.draw(st.none() | st.binary(max_size=10))
            elif how == "append_typed":
                value = data.draw(KIND_VALUES[value_kind])
            else:
                value = data.draw(st.lists(KIND_VALUES[value_kind], max_size=4))
            outcomes = []
            for b in buffers:
                try:
                    outcomes.append(getattr(b, how)(*head, uk, value))
                except (TypeError, OverflowError, UnicodeEncodeError) as exc:
                    outcomes.append(type(exc))
            assert outcomes[0] == outcomes[1]
            assert len(buffers[0]) == len(buffers[1])
        assert buffers[0].take() == buffers[1].take()


PACKABLE = st.one_of(
    st.integers(-(1 << 64), 1 << 64),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(max_size=2),
)


@settings(max_examples=120, deadline=None)
@given(
    dicts=st.lists(st.dictionaries(PACKABLE, PACKABLE, max_size=6), max_size=4),
    values=st.booleans(),
    kind=st.sampled_from(["q", "d"]),
)
def test_the_python_pack_packs_the_c_packs_bytes(
    dicts: list[dict[Any, Any]], values: bool, kind: str
) -> None:
    """Heap materialization columns: the same bytes, or the same refusal."""
    from backends import _heapstate_c, _heapstate_py

    outcomes = []
    for m in (_heapstate_c, _heapstate_py):
        try:
            outcomes.append(m.pack(dicts, values, kind))
        except (TypeError, OverflowError) as exc:
            outcomes.append(type(exc))
    assert outcomes[0] == outcomes[1]


TEXTS = st.one_of(st.text(max_size=4), st.binary(max_size=4), st.integers(0, 3))


@settings(max_examples=120, deadline=None)
@given(
    dicts=st.lists(st.dictionaries(TEXTS, TEXTS, max_size=6), max_size=4),
    values=st.booleans(),
    kind=st.sampled_from(["s", "b"]),
)
def test_the_python_pack_text_packs_the_c_packs_columns(
    dicts: list[dict[Any, Any]], values: bool, kind: str
) -> None:
    """String and binary columns: the same offsets and data, or both decline (None)."""
    from backends import _heapstate_c, _heapstate_py

    assert _heapstate_c.pack_text(dicts, values, kind) == _heapstate_py.pack_text(
        dicts, values, kind
    )


@settings(max_examples=300, deadline=None)
@given(key=st.binary(max_size=40), max_par=st.integers(1, 1 << 40))
def test_the_c_key_group_is_the_python_ones(key: bytes, max_par: int) -> None:
    """Key groups decide which subtask restores which state: both implementations give
    every key the same group, whatever the buffer type."""
    from backends import _heapstate_c, _heapstate_py

    want = _heapstate_py.key_group_for(key, max_par)
    assert 0 <= want < max_par
    for given_key in (key, bytearray(key), memoryview(key)):
        assert _heapstate_c.key_group_for(given_key, max_par) == want


@pytest.mark.parametrize("impl", ["_heapstate_c", "_heapstate_py"])
def test_key_groups_are_pinned_and_refuse_a_bad_parallelism(impl: str) -> None:
    """Checkpoints already written name their key groups by this hash: it never changes."""
    import importlib

    m = importlib.import_module(f"backends.{impl}")
    keys = (b"", b"a", bytes(8), (123456).to_bytes(8, "little"), "h\u00e9llo".encode())
    assert [m.key_group_for(k, 128) for k in keys] == [0, 55, 27, 41, 45]
    assert m.key_group_for(b"abc", 1 << 40) == 3505490737
    for bad in (0, -3):
        with pytest.raises(ValueError):
            m.key_group_for(b"a", bad)
    with pytest.raises(TypeError):
        m.key_group_for("text", 128)
