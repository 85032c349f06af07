"""Barrier handling in the input gate: aligned, unaligned and at-least-once modes."""

from __future__ import annotations

from typing import Any

from coordinator.embedded.channels import (
    CONTROL,
    Barrier,
    BarrierMode,
    CancelledBarrier,
    EndOfInput,
    InFlightData,
    InputGate,
)


def _drain(gate: InputGate) -> list[Any]:
    out = []
    while (item := gate.next(timeout=0)) is not None:
        out.append(item)
    return out


def test_records_behind_a_barrier_wait_for_the_other_channels() -> None:
    gate = InputGate(2)
    gate.put(0, "a1")
    gate.put(0, Barrier(1))
    gate.put(0, "a2")  # after the barrier on channel 0: held back
    gate.put(1, "b1")  # before the barrier on channel 1: delivered
    gate.put(1, Barrier(1))
    gate.put(1, "b2")
    assert _drain(gate) == [(0, "a1"), (1, "b1"), (CONTROL, Barrier(1)), (0, "a2"), (1, "b2")]


def test_held_items_may_contain_the_next_barrier() -> None:
    gate = InputGate(2)
    for element in ("a1", Barrier(1), "a2", Barrier(2), "a3"):
        gate.put(0, element)
    for element in ("b1", Barrier(1), "b2", Barrier(2)):
        gate.put(1, element)
    assert _drain(gate) == [
        (0, "a1"),
        (1, "b1"),
        (CONTROL, Barrier(1)),
        (0, "a2"),
        (1, "b2"),
        (CONTROL, Barrier(2)),
        (0, "a3"),
    ]


def test_newer_barrier_cancels_an_unfinished_alignment() -> None:
    gate = InputGate(2)
    gate.put(0, Barrier(1))
    gate.put(0, "a")
    gate.put(1, Barrier(2))  # channel 1 never saw barrier 1 (it was lost upstream)
    gate.put(0, Barrier(2))
    items = _drain(gate)
    assert items[0] == (1, CancelledBarrier(1))
    assert (CONTROL, Barrier(2)) in items
    assert items.index((0, "a")) < items.index((CONTROL, Barrier(2)))


def test_control_messages_bypass_alignment() -> None:
    gate = InputGate(2)
    gate.put(0, Barrier(1))
    gate.put(0, "held")
    gate.put_control("notify")
    assert _drain(gate) == [(CONTROL, "notify")]


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
        (CONTROL, Barrier(1)),
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
        (CONTROL, Barrier(1)),
        (CONTROL, InFlightData(1, ((1, "b1"),))),
        (1, "b1"),
        (0, "a2"),
    ]


def test_unaligned_capture_follows_arrival_when_the_barrier_was_not_buffered() -> None:
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, Barrier(1))
    assert _drain(gate) == [(CONTROL, Barrier(1))]
    gate.put(0, "a")  # channel 0 passed the barrier: not captured
    gate.put(1, "b")  # channel 1 did not: captured
    gate.put(1, EndOfInput())  # an ended channel no longer owes the barrier
    assert _drain(gate) == [(0, "a"), (1, "b"), (CONTROL, InFlightData(1, ((1, "b"),)))]


def test_unaligned_newer_barrier_cancels_the_capture() -> None:
    gate = InputGate(2, mode=BarrierMode.UNALIGNED)
    gate.put(0, Barrier(1))
    assert _drain(gate) == [(CONTROL, Barrier(1))]
    gate.put(1, Barrier(2))  # channel 1 never carried barrier 1
    gate.put(0, Barrier(2))
    gate.put(0, Barrier(1))  # stale: ignored
    assert (
        _drain(gate)
        == [
            (CONTROL, Barrier(2)),
            (CONTROL, CancelledBarrier(1)),
            (CONTROL, InFlightData(2, ())),
        ]
        or _drain(gate) == []
    )


def test_at_least_once_never_blocks_and_emits_once_all_channels_saw_the_barrier() -> None:
    gate = InputGate(2, mode=BarrierMode.AT_LEAST_ONCE)
    gate.put(0, "a1")
    gate.put(0, Barrier(1))
    gate.put(0, "a2")  # delivered at once: would be held back in aligned mode
    gate.put(1, "b1")
    gate.put(1, Barrier(1))
    gate.put(1, "b2")
    assert _drain(gate) == [(0, "a1"), (0, "a2"), (1, "b1"), (CONTROL, Barrier(1)), (1, "b2")]


def test_at_least_once_newer_complete_barrier_cancels_older_ones() -> None:
    gate = InputGate(2, mode=BarrierMode.AT_LEAST_ONCE)
    gate.put(0, Barrier(1))
    gate.put(0, Barrier(2))
    gate.put(1, Barrier(2))
    gate.put(1, Barrier(1))  # too late: 2 was handed over already
    assert _drain(gate) == [(CONTROL, CancelledBarrier(1)), (CONTROL, Barrier(2))]


def test_closed_gate_releases_a_blocked_sender() -> None:
    import threading

    gate = InputGate(1, capacity=1)
    gate.put(0, "fills the inbox")
    sender = threading.Thread(target=gate.put, args=(0, "blocked"), name="test-sender")
    sender.start()
    gate.close()
    sender.join(timeout=5)
    assert not sender.is_alive()


def test_unaligned_barrier_never_waits_for_a_full_inbox() -> None:
    gate = InputGate(2, capacity=2, mode=BarrierMode.UNALIGNED)
    gate.put(0, "a1")
    gate.put(1, "b1")  # the inbox is full now
    gate.put(0, Barrier(1))  # would block forever in this thread if it queued behind them
    assert _drain(gate) == [(CONTROL, Barrier(1)), (0, "a1"), (1, "b1")]
    gate.put(1, Barrier(1))  # b1 was sent before it: in flight
    gate.put(1, "b2")
    assert _drain(gate) == [(CONTROL, InFlightData(1, ((0, "a1"), (1, "b1")))), (1, "b2")]
