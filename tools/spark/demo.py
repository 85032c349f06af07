"""The main job on Spark: a streaming query with its keyed state in this backend, killed and
restarted, verified against a failure-free computation.

``python -m tools.spark.demo`` (what ``make demo`` runs) writes the demo's seeded event
stream (:mod:`tools.demo_job`: per user a count, a sum, the last five items and counts per
category) as JSON files into ``demo-data/spark/input``, one file per micro-batch, and runs
the query in a driver process on ``local[2]``: a file source, the stateful step (2 key-group
ranges, state on local disk, SQLite metadata in ``demo-data/spark/store``), output
committed as Parquet into ``demo-data/spark/output``. It kills the driver with SIGKILL at random moments,
restarts it until the input is done, then checks that the committed output and the final
checkpointed state equal a failure-free computation, prints a summary and exits non-zero
if anything did not match.

``python -m tools.spark.demo driver ...`` is one run of the query; it prints one JSON line
per micro-batch for the parent to read.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tools.demo import percentile

JOB = "demo-spark"
OPERATOR = "user-stats"
OUTPUT_SCHEMA = "user string, count long, total long"


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def write_inputs(input_dir: str, events_per_source: int, per_batch: int, seed: int) -> int:
    """The demo's two source streams, interleaved in order, one JSON file per batch.

    ``seq`` is the event's position: each user belongs to one source stream, so ordering
    a batch by ``seq`` replays every user's events in their generated order. Returns the
    number of files.
    """
    from tools.demo_job import DemoConfig, events

    config = DemoConfig(events_per_source=events_per_source, seed=seed)
    streams = [events(config, s, config.source_parallelism, 0) for s in range(2)]
    rows: list[dict[str, Any]] = []
    for pair in zip(*streams, strict=True):
        for user, (item, cents, category) in pair:
            rows.append({"seq": len(rows), "user": user, "item": item, "cents": cents, "category": category})  # fmt: skip
    os.makedirs(input_dir, exist_ok=True)
    files = 0
    for start in range(0, len(rows), per_batch):
        path = os.path.join(input_dir, f"events-{files:05d}.json")
        with open(path, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows[start : start + per_batch])
        os.utime(path, (1_700_000_000 + files, 1_700_000_000 + files))  # batch order
        files += 1
    return files


def driver(args: argparse.Namespace) -> int:
    """One run of the query until the input is processed (``availableNow``)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers: this venv, not python3 on PATH
    from pyspark.sql import SparkSession

    from coordinator.spark import Fault, stateful
    from tools.demo_job import UserStats

    spark = (
        SparkSession.builder.master("local[2,4]")  # up to 4 attempts per task
        .appName("changelog-state-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    faults = tuple(
        Fault(int(b), int(s), point) for b, s, point in (f.split(":") for f in args.fault)
    )
    events = (
        spark.readStream.schema("seq long, user string, item string, cents long, category string")
        .option("maxFilesPerTrigger", 1)
        .json(os.path.join(args.data, "input"))
    )
    _emit({"event": "started"})
    steps, queries = [], []
    for backend in backends_of(args):  # one query per state store, on the same input
        where = backend_dir(args.data, args, backend)
        step = stateful(
            UserStats,
            key="user",
            values=["item", "cents", "category"],
            output_schema=OUTPUT_SCHEMA,
            job=JOB,
            operator=OPERATOR,
            store=os.path.join(where, "store"),
            output=os.path.join(where, "output"),
            state_backend=backend,
            parallelism=args.parallelism,
            order_by="seq",
            materialization_interval_s=args.materialization_interval,
            local_dir=os.path.join(args.data, "local"),  # shared: a socket path is short
            faults=faults,
            before_deliver=_crash_at(args.crash_after_record, backend),
        )

        def each(df: Any, batch_id: int, step: Any = step, backend: str = backend) -> None:
            step(df, batch_id)
            progress = step.progress[-1]
            _emit(
                {"event": "batch", "backend": backend, "parallelism": args.parallelism, **progress}
            )

        steps.append(step)
        queries.append(
            events.writeStream.foreachBatch(each)
            .option("checkpointLocation", os.path.join(where, "spark-checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
    for query in queries:
        query.awaitTermination()
    _emit({"event": "finished"})
    for step in steps:
        step.close()
    spark.stop()
    return 0


def backends_of(args: argparse.Namespace) -> list[str]:
    """The state stores to run (``--state-backend``, repeatable; heap if none)."""
    return list(dict.fromkeys(args.state_backend or ["heap"]))


def backend_dir(data: str, args: argparse.Namespace, backend: str) -> str:
    """Where one store's query keeps its state, output and checkpoint: ``data`` itself
    with one state store, ``data/<backend>`` with several (the input and the state
    servers' ``local`` directory are shared)."""
    return data if len(backends_of(args)) == 1 else os.path.join(data, backend)


def _crash_at(batches: list[int], backend: str) -> Any:
    """A hook that kills this driver right after checkpoint ``b`` (in ``batches``) of the
    ``backend`` query is recorded, before its output is committed: the restarted query
    must find ``b`` complete and deliver its output again, not process it again."""
    marker_dir = os.environ.get("DEMO_SPARK_CRASHED_DIR", "")

    def hook(checkpoint: Any) -> None:
        marker = os.path.join(marker_dir, f"crashed-{backend}-{checkpoint.checkpoint_id}")
        if checkpoint.checkpoint_id in batches and not os.path.exists(marker):
            open(marker, "w").close()  # once per batch, across driver runs
            os.kill(os.getpid(), signal.SIGKILL)

    return hook if batches else None


def run_driver(cmd: list[str], kill_after_s: float | None) -> tuple[list[dict[str, Any]], int]:
    """Run one driver; SIGKILL it ``kill_after_s`` seconds after its first batch ended
    (so every run gets somewhere, and the kill lands in a later batch, at any phase)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read(stream: Any) -> None:  # the reader thread: the pipe's lines, then None
        for line in stream:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, args=(proc.stdout,), name="demo-driver-out")
    reader.start()
    events: list[dict[str, Any]] = []
    deadline: float | None = None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            os.kill(proc.pid, signal.SIGKILL)  # a real crash: no cleanup, nothing flushed
            kill_after_s = None
            deadline = None
            continue
        if line is None:
            break
        try:
            event = json.loads(line)
        except ValueError:
            continue
        events.append(event)
        if event.get("event") == "batch" and deadline is None and kill_after_s is not None:
            deadline = time.monotonic() + kill_after_s
    reader.join()
    proc.stdout.close()
    return events, proc.wait()


def verify(data: str, events_per_source: int, seed: int) -> tuple[bool, bool, int, int]:
    """(output matched, state matched, rows, expected rows) against a failure-free run."""
    import pyarrow.parquet as pq

    from coordinator.metadata import MetadataStore
    from dstl.fileio import FileIO
    from tools.demo_job import DemoConfig, reference
    from tools.restore import plan_restore, restore_operator

    expected_rows, expected_state = reference(
        DemoConfig(events_per_source=events_per_source, seed=seed)
    )
    output_dir = os.path.join(data, "output")
    rows: list[tuple[str, int, int]] = []
    if os.path.isdir(output_dir):
        table = pq.read_table(output_dir)
        rows = sorted(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))
    store_dir = os.path.join(data, "store")
    store = MetadataStore.for_local_store(store_dir, create=False)
    latest = store.latest(JOB)
    store.close()
    state_ok = False
    if latest is not None:
        plan = plan_restore(latest, os.path.join(data, "restored"))
        snapshot = restore_operator(FileIO(store_dir), plan.operators[OPERATOR])
        state = {
            name: {k: v for entries in table.values() for k, v in entries.items()}
            for name, table in snapshot.tables.items()
        }
        state_ok = state == expected_state
    return rows == expected_rows, state_ok, len(rows), len(expected_rows)


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What a demo run did and found (with several state stores: the counts are the
    smallest of any store's, ``parallelisms`` those every store processed batches at)."""

    ok: bool
    killed: int
    replayed: int
    restores: int
    output_ok: bool
    state_ok: bool
    parallelisms: tuple[int, ...] = ()  # of the batches processed (not re-delivered)


def run_demo(args: argparse.Namespace) -> int:
    """Kill-and-restart the query until done, verify, print the summary; 0 if all matched."""
    return 0 if run(args).ok else 1


def run(args: argparse.Namespace) -> DemoResult:
    """:func:`run_demo`, returning what happened."""
    from coordinator.spark.server import stop_servers

    data = os.path.abspath(args.data)
    if os.path.exists(data):
        shutil.rmtree(data)
    files = write_inputs(os.path.join(data, "input"), args.events, args.per_batch, args.seed)

    backends = backends_of(args)

    def cmd(run: int) -> list[str]:  # every other run at the other parallelism, if given
        parallelism = args.rescale if args.rescale and run % 2 else args.parallelism
        return [
            sys.executable, "-m", "tools.spark.demo", "driver",
            "--data", data,
            *[a for b in backends for a in ("--state-backend", b)],
            "--parallelism", str(parallelism),
            "--materialization-interval", str(args.materialization_interval),
            *[a for f in args.fault for a in ("--fault", f)],
            *[a for b in args.crash_after_record for a in ("--crash-after-record", str(b))],
        ]  # fmt: skip

    os.environ["DEMO_SPARK_CRASHED_DIR"] = data
    rng = random.Random(args.seed)
    started = time.monotonic()
    runs: list[tuple[list[dict[str, Any]], int]] = []
    try:
        for _ in range(args.kills):
            runs.append(run_driver(cmd(len(runs)), rng.uniform(args.kill_min_s, args.kill_max_s)))
            if runs[-1][1] == 0:
                break  # done before the kill
        code = 0
        for _ in range(args.kills + len(backends) * len(args.crash_after_record) + 3):
            events, code = run_driver(cmd(len(runs)), None)
            runs.append((events, code))
            if code == 0:
                break
    finally:
        stop_servers(os.path.join(data, "local"))
    elapsed = time.monotonic() - started
    killed = sum(1 for _, c in runs if c == -signal.SIGKILL)
    finished = bool(runs) and runs[-1][1] == 0
    ranges = f"{args.parallelism} ranges" + (
        f", {args.rescale} every other run" if args.rescale else ""
    )
    print(
        f"demo job on Spark (local[2], {ranges}): file source -> stateful step -> committed Parquet"
    )
    print(f"  input: {2 * args.events} events in {files} files (one per micro-batch)")
    print(f"  driver runs: {len(runs)}, {killed} killed with SIGKILL, last exit "
          f"{runs[-1][1] if runs else '?'}; wall time {elapsed:.1f} s")  # fmt: skip
    results = []
    for backend in backends:
        where = backend_dir(data, args, backend)
        batches = [
            e
            for events, _ in runs
            for e in events
            if e.get("event") == "batch" and e.get("backend") == backend
        ]
        processed = [b for b in batches if not b.get("replayed")]
        replayed = len(batches) - len(processed)
        durations = [float(b["batch_ms"]) for b in processed]
        output_ok, state_ok, got, expected = verify(where, args.events, args.seed)
        ok = finished and output_ok and state_ok and (killed > 0 or args.kills == 0)
        ok = ok and replayed >= len(args.crash_after_record)
        restores = sum(int(b.get("restores", 0)) for b in processed)
        parallelisms = tuple(sorted({int(b["parallelism"]) for b in processed}))
        rows = [
            ("batches", f"{len(processed)} processed (some twice after a kill), "
                        f"{replayed} found complete and re-delivered"),
            ("batch duration", f"p50 {percentile(durations, 0.5):.0f} ms, p99 {percentile(durations, 0.99):.0f} ms"),
            ("restores", f"{restores} range restores in {len(processed)} batches "
                         f"(after a kill, a task failure or a rescale only)"),
            ("output matched", f"{'yes' if output_ok else 'NO'} ({got} rows, expected {expected})"),
            ("final state matched", "yes" if state_ok else "NO"),
        ]  # fmt: skip
        width = max(len(k) for k, _ in rows)
        print(f"  {backend} state store:")
        for k, v in rows:
            print(f"    {k.ljust(width)}  {v}")
        results.append(
            DemoResult(ok, killed, replayed, restores, output_ok, state_ok, parallelisms)
        )
    statectl = os.path.relpath(os.path.join(os.path.dirname(sys.executable), "statectl"))
    print("\nThe store is kept; try:")
    store = os.path.join(backend_dir(data, args, backends[0]), "store")
    print(f"  {statectl} checkpoints list --store {os.path.relpath(store)}")
    result = DemoResult(
        all(r.ok for r in results),
        killed,
        min(r.replayed for r in results),
        min(r.restores for r in results),
        all(r.output_ok for r in results),
        all(r.state_ok for r in results),
        tuple(sorted(set.intersection(*(set(r.parallelisms) for r in results)))),
    )
    print("\nRESULT: " + ("OK" if result.ok else "MISMATCH"))
    return result


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the demo and of its driver."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.spark.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", nargs="?", choices=["demo", "driver"], default="demo")
    parser.add_argument("--data", default="demo-data/spark")
    parser.add_argument("--events", type=int, default=30_000, help="events per source stream")
    parser.add_argument("--per-batch", type=int, default=3_000, help="events per micro-batch")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--state-backend",
        choices=["heap", "rocksdb"],
        action="append",
        help="heap (default) or rocksdb; repeat for one query per store in the same driver",
    )
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument(
        "--rescale", type=int, default=0, help="run every other driver at this parallelism"
    )
    parser.add_argument("--materialization-interval", type=float, default=5.0)
    parser.add_argument("--kills", type=int, default=3, help="driver runs killed with SIGKILL")
    parser.add_argument("--kill-min-s", type=float, default=4.0)
    parser.add_argument("--kill-max-s", type=float, default=12.0)
    parser.add_argument(
        "--fault", action="append", default=[], help="BATCH:TASK:POINT (mid|after) to inject"
    )
    parser.add_argument(
        "--crash-after-record",
        type=int,
        action="append",
        default=[],
        help="kill the driver once after this batch's checkpoint is recorded, before its output is committed",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m tools.spark.demo [driver] [options]``."""
    args = build_parser().parse_args(argv)
    return driver(args) if args.mode == "driver" else run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
