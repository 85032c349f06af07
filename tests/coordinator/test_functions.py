"""The keyed function API: records, watermarks and timers, through a restore."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends import KeyGroupRange, ValueStateDescriptor
from backends.restore import restore_changelog_backend
from backends.serializers import INT64
from coordinator.functions import MIN_WATERMARK, Context, KeyedRunner, StateAccess
from dstl import ChangelogStorage, FileIO
from tests.backends.conftest import MAX_PAR, Factory


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[Factory]:
    """The backends' store factory (tests/backends/conftest.py), for this package."""
    fileio = FileIO(str(tmp_path / "store"))
    with ChangelogStorage(fileio, "job", "w0") as storage:
        made = Factory(tmp_path, storage, fileio)
        yield made
        made.close()


class Sessions:
    """Counts per key; an event-time timer 100 ms after each record closes the session."""

    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        self.count.update((self.count.value() or 0) + 1)
        assert ctx.timestamp is not None and ctx.key == key and ctx.time_domain is None
        ctx.register_event_time_timer(ctx.timestamp + 100)
        if value == "remind":
            ctx.register_processing_time_timer(ctx.current_processing_time() + 50)

    def on_timer(self, key: Any, timestamp: int, ctx: Context) -> None:
        ctx.emit(
            (ctx.time_domain.value if ctx.time_domain else None, key, timestamp, self.count.value())
        )
        if ctx.time_domain is not None and ctx.time_domain.value == "event":
            self.count.clear()


@pytest.mark.parametrize("kind", ["heap", "rocksdb"])
def test_timers_fire_in_order_once_and_survive_a_restore(factory: Factory, kind: str) -> None:
    now = [1_000]
    b = factory.logged(kind)
    runner = KeyedRunner(Sessions(), b, lambda: now[0])
    runner.open()
    out: list[Any] = []
    assert runner.watermark == MIN_WATERMARK
    runner.process("a", "x", 10, out.append)
    runner.process("b", "remind", 20, out.append)
    runner.process("a", "x", 30, out.append)  # a's session now ends at 130 (and 110)
    assert runner.advance_watermark(115, out.append) == 1  # a@110 only; b@120, a@130 wait
    assert out == [("event", "a", 110, 2)]
    out.clear()
    assert runner.advance_watermark(100, out.append) == 0  # the watermark never goes back
    handle = b.checkpoint(1).result()  # a@130, b@120 pending; b's reminder at 1050

    restored = factory.logged(kind, KeyGroupRange(0, MAX_PAR))
    restore_changelog_backend(restored, factory.fileio, [handle])
    again = KeyedRunner(Sessions(), restored, lambda: now[0])
    again.open()
    now[0] = 1_060
    assert again.advance_processing_time(now[0], out.append) == 1
    assert out == [("processing", "b", 1_050, 1)]
    out.clear()
    assert again.advance_watermark(200, out.append) == 2
    assert out == [("event", "b", 120, 1), ("event", "a", 130, None)]  # a was cleared at 110
    assert again.advance_watermark(300, out.append) == 0  # each fired once


def test_a_timer_without_on_timer_is_a_clear_error(factory: Factory) -> None:
    class NoTimer:
        def open(self, state: StateAccess) -> None:
            pass

        def process(self, key: Any, value: Any, ctx: Context) -> None:
            ctx.register_event_time_timer(5)

    runner = KeyedRunner(NoTimer(), factory.store("heap"), lambda: 0)
    runner.open()
    runner.process("k", 1, 0, lambda v: None)
    with pytest.raises(TypeError, match="no on_timer"):
        runner.advance_watermark(10, lambda v: None)
