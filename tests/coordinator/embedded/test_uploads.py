"""The runtime's own durable files (channel state, staged sink transactions) go through
the worker's Uploader: a transient write failure is retried under another name, and the
handle names the file that holds the bytes (regression: one failed PUT failed the
checkpoint)."""

from __future__ import annotations

from pathlib import Path

from coordinator.embedded.channel_state import read_channel_state, write_channel_state
from coordinator.sink import CollectSink, TransactionalSink, publish_staged
from dstl.retry import RetryPolicy
from dstl.upload import Uploader
from tests.dstl.faults import FaultyFileIO


def test_channel_state_survives_a_transient_write_failure(tmp_path: Path) -> None:
    fio = FaultyFileIO(str(tmp_path / "store"))
    fio.script("transient")
    entries = [(0, [("k", b"k", 3, 1, None)]), (1, [("j", b"j", 4, 2, 10)])]
    with Uploader(fio, RetryPolicy(max_attempts=3, base_delay_s=0)) as up:
        handle = write_channel_state(up, "job", "op", 0, 7, entries)
    assert ".a1" in handle.location
    assert read_channel_state(fio, handle).entries == entries


def test_a_staged_sink_transaction_survives_a_transient_write_failure(tmp_path: Path) -> None:
    fio = FaultyFileIO(str(tmp_path / "store"))
    collect = CollectSink()
    with Uploader(fio, RetryPolicy(max_attempts=3, base_delay_s=0)) as up:
        sink = TransactionalSink(fio, collect.publisher({}), "job", "out", 0, up)
        sink.write([{"a": 1}, {"a": 2}])
        fio.script("transient")
        (txn,) = sink.pre_commit(1)
    assert ".a1" in txn.location
    sink.commit_up_to(1)
    assert collect.records == [{"a": 1}, {"a": 2}]
    assert publish_staged(fio, collect.publisher({}), txn) is False  # idempotent
