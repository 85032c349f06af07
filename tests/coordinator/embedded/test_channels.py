"""Barrier handling in the input gate: aligned, aligned with a timeout, unaligned and
at-least-once, on hand-written cases (seed 002's among them) and on random interleavings
of records and barriers on 2-3 channels."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.embedded.channels import (
    CONTROL,
    Barrier,
    CancelledBarrier,
    EndOfInput,
    Inbox,
    InFlightData,
    Watermark,
)
from coordinator.embedded.gate import DebloatOptions, InputGate
from coordinator.options import BarrierMode


class ManualClock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _drain(gate: InputGate) -> list[Any]:
    out = []
    while (item := gate.next(timeout=0)) is not None:
        out.append(item)
    return out


def _b(cid: int, unaligned: bool = False) -> tuple[int, Barrier]:
    return CONTROL, Barrier(cid, 0.0, unaligned)


# -- aligned ------------------------------------------------------------------------------
def test_records_behind_a_barrier_wait_for_the_other_channels() -> None:
    gate = InputGate(2)
    gate.put(0, "a1")
    gate.put(0, Barrier(1))
    gate.put(0, "a2")  # after the barrier on channel 0: held back
    gate.put(1, "b1")  # before the barrier on channel 1: delivered
    gate.put(1, Barrier(1))
    gate.put(1, "b2")
    assert _drain(gate) == [(0, "a1"), (1, "b1"), _b(1), (0, "a2"), (1, "b2")]


def test_seed_002_one_input_task_with_two_gates_of_two_channels() -> None:
    # Flink's OneInputStreamTaskTest#testCheckpointBarriers (seed 002): channels are
    # (gate, channel) = (0,0), (0,1), (1,0), (1,1) -> 0, 1, 2, 3 here.
    gate = InputGate(4)
    gate.put(0, Barrier(1))
    gate.put(0, ["Hello-0-0"])  # buffered until every channel delivered the barrier
    gate.put(0, ["Ciao-0-0"])
    gate.put(3, ["Hello-1-1"])  # forwarded: no barrier on that channel yet
    gate.put(3, ["Ciao-1-1"])
    assert _drain(gate) == [(3, ["Hello-1-1"]), (3, ["Ciao-1-1"])]
    gate.put(1, Barrier(1))
    gate.put(2, Barrier(1))
    gate.put(3, Barrier(1))
    assert _drain(gate) == [_b(1), (0, ["Hello-0-0"]), (0, ["Ciao-0-0"])]


def test_held_items_may_contain_the_next_barrier() -> None:
    gate = InputGate(2)
    for element in ("a1", Barrier(1), "a2", Barrier(2), "a3"):
        gate.put(0, element)
    for element in ("b1", Barrier(1), "b2", Barrier(2)):
        gate.put(1, element)
    assert _drain(gate) == [
        (0, "a1"),
        (1, "b1"),
        _b(1),
        (0, "a2"),
        (1, "b2"),
        _b(2),
        (0, "a3"),
    ]


def test_newer_barrier_cancels_an_unfinished_alignment() -> None:
    gate = InputGate(2)
    gate.put(0, Barrier(1))
    gate.put(0, "a")
    gate.put(1, Barrier(2))  # channel 1 never saw barrier 1 (it was lost upstream)
    gate.put(0, Barrier(2))
    assert _drain(gate) == [(CONTROL, CancelledBarrier(1)), (0, "a"), _b(2)]


def test_control_messages_bypass_alignment() -> None:
    gate = InputGate(2)
    gate.put(0, Barrier(1))
    gate.put(0, "held")
    gate.put_control("notify")
    assert _drain(gate) == [(CONTROL, "notify")]


def test_an_ended_channel_no_longer_owes_the_barrier() -> None:
    gate = InputGate(2)
    gate.put(0, Barrier(1))
    gate.put(0, "after")
    gate.put(1, EndOfInput())
    assert _drain(gate) == [_b(1), (0, "after")]


# -- watermarks ------------------------------------------------------------------------------
def test_watermark_is_the_minimum_over_live_channels_and_never_goes_back() -> None:
    gate = InputGate(3)
    gate.put(0, Watermark(10))
    gate.put(1, Watermark(5))
    assert _drain(gate) == []  # channel 2 has none yet
    gate.put(2, Watermark(7))
    assert _drain(gate) == [(CONTROL, Watermark(5))]
    gate.put(1, Watermark(20))
    gate.put(1, Watermark(3))  # older: ignored
    assert _drain(gate) == [(CONTROL, Watermark(7))]
    gate.put(2, EndOfInput())  # an ended channel does not hold the watermark back
    assert _drain(gate) == [(CONTROL, Watermark(10))]


def test_a_blocked_channels_watermark_waits_with_its_records() -> None:
    gate = InputGate(2)
    gate.put(1, Watermark(50))
    gate.put(0, Barrier(1))
    gate.put(0, Watermark(100))  # behind the barrier: held
    assert _drain(gate) == []
    gate.put(1, Barrier(1))
    assert _drain(gate) == [_b(1), (CONTROL, Watermark(50))]


# -- aligned with a timeout --------------------------------------------------------------------
def test_alignment_that_times_out_becomes_unaligned_for_that_checkpoint() -> None:
    clock = ManualClock()
    gate = InputGate(3, aligned_timeout_s=1.0, clock=clock)
    gate.put(0, ["a1"])
    gate.put(0, Barrier(1, 0.0))
    gate.put(0, ["a2"])  # after the barrier on 0: held, then delivered, never in flight
    gate.put(1, ["b1"])  # delivered before the barrier: in the snapshot
    assert _drain(gate) == [(0, ["a1"]), (1, ["b1"])]
    gate.put(1, ["b2"])  # still before channel 1's barrier: in flight after the switch
    gate.put(2, ["c1"])
    gate.put(1, Barrier(1, 0.0))
    clock.now = 1.0
    items = _drain(gate)
    # channel 2's barrier is not queued yet: its items are captured as they arrive
    assert items == [_b(1, True), (0, ["a2"]), (1, ["b2"]), (2, ["c1"])]
    gate.put(2, ["c2"])
    gate.put(2, Barrier(1, 0.0))
    gate.put(2, ["c3"])
    assert _drain(gate) == [
        (2, ["c2"]),
        (CONTROL, InFlightData(1, ((1, ["b2"]), (2, ["c1"]), (2, ["c2"])))),
        (2, ["c3"]),
    ]
    assert gate.stats[1]["unaligned"] is True
    assert gate.stats[1]["alignment_ms"] == 1000.0
    assert gate.stats[1]["in_flight_records"] == 3


def test_timed_out_alignment_copies_queued_in_flight_items_at_once() -> None:
    clock = ManualClock()
    gate = InputGate(2, aligned_timeout_s=0.5, clock=clock)
    gate.put(0, Barrier(1, 0.0))
    assert _drain(gate) == []  # aligning: channel 0 blocked
    gate.put(1, ["b1"])
    gate.put(1, ["b2"])
    gate.put(1, Barrier(1, 0.0))
    gate.put(1, ["b3"])
    clock.now = 0.5
    # channel 1's barrier is queued: its in-flight items are copied at once, before
    # the task works off the backlog
    assert _drain(gate) == [
        _b(1, True),
        (CONTROL, InFlightData(1, ((1, ["b1"]), (1, ["b2"])))),
        (1, ["b1"]),
        (1, ["b2"]),
        (1, ["b3"]),
    ]


def test_barrier_older_than_the_timeout_starts_unaligned() -> None:
    clock = ManualClock()
    clock.now = 5.0
    gate = InputGate(2, aligned_timeout_s=1.0, clock=clock)
    gate.put(1, ["b1"])
    gate.put(0, Barrier(1, 3.0))
    gate.put(1, Barrier(1, 3.0))
    assert _drain(gate) == [
        (1, ["b1"]),
        (CONTROL, Barrier(1, 3.0, True)),
        (CONTROL, InFlightData(1, ())),
    ]
    assert gate.stats[1]["start_delay_ms"] == 2000.0


def test_an_upstream_switch_makes_the_checkpoint_unaligned_here() -> None:
    gate = InputGate(2, aligned_timeout_s=10.0, clock=ManualClock())
    gate.put(0, Barrier(1))
    gate.put(1, ["b1"])
    gate.put(1, ["b2"])
    gate.put(1, Barrier(1, 0.0, unaligned=True))  # overtakes b1 and b2
    assert _drain(gate) == [
        _b(1, True),
        (CONTROL, InFlightData(1, ((1, ["b1"]), (1, ["b2"])))),
        (1, ["b1"]),
        (1, ["b2"]),
    ]


def test_urgent_hands_over_a_timed_out_barrier_while_records_wait() -> None:
    clock = ManualClock()
    gate = InputGate(2, aligned_timeout_s=1.0, clock=clock)
    gate.put(0, Barrier(1))
    gate.put(1, ["b1"])
    assert gate.next(timeout=0) == (1, ["b1"])
    assert gate.urgent() is None
    clock.now = 2.0
    assert gate.urgent() == Barrier(1, 0.0, True)


def test_next_wakes_at_the_alignment_deadline() -> None:
    gate = InputGate(2, aligned_timeout_s=0.02)
    gate.put(0, Barrier(1, gate._clock()))
    assert gate.next(timeout=0) is None
    # nothing else arrives: a long wait ends at the deadline with the barrier
    item = gate.next(timeout=30)
    assert item is not None and item[1].unaligned and item[1].checkpoint_id == 1


# -- unaligned ---------------------------------------------------------------------------------
def test_unaligned_barrier_overtakes_buffered_records() -> None:
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, "a1")
    gate.put(1, "b1")
    gate.put(0, Barrier(1))
    gate.put(0, "a2")  # after the barrier on channel 0: not in flight
    gate.put(1, "b2")  # before the barrier on channel 1: in flight
    gate.put(1, Barrier(1))
    gate.put(1, "b3")
    items = _drain(gate)
    # the barrier goes first, ahead of everything queued, and the in-flight items are
    # copied from the inbox at once: the task need not work off the backlog first
    assert items == [
        _b(1, True),
        (CONTROL, InFlightData(1, ((0, "a1"), (1, "b1"), (1, "b2")))),
        (0, "a1"),
        (1, "b1"),
        (0, "a2"),
        (1, "b2"),
        (1, "b3"),
    ]


def test_unaligned_barrier_that_arrives_after_an_item_was_taken() -> None:
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, "a1")
    gate.put(1, "b1")
    assert gate.next(timeout=0) == (0, "a1")  # consumed before any barrier: not in flight
    gate.put(0, Barrier(1))
    gate.put(1, Barrier(1))
    gate.put(0, "a2")
    assert _drain(gate) == [
        _b(1, True),
        (CONTROL, InFlightData(1, ((1, "b1"),))),
        (1, "b1"),
        (0, "a2"),
    ]


def test_unaligned_capture_follows_arrival_when_the_barrier_was_not_buffered() -> None:
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, Barrier(1))
    assert _drain(gate) == [_b(1, True)]
    gate.put(0, "a")  # channel 0 passed the barrier: not captured
    gate.put(1, "b")  # channel 1 did not: captured
    gate.put(1, EndOfInput())  # an ended channel no longer owes the barrier
    assert _drain(gate) == [(0, "a"), (1, "b"), (CONTROL, InFlightData(1, ((1, "b"),)))]


def test_unaligned_newer_barrier_cancels_the_capture() -> None:
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, Barrier(1))
    assert _drain(gate) == [_b(1, True)]
    gate.put(1, Barrier(2))  # channel 1 never carried barrier 1
    gate.put(0, Barrier(2))
    gate.put(0, Barrier(1))  # stale: ignored
    assert _drain(gate) == [
        (CONTROL, CancelledBarrier(1)),
        _b(2, True),
        (CONTROL, InFlightData(2, ())),
    ]


def test_unaligned_barrier_never_waits_for_a_full_inbox() -> None:
    gate = InputGate(2, capacity=2, mode=BarrierMode.UNALIGNED)
    gate.put(0, ["a1"])
    gate.put(1, ["b1"])  # the inbox is full now
    gate.put(0, Barrier(1))  # would block forever in this thread if it queued behind them
    assert _drain(gate) == [_b(1, True), (0, ["a1"]), (1, ["b1"])]
    gate.put(1, Barrier(1))  # b1 was sent before it: in flight
    gate.put(1, ["b2"])
    assert _drain(gate) == [
        (CONTROL, InFlightData(1, ((0, ["a1"]), (1, ["b1"])))),
        (1, ["b2"]),
    ]


# -- at-least-once -------------------------------------------------------------------------------
def test_at_least_once_never_blocks_and_emits_once_all_channels_saw_the_barrier() -> None:
    gate = InputGate(2, mode=BarrierMode.AT_LEAST_ONCE)
    gate.put(0, "a1")
    gate.put(0, Barrier(1))
    gate.put(0, "a2")  # delivered at once: would be held back in aligned mode
    gate.put(1, "b1")
    gate.put(1, Barrier(1))
    gate.put(1, "b2")
    assert _drain(gate) == [(0, "a1"), (0, "a2"), (1, "b1"), _b(1), (1, "b2")]


def test_at_least_once_newer_complete_barrier_cancels_older_ones() -> None:
    gate = InputGate(2, mode=BarrierMode.AT_LEAST_ONCE)
    gate.put(0, Barrier(1))
    gate.put(0, Barrier(2))
    gate.put(1, Barrier(2))
    gate.put(1, Barrier(1))  # too late: 2 was handed over already
    assert _drain(gate) == [(CONTROL, CancelledBarrier(1)), _b(2)]


# -- the inbox: capacity, blocking, debloating ---------------------------------------------------
def test_closed_gate_releases_a_blocked_sender() -> None:
    gate = InputGate(1, capacity=1)
    gate.put(0, ["fills the inbox"])
    sender = threading.Thread(target=gate.put, args=(0, ["blocked"]), name="test-sender")
    sender.start()
    gate.close()
    sender.join(timeout=5)
    assert not sender.is_alive()


def test_a_blocked_sender_runs_its_wait_hook() -> None:
    inbox = Inbox(1, capacity=1)
    inbox.send(0, [1])
    calls: list[int] = []

    def hook() -> None:
        calls.append(1)
        if len(calls) == 3:
            inbox.get(0)  # room: the sender goes on

    inbox.reserve(0)
    inbox.put(0, [2], on_wait=hook, poll_s=0.001)
    assert len(calls) == 3
    assert inbox.queued() == [(0, [2])]


def test_capacity_counts_records_and_events_never_wait() -> None:
    inbox = Inbox(1, capacity=3)
    inbox.send(0, [1, 2, 3])  # admitted: the lane was empty
    inbox.send(0, Watermark(5))  # no records: never waits
    inbox.send(0, Barrier(1))
    assert inbox.queued_records == 3
    blocked = threading.Thread(target=inbox.send, args=(0, [4]), name="test-sender")
    blocked.start()
    blocked.join(timeout=0.05)
    assert blocked.is_alive()
    inbox.get(0)
    blocked.join(timeout=5)
    assert not blocked.is_alive()


def test_debloating_sizes_the_inbox_to_the_measured_throughput() -> None:
    clock = ManualClock()
    options = DebloatOptions(target_s=0.1, period_s=1.0)
    gate = InputGate(1, capacity=10_000, debloat=options, clock=clock)
    assert gate.inbox.capacity == 64  # small until measured
    for _ in range(16):
        gate.put(0, list(range(125)))
        assert gate.next(timeout=0) is not None
        clock.now += 0.0625  # 2,000 records in 1 s of busy time: 2,000 records/s
    gate.next(timeout=0)
    assert gate.inbox.capacity == 200  # 0.1 s of 2,000 records/s
    assert gate.inbox.batch_hint() == 50


def test_an_idle_period_keeps_the_measured_capacity() -> None:
    # Regression: with nothing delivered, an idle period measured 0 records/s and halved
    # the rate each period, down to the minimum, while the sender was merely stalled.
    clock = ManualClock()
    options = DebloatOptions(target_s=0.1, period_s=1.0)
    gate = InputGate(1, capacity=10_000, debloat=options, clock=clock)
    for _ in range(16):
        gate.put(0, list(range(125)))
        assert gate.next(timeout=0) is not None
        clock.now += 0.0625
    gate.next(timeout=0)
    assert gate.inbox.capacity == 200
    start = clock.now
    times = iter([start + t for i in range(5) for t in (i, i + 1.0)])
    gate._clock = lambda: next(times)
    for _ in range(5):  # idle: each wait of 1 s (the clock moves inside it) brings nothing
        assert gate.next(timeout=0) is None
    assert gate.inbox.capacity == 200


def test_a_bursty_backpressured_receiver_is_measured_by_its_real_throughput() -> None:
    # Regression: a backpressured task drains in bursts (a short period at full speed,
    # then a long one blocked on output); smoothing the per-period ratios weighed the
    # short fast period like the long slow one: 1,052 records/s here for 200 real.
    clock = ManualClock()
    options = DebloatOptions(target_s=1.0, period_s=0.05, window_s=100.0)
    gate = InputGate(1, capacity=10_000, debloat=options, clock=clock)
    gate.put(0, list(range(100)))
    assert gate.next(timeout=0) is not None
    clock.now += 0.05  # 100 records in 50 ms
    gate.put(0, list(range(100)))
    assert gate.next(timeout=0) is not None
    clock.now += 0.95  # 100 records in 950 ms (blocked on output most of it)
    assert gate.next(timeout=0) is None
    assert abs(gate.inbox.capacity - 200) <= 2  # 1 s of 200 records per s (decay: 199)


def test_a_barrier_reports_the_records_queued_ahead_of_it() -> None:
    gate = InputGate(2)
    for _ in range(3):
        gate.put(0, list(range(10)))
    gate.put(1, list(range(5)))
    gate.put(0, Barrier(1))  # behind 35 records
    gate.put(1, Barrier(1))  # behind 35 as well (the lane is shared), none taken yet
    out = _drain(gate)
    assert out[-1] == _b(1)
    assert gate.stats[1]["ahead_records"] == 35
    gate.put(0, [1])
    gate.put(0, Barrier(2))
    gate.put(1, Barrier(2))
    _drain(gate)
    assert gate.stats[2]["ahead_records"] == 1


def test_a_capture_started_among_held_items_captures_the_held_ones() -> None:
    # Found by the random interleavings: the alignment of 1 times out while channel 1
    # holds 2's barrier and channel 0 holds a record before its own barrier of 2. Taking
    # the held items again cancels 1 and starts 2 unaligned; the record still held is
    # before 2's barrier on channel 0, so it belongs to 2's in-flight data.
    clock = ManualClock()
    gate = InputGate(3, aligned_timeout_s=1.0, clock=clock)
    for channel, element in [
        (0, Barrier(1, 0.0)),
        (1, Barrier(1, 0.0)),
        (1, Barrier(2, 0.0)),
        (0, ["r0"]),
        (2, ["r1"]),
        (0, Barrier(2, 0.0)),
        (2, Barrier(1, 0.0)),
        (2, Barrier(2, 0.0)),
    ]:
        gate.put(channel, element)
    assert gate.next(timeout=0) == (2, ["r1"])  # 0 and 1 are aligned on 1, 2 is not
    clock.now = 1.2  # the alignment of 1 timed out
    out = _drain(gate)
    assert out == [
        _b(1, unaligned=True),
        (CONTROL, CancelledBarrier(1)),
        _b(2, unaligned=True),
        (0, ["r0"]),
        (CONTROL, InFlightData(2, ((0, ["r0"]),))),
    ]


# -- random interleavings ---------------------------------------------------------------------
def _script(draw: Callable[..., Any], channels: int, checkpoints: int) -> list[list[Any]]:
    """Per channel: record batches (unique ids) and the barriers, in channel order."""
    scripts: list[list[Any]] = []
    next_id = 0
    for _ in range(channels):
        items: list[Any] = []
        for cid in range(1, checkpoints + 2):
            for _ in range(draw(st.integers(0, 3))):
                items.append([next_id])
                next_id += 1
            if cid <= checkpoints:
                items.append(Barrier(cid, 0.0))
        scripts.append(items)
    return scripts


@st.composite
def _runs(draw: Callable[..., Any]) -> tuple[BarrierMode, float | None, list[Any], list[Any]]:
    mode = draw(st.sampled_from(list(BarrierMode)))
    timeout = draw(st.sampled_from([None, 1.0])) if mode is BarrierMode.ALIGNED else None
    channels = draw(st.integers(2, 3))
    scripts = _script(draw, channels, draw(st.integers(1, 2)))
    # one schedule: which channel sends next, when the task takes an element, when the
    # clock passes the alignment timeout
    moves = [c for c, s in enumerate(scripts) for _ in s]
    moves += [-1] * draw(st.integers(0, len(moves))) + [-2] * draw(st.integers(0, 3))
    steps = draw(st.permutations(moves))
    return mode, timeout, scripts, steps


@settings(max_examples=400, deadline=None)
@given(_runs())
def test_every_mode_on_random_interleavings(
    run: tuple[BarrierMode, float | None, list[list[Any]], list[int]],
) -> None:
    mode, timeout, scripts, steps = run
    clock = ManualClock()
    gate = InputGate(len(scripts), mode=mode, aligned_timeout_s=timeout, clock=clock)
    sent = [0] * len(scripts)
    out: list[Any] = []
    for step in steps:
        if step == -2:
            clock.now += 0.6  # two such steps pass the timeout
        elif step == -1:
            item = gate.next(timeout=0)
            if item is not None:
                out.append(item)
        elif sent[step] < len(scripts[step]):
            gate.put(step, scripts[step][sent[step]])
            sent[step] += 1
    out += _drain(gate)

    # every record exactly once, in its channel's order
    delivered = [(c, e[0]) for c, e in out if c != CONTROL]
    records = {c: [e[0] for e in s if isinstance(e, list)] for c, s in enumerate(scripts)}
    assert sorted(r for _, r in delivered) == sorted(r for rs in records.values() for r in rs)
    for c, rs in records.items():
        assert [r for ch, r in delivered if ch == c] == rs

    barriers = {e.checkpoint_id for s in scripts for e in s if isinstance(e, Barrier)}
    cancelled = {e.checkpoint_id for c, e in out if isinstance(e, CancelledBarrier)}
    for cid in sorted(barriers - cancelled):
        pre = {
            e[0]
            for s in scripts
            for e in s[: s.index(next(x for x in s if x == Barrier(cid, 0.0)))]
            if isinstance(e, list)
        }
        position = next(
            i for i, (c, e) in enumerate(out) if isinstance(e, Barrier) and e.checkpoint_id == cid
        )
        handed = out[position][1]
        before = {e[0] for c, e in out[:position] if c != CONTROL}
        if mode is BarrierMode.AT_LEAST_ONCE:
            assert pre <= before  # a restore replays the rest: duplicates, no loss
            continue
        in_flight = [e for c, e in out if isinstance(e, InFlightData) and e.checkpoint_id == cid]
        if not handed.unaligned:
            assert not in_flight
            assert before == pre  # the snapshot holds exactly the records before it
            continue
        assert mode is BarrierMode.UNALIGNED or timeout is not None
        assert len(in_flight) == 1
        captured = {b[0] for _, b in in_flight[0].batches}
        assert not before & captured
        assert before | captured == pre  # snapshot + channel state: exactly the records


# -- what a barrier overtook that is not persisted -----------------------------------------
def test_an_unaligned_barrier_counts_the_watermarks_and_ends_it_overtook() -> None:
    """Watermarks and end-of-input markers are not persisted (restored sources emit them
    again), but the job's end needs to know a final checkpoint overtook them (seed 107
    of the kill test: a final barrier overtook the maximum watermark, the job ended, and
    the last windows never fired)."""
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, Barrier(1))
    gate.put(1, "b1")
    gate.put(1, Watermark(99))  # before channel 1's barrier: overtaken, queued
    gate.put(1, Barrier(1))
    items = _drain(gate)
    assert items[:2] == [_b(1, True), (CONTROL, InFlightData(1, ((1, "b1"),)))]
    assert gate.stats[1]["overtaken_control"] == 1
    gate.put(0, Barrier(2))
    assert _drain(gate)[0] == _b(2, True)
    gate.put(1, Watermark(120))  # overtaken as it arrives (channel 1 owes barrier 2)
    gate.put(1, EndOfInput())
    _drain(gate)
    assert gate.stats[2]["overtaken_control"] == 2
    assert gate.stats[2]["in_flight_records"] == 0


def test_an_aligned_barrier_overtakes_nothing() -> None:
    gate = InputGate(2)
    gate.put(0, Watermark(5))
    gate.put(0, Barrier(1))
    gate.put(1, Watermark(7))
    gate.put(1, Barrier(1))
    _drain(gate)
    assert gate.stats[1]["unaligned"] is False
    assert gate.stats[1]["overtaken_control"] == 0


def test_a_timed_out_alignment_counts_what_it_overtook() -> None:
    clock = ManualClock()
    gate = InputGate(2, aligned_timeout_s=0.5, clock=clock)
    gate.put(0, Barrier(1, 0.0))
    assert _drain(gate) == []
    gate.put(1, ["b1"])
    gate.put(1, Watermark(50))
    gate.put(1, Barrier(1, 0.0))
    clock.now = 0.5
    assert _drain(gate)[:2] == [_b(1, True), (CONTROL, InFlightData(1, ((1, ["b1"]),)))]
    assert gate.stats[1]["overtaken_control"] == 1
