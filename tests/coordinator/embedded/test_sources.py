"""The file source (JSON lines, CSV, Parquet; positions in the checkpoint, rescaling) and a
builder job reading it whose processing-time timers survive a restore and fire once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backends.serializers import INT64, STR
from backends.state import MapStateDescriptor, ValueStateDescriptor
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import (
    CollectSink,
    Context,
    EmbeddedRuntime,
    FileSource,
    PipelineBuilder,
    RuntimeOptions,
    StateAccess,
)
from coordinator.metadata import CompletedCheckpoint
from dstl.errors import CorruptionError

RECORDS = 300


def _write_inputs(directory: Path) -> None:
    """Records ``t`` = 0..RECORDS-1 over three files, one per format."""
    directory.mkdir()
    third = RECORDS // 3
    rows = [{"user": f"u{t % 7}", "t": t} for t in range(RECORDS)]
    (directory / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:third]))
    csv_rows = "".join(f"{r['user']},{r['t']}\n" for r in rows[third : 2 * third])
    (directory / "b.csv").write_text("user,t\n" + csv_rows)
    pq.write_table(pa.Table.from_pylist(rows[2 * third :]), directory / "c.parquet")


def _normalized(records: list[Any]) -> list[tuple[str, int]]:
    return sorted((r["user"], int(r["t"])) for r in records)  # CSV gives strings


def _read_all(reader: Any, step: int) -> list[Any]:
    out: list[Any] = []
    while (batch := reader.read(step)) is not None:
        out += batch
    return out


def test_every_format_is_read_and_a_position_resumes_after_the_last_read(tmp_path: Path) -> None:
    _write_inputs(tmp_path / "in")
    source = FileSource(str(tmp_path / "in"))
    reader = source.open(0, 1, None)
    first = reader.read(7) + reader.read(150)  # crosses from the JSON lines into the CSV
    position = reader.position()
    json.dumps(position)  # it goes into the checkpoint record
    rest = _read_all(source.open(0, 1, [position]), 64)
    assert _normalized(first + rest) == sorted((f"u{t % 7}", t) for t in range(RECORDS))
    assert len(first) + len(rest) == RECORDS  # nothing twice


def test_positions_restore_at_another_parallelism(tmp_path: Path) -> None:
    _write_inputs(tmp_path / "in")
    source = FileSource(str(tmp_path / "in"))
    readers = [source.open(s, 2, None) for s in range(2)]
    taken = readers[0].read(30) + readers[1].read(45)
    positions = [r.position() for r in readers]
    rest = _read_all(source.open(0, 1, positions), 50)
    assert _normalized(taken + rest) == sorted((f"u{t % 7}", t) for t in range(RECORDS))
    assert len(taken) + len(rest) == RECORDS


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_files_are_streamed_and_every_position_resumes_exactly(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one file of 5,000 records; Parquet in row groups of 700 (a position falls inside
    # a group and on its edges), JSON lines with blank lines (not records)
    directory = tmp_path / "in"
    directory.mkdir()
    n = 5_000
    rows = [{"user": f"u{t % 7}", "t": t} for t in range(n)]
    if fmt == "jsonl":
        text = "".join(json.dumps(r) + ("\n\n" if r["t"] % 97 == 0 else "\n") for r in rows)
        (directory / "x.jsonl").write_text(text)
    elif fmt == "csv":
        (directory / "x.csv").write_text(
            "user,t\n" + "".join(f"{r['user']},{r['t']}\n" for r in rows)
        )
    else:
        pq.write_table(pa.Table.from_pylist(rows), directory / "x.parquet", row_group_size=700)
    # streamed: the whole file is never read into memory at once
    monkeypatch.setattr("dstl.fileio.FileIO.read", lambda *a: pytest.fail("read whole file"))
    source = FileSource(str(directory))
    for cut in (1, 699, 700, 701, 2_345, 4_999, 5_000):
        reader = source.open(0, 1, None)
        first: list[Any] = []
        while len(first) < cut:
            batch = reader.read(min(256, cut - len(first)))
            assert batch is not None
            first += batch
        position = reader.position()
        reader.close()
        resumed = source.open(0, 1, [json.loads(json.dumps(position))])
        rest = _read_all(resumed, 300)
        resumed.close()
        assert [int(r["t"]) for r in first + rest] == list(range(n)), cut


def test_an_unreadable_file_is_a_corruption_error(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(CorruptionError, match="parquet"):
        FileSource(str(tmp_path / "in")).open(0, 1, None).read(10)


class _Delayed:
    """Per record: count it, remember the count under ``t`` and set a processing-time
    timer at ``t + 1``; the timer emits ``[user, t, count]``. Task thread only."""

    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64))
        self.pending = state.get_state(MapStateDescriptor("pending", INT64, INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        self.pending.put(value["t"], n)
        ctx.register_processing_time_timer(value["t"] + 1)  # > 0, attempt 1's clock

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> None:
        t = timestamp - 1
        ctx.emit([key, t, self.pending.get(t)])
        self.pending.remove(t)


class _Crash(Exception):
    """Raised by a checkpoint listener: the attempt dies right after that record."""


def test_processing_time_timers_survive_a_restore_and_fire_once(tmp_path: Path) -> None:
    # Attempt 1 runs with its processing clock at 0: every timer stays pending, in the
    # checkpointed state, until the crash. Attempt 2's clock is past every timer: the
    # restored ones and the new ones fire at the next tick, each exactly once.
    _write_inputs(tmp_path / "in")
    sink = CollectSink()
    job = PipelineBuilder("files", parallelism=2)
    (
        job.source("files", FileSource(str(tmp_path / "in")), 1, rate_per_s=300.0)
        .map(lambda r: {"user": r["user"], "t": int(r["t"])})
        .key_by(lambda r: r["user"], STR)
        .process("delayed", _Delayed)
        .sink("out", sink, parallelism=1)
    )
    graph = job.build()
    options = RuntimeOptions(
        store_url=str(tmp_path / "store"),
        checkpoint=CheckpointOptions(interval_s=0.05, retain=2),
        materialization_interval_s=0.1,
        source_batch=16,
    )
    crashed: list[int] = []

    def crash(cp: CompletedCheckpoint) -> None:
        offsets = sum(sum(p.values()) for p in cp.source_offsets.values() if p)
        if not crashed and offsets >= RECORDS // 2:
            crashed.append(cp.checkpoint_id)
            raise _Crash(f"after checkpoint {cp.checkpoint_id}")

    with pytest.raises(_Crash):
        EmbeddedRuntime(graph, options, on_checkpoint=crash, processing_ms=lambda: 0).run()
    assert sink.records == []  # no timer fired before the crash
    result = EmbeddedRuntime(graph, options, processing_ms=lambda: 1 << 40).run()
    assert result.restored_from == crashed[0]
    counts: dict[str, int] = {}
    expected = []
    for t in range(RECORDS):  # per user, the files are read in t order
        user = f"u{t % 7}"
        counts[user] = counts.get(user, 0) + 1
        expected.append([user, t, counts[user]])
    assert sorted(sink.records) == sorted(expected)
