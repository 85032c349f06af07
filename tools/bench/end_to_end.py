"""End to end: a keyed count and sum over many keys, killed with SIGKILL and restored.

The workload (:mod:`tools.bench.workload`): one source, one keyed operator keeping a
count and a sum per key (two ``ValueState[int64]`` with default 0), checkpoints every
second, default materialization, default DSTL options, local disk, SQLite. The first
``keys`` records load every key once; then keys are uniform (the headline) or drawn from
1% of the keys (``hot``, labelled). Each case runs in a worker process: the load, then
``seconds`` of measurement, then SIGKILL; then a second worker restores from the latest
completed checkpoint and stops. Cases: heap and RocksDB, changelog on and off, uniform
and hot keys, and ``long-log`` (labelled: uniform keys with materialization off, so the
restore replays every change since the start, millions of them: what the
``replay_changes_per_s`` headline measures; the short log a kill leaves at default
settings measures fixed costs); the peer (Apache Flink, :mod:`tools.bench.peers`) runs
in the same run when its virtualenv can be made.

Per case: ``records_per_s`` (measurement window), ``records_per_s_mat`` (only while a
materialization is in flight: snapshot to upload done) over ``records_per_s_idle``
(none in flight) as ``mat_throughput_ratio`` (the headline
``materialization_whole_run_ratio_heap`` is the stricter reading: the uniform case's
records/s over the long-log case's, where nothing materializes; the pair runs a second
time at the end, in the other order, and both pairs are summed); checkpoint duration
p50/p99; ``own_p99_ms`` (our own part: everything but the barriers' travel and wait in
queues, see :func:`_own_steps`; ``own_old_p99_ms`` the narrower meaning used before) and
``own_steps`` (p50/p99 of each step of it; ``own_ms`` each checkpoint's: the headline
``own_checkpoint_p99_ms`` pools those of every uniform changelog-on case, see
:func:`_own_pooled`; ``own_slowest`` the steps of the slowest three, see
:func:`_slowest`); materialization duration (sync + upload)
p50/max and its sync part p50/max; ``log_at_kill`` (change records the
restore has to replay); ``restore_s`` (the restarted worker building its tasks, restore
included) and ``replay_per_s`` (changes replayed per second: read, fold and load of the
log, timed by the restore itself and logged; materialized tables not included);
``space_amp`` (the largest full checkpoint of the window over the live state, one
compact zstd Parquet table per state) and what that checkpoint is made of, ``amp_mat``
(materialized files) and ``amp_log`` (log segments) over the live state; files and bytes
new per checkpoint; peak RSS. The headline ``space_amplification`` is the worst of the
uniform cases (both stores, 1M and 100k keys), ``space_amplification_hot`` the hot-key
cases' beside it.

``python -m tools.bench run end-to-end [--quick] --json OUT``; the worker is
``python -m tools.bench.end_to_end worker ...`` (one attempt, JSON lines on stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from statistics import median
from typing import Any

COLUMNS = [
    "system",
    "store",
    "changelog",
    "keys",
    "pattern",
    "records_per_s",
    "mat_throughput_ratio",
    "runq_s_per_s_mat",
    "runq_s_per_s_idle",
    "cp_p50_ms",
    "cp_p99_ms",
    "own_p99_ms",
    "own_old_p99_ms",
    "mat_p50_s",
    "mat_max_s",
    "mat_sync_max_ms",
    "log_at_kill",
    "restore_s",
    "replay_per_s",
    "replay_per_cpu_s",
    "space_amp",
    "amp_mat",
    "amp_log",
    "files_per_cp",
    "bytes_per_cp",
    "peak_rss_mb",
    "child_cpu_per_mat_s",
    "snapshot_helper_cores",
    "encoder_helper_cores",
    "minflt_per_s",
]

OPERATOR = "count-sum"
JOB = "e2e"


# -- the worker (one attempt, in its own process) --------------------------------------
_EMIT_LOCK = threading.Lock()


def _emit(event: dict[str, Any]) -> None:
    """One JSON line on stdout. Under a lock: the sampler, the log handler and the task
    threads emit, and ``print`` writes the text and the newline separately, so two
    events could share a line the parent cannot parse (a lost ``restored`` event made
    ``replay_per_s`` None)."""
    line = json.dumps(event) + "\n"
    with _EMIT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


class _LogEvents(logging.Handler):
    """Forwards the materializer's and the restore's log lines as events."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith(("materialized ", "restored ", "checkpoint completed ")):
            _emit({"event": "log", "t": record.created, "msg": record.getMessage()})


def worker(args: argparse.Namespace) -> int:
    """One attempt: run (``--restore-only``: restore, take the final checkpoint, stop)."""
    from backends.serializers import INT64
    from backends.state import ValueStateDescriptor
    from coordinator.checkpoint import CheckpointOptions
    from coordinator.embedded import (
        Context,
        EmbeddedRuntime,
        OperatorSpec,
        Pipeline,
        RuntimeOptions,
        SinkSpec,
        SourceSpec,
        StateAccess,
    )
    from coordinator.metadata import CompletedCheckpoint
    from tools.bench.workload import records

    handler = _LogEvents(logging.INFO)
    for name in ("materializer.materializer", "backends.restore", "coordinator.checkpoint"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)

    class CountSum:
        """The keyed function: count and sum per key. Task thread only."""

        def __init__(self) -> None:
            self.n = 0

        def open(self, state: StateAccess) -> None:
            self.count = state.get_state(ValueStateDescriptor("count", INT64, default=0))
            self.sum = state.get_state(ValueStateDescriptor("sum", INT64, default=0))

        def process(self, key: Any, value: Any, ctx: Context) -> None:
            self.count.update(self.count.value() + 1)
            self.sum.update(self.sum.value() + value)
            self.n += 1

    functions: list[CountSum] = []

    def function() -> CountSum:
        functions.append(CountSum())
        return functions[-1]

    def source(_subtask: int, _parallelism: int, offset: int) -> Iterator[tuple[int, int]]:
        return iter(()) if args.restore_only else records(args.keys, args.hot, offset)

    store = os.path.abspath(args.store)
    options = RuntimeOptions(
        store_url=store,
        checkpoint=CheckpointOptions(interval_s=1.0),
        state_backend=args.backend,
        changelog_enabled=args.changelog == "on",
        materialization="offline" if args.long_log else "online",  # offline: log only
        local_dir=os.path.join(store, "local"),
    )

    def on_checkpoint(cp: CompletedCheckpoint) -> None:
        stats = dict(cp.stats)
        subtasks = stats.pop("subtask_stats", {})
        op = subtasks.get(f"{OPERATOR}/0", {})
        _emit(
            {
                "event": "checkpoint",
                "id": cp.checkpoint_id,
                "subtask_stats": subtasks,
                "t": time.time(),
                "commit_ms": (time.time() - cp.completed_at) * 1e3,
                "offset": cp.states_of("source")[0].offset,
                "operator": op,
                **_size_breakdown(cp),
                **stats,
            }
        )

    def sample() -> None:
        while True:
            time.sleep(0.2)
            n = functions[0].n if functions else 0
            _emit({"event": "sample", "t": time.time(), "n": n, "rss_kb": _rss_kb(), **_usage()})

    pipeline = Pipeline(
        JOB,
        SourceSpec("source", 1, source),
        OperatorSpec(OPERATOR, 1, INT64, function),
        SinkSpec("sink", os.path.join(store, "output")),
    )
    threading.Thread(target=sample, name="bench-sampler", daemon=True).start()
    runtime = EmbeddedRuntime(pipeline, options, on_checkpoint=on_checkpoint)
    _emit({"event": "start", "t": time.time()})
    result = runtime.run()
    _emit({"event": "finished", "restore_s": result.restore_s, "rss_kb": _rss_kb()})
    return 0


def _size_breakdown(cp: Any) -> dict[str, int]:
    """What the operator's part of checkpoint ``cp`` is made of: bytes of materialized
    files (``bytes_mat``), of log segments (``bytes_log``), and the log's change rows."""
    from backends.handles import KeyedStateHandle

    mat: dict[str, int] = {}
    seg: dict[str, int] = {}
    rows = 0
    for s in cp.states_of(OPERATOR):
        for h in s.handles:
            if not isinstance(h, KeyedStateHandle):
                continue
            for m in h.materialized:
                mat.update((r.location, r.size_bytes) for r in m.file_refs())
            for c in h.changelog:
                seg[c.location] = c.size_bytes
                rows += c.rows
    return {"bytes_mat": sum(mat.values()), "bytes_log": sum(seg.values()), "log_rows": rows}


def _usage() -> dict[str, float]:
    """CPU seconds and minor page faults so far of this process and of its reaped
    children (the forked snapshots: the fork path reaps each; the snapshot helper of
    :mod:`backends.snapshot_helper` only once it has ended)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return {
        "cpu_s": me.ru_utime + me.ru_stime,
        "minflt": me.ru_minflt,
        "child_cpu_s": kids.ru_utime + kids.ru_stime,
        "child_minflt": kids.ru_minflt,
        "runq_s": _runq_s(),
        **_helpers_cpu(),
    }


def _runq_s() -> float:
    """Seconds this process's live threads have spent so far runnable but waiting for a
    core (field 2 of each ``/proc/self/task/<tid>/schedstat``)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/schedstat") as fh:
            total += int(fh.read().split()[1])
    return total / 1e9


HELPERS = ("snapshot_helper", "encoder_helper")
"""The long-lived helper processes (:mod:`backends.snapshot_helper`, :mod:`dstl.encoder`):
never reaped while the worker runs, so ``RUSAGE_CHILDREN`` never counts them."""

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _helpers_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's helpers (:data:`HELPERS`), each
    ``<name>_cpu_s`` (0 while it is not running): their pids from the modules that run
    them, their CPU from ``/proc/<pid>/stat``."""
    from backends.snapshot_helper import running_helper
    from dstl.encoder import shared_encoder

    snapshot = running_helper(start=False)
    pids = (snapshot.pid if snapshot is not None else None, shared_encoder().pid)
    return {f"{name}_cpu_s": _cpu_s(pid) for name, pid in zip(HELPERS, pids, strict=True)}


def _cpu_s(pid: int | None) -> float:
    """User and system CPU seconds of process ``pid`` (fields 14 and 15 of its stat); 0
    for none, or one that ended before the read."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _rss_kb() -> int:
    """Peak resident set size of this process (VmHWM), in KiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


# -- the parent --------------------------------------------------------------------------
class _Worker:
    """A worker process and the events it printed (read on a thread of our own)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="bench-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(event)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def processed(self) -> int:
        samples = [e for e in self.snapshot() if e["event"] == "sample"]
        return samples[-1]["n"] if samples else 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)  # a real crash: no cleanup, no final checkpoint
        self.finish()

    def finish(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout)
        self._reader.join()
        return code


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _parse_fields(msg: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in msg.split():
        key, sep, value = part.partition("=")
        if sep:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def _materializations(events: list[dict[str, Any]]) -> list[tuple[float, float, dict[str, float]]]:
    """(start, end, fields) of every materialization the worker logged."""
    out = []
    for e in events:
        if e["event"] == "log" and e["msg"].startswith("materialized "):
            f = _parse_fields(e["msg"])
            total_s = (f.get("duration_ms", 0.0) + f.get("sync_ms", 0.0)) / 1e3
            out.append((e["t"] - total_s, e["t"], f))
    return out


def _throughput(
    samples: list[dict[str, Any]], windows: list[tuple[float, float]], field: str = "n"
) -> tuple[float, float]:
    """Records/s (or another counter of the samples, ``field``, a second) while a
    materialization is in flight, and while none is."""
    busy = [0.0, 0.0]  # records, seconds
    idle = [0.0, 0.0]
    for a, b in itertools.pairwise(samples):
        dt, dn = b["t"] - a["t"], b[field] - a[field]
        mid = (a["t"] + b["t"]) / 2
        into = busy if any(s <= mid <= e for s, e in windows) else idle
        into[0] += dn
        into[1] += dt
    return (busy[0] / busy[1] if busy[1] else 0.0, idle[0] / idle[1] if idle[1] else 0.0)


def _checkpoint_facts(store: str) -> dict[str, Any]:
    """Log rows and bytes of the latest completed checkpoint (what a restore reads)."""
    from backends.handles import KeyedStateHandle
    from coordinator.metadata import MetadataStore

    meta = MetadataStore.for_local_store(store, create=False)
    try:
        latest = meta.latest(JOB)
    finally:
        meta.close()
    if latest is None:
        return {"checkpoint_id": None, "log_at_kill": 0}
    rows = 0
    handles = [
        h for s in latest.states_of(OPERATOR) for h in s.handles if isinstance(h, KeyedStateHandle)
    ]
    for h in handles:
        blocks = {(c.location, c.block): c.rows for c in h.changelog}
        rows += sum(blocks.values())
    return {"checkpoint_id": latest.checkpoint_id, "log_at_kill": rows, "handles": handles}


def _live_bytes(store: str, handles: list[Any]) -> int:
    """The live state as one compact zstd Parquet table per state."""
    from backends.tables import table_for
    from dstl.fileio import FileIO
    from tools.bench.harness import live_parquet_bytes
    from tools.restore import restore_operator

    snapshot = restore_operator(FileIO(store), tuple(handles))
    return sum(
        live_parquet_bytes(table_for(meta, snapshot.key_serializer, snapshot.tables.get(n, {})))
        for n, meta in sorted(snapshot.metas.items())
    )


def _worker_cmd(store: str, case: dict[str, Any], restore_only: bool) -> list[str]:
    cmd = [
        sys.executable, "-m", "tools.bench.end_to_end", "worker",
        "--store", store,
        "--backend", case["store"],
        "--changelog", case["changelog"],
        "--keys", str(case["keys"]),
        "--hot", str(case["hot"]),
    ]  # fmt: skip
    if case.get("long_log"):
        cmd.append("--long-log")
    return [*cmd, "--restore-only"] if restore_only else cmd


def run_case(
    store_kind: str, changelog: str, keys: int, pattern: str, seconds: float
) -> dict[str, Any]:
    """One case of ours: run, kill, restore; see the module docstring for the fields."""
    hot = max(1, keys // 100) if pattern == "hot" else 0
    case = {
        "store": store_kind,
        "changelog": changelog,
        "keys": keys,
        "hot": hot,
        "long_log": pattern == "long-log",
    }
    root = tempfile.mkdtemp(prefix="bench-e2e-")
    try:
        store = os.path.join(root, "store")
        os.makedirs(store)
        w = _Worker(_worker_cmd(store, case, restore_only=False))
        deadline = time.monotonic() + 600
        while w.processed() < keys and time.monotonic() < deadline and w.proc.poll() is None:
            time.sleep(0.2)
        loaded_at = time.time()
        time.sleep(seconds)
        w.kill()
        events = w.snapshot()
        facts = _checkpoint_facts(store)
        started = time.monotonic()
        r = _Worker(_worker_cmd(store, case, restore_only=True))
        code = r.finish(timeout=900)
        restart_s = time.monotonic() - started
        revents = r.snapshot()
        # The same state, read from the restored worker's final checkpoint: the killed
        # run's files may be gone once that checkpoint subsumed them.
        after = _checkpoint_facts(store)
        live = _live_bytes(store, after.get("handles", [])) if after["checkpoint_id"] else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _summarize(case, pattern, events, revents, facts, live, loaded_at, code, restart_s)


def _summarize(
    case: dict[str, Any],
    pattern: str,
    events: list[dict[str, Any]],
    revents: list[dict[str, Any]],
    facts: dict[str, Any],
    live: int,
    loaded_at: float,
    restore_exit: int,
    restart_s: float,
) -> dict[str, Any]:
    samples = [e for e in events if e["event"] == "sample" and e["t"] >= loaded_at]
    cps = [e for e in events if e["event"] == "checkpoint" and e["t"] >= loaded_at]
    mats = [m for m in _materializations(events) if m[1] >= loaded_at]
    rate = (
        (samples[-1]["n"] - samples[0]["n"]) / (samples[-1]["t"] - samples[0]["t"])
        if len(samples) > 1
        else 0.0
    )
    windows = [(s, e) for s, e, _ in mats]
    busy, idle = _throughput(samples, windows)
    runq = _throughput(samples, windows, "runq_s") if samples and "runq_s" in samples[0] else None
    durations = [float(c["duration_ms"]) for c in cps]
    steps = _own_steps(cps, events)
    mat_s = [e - s for s, e, _ in mats]
    biggest = max(cps, key=lambda c: c["bytes_total"], default=None)
    finished = next((e for e in revents if e["event"] == "finished"), None)
    replay = [
        _parse_fields(e["msg"])
        for e in revents
        if e["event"] == "log" and e["msg"].startswith("restored ")
    ]
    replayed = sum(f.get("changes", 0.0) for f in replay)
    replay_s = sum(f.get("replay_ms", 0.0) for f in replay) / 1e3
    replay_cpu_s = sum(f.get("replay_cpu_ms", 0.0) for f in replay) / 1e3
    return {
        "system": "ours",
        "store": case["store"],
        "changelog": case["changelog"],
        "keys": case["keys"],
        "pattern": pattern,
        "records_per_s": round(rate),
        "records_per_s_mat": round(busy),
        "records_per_s_idle": round(idle),
        "mat_throughput_ratio": round(busy / idle, 3) if busy and idle else None,
        # the worker's threads' seconds a second waiting for a core, during / outside a
        # materialization (the snapshot helper's thread competes for the cores)
        "runq_s_per_s_mat": round(runq[0], 3) if runq and mats else None,
        "runq_s_per_s_idle": round(runq[1], 3) if runq else None,
        "checkpoints": len(cps),
        "cp_p50_ms": round(_pct(durations, 0.5), 1),
        "cp_p99_ms": round(_pct(durations, 0.99), 1),
        "own_p99_ms": steps.pop("own_p99_ms"),
        "own_old_p99_ms": steps.pop("own_old_p99_ms"),
        "own_ms": steps.pop("own_ms"),
        "own_slowest": steps.pop("own_slowest"),
        "own_steps": steps,
        "materializations": len(mats),
        "mat_p50_s": round(median(mat_s), 3) if mat_s else None,
        "mat_max_s": round(max(mat_s), 3) if mat_s else None,
        "mat_sync_p50_ms": round(median(f.get("sync_ms", 0.0) for _, _, f in mats), 1)
        if mats
        else None,
        "mat_sync_max_ms": round(max(f.get("sync_ms", 0.0) for _, _, f in mats), 1)
        if mats
        else None,
        "log_at_kill": facts["log_at_kill"],
        "restore_s": round(finished["restore_s"], 3) if finished else None,
        "restart_s": round(restart_s, 3),
        "restore_exit": restore_exit,
        "replay_per_s": round(replayed / replay_s) if replay_s > 0 else None,
        # per second of the restoring process's CPU: what the replay costs, whatever else
        # runs on the machine
        "replay_per_cpu_s": round(replayed / replay_cpu_s) if replay_cpu_s > 0 else None,
        "replayed": int(replayed),
        "live_bytes": live,
        "space_amp": round(biggest["bytes_total"] / live, 3) if biggest and live else None,
        # what the largest checkpoint is made of, over the live state
        "amp_mat": round(biggest.get("bytes_mat", 0) / live, 3) if biggest and live else None,
        "amp_log": round(biggest.get("bytes_log", 0) / live, 3) if biggest and live else None,
        "amp_log_rows": biggest.get("log_rows") if biggest else None,
        "files_per_cp": round(median(c["files_new"] for c in cps), 1) if cps else None,
        "bytes_per_cp": round(median(c["bytes_new"] for c in cps)) if cps else None,
        "peak_rss_mb": round(max((e.get("rss_kb", 0) for e in events), default=0) / 1024, 1),
        **_cpu_facts(samples, len(mats)),
    }


def _cpu_facts(samples: list[dict[str, Any]], materializations: int) -> dict[str, Any]:
    """Over the measured samples: the worker's cores in use (its own CPU seconds a
    second), its minor page faults a second, its forked snapshot children's CPU
    seconds and page faults per materialization (a child counts once reaped), and each
    live helper's cores in use (``snapshot_helper_cores``: materializations' encoding;
    ``encoder_helper_cores``: the log's pre-emptive segments)."""
    if len(samples) < 2 or "cpu_s" not in samples[0]:
        return {}
    first, last = samples[0], samples[-1]
    wall = last["t"] - first["t"]
    mats = max(materializations, 1)
    out = {
        "worker_cores": round((last["cpu_s"] - first["cpu_s"]) / wall, 3),
        "minflt_per_s": round((last["minflt"] - first["minflt"]) / wall),
        "child_cpu_per_mat_s": round((last["child_cpu_s"] - first["child_cpu_s"]) / mats, 3),
        "child_minflt_per_mat": round((last["child_minflt"] - first["child_minflt"]) / mats),
    }
    for name in HELPERS:  # a helper started (or restarted) mid-window: from 0
        key = f"{name}_cpu_s"
        if key in last:
            used = last[key] - first.get(key, 0.0)
            out[f"{name}_cores"] = round(max(used, 0.0) / wall, 3)
    return out


OWN_STEPS = (  # (name, where): the steps of our own part of a checkpoint, in order
    ("trigger_ms", "coordinator"),  # reserving the id, before the barrier is injected
    ("snapshot_ms", "operator"),  # barrier at the operator: its task thread's part
    ("compaction_check_ms", "operator"),  # ... of which looking for offline compactions
    ("persist_queue_ms", "operator"),  # the persist waiting for the upload thread
    ("persist_window_ms", "operator"),  # ... in the segment-sharing window
    ("encode_ms", "operator"),  # ... encoding the segment
    ("write_ms", "operator"),  # ... writing it durably (write, fsync, link, dir fsync)
    ("async_ms", "operator"),  # barrier at the operator until its state is durable
    ("async_ms", "sink"),  # barrier at the sink until its transaction is staged
    ("ack_delay_ms", "coordinator"),  # the last ack, sent until the coordinator took it
    ("record_ms", "coordinator"),  # the metadata commit
    ("commit_ms", "coordinator"),  # the last ack taken until the listener ran
)


def _own_steps(cps: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Our own part of each checkpoint, p50/p99 of each of its steps, and two totals.

    ``own_old_p99_ms`` (the meaning until this round): the operator's barrier-to-durable
    time plus the coordinator's commit. ``own_p99_ms``: everything of ours on the
    checkpoint's critical path that is not a barrier travelling or waiting in a queue:
    reserving the id, the slowest subtask's barrier-to-durable time (the sink's too), the
    last ack reaching the coordinator, and the commit; it includes the old meaning.
    """
    recorded: dict[int, tuple[float, float]] = {}  # id: (record_ms, record_cpu_ms)
    for e in events:
        if e["event"] == "log" and e["msg"].startswith("checkpoint completed "):
            f = _parse_fields(e["msg"])
            recorded[int(f.get("id", -1))] = (f.get("record_ms", 0.0), f.get("record_cpu_ms", 0.0))
    rows = []
    for c in cps:
        subtasks = c.get("subtask_stats", {})
        sink: dict[str, Any] = next((v for k, v in subtasks.items() if k.startswith("sink/")), {})
        row = {f"{k}@operator": float(v) for k, v in c["operator"].items() if _number(v)}
        row.update({f"{k}@sink": float(v) for k, v in sink.items() if _number(v)})
        for k in ("trigger_ms", "ack_delay_ms", "commit_ms"):
            row[f"{k}@coordinator"] = float(c.get(k, 0.0))
        row["record_ms@coordinator"], row["record_cpu_ms@coordinator"] = recorded.get(
            c["id"], (0.0, 0.0)
        )
        slowest = max(row.get("async_ms@operator", 0.0), row.get("async_ms@sink", 0.0))
        row["own_old"] = row.get("async_ms@operator", 0.0) + row["commit_ms@coordinator"]
        row["own"] = (
            row["trigger_ms@coordinator"]
            + slowest
            + row["ack_delay_ms@coordinator"]
            + row["commit_ms@coordinator"]
        )
        row["id"] = c["id"]
        rows.append(row)
    out: dict[str, Any] = {
        "own_ms": [round(r["own"], 1) for r in rows],  # each checkpoint's, for a pooled p99
        "own_slowest": _slowest(rows),
        "own_p99_ms": round(_pct([r["own"] for r in rows], 0.99), 1),
        "own_old_p99_ms": round(_pct([r["own_old"] for r in rows], 0.99), 1),
    }
    for name, where in OWN_STEPS:
        values = [r[f"{name}@{where}"] for r in rows if f"{name}@{where}" in r]
        if values:
            key = f"{where}.{name}"
            out[key] = {"p50": round(_pct(values, 0.5), 1), "p99": round(_pct(values, 0.99), 1)}
    # Not in ms: the blocks the barrier's upload wrote, its own and those still waiting
    # for the pre-emptive lane (its backlog, taken along).
    blocks = [r["upload_blocks@operator"] for r in rows if "upload_blocks@operator" in r]
    if blocks:
        out["operator.upload_blocks"] = {"p50": _pct(blocks, 0.5), "max": max(blocks)}
    return out


SLOWEST = 3
"""How many of a case's slowest checkpoints :func:`_slowest` describes."""

_SLOWEST_STEPS = (
    *(f"{name}@{where}" for name, where in OWN_STEPS),
    "encode_cpu_ms@operator",  # of encode_ms, the upload thread's CPU
    "record_cpu_ms@coordinator",  # of record_ms, the committer's CPU
    "upload_blocks@operator",
)


def _slowest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The :data:`SLOWEST` checkpoints of largest own part, slowest first: id, own part
    and each step of it (see :data:`OWN_STEPS`, with the CPU beside the encoding and the
    record), so a run's note can say what made its tail without running it again."""
    out = []
    for r in sorted(rows, key=lambda r: r["own"], reverse=True)[:SLOWEST]:
        steps = {k: round(r[k], 1) for k in _SLOWEST_STEPS if k in r}
        out.append({"id": r["id"], "own_ms": round(r["own"], 1), **steps})
    return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _worst_amp(cases: list[dict[str, Any]], pattern: str) -> float | None:
    """The largest full checkpoint / live state of our changelog-on cases of ``pattern``."""
    return max(
        (
            c["space_amp"]
            for c in cases
            if c["system"] == "ours"
            and c["changelog"] == "on"
            and c["pattern"] == pattern
            and c["space_amp"]
        ),
        default=None,
    )


def _own_pooled(cases: list[dict[str, Any]], repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Our own part of a checkpoint over every checkpoint of our uniform changelog-on
    cases at default settings (both stores, every key count, the repeated ones too): p99,
    max and how many.

    Pooled because a case has ~30 checkpoints, and the p99 of 30 is their maximum: the
    headline was the larger of two such maxima (60 checkpoints), one disk stall's worth
    (190 ms in one run of four, where a segment write and the metadata commit's sync
    stalled together). Pooled over ~150, the p99 lets one such checkpoint in a hundred
    through, as a p99 does; the maximum stays beside it, and the steps of the
    :data:`SLOWEST` slowest (``own_checkpoint_slowest``, each naming its case)."""
    pooled = [
        c
        for c in (*cases, *repeats)
        if c["system"] == "ours" and c["changelog"] == "on" and c["pattern"] == "uniform"
    ]
    own = [v for c in pooled for v in c.get("own_ms", ())]
    slowest = sorted(
        (
            {"case": f"{c['store']} {c['keys']}", **s}
            for c in pooled
            for s in c.get("own_slowest", ())
        ),
        key=lambda s: s["own_ms"],
        reverse=True,
    )
    return {
        "own_checkpoint_p99_ms": round(_pct(own, 0.99), 1) if own else None,
        "own_checkpoint_max_ms": max(own) if own else None,
        "own_checkpoint_samples": len(own),
        "own_checkpoint_slowest": slowest[:SLOWEST],
    }


def _whole_run_pairs(
    cases: list[dict[str, Any]], case: dict[str, Any], repeats: Sequence[dict[str, Any]]
) -> tuple[list[float], list[float]]:
    """Records/s of ``case`` and of its store's long-log case (same keys, no
    materialization), with those of the repeated pair (``repeats``, run at the end in the
    other order) when there is one: ``([with...], [log only...])``, in run order."""

    def find(among: Sequence[dict[str, Any]], pattern: str) -> dict[str, Any] | None:
        return next(
            (
                c
                for c in among
                if c["system"] == "ours"
                and c["pattern"] == pattern
                and (c["store"], c["changelog"], c["keys"])
                == (case["store"], case["changelog"], case["keys"])
                and c["records_per_s"]
            ),
            None,
        )

    log_only = find(cases, "long-log")
    if log_only is None or not case["records_per_s"]:
        return [], []
    with_mat, without = [case["records_per_s"]], [log_only["records_per_s"]]
    again, again_log = find(repeats, case["pattern"]), find(repeats, "long-log")
    if again is not None and again_log is not None:
        with_mat.append(again["records_per_s"])
        without.append(again_log["records_per_s"])
    return with_mat, without


def _whole_run_ratio(pairs: tuple[list[float], list[float]]) -> float | None:
    """Records/s with materialization over log only, each summed over the pairs
    (:func:`_whole_run_pairs`: both orders when the pair was repeated, see :func:`run`);
    None without a long-log case."""
    with_mat, without = pairs
    return round(sum(with_mat) / sum(without), 3) if without else None


def _headline(
    cases: list[dict[str, Any]],
    peer: dict[str, Any] | None,
    repeats: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The headline fields from ``cases`` (each case once), the peer's case, and the cases
    run again at the end (``repeats``: read by the whole-run ratio and the pooled own
    part only)."""

    def get(store: str, changelog: str = "on", pattern: str = "uniform") -> dict[str, Any]:
        return next(
            c
            for c in cases
            if (c["store"], c["changelog"], c["pattern"]) == (store, changelog, pattern)
        )

    heap, rocks = get("heap"), get("rocksdb")
    heap_pairs = _whole_run_pairs(cases, heap, repeats)
    out: dict[str, Any] = {
        "records_per_s_heap": heap["records_per_s"],
        "records_per_s_rocksdb": rocks["records_per_s"],
        "restore_s_heap": heap["restore_s"],
        "restore_s_rocksdb": rocks["restore_s"],
        # the replay of a long log (millions of changes, materialization off), the slower
        # store's: the short log left at a kill with default settings measures fixed costs
        "replay_changes_per_s": min(
            (c["replay_per_s"] for c in cases if c["pattern"] == "long-log" and c["replay_per_s"]),
            default=None,
        ),
        "materialization_s_max_heap": heap["mat_max_s"],
        "materialization_throughput_ratio_heap": heap["mat_throughput_ratio"],
        # the stricter reading of "without one": the whole run's records/s over the same
        # pipeline's with the log only (long-log, no materialization), in the same run;
        # it holds every cost of materializing, also those outside its windows; the heap
        # pair runs twice, the second time last and the other way round, so a drift of
        # the machine over the run cancels out (see run)
        "materialization_whole_run_ratio_heap": _whole_run_ratio(heap_pairs),
        "materialization_whole_run_records_per_s_heap": dict(
            zip(("with", "log_only"), heap_pairs, strict=True)
        ),
        "materialization_whole_run_ratio_rocksdb": _whole_run_ratio(
            _whole_run_pairs(cases, rocks, [])
        ),
        # ours (the peer's case has one too), the worst of both stores at 1M and 100k keys:
        # the headline is uniform keys (what a user gets), the hot-key case beside it
        "space_amplification": _worst_amp(cases, "uniform"),
        "space_amplification_hot": _worst_amp(cases, "hot"),
        **_own_pooled(cases, repeats),
        "own_checkpoint_old_p99_ms": max(c["own_old_p99_ms"] for c in (heap, rocks)),
        "own_checkpoint_steps_ms": {c["store"]: c["own_steps"] for c in (heap, rocks)},
        "materialization_sync_p50_ms_rocksdb": rocks["mat_sync_p50_ms"],
        "materialization_sync_max_ms_rocksdb": rocks["mat_sync_max_ms"],
    }
    if peer is not None and peer.get("records_per_s"):
        out["peer"] = peer.get("peer_label")
        out["records_per_s_peer"] = peer["records_per_s"]
        out["restore_s_peer"] = peer.get("restore_s")
        out["ratio_records_per_s_rocksdb_vs_peer"] = round(
            rocks["records_per_s"] / peer["records_per_s"], 3
        )
        out["ratio_records_per_s_heap_vs_peer"] = round(
            heap["records_per_s"] / peer["records_per_s"], 3
        )
        if peer.get("restore_s"):
            for name, c in (("heap", heap), ("rocksdb", rocks)):
                if c["restore_s"] is not None:
                    out[f"ratio_restore_s_{name}_vs_peer"] = round(
                        c["restore_s"] / peer["restore_s"], 3
                    )
    return out


def run(quick: bool) -> dict[str, Any]:
    """Every case of ours, the peer in the same run, and the headline fields."""
    from tools.bench import peers

    keys = 100_000 if quick else 1_000_000
    seconds = 12.0 if quick else 30.0
    # Each store's long-log case right after its uniform one: it is the baseline of the
    # whole-run ratio, and the machine drifts over a run (heap uniform at 206k-222k
    # records/s against long-log at 258k-266k six minutes later, 0.80-0.83, in two runs;
    # 0.91 in two alternated pairs of worker runs)
    plan = [
        ("heap", "on", "uniform"),
        ("heap", "on", "long-log"),
        ("rocksdb", "on", "uniform"),
        ("rocksdb", "on", "long-log"),
        ("heap", "on", "hot"),
        ("rocksdb", "on", "hot"),
        ("heap", "off", "uniform"),
        ("rocksdb", "off", "uniform"),
    ]
    if quick:
        plan = [p for p in plan if p[2] != "hot"]
    cases = [run_case(s, c, keys, p, seconds) for s, c, p in plan]
    if not quick:  # the size target holds at 100k keys too
        cases += [run_case(s, "on", keys // 10, "uniform", seconds) for s in ("heap", "rocksdb")]
    peer = peers.flink_case(keys, 0, seconds)
    if peer is not None:
        live = next(c["live_bytes"] for c in cases if c["store"] == "heap" and c["keys"] == keys)
        if live and peer.get("full_checkpoint_bytes"):  # the same logical state as ours
            peer["space_amp"] = round(peer["full_checkpoint_bytes"] / live, 3)
        cases.append(peer)
    # The heap pair once more, last (no case after it to disturb) and the other way round
    # (long-log first): the whole-run ratio sums both pairs, so the machine's drift over
    # the run cancels. With one pair the log-only case alone moved it by 10-20% between
    # runs (0.884-1.009 in four full runs; 503k-668k records/s log only), while the ratio
    # inside each run (during / outside a materialization) stayed at 0.91-0.94.
    repeats = (
        [] if quick else [run_case("heap", "on", keys, p, seconds) for p in ("long-log", "uniform")]
    )
    return {"cases": cases, "repeated_cases": repeats, **_headline(cases, peer, repeats)}


def main(argv: list[str] | None = None) -> int:
    """``worker`` entry point (the benchmark itself runs through ``python -m tools.bench``)."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.end_to_end")
    parser.add_argument("mode", choices=["worker"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--backend", choices=["heap", "rocksdb"], default="heap")
    parser.add_argument("--changelog", choices=["on", "off"], default="on")
    parser.add_argument("--keys", type=int, required=True)
    parser.add_argument("--hot", type=int, default=0)
    parser.add_argument("--restore-only", action="store_true")
    parser.add_argument(
        "--long-log", action="store_true", help="no materialization: the log only grows"
    )
    return worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
