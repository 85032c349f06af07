"""Barrier alignment in the input gate (aligned, exactly-once mode)."""

from __future__ import annotations

from typing import Any

from coordinator.channels import CONTROL, Barrier, CancelledBarrier, InputGate


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
