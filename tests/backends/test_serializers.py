"""Serializers: every name round-trips, bytes and Arrow columns round-trip, typed columns."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.serializers import (
    BOOL,
    BYTES,
    FLOAT64,
    INT64,
    PICKLE,
    STR,
    Serializer,
    serializer_for,
    ttl_of,
    tuple_of,
)
from dstl.errors import ConfigError, CorruptionError

SAMPLES: list[tuple[Serializer, list[Any]]] = [
    (INT64, [0, -1, 2**63 - 1]),
    (FLOAT64, [0.5, -1e300]),
    (BOOL, [True, False]),
    (STR, ["", "héllo"]),
    (BYTES, [b"", b"\x00\xff"]),
    (PICKLE, [{"a": (1, 2)}, None]),
    (tuple_of(INT64, FLOAT64), [(1, 2.5), (-3, 0.0)]),
    (tuple_of(STR, INT64, BYTES), [("a", 1, b"x"), ("", -2, b"")]),
    (tuple_of(STR, tuple_of(INT64, BOOL)), [("k", (1, True))]),
    (ttl_of(STR), [(5, "v")]),
    (ttl_of(tuple_of(INT64, STR)), [(5, (1, "v"))]),
]


@pytest.mark.parametrize(("ser", "values"), SAMPLES, ids=[s.name for s, _ in SAMPLES])
def test_round_trips(ser: Serializer, values: list[Any]) -> None:
    assert serializer_for(ser.name) == ser
    assert serializer_for(ser.name).name == ser.name
    for v in values:
        assert ser.deserialize(ser.serialize(v)) == v
    col = ser.to_arrow(values)
    assert col.type == ser.arrow_type
    assert ser.from_arrow(col) == values
    assert ser.from_arrow(pa.chunked_array([col])) == values


def test_tuple_columns_are_typed_structs() -> None:
    ser = tuple_of(STR, INT64)
    assert ser.arrow_type == pa.struct([("f0", pa.string()), ("f1", pa.int64())])
    assert ser.name == "tuple<str,int64>"


def test_unknown_and_corrupt() -> None:
    with pytest.raises(ConfigError):
        serializer_for("tuple<nope>")
    with pytest.raises(ConfigError):
        serializer_for("decimal")
    with pytest.raises(CorruptionError):
        tuple_of(STR, INT64).deserialize(b"\x05\x00\x00\x00ab")
    with pytest.raises(CorruptionError):
        INT64.deserialize(b"\x01")


@settings(max_examples=50, deadline=None)
@given(st.tuples(st.text(), st.integers(-(2**63), 2**63 - 1), st.binary(), st.booleans()))
def test_tuple_property(value: tuple[str, int, bytes, bool]) -> None:
    ser = tuple_of(STR, INT64, BYTES, BOOL)
    assert ser.deserialize(ser.serialize(value)) == value


@settings(max_examples=200, deadline=None)
@given(
    i=st.integers(-(1 << 63), (1 << 63) - 1),
    f=st.floats(allow_nan=False) | st.integers(-(1 << 60), 1 << 60),
)
def test_int64_and_float64_write_what_struct_writes(i: int, f: float) -> None:
    import struct

    assert INT64.serialize(i) == struct.pack("<q", i)
    assert FLOAT64.serialize(f) == struct.pack("<d", f)


class _Index:
    def __index__(self) -> int:
        return 7


class _Float:
    def __float__(self) -> float:
        return 2.5


def test_int64_and_float64_accept_and_refuse_like_int_and_float() -> None:
    # The same C conversion as the heap's record buffer, so every store refuses a value
    # with the same error (it used to be struct.error on RocksDB).
    assert INT64.serialize(_Index()) == INT64.serialize(7)
    assert INT64.serialize(True) == INT64.serialize(1)
    assert FLOAT64.serialize(_Float()) == FLOAT64.serialize(2.5)
    for bad, error in ((1 << 63, OverflowError), (-(1 << 63) - 1, OverflowError)):
        with pytest.raises(error):
            INT64.serialize(bad)
    for bad in (1.5, "7", None, b"7"):
        with pytest.raises(TypeError):
            INT64.serialize(bad)
    for bad in ("x", None):
        with pytest.raises(TypeError):
            FLOAT64.serialize(bad)
    with pytest.raises(OverflowError):
        FLOAT64.serialize(1 << 1100)
