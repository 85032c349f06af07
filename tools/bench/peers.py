"""The peer: the end-to-end workload on Apache Flink 2.3, beside ours in the same run.

Flink runs from its own virtualenv, made on demand (``apache-flink`` from PyPI, which
ships Flink's jars; Java 17 on PATH) under ``$CHANGELOG_STATE_CACHE`` (default
``~/.cache/changelog-state``)/``flink-venv``; ``make test`` never needs it. The job is
:mod:`tools.bench.flink_job`: RocksDB, incremental checkpoints, the changelog state
backend on (its DSTL on the local file system), checkpoints every second, otherwise
Flink's defaults. Two shapes of the same count and sum:

- ``sql`` (the peer of the headline): ``GROUP BY`` key in Flink SQL over a Java source:
  Java operators, no Python per record: the fastest way Flink offers for this job.
- ``datastream`` (labelled): PyFlink's ``KeyedProcessFunction`` with two ``ValueState``s,
  the shape of our job. Every state read that misses PyFlink's Python-side cache is a
  round trip to the Java process; measured here without a restore (its load phase alone
  would take tens of minutes at 1M keys).

Measured through Flink's REST API (the mini cluster's endpoint; its port from the log):
records/s from the source vertex's ``write-records``, checkpoint durations and full size
from ``/checkpoints``, and the restore as the keyed vertex's time from INITIALIZING to
RUNNING in a second job started from the latest retained checkpoint after a SIGKILL of
the first (``CLAIM`` mode: Flink cannot restore a changelog checkpoint without claiming
it). ``restore_s`` so covers the state backend's restore (download, RocksDB open, log
replay) and the operators' open, like ours.

``python -m tools.bench run peers [--quick]``: Flink (``sql``) and ours (heap and RocksDB,
changelog on, uniform keys) in the same run, with ratios ours/Flink.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from typing import Any

COLUMNS = [
    "system",
    "store",
    "changelog",
    "keys",
    "pattern",
    "records_per_s",
    "cp_p50_ms",
    "cp_p99_ms",
    "restore_s",
    "space_amp",
    "full_checkpoint_bytes",
]

FLINK_VERSION = "2.3.0"
_JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flink_job.py")


def flink_python() -> str | None:
    """The Python of Flink's virtualenv, made if missing; None (and why) if it cannot be."""
    cache = os.environ.get(
        "CHANGELOG_STATE_CACHE", os.path.join(os.path.expanduser("~"), ".cache/changelog-state")
    )
    venv = os.path.join(cache, "flink-venv")
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, f".apache-flink-{FLINK_VERSION}")
    if os.path.exists(marker):
        return python
    if shutil.which("java") is None:
        print("peers: no java on PATH: Flink is not measured", file=sys.stderr)
        return None
    print(f"peers: installing apache-flink {FLINK_VERSION} into {venv} (once)", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", f"apache-flink=={FLINK_VERSION}"], check=True
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"peers: cannot install Flink ({exc}): not measured", file=sys.stderr)
        return None
    with open(marker, "w"):
        pass
    return python


class _FlinkJob:
    """One Flink job process (its own session: killed with everything it started)."""

    def __init__(self, python: str, root: str, keys: int, hot: int, api: str, restore: str) -> None:
        self.log_dir = os.path.join(root, f"log-{time.monotonic_ns()}")
        env = {**os.environ, "FLINK_LOG_DIR": self.log_dir}
        cmd = [python, _JOB, "--dir", root, "--keys", str(keys), "--hot", str(hot), "--api", api]
        if restore:
            cmd += ["--restore-from", restore]
        self.out = open(os.path.join(root, "job.out"), "ab")  # noqa: SIM115  (closed by kill)
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.base = ""

    def log(self) -> str:
        try:
            names = [n for n in os.listdir(self.log_dir) if n.endswith(".log")]
        except FileNotFoundError:
            return ""
        if not names:
            return ""
        with open(os.path.join(self.log_dir, names[0]), errors="replace") as fh:
            return fh.read()

    def rest(self, path: str) -> Any:
        if not self.base:
            m = re.search(r"Rest endpoint listening at ([\w.-]+):(\d+)", self.log())
            if m is None:
                return None
            self.base = f"http://{m.group(1)}:{m.group(2)}"
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as resp:
                return json.load(resp)
        except (OSError, ValueError):
            return None

    def job(self) -> dict[str, Any] | None:
        jobs = self.rest("/jobs")
        if not jobs or not jobs.get("jobs"):
            return None
        details: dict[str, Any] | None = self.rest(f"/jobs/{jobs['jobs'][0]['id']}")
        return details

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.out.close()


def _source_records(job: dict[str, Any]) -> int | None:
    """Records the source vertex wrote; None while the job has no vertices yet."""
    sources = [v for v in job.get("vertices", []) if "ource" in v.get("name", "")]
    if not sources:
        return None
    return int(sources[0].get("metrics", {}).get("write-records", 0))


def _wait(predicate: Any, timeout: float, step: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return None


def _latest_checkpoint(root: str) -> str | None:
    found: list[tuple[int, str]] = []
    for dirpath, dirnames, _ in os.walk(os.path.join(root, "checkpoints")):
        for d in dirnames:
            if d.startswith("chk-") and os.path.exists(os.path.join(dirpath, d, "_metadata")):
                found.append((int(d[4:]), os.path.join(dirpath, d)))
    return max(found)[1] if found else None


def _initializing_s(text: str, vertex: str) -> float | None:
    """Seconds the task whose name starts with ``vertex`` spent INITIALIZING (from the log)."""
    stamps: dict[str, datetime] = {}
    for line in text.splitlines():
        if "taskmanager.Task" not in line or vertex not in line:
            continue
        for state in ("DEPLOYING to INITIALIZING", "INITIALIZING to RUNNING"):
            if state in line:
                stamps[state] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    if len(stamps) < 2:
        return None
    delta = stamps["INITIALIZING to RUNNING"] - stamps["DEPLOYING to INITIALIZING"]
    return delta.total_seconds()


def flink_case(
    keys: int, hot: int, seconds: float, api: str = "sql", restore: bool = True
) -> dict[str, Any] | None:
    """Flink on the workload: load, ``seconds`` of measurement, SIGKILL, restore."""
    python = flink_python()
    if python is None:
        return None
    root = tempfile.mkdtemp(prefix="bench-flink-")
    label = f"flink-{FLINK_VERSION}-{api}-rocksdb-changelog"
    try:
        job = _FlinkJob(python, root, keys, hot, api, "")
        try:
            if _wait(job.job, 180) is None:
                print(f"peers: Flink did not start (see {root}/job.out)", file=sys.stderr)
                return None
            samples: list[tuple[float, int]] = []
            load_target = keys if api == "sql" else 0
            deadline = time.monotonic() + 900
            loaded_at: float | None = None
            details: dict[str, Any] | None = None
            while time.monotonic() < deadline:
                details = job.job()
                written = None if details is None else _source_records(details)
                if written is not None:
                    samples.append((time.monotonic(), written))
                if loaded_at is None and samples and samples[-1][1] >= load_target:
                    loaded_at = samples[-1][0]
                if loaded_at is not None and time.monotonic() - loaded_at >= seconds:
                    break
                time.sleep(0.5)
            checkpoints = job.rest(f"/jobs/{details['jid']}/checkpoints") if details else None
        finally:
            job.kill()
        window = [s for s in samples if loaded_at is not None and s[0] >= loaded_at]
        rate = (
            (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
            if len(window) > 1
            else 0.0
        )
        history = (checkpoints or {}).get("history", [])
        done = [h for h in history if h.get("status") == "COMPLETED"]
        durations = sorted(float(h["end_to_end_duration"]) for h in done)
        full = max((int(h.get("state_size", 0)) for h in done), default=0)
        result: dict[str, Any] = {
            "system": "flink",
            "peer_label": label,
            "store": "rocksdb",
            "changelog": "on",
            "keys": keys,
            "pattern": "hot" if hot else "uniform",
            "records_per_s": round(rate),
            "checkpoints": len(done),
            "cp_p50_ms": durations[len(durations) // 2] if durations else None,
            "cp_p99_ms": durations[min(len(durations) - 1, round(0.99 * (len(durations) - 1)))]
            if durations
            else None,
            "full_checkpoint_bytes": full,
            "startup_initializing_s": _initializing_s(job.log(), "GroupAggregate")
            if api == "sql"
            else _initializing_s(job.log(), "KEYED PROCESS"),
        }
        chk = _latest_checkpoint(root) if restore else None
        if chk is not None:
            result.update(_flink_restore(python, root, keys, hot, api, chk))
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _flink_restore(
    python: str, root: str, keys: int, hot: int, api: str, chk: str
) -> dict[str, Any]:
    vertex = "GroupAggregate" if api == "sql" else "KEYED PROCESS"
    started = time.monotonic()
    job = _FlinkJob(python, root, keys, hot, api, chk)
    try:
        restore_s = _wait(lambda: _initializing_s(job.log(), vertex), 600)
        restart_s = time.monotonic() - started
    finally:
        job.kill()
    return {"restore_s": restore_s, "restart_s": round(restart_s, 3), "restored_from": chk}


def run(quick: bool) -> dict[str, Any]:
    """Flink and ours on the headline workload, in the same run; ratios ours/Flink."""
    from tools.bench.end_to_end import run_case

    keys = 100_000 if quick else 1_000_000
    seconds = 12.0 if quick else 30.0
    peer = flink_case(keys, 0, seconds)
    ours = [run_case(store, "on", keys, "uniform", seconds) for store in ("heap", "rocksdb")]
    cases: list[dict[str, Any]] = [*ours]
    out: dict[str, Any] = {"cases": cases}
    if peer is None:
        out["peer"] = "not measured (see stderr)"
        return out
    cases.append(peer)
    out["peer"] = peer["peer_label"]
    for c in ours:
        name = c["store"]
        if peer.get("records_per_s"):
            out[f"ratio_records_per_s_{name}"] = round(
                c["records_per_s"] / peer["records_per_s"], 3
            )
        if peer.get("restore_s") and c.get("restore_s") is not None:
            out[f"ratio_restore_s_{name}"] = round(c["restore_s"] / peer["restore_s"], 3)
    if not quick:  # the shape of our job on Flink, measured without a restore
        side = flink_case(keys, 0, seconds, api="datastream", restore=False)
        if side is not None:
            cases.append(side)
    return out
