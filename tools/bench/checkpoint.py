"""Checkpoint cost follows change, not size (design invariant 4).

One heap backend holds ``S`` keys, then ``10 S`` and ``100 S`` (``--quick``: 1x and 10x).
Between two checkpoints it applies the same number of updates to random keys, then takes
a checkpoint and waits until it is durable. With the changelog on, a checkpoint persists
only the log since the last one; the baseline in the same run is the changelog off
(every checkpoint a snapshot through :class:`~materializer.full.FullSnapshotCheckpointer`,
sharing unchanged files). Per case: checkpoint latency p50/p99 (sync + async until the
handle is ready) and bytes uploaded per checkpoint.

Summary fields: ``changelog_duration_ratio_largest`` and ``changelog_bytes_ratio_largest``
(largest state / smallest state, changelog on; flat means close to 1), and the same for
the baseline (``snapshot_*``), which grow with the state.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from statistics import median
from typing import Any

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyGroupRange,
    ValueStateDescriptor,
)
from backends.serializers import INT64, STR
from dstl import ChangelogStorage, FileIO
from materializer.full import FullSnapshotCheckpointer

COLUMNS = ["mode", "keys", "updates", "checkpoints", "p50_ms", "p99_ms", "bytes_per_checkpoint"]
MAX_PAR = 128
DESC: ValueStateDescriptor[int] = ValueStateDescriptor("v", INT64)


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def _fill(backend: Any, keys: int) -> None:
    state = backend.get_state(DESC)
    for i in range(keys):
        backend.set_current_key(f"k{i}")
        state.update(i)


def _update(backend: Any, keys: int, updates: int, rnd: random.Random) -> None:
    state = backend.get_state(DESC)
    for _ in range(updates):
        backend.set_current_key(f"k{rnd.randrange(keys)}")
        state.update(rnd.randrange(1 << 40))


def _case(mode: str, keys: int, updates: int, rounds: int) -> dict[str, Any]:
    rnd = random.Random(7)
    with tempfile.TemporaryDirectory() as root:
        fileio = FileIO(root)
        inner = HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
        storage = ChangelogStorage(fileio, "bench", "w0")
        backend: Any
        if mode == "changelog":
            backend = ChangelogKeyedStateBackend(inner, storage.create_writer("op-0"))
        else:
            backend = FullSnapshotCheckpointer(inner, fileio, "bench", "op", 0, "op-0")
        _fill(backend, keys)
        backend.checkpoint(1).result()  # the initial state is uploaded once in both modes
        latencies: list[float] = []
        sizes: list[int] = []
        for cid in range(2, rounds + 2):
            _update(backend, keys, updates, rnd)
            before = _dir_bytes(root)
            started = time.perf_counter()
            backend.checkpoint(cid).result()
            latencies.append((time.perf_counter() - started) * 1e3)
            sizes.append(_dir_bytes(root) - before)
            if mode != "changelog":
                backend.notify_checkpoint_complete(cid)
        if mode != "changelog":
            backend.close()
        storage.close()
    ordered = sorted(latencies)
    return {
        "mode": mode,
        "keys": keys,
        "updates": updates,
        "checkpoints": rounds,
        "p50_ms": median(latencies),
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "bytes_per_checkpoint": sum(sizes) / len(sizes),
    }


def run(quick: bool) -> dict[str, Any]:
    """Checkpoint latency and bytes at growing state, changelog on vs snapshots."""
    sizes = [10_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    updates, rounds = (2_000, 5) if quick else (5_000, 10)
    cases = [
        _case(mode, keys, updates, rounds) for mode in ("changelog", "snapshot") for keys in sizes
    ]

    def ratio(mode: str, field: str) -> float:
        rows = [c for c in cases if c["mode"] == mode]
        return round(rows[-1][field] / max(rows[0][field], 1e-9), 3)

    return {
        "cases": cases,
        "state_growth": sizes[-1] // sizes[0],
        "changelog_duration_ratio_largest": ratio("changelog", "p50_ms"),
        "changelog_bytes_ratio_largest": ratio("changelog", "bytes_per_checkpoint"),
        "snapshot_duration_ratio_largest": ratio("snapshot", "p50_ms"),
        "snapshot_bytes_ratio_largest": ratio("snapshot", "bytes_per_checkpoint"),
    }
