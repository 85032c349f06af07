"""The main job: run the demo pipeline, kill it, restore it, verify it.

``python -m tools.demo`` (what ``make demo-embedded`` runs) starts the demo pipeline in a
worker process on the embedded defaults (local directory ``demo-data/embedded/`` as durable
storage, beside the Spark demo's ``demo-data/spark/``,
SQLite metadata inside it), kills that process with SIGKILL after a few completed
checkpoints, restarts it from the latest completed checkpoint, and checks that the sink's
committed output and the final checkpointed state equal a failure-free run's. It prints a
summary and exits non-zero if anything did not match.

``python -m tools.demo worker ...`` is one attempt of the job; it prints one JSON line per
event (start, checkpoint, finish) on stdout for the parent to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from coordinator.checkpoint import CheckpointOptions
from coordinator.embedded import EmbeddedRuntime, RuntimeOptions
from coordinator.metadata import CompletedCheckpoint, MetadataStore
from coordinator.sink import read_output
from dstl.fileio import FileIO
from tools.demo_job import DemoConfig, pipeline, reference
from tools.restore import plan_restore, restore_operator

JOB = "demo"


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def worker(args: argparse.Namespace) -> int:
    """One attempt of the demo job; restores from the latest checkpoint if there is one."""
    config = DemoConfig(events_per_source=args.events, rate_per_source=args.rate or None)
    store_dir = os.path.abspath(args.store)
    options = RuntimeOptions(
        store_url=store_dir,
        checkpoint=CheckpointOptions(interval_s=args.checkpoint_interval, retain=2),
        materialization_interval_s=args.materialization_interval,
        state_backend=args.state_backend,
        changelog_enabled=args.changelog == "on",
    )

    def on_checkpoint(cp: CompletedCheckpoint) -> None:
        _emit(
            {
                "event": "checkpoint",
                "id": cp.checkpoint_id,
                **{k: v for k, v in cp.stats.items() if k != "subtask_stats"},
            }
        )

    runtime = EmbeddedRuntime(
        pipeline(config, os.path.join(store_dir, "output"), JOB),
        options,
        on_checkpoint=on_checkpoint,
    )
    result = runtime.run()
    _emit(
        {
            "event": "finished",
            "attempt": result.attempt,
            "restored_from": result.restored_from,
            "restore_ms": round(result.restore_s * 1e3, 3),
            "state_entries": result.state_entries,
            "materializations": result.materializations,
        }
    )
    return 0


def _run_worker(cmd: list[str], kill_after: int | None) -> tuple[list[dict[str, Any]], int]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    events: list[dict[str, Any]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        events.append(event)
        checkpoints = sum(1 for e in events if e["event"] == "checkpoint")
        if kill_after is not None and checkpoints >= kill_after:
            os.kill(proc.pid, signal.SIGKILL)  # a real crash: no cleanup, no final checkpoint
            break
    proc.stdout.close()
    return events, proc.wait()


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _flatten(tables: dict[str, dict[int, dict[Any, Any]]]) -> dict[str, dict[Any, Any]]:
    out: dict[str, dict[Any, Any]] = {}
    for name, table in tables.items():
        merged: dict[Any, Any] = {}
        for entries in table.values():
            merged.update(entries)
        out[name] = merged
    return out


def run_demo(args: argparse.Namespace) -> int:
    """Kill-and-restore the job, verify, print the summary; 0 only if everything matched."""
    store_dir = os.path.abspath(args.store)
    if os.path.exists(store_dir):
        shutil.rmtree(store_dir)
    os.makedirs(store_dir)
    base = [
        sys.executable, "-m", "tools.demo", "worker",
        "--store", store_dir,
        "--events", str(args.events),
        "--rate", str(args.rate),
        "--checkpoint-interval", str(args.checkpoint_interval),
        "--materialization-interval", str(args.materialization_interval),
        "--state-backend", args.state_backend,
        "--changelog", args.changelog,
    ]  # fmt: skip
    started = time.monotonic()
    first, code1 = _run_worker(base, kill_after=args.kill_after)
    killed = code1 == -signal.SIGKILL
    second, code2 = _run_worker(base, kill_after=None)
    elapsed = time.monotonic() - started
    finished = next((e for e in second if e["event"] == "finished"), None)

    config = DemoConfig(events_per_source=args.events)
    expected_rows, expected_state = reference(config)
    output = read_output(FileIO(os.path.join(store_dir, "output")))
    got_rows = sorted((r[0], r[1], r[2]) for r in output)
    output_ok = got_rows == expected_rows

    store = MetadataStore.for_local_store(store_dir, create=False)
    latest = store.latest(JOB)
    store.close()
    state_ok = False
    if latest is not None:
        plan = plan_restore(latest, os.path.join(store_dir, "restored"))
        snapshot = restore_operator(FileIO(store_dir), plan.operators["user-stats"])
        state_ok = _flatten(snapshot.tables) == expected_state

    cps = [e for e in first + second if e["event"] == "checkpoint"]
    durations = [float(e["duration_ms"]) for e in cps]
    new_bytes = [float(e["bytes_new"]) for e in cps]
    ok = killed and code2 == 0 and finished is not None and output_ok and state_ok
    rows = [
        ("checkpoints completed", f"{len(cps)} ({sum(1 for e in first if e['event'] == 'checkpoint')} before the kill)"),
        ("checkpoint duration", f"p50 {percentile(durations, 0.5):.1f} ms, p99 {percentile(durations, 0.99):.1f} ms"),
        ("bytes per checkpoint", f"new p50 {percentile(new_bytes, 0.5) / 1024:.1f} KiB, p99 {percentile(new_bytes, 0.99) / 1024:.1f} KiB"),
        ("state size", f"{finished['state_entries'] if finished else '?'} entries, "
                       f"{(cps[-1]['bytes_total'] / 1024) if cps else 0:.1f} KiB referenced"),
        ("materializations", f"{finished['materializations'] if finished else '?'} after the restore"),
        ("killed", "yes (SIGKILL)" if killed else f"NO (exit {code1})"),
        ("restore time", f"{finished['restore_ms']:.1f} ms from checkpoint {finished['restored_from']}" if finished else "?"),
        ("output matched", f"{'yes' if output_ok else 'NO'} ({len(got_rows)} rows, expected {len(expected_rows)})"),
        ("final state matched", "yes" if state_ok else "NO"),
        ("wall time", f"{elapsed:.1f} s"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print(
        f"demo job: {2 * args.events} events, 2 sources -> keyed operator x2 -> transactional sink"
    )
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}")
    statectl = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "statectl"))
    store = os.path.relpath(store_dir)
    # beside the store, not inside it (restore refuses to write into a store)
    restored = os.path.relpath(os.path.join(os.path.dirname(store_dir), "restored"))
    print("\nThe store is kept; try:")
    print(f"  {statectl} checkpoints list --store {store}")
    if latest is not None:
        print(
            f"  {statectl} restore --store {store} --checkpoint {latest.checkpoint_id} -o {restored}"
        )
    print("\nRESULT: " + ("OK" if ok else "MISMATCH"))
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the demo and of its worker."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", nargs="?", choices=["demo", "worker"], default="demo")
    parser.add_argument("--store", default="demo-data/embedded")
    parser.add_argument("--events", type=int, default=60_000, help="events per source subtask")
    parser.add_argument(
        "--rate", type=float, default=12_000.0, help="events/s per source subtask (0: unthrottled)"
    )
    parser.add_argument("--checkpoint-interval", type=float, default=1.0)
    parser.add_argument("--materialization-interval", type=float, default=3.0)
    parser.add_argument(
        "--kill-after", type=int, default=3, help="completed checkpoints before the kill"
    )
    parser.add_argument("--state-backend", choices=["heap", "rocksdb"], default="heap")
    parser.add_argument(
        "--changelog",
        choices=["on", "off"],
        default="on",
        help="off: every checkpoint is a full snapshot",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m tools.demo [worker] [options]``."""
    args = build_parser().parse_args(argv)
    return worker(args) if args.mode == "worker" else run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
