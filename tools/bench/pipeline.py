"""The embedded pipeline under backpressure: checkpoint latency per barrier mode.

The job: an unpaced generator source (2 subtasks) -> key_by -> a keyed count (2) ->
key_by -> a slow keyed stage (1 subtask, ``slow_ms`` per record: the sink side that
cannot keep up, an external call say) -> a collect sink. The slow stage sits in the
sink's position because a sink's publisher only runs at commit time; what matters here is
that the last stage is slower than its input, so every inbox before it fills and aligned
barriers queue behind records. Checkpoints every ``interval_s``; heap state, changelog on,
local disk, SQLite.

Cases, in the same run (the machine is shared and noisy: compare within one run):

- ``aligned``: aligned barriers, inboxes bounded only in records (16,384, debloating off);
- ``debloated``: aligned, with buffer debloating at ``buffer-debloat.target-s`` =
  ``target_s`` (20 ms, labelled: the issue's latency goal needs less than the 1 s default,
  since a barrier waits behind about ``target_s`` of data at the slow input);
- ``debloated-1s``: the same at the default target, 1 s;
- ``timeout``: aligned, switching to unaligned 50 ms after the trigger (debloated);
- ``unaligned``: unaligned barriers (debloated).

Per case: checkpoint duration (trigger to record committed) p50/p99, the slowest
subtask's alignment duration and start delay p99, bytes in flight (the largest subtask's
estimate) p99, the share of checkpoints that went unaligned, ``records_per_s`` (records
the source emitted over the measured window). Summary fields:
``checkpoint_p99_ms_aligned``, ``checkpoint_p99_ms_debloated`` (and ``_debloated_1s``),
``checkpoint_p99_ms_timeout``, ``checkpoint_p99_ms_unaligned``, ``records_per_s`` (the
debloated case), and ``debloated_over_unaligned_p99``.

Also the key serialized and hashed once per record (issue 16): the sender serializes a
record's key to route it by key group and hands the bytes and group along; a keyed
operator that serialized and hashed it again paid for that twice. ``key_once_us`` and
``key_again_us`` are the per-record times of the same keyed function (a count in a heap
value state) fed ``(key, key bytes, key group)`` through ``KeyedRunner.process_keyed`` and
fed the key alone (serialized and hashed again by ``set_current_key``), medians over
paired rounds; ``key_once_saving_us`` is their difference.

``python -m tools.bench run pipeline [--quick] --json OUT``
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from backends import HeapKeyedStateBackend, KeyGroupRange
from backends.keygroups import key_group_for
from backends.serializers import INT64, STR
from backends.state import ValueStateDescriptor
from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import (
    CollectSink,
    Context,
    EmbeddedRuntime,
    GeneratorSource,
    PipelineBuilder,
    RuntimeOptions,
    StateAccess,
)
from coordinator.embedded.pipeline import JobGraph
from coordinator.functions import KeyedRunner
from coordinator.metadata import CompletedCheckpoint
from coordinator.options import BarrierMode

COLUMNS = [
    "case",
    "checkpoints",
    "cp_p50_ms",
    "cp_p99_ms",
    "align_p99_ms",
    "start_delay_p99_ms",
    "in_flight_kb_p99",
    "unaligned_share",
    "records_per_s",
]

KEYS = 1_000


class _Count:
    """A running count per key. Task thread only."""

    def open(self, state: StateAccess) -> None:
        self.count = state.get_state(ValueStateDescriptor("count", INT64))

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        ctx.emit((key, n))


class _Slow:
    """The slow last stage: ``seconds`` per record. Task thread only."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def open(self, state: StateAccess) -> None:
        pass

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        time.sleep(self.seconds)
        ctx.emit(value[1])


def _record(rng: random.Random, i: int) -> tuple[str, int]:
    return (f"k{rng.randrange(KEYS)}", i)


def build(slow_s: float, sink: CollectSink) -> JobGraph:
    """The benchmark's job graph."""
    job = PipelineBuilder("bench-pipeline")
    counts = (
        job.source("gen", GeneratorSource(_record, None, seed=3), 2)
        .key_by(lambda r: r[0], STR)
        .process("count", _Count, parallelism=2)
    )
    slow = counts.key_by(lambda r: r[0], STR).process("slow", lambda: _Slow(slow_s), parallelism=1)
    slow.sink("out", sink, parallelism=1)
    return job.build()


def _p(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _run_case(
    name: str, options: dict[str, Any], seconds: float, warmup_s: float, slow_s: float
) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix=f"bench-pipeline-{name}-")
    checkpoints: list[CompletedCheckpoint] = []
    try:
        opts = RuntimeOptions(
            store_url=root,
            checkpoint=CheckpointOptions(interval_s=options.pop("interval_s"), retain=2),
            **options,
        )
        sink = CollectSink()
        runtime = EmbeddedRuntime(
            build(slow_s, sink),
            opts,
            on_checkpoint=checkpoints.append,
        )
        started = time.time()  # records keep wall-clock trigger times
        timer = threading.Timer(warmup_s + seconds, runtime.stop)
        timer.start()
        try:
            runtime.run(restore=False)
        finally:
            timer.cancel()
        # completed after the warm-up, triggered before the end: an aligned checkpoint
        # without debloating takes longer than the whole window (it counts once); one
        # still pending at stop() completes while the queues drain, at the same pace
        begin, end = started + warmup_s, started + warmup_s + seconds
        window = [cp for cp in checkpoints if cp.completed_at >= begin and cp.triggered_at < end]
        return _summarize(name, window)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _summarize(name: str, window: list[CompletedCheckpoint]) -> dict[str, Any]:
    durations, align, delay, in_flight, unaligned = [], [], [], [], 0
    for cp in window:
        durations.append((cp.completed_at - cp.triggered_at) * 1e3)
        stats = [s.stats for s in cp.subtasks if s.stats]
        align.append(max((s.get("alignment_ms", 0.0) for s in stats), default=0.0))
        delay.append(max((s.get("start_delay_ms", 0.0) for s in stats), default=0.0))
        in_flight.append(max((s.get("in_flight_bytes", 0) for s in stats), default=0) / 1024)
        unaligned += any(s.get("unaligned") for s in stats)
    offsets = [sum(o for o in cp.source_offsets.values()) for cp in window]
    elapsed = window[-1].triggered_at - window[0].triggered_at if len(window) > 1 else 0.0
    rate = (offsets[-1] - offsets[0]) / elapsed if elapsed > 0 else 0.0
    return {
        "case": name,
        "checkpoints": len(window),
        "cp_p50_ms": round(_p(durations, 0.5), 1),
        "cp_p99_ms": round(_p(durations, 0.99), 1),
        "align_p99_ms": round(_p(align, 0.99), 1),
        "start_delay_p99_ms": round(_p(delay, 0.99), 1),
        "in_flight_kb_p99": round(_p(in_flight, 0.99), 1),
        "unaligned_share": round(unaligned / len(window), 2) if window else 0.0,
        "records_per_s": round(rate),
    }


def _key_costs(records: int, rounds: int) -> tuple[float, float]:
    """Per-record µs of a keyed count fed raw keys, then keys to serialize and hash again."""
    max_par = 128
    rng = random.Random(5)
    keys = [f"user-{rng.randrange(KEYS):06d}" for _ in range(records)]
    raw = []
    for k in keys:  # what the sender computed anyway, to route the record
        kb = STR.serialize(k)
        raw.append((k, kb, key_group_for(kb, max_par), 1, None))
    once, again = [], []
    for _ in range(rounds):
        for which in ("once", "again"):
            backend = HeapKeyedStateBackend(STR, KeyGroupRange(0, max_par), max_par)
            runner = KeyedRunner(_Count(), backend, lambda: 0)
            runner.open()
            out: list[Any] = []
            started = time.perf_counter()
            if which == "once":
                runner.process_keyed(raw, out.append)
                once.append(time.perf_counter() - started)
            else:
                for k in keys:
                    runner.process(k, 1, None, out.append)
                again.append(time.perf_counter() - started)
    per = 1e6 / records
    return statistics.median(once) * per, statistics.median(again) * per


def run(quick: bool) -> dict[str, Any]:
    """Every case in one run."""
    seconds, warmup_s = (6.0, 3.0) if quick else (20.0, 4.0)
    slow_s = 0.0005
    target_s = 0.02
    interval_s = 0.25
    aligned = BarrierMode.ALIGNED
    cases: dict[str, dict[str, Any]] = {
        "aligned": {"barrier_mode": aligned, "debloat_target_s": None},
        "debloated": {"barrier_mode": aligned, "debloat_target_s": target_s},
        "debloated-1s": {"barrier_mode": aligned, "debloat_target_s": 1.0},
        "timeout": {
            "barrier_mode": aligned,
            "debloat_target_s": target_s,
            "aligned_timeout_s": 0.05,
        },
        "unaligned": {"barrier_mode": BarrierMode.UNALIGNED, "debloat_target_s": target_s},
    }
    rows = []
    for name, options in cases.items():
        rows.append(
            _run_case(name, {**options, "interval_s": interval_s}, seconds, warmup_s, slow_s)
        )
    key_once, key_again = _key_costs(50_000 if quick else 200_000, 5 if quick else 9)
    by = {r["case"]: r for r in rows}
    unaligned_p99 = by["unaligned"]["cp_p99_ms"]
    return {
        "cases": rows,
        "slow_ms_per_record": slow_s * 1e3,
        "debloat_target_s": target_s,
        "interval_s": interval_s,
        "checkpoint_p99_ms_aligned": by["aligned"]["cp_p99_ms"],
        "checkpoint_p99_ms_debloated": by["debloated"]["cp_p99_ms"],
        "checkpoint_p99_ms_debloated_1s": by["debloated-1s"]["cp_p99_ms"],
        "checkpoint_p99_ms_timeout": by["timeout"]["cp_p99_ms"],
        "checkpoint_p99_ms_unaligned": unaligned_p99,
        "records_per_s": by["debloated"]["records_per_s"],
        "key_once_us": round(key_once, 3),
        "key_again_us": round(key_again, 3),
        "key_once_saving_us": round(key_again - key_once, 3),
        "debloated_over_unaligned_p99": (
            round(by["debloated"]["cp_p99_ms"] / unaligned_p99, 2) if unaligned_p99 else None
        ),
    }
