"""End to end in the embedded runtime: the source and the operator ask whether to stand
aside (:func:`dstl.gil.yield_to_critical`) before every batch, the checkpoints' critical
steps open sections, and none is left open when the job ends."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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
from coordinator.embedded import tasks as tasks_module
from dstl import gil

RECORDS = 5000


class Count:
    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64, default=0))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        self.count.update(self.count.value() + 1)


def _source(_subtask: int, _parallelism: int, offset: int) -> Iterator[tuple[int, int]]:
    return ((i % 101, i) for i in range(offset, RECORDS))


def test_tasks_yield_between_batches_and_sections_open_while_checkpointing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: Counter[str] = Counter()
    sections = [0]
    real_yield, real_section = gil.yield_to_critical, gil.critical_section

    def counted_yield() -> float:
        calls[threading.current_thread().name] += 1
        return real_yield()

    def counted_section(*args: Any, **kwargs: Any) -> Any:
        sections[0] += 1
        return real_section(*args, **kwargs)

    monkeypatch.setattr(tasks_module, "yield_to_critical", counted_yield)
    monkeypatch.setattr("dstl.changelog.critical_section", counted_section)
    monkeypatch.setattr("coordinator.checkpoint.critical_section", counted_section)
    pipeline = Pipeline(
        "crit",
        SourceSpec("source", 1, _source),
        OperatorSpec("count", 1, INT64, Count),
        SinkSpec("sink", str(tmp_path / "out")),
    )
    options = RuntimeOptions(
        store_url=str(tmp_path / "store"),
        checkpoint=CheckpointOptions(interval_s=0.05),
        source_batch=100,
        local_dir=str(tmp_path / "local"),
    )
    EmbeddedRuntime(pipeline, options).run()
    # every batch: the source before reading one, the operator before processing one
    assert calls["source-0"] >= RECORDS // 100
    assert calls["count-0"] >= 1
    # a record per checkpoint and a barrier's upload for each, at least the final one
    assert sections[0] >= 2
    assert not gil._critical
