"""The embedded pipeline under backpressure: checkpoint latency per barrier mode.

The job: an unpaced generator source (2 subtasks) -> key_by -> a keyed count (2) ->
key_by -> a slow keyed stage (1 subtask, ``slow_ms`` per record: the sink side that
cannot keep up, an external call say) -> a collect sink. The slow stage sits in the
sink's position because a sink's publisher only runs at commit time; what matters here is
that the last stage is slower than its input, so every inbox before it fills and aligned
barriers queue behind records. Checkpoints every ``interval_s``; heap state, changelog on,
local disk, SQLite.

Cases, in the same run (the machine is shared and noisy: compare within one run). The
headline is what a user gets: every option at its default (aligned barriers, buffer
debloating at the default ``buffer-debloat.target-s``); the other barrier modes and a
sweep of targets are labelled cases beside it.

- ``debloated`` (the headline): aligned, debloating at the default target;
- ``aligned``: aligned, inboxes bounded only in records (16,384; debloating off), the
  baseline debloating is measured against;
- ``timeout``: the defaults, switching to unaligned 50 ms after the trigger;
- ``unaligned``: unaligned barriers at the default target;
- ``debloated-<T>``: aligned, debloating at target ``T`` seconds (the sweep the default
  was chosen from: a barrier waits behind about ``T`` per hop, so the checkpoint
  duration grows with ``T`` times the hops, here two);
- ``cpu-<T>`` / ``cpu-off``: the same job without the slow stage's sleep (CPU bound:
  small batches cost Python overhead per batch), for ``records_per_s`` only: debloating
  must not cost throughput.

Per case: checkpoint duration (trigger to record committed) p50/p99, the slowest
subtask's alignment duration and start delay p99, the data a barrier waited behind
(``ahead_kb``: the most queued ahead of it in any inbox when it was sent, p99), bytes
held or captured in flight (``in_flight_kb_p99``), the share of checkpoints that went
unaligned, ``records_per_s`` (records the last stage processed over the measured
window). Summary fields: ``checkpoint_p99_ms_aligned``, ``checkpoint_p99_ms_debloated``
(default settings), ``checkpoint_p99_ms_timeout``, ``checkpoint_p99_ms_unaligned``,
``records_per_s`` (default settings), ``throughput_vs_aligned`` (its ratio to the
case without debloating), ``debloated_over_unaligned_p99``,
``checkpoint_p99_ms_debloated_<T>`` per target of the sweep, ``records_per_s_cpu_<T>``
and ``cpu_throughput_vs_off`` (default target over debloating off, CPU bound).

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
    "ahead_kb_p99",
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
    """The slow last stage: ``seconds`` per record (none: no sleep), counting records in
    ``processed[0]``. Task thread only (one subtask; the sampler only reads)."""

    def __init__(self, seconds: float, processed: list[int]) -> None:
        self.seconds = seconds
        self.processed = processed

    def open(self, state: StateAccess) -> None:
        pass

    def process(self, key: Any, value: Any, ctx: Context) -> None:
        if self.seconds:
            time.sleep(self.seconds)
        self.processed[0] += 1
        ctx.emit(value[1])


def _record(rng: random.Random, i: int) -> tuple[str, int]:
    return (f"k{rng.randrange(KEYS)}", i)


def build(slow_s: float, sink: CollectSink, processed: list[int] | None = None) -> JobGraph:
    """The benchmark's job graph (the last stage counts its records in ``processed``)."""
    counter = processed if processed is not None else [0]
    job = PipelineBuilder("bench-pipeline")
    counts = (
        job.source("gen", GeneratorSource(_record, None, seed=3), 2)
        .key_by(lambda r: r[0], STR)
        .process("count", _Count, parallelism=2)
    )
    slow = counts.key_by(lambda r: r[0], STR).process(
        "slow", lambda: _Slow(slow_s, counter), parallelism=1
    )
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
        processed = [0]
        runtime = EmbeddedRuntime(
            build(slow_s, sink, processed),
            opts,
            on_checkpoint=checkpoints.append,
        )
        counts: list[float] = []
        timers = [
            threading.Timer(warmup_s, lambda: counts.append(processed[0])),
            threading.Timer(warmup_s + seconds, lambda: counts.append(processed[0])),
            threading.Timer(warmup_s + seconds, runtime.stop),
        ]
        started = time.time()  # records keep wall-clock trigger times
        for t in timers:
            t.start()
        try:
            runtime.run(restore=False)
        finally:
            for t in timers:
                t.cancel()
        # completed after the warm-up, triggered before the end: an aligned checkpoint
        # without debloating takes longer than the whole window (it counts once); one
        # still pending at stop() completes while the queues drain, at the same pace
        begin, end = started + warmup_s, started + warmup_s + seconds
        window = [cp for cp in checkpoints if cp.completed_at >= begin and cp.triggered_at < end]
        rate = (counts[1] - counts[0]) / seconds if len(counts) == 2 else 0.0
        return _summarize(name, window, rate)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _summarize(name: str, window: list[CompletedCheckpoint], rate: float) -> dict[str, Any]:
    durations, align, delay, ahead, in_flight, unaligned = [], [], [], [], [], 0
    for cp in window:
        durations.append((cp.completed_at - cp.triggered_at) * 1e3)
        stats = [s.stats for s in cp.subtasks if s.stats]
        align.append(max((s.get("alignment_ms", 0.0) for s in stats), default=0.0))
        delay.append(max((s.get("start_delay_ms", 0.0) for s in stats), default=0.0))
        ahead.append(max((s.get("ahead_bytes", 0) for s in stats), default=0) / 1024)
        in_flight.append(max((s.get("in_flight_bytes", 0) for s in stats), default=0) / 1024)
        unaligned += any(s.get("unaligned") for s in stats)
    return {
        "case": name,
        "checkpoints": len(window),
        "cp_p50_ms": round(_p(durations, 0.5), 1),
        "cp_p99_ms": round(_p(durations, 0.99), 1),
        "align_p99_ms": round(_p(align, 0.99), 1),
        "start_delay_p99_ms": round(_p(delay, 0.99), 1),
        "ahead_kb_p99": round(_p(ahead, 0.99), 1),
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


SWEEP_S = (0.005, 0.01, 0.02, 0.05, 0.1, 1.0)
"""Debloating targets measured beside the default (seconds; the default's case is the
headline ``debloated``)."""

CPU_SWEEP_S = (0.01, 0.05, 1.0)
"""Targets of the CPU-bound throughput cases (with the default and debloating off)."""


def _label(target_s: float) -> str:
    return f"{target_s * 1e3:g}ms"


def run(quick: bool) -> dict[str, Any]:
    """Every case in one run."""
    seconds, warmup_s = (6.0, 3.0) if quick else (20.0, 4.0)
    cpu_seconds, cpu_warmup_s = (3.0, 2.0) if quick else (8.0, 3.0)
    slow_s = 0.0005
    interval_s = 0.25
    default = RuntimeOptions(store_url="").debloat_target_s
    assert default is not None, "the bench measures debloating at its default target"
    aligned = BarrierMode.ALIGNED
    cases: dict[str, dict[str, Any]] = {
        "debloated": {"barrier_mode": aligned},
        "aligned": {"barrier_mode": aligned, "debloat_target_s": None},
        "timeout": {"barrier_mode": aligned, "aligned_timeout_s": 0.05},
        "unaligned": {"barrier_mode": BarrierMode.UNALIGNED},
    }
    sweep = [t for t in SWEEP_S if t != default]
    for t in sweep:
        cases[f"debloated-{_label(t)}"] = {"barrier_mode": aligned, "debloat_target_s": t}
    rows = []
    for name, options in cases.items():
        rows.append(
            _run_case(name, {**options, "interval_s": interval_s}, seconds, warmup_s, slow_s)
        )
    cpu_targets: list[float | None] = [None, *sorted({default, *CPU_SWEEP_S})]
    for target in cpu_targets:
        name = "cpu-off" if target is None else f"cpu-{_label(target)}"
        cpu = {"barrier_mode": aligned, "debloat_target_s": target, "interval_s": interval_s}
        rows.append(_run_case(name, cpu, cpu_seconds, cpu_warmup_s, 0.0))
    key_once, key_again = _key_costs(50_000 if quick else 200_000, 5 if quick else 9)
    by = {r["case"]: r for r in rows}
    unaligned_p99 = by["unaligned"]["cp_p99_ms"]
    off_rate = by["cpu-off"]["records_per_s"]
    return {
        "cases": rows,
        "slow_ms_per_record": slow_s * 1e3,
        "debloat_target_s": default,
        "interval_s": interval_s,
        "checkpoint_p99_ms_aligned": by["aligned"]["cp_p99_ms"],
        "checkpoint_p99_ms_debloated": by["debloated"]["cp_p99_ms"],
        "checkpoint_p99_ms_timeout": by["timeout"]["cp_p99_ms"],
        "checkpoint_p99_ms_unaligned": unaligned_p99,
        "records_per_s": by["debloated"]["records_per_s"],
        "throughput_vs_aligned": (
            round(by["debloated"]["records_per_s"] / by["aligned"]["records_per_s"], 2)
            if by["aligned"]["records_per_s"]
            else None
        ),
        "debloated_over_unaligned_p99": (
            round(by["debloated"]["cp_p99_ms"] / unaligned_p99, 2) if unaligned_p99 else None
        ),
        **{
            f"checkpoint_p99_ms_debloated_{_label(t)}": by[f"debloated-{_label(t)}"]["cp_p99_ms"]
            for t in sweep
        },
        **{
            f"records_per_s_cpu_{'off' if t is None else _label(t)}": by[
                "cpu-off" if t is None else f"cpu-{_label(t)}"
            ]["records_per_s"]
            for t in cpu_targets
        },
        "cpu_throughput_vs_off": (
            round(by[f"cpu-{_label(default)}"]["records_per_s"] / off_rate, 2) if off_rate else None
        ),
        "key_once_us": round(key_once, 3),
        "key_again_us": round(key_again, 3),
        "key_once_saving_us": round(key_again - key_once, 3),
    }
