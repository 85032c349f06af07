"""RocksDB options: applied to the database, and compactions of hot updates stay small."""

from __future__ import annotations

import glob
import os
import random
import re
from pathlib import Path

from backends import KeyGroupRange, RocksDBKeyedStateBackend, ValueStateDescriptor
from backends.rocksdb import (
    BLOCK_CACHE_BYTES,
    BLOCK_SIZE,
    MAX_BYTES_FOR_LEVEL_BASE,
    MAX_MANIFEST_FILE_SIZE,
    TARGET_FILE_SIZE,
)
from backends.serializers import INT64, STR
from tests.backends.conftest import MAX_PAR


def _options_file(db_dir: str) -> dict[str, str]:
    """``name=value`` lines of the newest OPTIONS file RocksDB wrote (first occurrence)."""
    path = max(glob.glob(os.path.join(db_dir, "OPTIONS-*")))
    out: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            name, sep, value = line.strip().partition("=")
            if sep and name not in out:
                out[name] = value
    return out


def test_options_are_applied(tmp_path: Path) -> None:
    with RocksDBKeyedStateBackend(
        STR, KeyGroupRange(0, MAX_PAR), MAX_PAR, path=str(tmp_path / "b")
    ) as b:
        opts = _options_file(os.path.join(b.path, "db"))
    assert opts["compression"] == "kZSTD"
    assert opts["bottommost_compression"] == "kZSTD"
    assert opts["level_compaction_dynamic_level_bytes"] == "true"
    assert int(opts["target_file_size_base"]) == TARGET_FILE_SIZE
    assert int(opts["max_bytes_for_level_base"]) == MAX_BYTES_FOR_LEVEL_BASE
    assert int(opts["block_size"]) == BLOCK_SIZE
    assert int(opts["max_manifest_file_size"]) == MAX_MANIFEST_FILE_SIZE
    assert opts["memtable_whole_key_filtering"] == "true"
    assert float(opts["memtable_prefix_bloom_size_ratio"]) > 0


def _block_cache(db_dir: str) -> tuple[str, int]:
    """(address, capacity) of the block cache a database's LOG names."""
    with open(os.path.join(db_dir, "LOG")) as f:
        text = f.read()
    address = re.search(r"block_cache: (0x[0-9a-f]+)", text)
    capacity = re.search(r"capacity : (\d+)", text)
    assert address is not None and capacity is not None
    return address.group(1), int(capacity.group(1))


def test_stores_of_a_process_share_one_sized_block_cache(tmp_path: Path) -> None:
    """One block cache of BLOCK_CACHE_BYTES for every store of the process (RocksDB's
    default is 32 MiB per database: too small for 1M keys, too many for many stores)."""
    rng = KeyGroupRange(0, MAX_PAR)
    with (
        RocksDBKeyedStateBackend(STR, rng, MAX_PAR, path=str(tmp_path / "a")) as a,
        RocksDBKeyedStateBackend(STR, rng, MAX_PAR, path=str(tmp_path / "b")) as b,
    ):
        first = _block_cache(os.path.join(a.path, "db"))
        second = _block_cache(os.path.join(b.path, "db"))
    assert first == second
    assert first[1] == BLOCK_CACHE_BYTES


def test_hot_updates_on_a_large_state_share_most_sst_bytes(tmp_path: Path) -> None:
    """Snapshots after rounds of updates to a few hot keys reuse nearly every SST byte.

    With RocksDB's default options the state (~1 MB) is one last-level file and the L0
    compaction every 4 flushes rewrites it whole; with ours L0 is compacted into a small
    base level and the last level is left alone.
    """
    rnd = random.Random(3)
    keys = 30_000
    with RocksDBKeyedStateBackend(
        STR, KeyGroupRange(0, MAX_PAR), MAX_PAR, path=str(tmp_path / "b")
    ) as b:
        count = b.get_state(ValueStateDescriptor("count", INT64))
        profile = b.get_state(ValueStateDescriptor("profile", STR))
        for i in range(keys):
            b.set_current_key(f"user-{i:08d}")
            count.update(i)
            profile.update(f"profile of user {i}: {rnd.getrandbits(64):016x}")
        hot = [f"user-{rnd.randrange(keys):08d}" for _ in range(8)]

        def sst_sizes() -> dict[str, int]:
            snap = b.snapshot()
            try:
                return {
                    f.name: os.path.getsize(f.local_path)
                    for f in snap.files()
                    if f.local_path is not None and f.name.endswith(".sst")
                }
            finally:
                snap.release()

        prev = sst_sizes()
        total = sum(prev.values())
        assert total > 2 * MAX_BYTES_FOR_LEVEL_BASE  # the state outgrows the base level
        worst = 0.0
        for r in range(12):  # three L0 compaction cycles
            for u in range(500):
                b.set_current_key(rnd.choice(hot))
                count.update(r * 1000 + u)
                profile.update(f"round {r} update {u}")
            cur = sst_sizes()
            new = sum(size for name, size in cur.items() if prev.get(name) != size)
            worst = max(worst, new / sum(cur.values()))
            prev = cur
        assert worst < 0.05, f"a snapshot had {worst:.0%} new SST bytes"
