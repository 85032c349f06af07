"""Materialization: bytes uploaded per materialization follow the change, not the state.

A backend with the changelog on holds ``S`` keys (then ``10 S``); between two
materializations it applies the same number of updates, either uniformly over all keys
(``uniform``: the headline, what a keyed job over many keys does; every heap piece
changes, so a heap materialization re-uploads about everything, and the changelog, not
the materialization, is what keeps checkpoints flat then) or to a fixed set of
:data:`HOT_KEYS` keys (``hot``, labelled: most files stay unchanged and are shared). Per
case it reports the averages over the counted materializations: new and total bytes and
files, upload and task-thread (sync) time and their sum (``mat_ms``, the wall time of one
materialization); and, at a checkpoint taken right before a materialization (the largest
log), the full checkpoint size (every referenced byte: materialized files + changelog
segments) over the live state size (the state as one compact zstd Parquet table per
state): ``space_amp``.

Heap: the first materialization (the full upload) is not counted, every later one is.
RocksDB's files depend on its history, so its cases run longer. The load (every key
inserted once, spread over all key groups) is settled by a full manual compaction (forced
through the last level) before the first materialization: the state then lies in the
last level as ``target_file_size_base`` files with zeroed sequence numbers, as in a job
that has run for a while. Without it the load is one flush of the whole state (a single
giant SST moved untouched to the last level, its sequence numbers kept: ~1.3x larger),
or, loaded over several flushes, leaves uniform inserts in the upper levels whose
compaction debt is paid by one rewrite of the whole state a few rounds later. Then
:data:`ROCKSDB_WARMUP` uncounted rounds (one L0 compaction cycle), then the counted
rounds, a multiple of the 4 flushes (one per materialization) that trigger an L0
compaction, so the mean includes whole compaction cycles. Its live size is measured once,
after the last round (the values are overwritten in place with values of about the same
size), and also as one compact SST file written with the backend's own options
(``live_sst_bytes``, ``space_amp_sst``): the same format and codec (zstd), so that
ratio is the LSM's own amplification, apart from the format's.

Summary fields (uniform keys unless labelled): ``new_bytes_ratio_10x_state`` (heap: new
bytes per materialization at 10 S / at S), ``materialization_ms`` (heap at 10 S: sync +
upload, the wall time of one materialization), ``new_bytes_ratio_10x_state_rocksdb`` and
``materialization_ms_rocksdb``; the same for hot keys with the suffix ``_hot`` (heap, and
RocksDB in a full run); ``space_amplification`` (heap, worst case; target <= 1.5),
``space_amplification_rocksdb`` (against the zstd Parquet size, like heap) and
``space_amplification_rocksdb_sst`` (against a compact SST). Default settings throughout
(content-defined heap pieces of :data:`~backends.tables.DEFAULT_PIECE_ROWS` rows,
default DSTL options, :func:`backends.rocksdb.db_options`).
"""

from __future__ import annotations

import os
import random
import tempfile
from statistics import mean
from typing import Any

import rocksdict

from backends import (
    ChangelogKeyedStateBackend,
    HeapKeyedStateBackend,
    KeyGroupRange,
    ValueStateDescriptor,
)
from backends.rocksdb import RocksDBKeyedStateBackend, db_options
from backends.serializers import INT64, STR
from backends.tables import table_for
from dstl import ChangelogStorage, FileIO
from materializer import Materializer
from tools.bench.harness import live_parquet_bytes

COLUMNS: list[str] = [
    "store",
    "pattern",
    "keys",
    "updates",
    "mats",
    "bytes_new",
    "bytes_total",
    "files_new",
    "files_shared",
    "mat_ms",
    "upload_ms",
    "sync_ms",
    "log_bytes",
    "checkpoint_bytes",
    "live_bytes",
    "space_amp",
    "live_sst_bytes",
    "space_amp_sst",
]

MAX_PAR = 128
HOT_KEYS = 8
CHECKPOINT_EVERY = 500  # updates between checkpoints, as a running job would take them
ROCKSDB_WARMUP = 4  # RocksDB: uncounted rounds before the counted ones


def _key(i: int) -> str:
    return f"user-{i:08d}"


def _live_bytes(inner: Any) -> int:
    """The state as one compact Parquet table per state (the denominator of space_amp)."""
    total = 0
    for name, meta in sorted(inner.state_metas().items()):
        table: dict[int, dict[Any, Any]] = {}
        for kg, key, value in inner.entries(name):
            table.setdefault(kg, {})[key] = value
        total += live_parquet_bytes(table_for(meta, inner.key_serializer, table))
    return total


def _live_sst_bytes(inner: RocksDBKeyedStateBackend, directory: str) -> int:
    """The live rows as one compact SST file written with the backend's own options."""
    path = os.path.join(directory, "live.sst")
    writer = rocksdict.SstFileWriter(db_options())
    writer.open(path)
    for k, v in inner._db.items():
        writer[k] = v
    writer.finish()
    size = os.path.getsize(path)
    os.remove(path)
    return size


def _case(
    store: str, pattern: str, keys: int, updates: int, rounds: int, seed: int
) -> dict[str, Any]:
    rocks = store == "rocksdb"
    rnd = random.Random(seed)
    hot = [rnd.randrange(keys) for _ in range(HOT_KEYS)]
    with tempfile.TemporaryDirectory(prefix="bench-mat-") as root:
        fileio = FileIO(os.path.join(root, "store"))
        inner: Any = (
            HeapKeyedStateBackend(STR, KeyGroupRange(0, MAX_PAR), MAX_PAR)
            if store == "heap"
            else RocksDBKeyedStateBackend(
                STR, KeyGroupRange(0, MAX_PAR), MAX_PAR, path=os.path.join(root, "local")
            )
        )
        with ChangelogStorage(fileio, "bench", "w0") as storage:
            backend = ChangelogKeyedStateBackend(inner, storage.create_writer("op-0"))
            count = backend.get_state(ValueStateDescriptor("count", INT64))
            profile = backend.get_state(ValueStateDescriptor("profile", STR))
            for i in range(keys):
                backend.set_current_key(_key(i))
                count.update(i)
                profile.update(f"profile of user {i}: {rnd.getrandbits(64):016x}")
            cid = 1
            backend.checkpoint(cid).result()  # a running job checkpoints before materializing
            if rocks:  # settle the load: see the module doc
                settle = rocksdict.CompactOptions()
                settle.set_bottommost_level_compaction(rocksdict.BottommostLevelCompaction.force())
                inner._db.compact_range(None, None, settle)
            mat = Materializer(backend, fileio, "bench", "op", 0)
            mat.materialize_now()  # the initial full upload: not counted
            warmup = ROCKSDB_WARMUP if rocks else 0
            stats = []
            amps: list[tuple[int, int, int]] = []
            for r in range(warmup + rounds):
                for u in range(updates):
                    i = rnd.choice(hot) if pattern == "hot" else rnd.randrange(keys)
                    backend.set_current_key(_key(i))
                    count.update((count.value() or 0) + 1)
                    if u % 4 == 0:
                        profile.update(f"profile of user {i}: round {r} update {u}")
                    if (u + 1) % CHECKPOINT_EVERY == 0:
                        cid += 1
                        handle = backend.checkpoint(cid).result()
                # ``handle``: the checkpoint right before materializing (the longest log)
                mat_bytes = sum(f.size_bytes for m in handle.materialized for f in m.state_files)
                log_bytes = sum({c.location: c.size_bytes for c in handle.changelog}.values())
                counted = r >= warmup
                if counted:
                    # RocksDB: live size measured once, after the last round (see above)
                    live = 0 if rocks else _live_bytes(inner)
                    amps.append((mat_bytes + log_bytes, log_bytes, live))
                mat.materialize_now()
                assert mat.last_stats is not None
                if counted:
                    stats.append(mat.last_stats)
            sst: dict[str, Any] = {}
            if rocks:
                live = _live_bytes(inner)
                amps = [(a, lg, live) for a, lg, _ in amps]
                live_sst = _live_sst_bytes(inner, root)
                top = max(a for a, _, _ in amps)
                sst = {"live_sst_bytes": live_sst, "space_amp_sst": round(top / live_sst, 3)}
        if rocks:
            inner.close()
    worst = max(amps, key=lambda a: a[0] / a[2])
    return {
        "store": store,
        "pattern": pattern,
        "keys": keys,
        "updates": updates,
        "mats": len(stats),
        "bytes_new": round(mean(s.bytes_new for s in stats)),
        "bytes_total": round(mean(s.bytes_total for s in stats)),
        "files_new": round(mean(s.files_new for s in stats), 1),
        "files_shared": round(mean(s.files_shared for s in stats), 1),
        "mat_ms": round(mean(s.duration_s + s.sync_duration_s for s in stats) * 1e3, 1),
        "upload_ms": round(mean(s.duration_s for s in stats) * 1e3, 1),
        "sync_ms": round(mean(s.sync_duration_s for s in stats) * 1e3, 1),
        "log_bytes": worst[1],
        "checkpoint_bytes": worst[0],
        "live_bytes": worst[2],
        "space_amp": round(worst[0] / worst[2], 3),
        **sst,
    }


def run(quick: bool) -> dict[str, Any]:
    """Uniform (headline) and hot updates at state S and 10 S, heap and RocksDB."""
    keys = 40_000 if quick else 100_000
    updates = 2_000  # a multiple of CHECKPOINT_EVERY
    rounds = 2 if quick else 4
    # RocksDB: counted rounds in whole L0 compaction cycles (4 flushes, one per
    # materialization), after the warm-up; --quick runs only its uniform case.
    rocks_rounds = 8 if quick else 16
    plan = [("heap", "uniform"), ("heap", "hot"), ("rocksdb", "uniform")]
    if not quick:
        plan.append(("rocksdb", "hot"))
    cases = [
        _case(store, pattern, n, updates, rounds if store == "heap" else rocks_rounds, seed=7)
        for store, pattern in plan
        for n in (keys, 10 * keys)
    ]
    by = {(c["store"], c["pattern"], c["keys"]): c for c in cases}

    def headline(store: str, pattern: str) -> dict[str, Any]:
        small, big = by[(store, pattern, keys)], by[(store, pattern, 10 * keys)]
        suffix = ("" if store == "heap" else "_rocksdb") + ("" if pattern == "uniform" else "_hot")
        return {
            f"new_bytes_ratio_10x_state{suffix}": round(
                big["bytes_new"] / max(small["bytes_new"], 1), 3
            ),
            f"materialization_ms{suffix}": big["mat_ms"],
        }

    rocks = [c for c in cases if c["store"] == "rocksdb"]
    out: dict[str, Any] = {"cases": cases, "keys_largest": 10 * keys}
    for store, pattern in plan:
        out.update(headline(store, pattern))
    return {
        **out,
        "space_amplification": max(c["space_amp"] for c in cases if c["store"] == "heap"),
        "space_amplification_rocksdb": max(c["space_amp"] for c in rocks),
        "space_amplification_rocksdb_sst": max(c["space_amp_sst"] for c in rocks),
        "hot_keys": HOT_KEYS,
    }
