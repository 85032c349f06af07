"""The state server's logic without Spark: ranges kept, rebuilt only when stale, rescaled.

``StateHost.process`` is driven directly with Arrow batches, as the server's connection
threads do; both state stores; the store is local disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from backends.keygroups import key_group_for
from coordinator.spark.config import StepConfig, schema_bytes
from coordinator.spark.host import NO_CHECKPOINT, BatchAck, BatchRequest, StateHost
from dstl.fileio import FileIO
from dstl.retry import RetryPolicy
from dstl.upload import Uploader
from tests.coordinator.spark.jobs import Counts, Lists, Sessions, key_of, reference
from tests.dstl.faults import FaultyFileIO
from tools.restore import restore_operator

OUTPUT_SCHEMA = pa.schema(
    [("k", pa.string()), ("v", pa.int64()), ("n", pa.int64()), ("total", pa.int64())]
)


def make_config(tmp_path: Path, backend: str, parallelism: int = 2, **kw: Any) -> StepConfig:
    settings: dict[str, Any] = {
        "job": "host-test",
        "operator": "counts",
        "store_url": str(tmp_path / "store"),
        "storage_options": {},
        "state_backend": backend,
        "parallelism": parallelism,
        "max_parallelism": 128,
        "key": "k",
        "key_serializer": "str",
        "values": ("v",),
        "processor": cloudpickle.dumps(Counts),
        "output_schema": schema_bytes(OUTPUT_SCHEMA),
        "order_by": "v",
        "local_dir": str(tmp_path / "local"),
    }
    settings.update(kw)
    return StepConfig(**settings)


def rows_of(config: StepConfig, subtask: int, values: range) -> list[pa.RecordBatch]:
    """The rows of ``values`` that belong to ``subtask``'s key groups, in two batches."""
    mine = config.key_group_range(subtask)
    keys = [key_of(v) for v in values]
    kept = [
        (k, v)
        for k, v in zip(keys, values, strict=True)
        if key_group_for(k.encode(), config.max_parallelism) in mine
    ]
    half = len(kept) // 2
    return [
        pa.RecordBatch.from_pylist([{"k": k, "v": v} for k, v in part])
        for part in (kept[:half], kept[half:])
        if part
    ]


def run_batch(
    host: StateHost,
    config: StepConfig,
    batch_id: int,
    base_id: int,
    base: list[BatchAck],
    values: range,
) -> list[BatchAck]:
    acks = []
    for subtask in range(config.parallelism):
        request = BatchRequest(
            subtask, batch_id, base_id, tuple(a.keyed for a in base), -(1 << 63), 0
        )
        acks.append(host.process(config.encode(), request, rows_of(config, subtask, values)))
    return acks


def output(host: StateHost, acks: list[BatchAck]) -> set[tuple[Any, ...]]:
    import pyarrow.parquet as pq

    out: set[tuple[Any, ...]] = set()
    for ack in acks:
        if ack.output is not None:
            data = host.fileio.read(ack.output.location)
            table = pq.read_table(pa.py_buffer(data))
            out.update(tuple(r.values()) for r in table.to_pylist())
    return out


@pytest.fixture(params=["heap", "rocksdb"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_ranges_stay_between_batches(tmp_path: Path, backend: str) -> None:
    config = make_config(tmp_path, backend)
    host = StateHost(config.store_url, {}, config.job, str(tmp_path / "local"))
    try:
        acks0 = run_batch(host, config, 0, NO_CHECKPOINT, [], range(0, 300))
        acks1 = run_batch(host, config, 1, 0, acks0, range(300, 600))
        acks2 = run_batch(host, config, 2, 1, acks1, range(600, 900))
        assert host.restores == 0
        assert not any(a.stats["restored"] for a in acks0 + acks1 + acks2)
        expected, _ = reference(range(900))
        assert output(host, acks0) | output(host, acks1) | output(host, acks2) == expected
    finally:
        host.close()


def test_a_replanned_batch_starts_from_its_base_again(tmp_path: Path, backend: str) -> None:
    # Batch 1 was applied and acked, but its checkpoint never completed (the driver died):
    # Spark re-plans batch 1 on top of checkpoint 0; applying it on top of the state that
    # already holds batch 1 would count every value of batch 1 twice.
    config = make_config(tmp_path, backend)
    host = StateHost(config.store_url, {}, config.job, str(tmp_path / "local"))
    try:
        acks0 = run_batch(host, config, 0, NO_CHECKPOINT, [], range(0, 300))
        run_batch(host, config, 1, 0, acks0, range(300, 600))
        again = run_batch(host, config, 1, 0, acks0, range(300, 600))
        assert host.restores == 2  # both ranges rebuilt from checkpoint 0
        assert all(a.stats["restored"] for a in again)
        expected, _ = reference(range(600))
        assert output(host, acks0) | output(host, again) == expected
        # and the rebuilt ranges are reused for the next batch on top of the new ack
        run_batch(host, config, 2, 1, again, range(600, 700))
        assert host.restores == 2
    finally:
        host.close()


def test_a_failure_in_the_middle_leaves_the_range_dirty(tmp_path: Path, backend: str) -> None:
    config = make_config(tmp_path, backend, parallelism=1)
    host = StateHost(config.store_url, {}, config.job, str(tmp_path / "local"))
    try:
        acks0 = run_batch(host, config, 0, NO_CHECKPOINT, [], range(0, 200))

        def broken() -> Iterator[pa.RecordBatch]:
            yield rows_of(config, 0, range(200, 400))[0]  # half the rows are applied
            raise ConnectionResetError("task killed")

        request = BatchRequest(0, 1, 0, tuple(a.keyed for a in acks0), -(1 << 63), 0)
        with pytest.raises(ConnectionResetError):
            host.process(config.encode(), request, broken())
        retried = run_batch(host, config, 1, 0, acks0, range(200, 400))
        assert host.restores == 1
        expected, _ = reference(range(400))
        assert output(host, acks0) | output(host, retried) == expected
    finally:
        host.close()


def test_an_ack_that_was_not_used_forces_a_rebuild(tmp_path: Path, backend: str) -> None:
    # A speculative copy of batch 1 ran on another host and Spark used that copy's ack:
    # this host applied batch 1 too, but its state is not the recorded checkpoint's.
    config = make_config(tmp_path, backend, parallelism=1)
    host = StateHost(config.store_url, {}, config.job, str(tmp_path / "local"))
    other = StateHost(config.store_url, {}, config.job, str(tmp_path / "local2"))
    try:
        acks0 = run_batch(host, config, 0, NO_CHECKPOINT, [], range(0, 100))
        run_batch(host, config, 1, 0, acks0, range(100, 200))
        used = run_batch(other, config, 1, 0, acks0, range(100, 200))
        assert other.restores == 1
        after = run_batch(host, config, 2, 1, used, range(200, 300))
        assert host.restores == 1 and after[0].stats["restored"]
        expected, _ = reference(range(300))
        assert output(host, acks0) | output(other, used) | output(host, after) == expected
    finally:
        host.close()
        other.close()


def test_rescale_restores_each_range_from_the_old_ranges(tmp_path: Path, backend: str) -> None:
    two = make_config(tmp_path, backend, parallelism=2)
    host = StateHost(two.store_url, {}, two.job, str(tmp_path / "local"))
    try:
        acks0 = run_batch(host, two, 0, NO_CHECKPOINT, [], range(0, 400))
        acks1 = run_batch(host, two, 1, 0, acks0, range(400, 800))
        three = make_config(tmp_path, backend, parallelism=3)
        acks2 = run_batch(host, three, 2, 1, acks1, range(800, 1200))
        assert host.restores == 3
        assert [(a.keyed.key_group_start, a.keyed.key_group_end) for a in acks2] == [
            (0, 43),
            (43, 86),
            (86, 128),
        ]
        one = make_config(tmp_path, backend, parallelism=1)
        acks3 = run_batch(host, one, 3, 2, acks2, range(1200, 1500))
        expected, _ = reference(range(1500))
        got = set().union(*(output(host, a) for a in (acks0, acks1, acks2, acks3)))
        assert got == expected
    finally:
        host.close()


def test_rescaling_back_and_forth_replays_each_change_once(tmp_path: Path, backend: str) -> None:
    # 2 -> 3 -> 2 -> 3: the second rescale's ranges were restored from handles that each
    # listed the first writers' blocks (regression: listed twice, replayed twice, so every
    # list grew by its old items again).
    configs = {
        p: make_config(tmp_path, backend, parallelism=p, processor=cloudpickle.dumps(Lists))
        for p in (2, 3)
    }
    host = StateHost(configs[2].store_url, {}, configs[2].job, str(tmp_path / "local"))
    try:
        acks = run_batch(host, configs[2], 0, NO_CHECKPOINT, [], range(0, 400))
        got = output(host, acks)
        for batch, parallelism in enumerate((2, 3, 2, 3, 2), start=1):
            values = range(batch * 100 + 300, batch * 100 + 400)
            acks = run_batch(host, configs[parallelism], batch, batch - 1, acks, values)
            got |= output(host, acks)
        lengths: dict[str, int] = {}
        expected = set()
        for v in range(900):
            lengths[key_of(v)] = lengths.get(key_of(v), 0) + 1
            expected.add((key_of(v), v, lengths[key_of(v)], 0))
        assert got == expected
        state = restore_operator(FileIO(configs[2].store_url), tuple(a.keyed for a in acks))
        items = {k: v for e in state.tables["items"].values() for k, v in e.items()}
        assert {k: sorted(v) for k, v in items.items()} == {
            k: sorted(v for v in range(900) if key_of(v) == k) for k in lengths
        }
    finally:
        host.close()


def test_event_and_processing_time_timers(tmp_path: Path, backend: str) -> None:
    config = make_config(
        tmp_path,
        backend,
        parallelism=1,
        processor=cloudpickle.dumps(Sessions),
        values=("v",),
        order_by="v",
        event_time="v",
    )
    host = StateHost(config.store_url, {}, config.job, str(tmp_path / "local"))
    try:

        def send(
            batch_id: int, base: list[BatchAck], values: list[int], wm: int, now: int
        ) -> BatchAck:
            rows = [pa.RecordBatch.from_pylist([{"k": "a", "v": v} for v in values])]
            request = BatchRequest(0, batch_id, batch_id - 1, tuple(a.keyed for a in base), wm, now)
            return host.process(config.encode(), request, rows)

        first = send(0, [], [100, 200], -(1 << 63), 1_000)  # processing timer due at 1_001
        assert first.stats["timers_fired"] == 0
        second = send(1, [first], [300], 500, 2_000)  # the batch clock passed it
        assert second.stats["timers_fired"] == 1
        third = send(2, [second], [], 1_300, 3_000)  # the watermark passes 300 + 1000
        assert third.stats["timers_fired"] == 1
        rows = output(host, [first, second, third])
        assert rows == {("a", -1, 3, 1_001), ("a", 0, 3, 1_300)}
        assert first.stats["max_event_time_ms"] == 200
    finally:
        host.close()


def test_staged_output_goes_through_the_hosts_uploader(tmp_path: Path) -> None:
    # A transient failure of one PUT is retried under another name (the embedded
    # runtime's retries and byte budget), and the ack names the file that holds the rows.
    config = make_config(tmp_path, "heap", parallelism=1)
    host = StateHost(config.store_url, {}, config.job, str(tmp_path / "local"))
    try:
        faulty = FaultyFileIO(config.store_url)
        host.uploader.close()
        host.uploader = Uploader(faulty, RetryPolicy(max_attempts=3, base_delay_s=0))
        faulty.script("transient")
        (ack,) = run_batch(host, config, 0, NO_CHECKPOINT, [], range(0, 100))
        assert ack.output is not None and ".a1." in ack.output.location
        assert [action for _, action in faulty.writes] == ["transient", "ok"]
        assert output(host, [ack]) == reference(range(100))[0]
    finally:
        host.close()


def _materialize(host: StateHost, subtask: int) -> None:
    """Materialize one range now and apply it (the scheduler's steps, driven by hand)."""
    slot = host._slots[subtask]
    assert slot.host is not None
    scheduler = slot.host.scheduler
    assert scheduler.tick(float("inf"))
    assert scheduler.wait(60)
    assert scheduler.poll() is not None


def test_a_materialization_between_two_rescales_keeps_the_latest_values(tmp_path: Path) -> None:
    configs = {p: make_config(tmp_path, "heap", parallelism=p) for p in (2, 3)}
    host = StateHost(configs[2].store_url, {}, configs[2].job, str(tmp_path / "local"))
    try:
        acks = run_batch(host, configs[2], 0, NO_CHECKPOINT, [], range(0, 400))
        acks = run_batch(host, configs[3], 1, 0, acks, range(400, 800))  # 2 -> 3
        _materialize(host, 0)  # range 0 of 3 now rests on a materialization
        acks = run_batch(host, configs[3], 2, 1, acks, range(800, 805))
        acks = run_batch(host, configs[2], 3, 2, acks, range(805, 810))  # 3 -> 2: merged
        acks = run_batch(host, configs[3], 4, 3, acks, range(810, 815))  # 2 -> 3 again
        state = restore_operator(FileIO(configs[2].store_url), tuple(a.keyed for a in acks))
        n = {k: v for e in state.tables["n"].values() for k, v in e.items()}
        assert n == {k: c for k, (c, _) in reference(range(815))[1].items()}
    finally:
        host.close()
