"""End to end in the embedded runtime: a record's key is serialized and hashed to its key
group once, by the sender that routes it; the keyed operator and its store (heap or
RocksDB, logged or not) take the bytes and the group as they are. Counted, not timed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import backends.keygroups
from backends.serializers import INT64
from backends.state import ValueStateDescriptor
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import (
    Context,
    EmbeddedRuntime,
    OperatorSpec,
    Pipeline,
    RuntimeOptions,
    SinkSpec,
    SourceSpec,
    StateAccess,
)

RECORDS = 3000
KEYS = 97


class CountingInt64:
    """INT64 with its ``serialize`` calls counted (thread-safe enough: one task sends)."""

    name = INT64.name
    arrow_type: pa.DataType = INT64.arrow_type

    def __init__(self) -> None:
        self.serialized = 0

    def serialize(self, value: Any) -> bytes:
        self.serialized += 1
        return INT64.serialize(value)

    def deserialize(self, data: bytes) -> Any:
        return INT64.deserialize(data)

    def to_arrow(self, values: Any) -> pa.Array:
        return INT64.to_arrow(values)

    def from_arrow(self, column: Any) -> list[Any]:
        return INT64.from_arrow(column)


class CountSum:
    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64, default=0))
        self.sum = state.get_state(ValueStateDescriptor("sum", INT64, default=0))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        self.count.update(self.count.value() + 1)
        self.sum.update(self.sum.value() + value)


def _source(_subtask: int, _parallelism: int, offset: int) -> Iterator[tuple[int, int]]:
    return ((i % KEYS, i) for i in range(offset, RECORDS))


@pytest.mark.parametrize("backend,changelog", [("heap", True), ("rocksdb", True), ("heap", False)])
def test_key_serialized_and_hashed_once_per_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, changelog: bool
) -> None:
    hashed = 0
    original = backends.keygroups.key_group_for

    def counting(key_bytes: bytes, max_parallelism: int) -> int:
        nonlocal hashed
        hashed += 1
        return original(key_bytes, max_parallelism)

    for module in list(sys.modules.values()):  # every module that imported it by name
        if getattr(module, "key_group_for", None) is original:
            monkeypatch.setattr(module, "key_group_for", counting)
    key_serializer = CountingInt64()
    pipeline = Pipeline(
        "once",
        SourceSpec("source", 1, _source),
        OperatorSpec("count-sum", 1, key_serializer, CountSum),
        SinkSpec("sink", str(tmp_path / "out")),
    )
    options = RuntimeOptions(
        store_url=str(tmp_path / "store"),
        checkpoint=CheckpointOptions(interval_s=0.05),
        materialization_interval_s=0.1,
        state_backend=backend,
        changelog_enabled=changelog,
        local_dir=str(tmp_path / "local"),
    )
    EmbeddedRuntime(pipeline, options).run()
    assert key_serializer.serialized == RECORDS
    assert hashed == RECORDS
