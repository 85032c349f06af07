"""The RocksDB keyed-state store, through ``rocksdict`` in raw mode (bytes in, bytes out).

Row keys (all big-endian, so a key-group range is one contiguous range scan)::

    key_group:u16 | state_id:u16 | len(key):u32 | key bytes [| user key bytes]

Value-like states (value, reducing, aggregating) hold the raw value's bytes; list state
one row per key with length-prefixed elements (:func:`~backends.serializers.pack_list`);
map and timer state one row per entry. With TTL, values are ``ts:i64 BE | value``
(:class:`~backends.serializers.TtlSerializer`). State ids are local to one database and
recorded, with every state's metadata, in the snapshot's ``STATE-META.json``.

The WAL is off: the DSTL (changelog) is what makes changes durable. A snapshot is a
RocksDB checkpoint (hard links, flushed memtable) in a fresh directory next to the
database; its files are the SSTs (named as RocksDB names them, stable across snapshots)
plus the few small files needed to open them as a database. Its memtable flush runs on
the task thread without the GIL, and :meth:`RocksDBKeyedStateBackend.prepare_snapshot`
first flushes most of the memtable in the background (see
:meth:`RocksDBKeyedStateBackend.snapshot` for what consistency needs); a
materialization's snapshot is compacted in its own copy on the upload thread
(:meth:`RocksDBSnapshot.compact_copy`), so it uploads each key once. A restore ingests
folded log values as an SST file (:meth:`RocksDBKeyedStateBackend.load_serialized_values`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import rocksdict

from backends.backend import wall_clock_ms
from backends.batch import PreparedBatch, prepare_batch
from backends.errors import KeyGroupOutOfRangeError, LocalStoreError
from backends.keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, key_group_for
from backends.localdirs import owned_dir
from backends.rocksload import ascending, fixed8, sorted_rows8, write_sst
from backends.serializers import Serializer, pack_list, unpack_list
from backends.snapshot import SnapshotFile
from backends.state import MAP_LIKE, Op, StateDescriptor, StateKind, StateMeta
from backends.wrappers import alive, wrap
from dstl.errors import CorruptionError

KIND = "rocksdb-sst"
META_FILE = "STATE-META.json"
META_VERSION = 1
_LEN = struct.Struct(">I")
_LEN_LE = struct.Struct("<I")


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\xff" * (len(prefix) + 1)
    p[-1] += 1
    return bytes(p)


# Options: a materialization uploads every SST it cannot share by name + size + checksum,
# so these make the files a compaction rewrites few and small, and keep every SST as
# compact as the Parquet heap tables. See :func:`db_options`.
TARGET_FILE_SIZE = 1 << 20
MAX_BYTES_FOR_LEVEL_BASE = 256 << 10
LEVEL_MULTIPLIER = 10.0
BLOCK_SIZE = 64 << 10
COPY_BLOCK_SIZE = 128 << 10  # a compacted snapshot copy's blocks: see compact_copy
BLOCK_RESTART_INTERVAL = 64
BOTTOMMOST_ZSTD_LEVEL = 7
MAX_MANIFEST_FILE_SIZE = 4 << 10
# Options for the per-record path. See :func:`db_options`.
BLOCK_CACHE_BYTES = 256 << 20
MEMTABLE_BLOOM_RATIO = 0.1
SST_BLOOM_BITS_PER_KEY = 10
# A snapshot waits for the memtable flush in sleeps of this long (GIL released), and
# after this long lets a blocking flush report why it has not finished.
FLUSH_POLL_S = 0.001
FLUSH_WAIT_S = 60.0
# prepare_snapshot flushes in the background until the memtable holds at most this many
# entries (its flush on the task thread then takes milliseconds), at most this many times.
SNAPSHOT_FLUSH_ENTRIES = 16384
PREPARE_FLUSH_ROUNDS = 2
# load_serialized_values ingests an SST file from this many rows on (fewer: a write batch).
INGEST_MIN_ROWS = 4096
# A snapshot whose SSTs above their deepest level hold more than this fraction of its SST
# bytes is compacted (its copy, on the upload thread) before it is uploaded. See
# :meth:`RocksDBKeyedStateBackend.snapshot`.
SNAPSHOT_COMPACT_UPPER = 0.1
SNAPSHOT_COMPACT_MIN_BYTES = 64 << 10
# Files RocksDB writes into a database directory when it opens it that are no part of
# its data (the info log and the lock): a compacted snapshot does not upload them.
_OPEN_ONLY_FILES = ("LOG", "LOCK")

_block_cache: rocksdict.Cache | None = None


def shared_block_cache() -> rocksdict.Cache:
    """The block cache every store of this process shares (``BLOCK_CACHE_BYTES``, LRU):
    like Flink's managed memory, one budget per worker however many stores it runs.
    Created on first use; thread-safe in RocksDB."""
    global _block_cache
    if _block_cache is None:
        _block_cache = rocksdict.Cache(BLOCK_CACHE_BYTES)
    return _block_cache


def db_options(block_size: int = BLOCK_SIZE) -> rocksdict.Options:
    """Raw-mode options tuned for incremental upload (RocksDB 9.8 through rocksdict);
    ``block_size`` is that of the SSTs it writes (a compacted snapshot copy's is larger:
    :meth:`RocksDBSnapshot.compact_copy`).

    - Leveled compaction with dynamic level bytes and a small base level
      (``max_bytes_for_level_base`` 256 KiB, multiplier 10): L0 is compacted into a level
      of at most ~256 KiB whatever the state size, and deeper levels are rewritten one
      ~1 MiB file (``target_file_size_base``) plus its overlap at a time. With RocksDB's
      defaults (256 MiB base, 64 MiB files) a state under 256 MiB lives in one level of
      one or a few files, L0 is compacted straight into it, and a compaction rewrites
      every file it overlaps: most of the state, as new SSTs. The cost: more files, so a
      larger MANIFEST (uploaded whole by every materialization, see below).
    - zstd on every level, bottommost included, at level ``BOTTOMMOST_ZSTD_LEVEL`` (7)
      in the last level, 64 KiB blocks and a full key every ``BLOCK_RESTART_INTERVAL``
      (64) keys instead of 16: SSTs are what is uploaded and stored. The end-to-end state
      (1M int64 keys, two int64 states), fully compacted, was 1.19x its zstd Parquet size
      with restarts every 16 keys, 1.09x with 64 (a point read from a cached block scans
      further: +0.25 us of ~2.1 us). With 16 KiB blocks at zstd's default level 3 the
      same state at 100k keys took 1.25x; 64 KiB blocks and level 7 in the last level
      write 0.72x the bytes at 100k keys, 0.89x at 1M (level 7 alone: 0.86x / 0.90x),
      for about twice the CPU of a bottommost compaction (0.7 s instead of 0.35 s for
      2M rows, on a background thread). Blocks are cached uncompressed, so a larger
      block costs a read nothing once cached. Only compacted bottommost files are that
      small: flushed and upper-level files keep each entry's sequence number (RocksDB
      zeroes them in the last level), so a materialization's snapshot with much above
      the last level is compacted in its copy before the upload
      (:meth:`RocksDBSnapshot.compact_copy`).
    - ``max_manifest_file_size`` 4 KiB: the MANIFEST changes at every flush, so every
      materialization uploads it whole; rolling it over at the first edit past 4 KiB keeps
      it near the live-file list instead of an ever-growing edit history.

    For the per-record path (a point read and a write per state access):

    - A block cache of ``BLOCK_CACHE_BYTES`` (256 MiB) shared by every store of the process
      (:func:`shared_block_cache`). Blocks are cached uncompressed; with RocksDB's 32 MiB
      per-database default, 1M keys of the end-to-end job (two int64 states, ~60 MB of
      blocks uncompressed) missed the cache on most reads, and each miss decompressed a
      16 KiB zstd block: the job's keyed function took 34 us of task-thread CPU per record,
      17 us with the cache (driven directly, 1M keys, a snapshot every 100k records).
    - A whole-key bloom filter on the memtable (``MEMTABLE_BLOOM_RATIO`` of it): most
      reads of uniform keys are for keys not in the memtable, and the filter answers
      them without a skip-list search (~1 us of a ~4 us read when the memtable is full).
    - A whole-key bloom filter (``SST_BLOOM_BITS_PER_KEY``) in every SST but the last
      level's (``optimize_filters_for_hits``). A read goes from the newest level to the
      oldest and stops at the first that holds its key; for uniform keys that is mostly
      the last level, so without filters every L0 file and upper level in between was
      searched too (index, then data block). With the end-to-end job's usual shape (a
      full memtable, one or two files above the last level) a read took 4.0 us instead
      of 5.6 us (two stores alternated in one process), and the whole job ran at
      42-50k records/s instead of 36-38k (three alternated bench workers). The last
      level, where most keys are and every read that gets there finds its key, keeps
      none: a compacted snapshot (all last level) uploads no filter bytes.
    """
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_target_file_size_base(TARGET_FILE_SIZE)
    opts.set_max_bytes_for_level_base(MAX_BYTES_FOR_LEVEL_BASE)
    opts.set_max_bytes_for_level_multiplier(LEVEL_MULTIPLIER)
    opts.set_compression_type(rocksdict.DBCompressionType.zstd())
    opts.set_bottommost_compression_type(rocksdict.DBCompressionType.zstd())
    # window bits (-14: zstd's default), level, strategy, dictionary bytes, enabled
    opts.set_bottommost_compression_options(-14, BOTTOMMOST_ZSTD_LEVEL, 0, 0, True)
    table = rocksdict.BlockBasedOptions()
    table.set_block_size(block_size)
    table.set_block_restart_interval(BLOCK_RESTART_INTERVAL)
    table.set_block_cache(shared_block_cache())
    table.set_bloom_filter(SST_BLOOM_BITS_PER_KEY, False)  # whole keys
    opts.set_optimize_filters_for_hits(True)  # none in the last level
    opts.set_block_based_table_factory(table)
    opts.set_max_manifest_file_size(MAX_MANIFEST_FILE_SIZE)
    opts.set_memtable_whole_key_filtering(True)
    opts.set_memtable_prefix_bloom_ratio(MEMTABLE_BLOOM_RATIO)
    return opts


def ingest_writer_options() -> rocksdict.Options:
    """:func:`db_options` with zstd's default level (3) for the last level too, for the
    ``SstFileWriter`` of a restore's ingestion (which compresses as for the last level):
    it runs on the restoring thread, where level ``BOTTOMMOST_ZSTD_LEVEL`` nearly doubled
    its CPU (0.68 s instead of 0.37 s for 1M rows); the next compaction rewrites the
    file at that level in the background."""
    opts = db_options()
    opts.set_bottommost_compression_options(-14, 3, 0, 0, True)
    return opts


def _rdict(path: str, opts: rocksdict.Options) -> rocksdict.Rdict:
    """``rocksdict.Rdict(path, opts)`` with ``opts`` for the default column family too.

    Given options alone, rocksdict 0.3.29 opens a database that has an ``OPTIONS`` file
    (any it wrote before: a reopened store, a restored snapshot, a snapshot's copy) with
    the column family options read from that file, and a new 8 MiB block cache: a
    restored store ran with its own small cache instead of the shared one
    (:func:`shared_block_cache`), and with whatever table and compression options were
    saved, not :func:`db_options`'s."""
    return rocksdict.Rdict(path, opts, column_families={"default": opts})


def open_raw_db(path: str) -> rocksdict.Rdict:
    """Open (or create) a raw-mode database with the WAL off for writes, with
    :func:`db_options` whatever options its files were written with."""
    try:
        db = _rdict(path, db_options())
    except Exception as exc:  # rocksdict raises plain Exception subclasses
        raise LocalStoreError(f"cannot open RocksDB at {path} ({exc})") from exc
    wo: Any = rocksdict.WriteOptions()
    wo.disable_wal = True  # a property in rocksdict 0.3.29, not a method
    db.set_write_options(wo)
    return db


def iter_rows(db: Any, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Rows with ``lo <= key < hi`` in key order (``from_key``: see ENVIRONMENT.md)."""
    for k, v in db.items(from_key=lo):
        if k >= hi:
            return
        yield k, v


def decode_state_rows(
    meta: StateMeta, key_ser: Serializer, rows: Iterable[tuple[bytes, bytes]]
) -> list[tuple[int, list[Any], list[Any]]]:
    """One ``(key group, keys, raw values)`` run per key group of one state's rows, in
    key order."""
    vser = meta.raw_value_ser()
    runs: list[tuple[int, list[Any], list[Any]]] = []
    keys: list[Any] = []
    values: list[Any] = []
    kind = meta.kind
    uks = meta.user_key_ser() if kind in MAP_LIKE else None
    last_kb: bytes | None = None
    last_kg = -1
    for k, v in rows:
        kg = (k[0] << 8) | k[1]
        if kg != last_kg:
            keys, values = [], []
            runs.append((kg, keys, values))
            last_kg, last_kb = kg, None
        (klen,) = _LEN.unpack_from(k, 4)
        kb = k[8 : 8 + klen]
        if uks is not None:
            if kb != last_kb:
                keys.append(key_ser.deserialize(kb))
                values.append({})
                last_kb = kb
            values[-1][uks.deserialize(k[8 + klen :])] = vser.deserialize(v)
            continue
        keys.append(key_ser.deserialize(kb))
        if kind is StateKind.LIST:
            values.append([vser.deserialize(e) for e in unpack_list(v)])
        else:
            values.append(vser.deserialize(v))
    return runs


def _worth_compacting(live_files: list[dict[str, Any]]) -> bool:
    """Whether the SSTs above the deepest level that has files (of several L0 files
    alone: all but the largest), in RocksDB's ``live_files()``, hold more than
    ``SNAPSHOT_COMPACT_UPPER`` of their bytes and at least ``SNAPSHOT_COMPACT_MIN_BYTES``:
    about how much of a snapshot of them repeats keys of its last level."""
    files = [(f["level"], f["size"]) for f in live_files]
    total = sum(size for _, size in files)
    if not total:
        return False
    deepest = max(level for level, _ in files)
    if deepest == 0:
        upper = total - max(size for _, size in files)
    else:
        upper = sum(size for level, size in files if level < deepest)
    return upper > SNAPSHOT_COMPACT_UPPER * total and upper >= SNAPSHOT_COMPACT_MIN_BYTES


class _RocksValueState:
    """Raw value-like state (value, reducing, aggregating). Task thread only."""

    __slots__ = ("_b", "_db", "_de", "_default", "_ser", "_sid")

    def __init__(
        self, backend: RocksDBKeyedStateBackend, sid: bytes, ser: Serializer, default: Any = None
    ) -> None:
        self._b = backend
        self._db = backend._db
        self._sid = sid
        self._ser = ser
        self._de = ser.deserialize
        self._default = default

    def value(self) -> Any:
        b, de = self._b, self._de
        data = self._db.get(b._kgb + self._sid + b._kpart)
        v = None if data is None else de(data)
        return self._default if v is None else v

    def with_default(self, default: Any) -> _RocksValueState:
        """The same rows, read with ``default`` for an absent value (no extra call for
        the default: :func:`backends.wrappers.wrap`)."""
        return _RocksValueState(self._b, self._sid, self._ser, default)

    def update(self, value: Any) -> None:
        b = self._b
        self._db.put(b._kgb + self._sid + b._kpart, self._ser.serialize(value))

    def update_serialized(self, data: bytes) -> None:
        """Store already serialized bytes (the changelog wrapper serializes once)."""
        b = self._b
        self._db.put(b._kgb + self._sid + b._kpart, data)

    def clear(self) -> None:
        b = self._b
        self._db.delete(b._kgb + self._sid + b._kpart)


class _RocksListState:
    """Raw list state: one row of length-prefixed elements per key. Task thread only."""

    __slots__ = ("_b", "_db", "_ser", "_sid")

    def __init__(self, backend: RocksDBKeyedStateBackend, sid: bytes, ser: Serializer) -> None:
        self._b = backend
        self._db = backend._db
        self._sid = sid
        self._ser = ser

    def get(self) -> list[Any]:
        b = self._b
        data = self._db.get(b._kgb + self._sid + b._kpart)
        if not data:
            return []
        de = self._ser.deserialize
        return [de(e) for e in unpack_list(data)]

    def add(self, value: Any) -> None:
        self.add_serialized(self._ser.serialize(value))

    def add_serialized(self, element: bytes) -> None:
        """Append one already serialized element."""
        b = self._b
        row = b._kgb + self._sid + b._kpart
        db = self._db
        data = db.get(row)
        frame = _LEN_LE.pack(len(element)) + element
        db.put(row, frame if data is None else data + frame)

    def update(self, values: Iterable[Any]) -> None:
        ser = self._ser.serialize
        items = [ser(v) for v in values]
        if items:
            self.update_serialized(pack_list(items))
        else:
            self.clear()

    def update_serialized(self, framed: bytes) -> None:
        """Make the list the already framed elements ``framed`` (:func:`pack_list` of at
        least one serialized element): what the changelog wrapper logs is what is stored."""
        b = self._b
        self._db.put(b._kgb + self._sid + b._kpart, framed)

    def clear(self) -> None:
        b = self._b
        self._db.delete(b._kgb + self._sid + b._kpart)


class _RocksMapState:
    """Raw map (and timer) state: one row per entry. Task thread only."""

    __slots__ = ("_b", "_db", "_sid", "_uk", "_v")

    def __init__(
        self, backend: RocksDBKeyedStateBackend, sid: bytes, uk: Serializer, v: Serializer
    ) -> None:
        self._b = backend
        self._db = backend._db
        self._sid = sid
        self._uk = uk
        self._v = v

    def get(self, user_key: Any) -> Any:
        b = self._b
        data = self._db.get(b._kgb + self._sid + b._kpart + self._uk.serialize(user_key))
        return None if data is None else self._v.deserialize(data)

    def put(self, user_key: Any, value: Any) -> None:
        b = self._b
        self._db.put(
            b._kgb + self._sid + b._kpart + self._uk.serialize(user_key), self._v.serialize(value)
        )

    def put_serialized(self, user_key: bytes, value: bytes) -> None:
        """Store an entry whose user key and value are already serialized."""
        b = self._b
        self._db.put(b._kgb + self._sid + b._kpart + user_key, value)

    def remove(self, user_key: Any) -> None:
        b = self._b
        self._db.delete(b._kgb + self._sid + b._kpart + self._uk.serialize(user_key))

    def contains(self, user_key: Any) -> bool:
        b = self._b
        return (
            self._db.get(b._kgb + self._sid + b._kpart + self._uk.serialize(user_key)) is not None
        )

    def items(self) -> Iterator[tuple[Any, Any]]:
        b = self._b
        prefix = b._kgb + self._sid + b._kpart
        n = len(prefix)
        uk, v = self._uk.deserialize, self._v.deserialize
        out = [(uk(k[n:]), v(d)) for k, d in iter_rows(self._db, prefix, _prefix_end(prefix))]
        return iter(out)

    def clear(self) -> None:
        b = self._b
        prefix = b._kgb + self._sid + b._kpart
        self._db.delete_range(prefix, _prefix_end(prefix))


@dataclass(slots=True)
class RocksDBSnapshot:
    """A hard-linked RocksDB checkpoint in a private temp dir; kind ``rocksdb-sst``.

    Implements :class:`~backends.snapshot.MaterializationSnapshot`. Immutable once taken;
    ``files``/``release`` may run on the upload thread. ``metadata`` is the content of
    ``STATE-META.json`` (byte-identical while the states do not change).
    """

    sqn: int | None
    key_group_range: KeyGroupRange
    directory: str
    checkpoint_dir: str
    metadata: bytes
    released: bool = field(default=False)
    compact: bool = field(default=False)

    @property
    def kind(self) -> str:
        """The table format: RocksDB SST files plus ``STATE-META.json``."""
        return KIND

    def files(self) -> Iterator[SnapshotFile]:
        """``STATE-META.json`` (in memory) then every file of the checkpoint, by name.

        With ``compact`` set, the first call compacts the checkpoint's copy of the
        database first (:meth:`compact_copy`): the same rows, in fewer bytes."""
        if self.compact:
            self.compact_copy()
        rng = self.key_group_range
        yield SnapshotFile(META_FILE, None, rng.start, rng.end, 0, data=self.metadata)
        for name in sorted(os.listdir(self.checkpoint_dir)):
            path = os.path.join(self.checkpoint_dir, name)
            if os.path.isfile(path) and not name.startswith(_OPEN_ONLY_FILES):
                yield SnapshotFile(name, None, rng.start, rng.end, 0, local_path=path)

    def compact_copy(self) -> None:
        """Compact the checkpoint directory's database into its last level (once).

        The checkpoint is a database of its own (hard links to the store's SSTs), so its
        compaction writes new SSTs into this directory only; the store and its files are
        untouched, and the rows (what the snapshot means) stay exactly the same: only
        overwritten versions and sequence numbers go. The files of a compacted copy are
        new files, shared with no other materialization. Runs on the thread that calls
        it (the upload thread; ``compact_range`` releases the GIL).

        Its blocks are ``COPY_BLOCK_SIZE`` (128 KiB) instead of the store's
        ``BLOCK_SIZE`` (64 KiB): the copy is written once, uploaded, and read only by a
        restore (which keeps its files until RocksDB rewrites them), and zstd compresses
        the end-to-end job's 100k-key state better in larger blocks. Snapshots of its
        bench workers, compacted at 64 / 128 / 256 KiB: 100k keys 700 / 637 / 627 KB,
        1M keys 8.08 / 8.08 / 8.35 MB, for about the same compaction CPU. The store keeps
        64 KiB: a point read that misses the block cache decompresses half as much.
        """
        self.compact = False
        try:
            db = _rdict(self.checkpoint_dir, db_options(COPY_BLOCK_SIZE))
            try:
                db.compact_range(None, None)
            finally:
                db.close()
        except Exception as exc:  # rocksdict raises plain Exception subclasses
            raise LocalStoreError(
                f"RocksDB compaction of snapshot {self.checkpoint_dir} failed ({exc})"
            ) from exc

    def release(self) -> None:
        """Delete the checkpoint directory (idempotent)."""
        if not self.released:
            self.released = True
            shutil.rmtree(self.directory, ignore_errors=True)


def encode_metadata(
    key_serializer: str,
    key_group_range: KeyGroupRange,
    max_parallelism: int,
    metas: dict[str, StateMeta],
    ids: dict[str, int],
) -> bytes:
    """The ``STATE-META.json`` bytes (sorted keys: content-stable)."""
    return json.dumps(
        {
            "version": META_VERSION,
            "key_serializer": key_serializer,
            "key_group_start": key_group_range.start,
            "key_group_end": key_group_range.end,
            "max_parallelism": max_parallelism,
            "states": [{"id": ids[name], "meta": metas[name].to_dict()} for name in sorted(metas)],
        },
        sort_keys=True,
    ).encode()


def decode_metadata(data: bytes, location: str) -> tuple[str, int, dict[int, StateMeta]]:
    """(key serializer name, max parallelism, state id -> meta) of ``STATE-META.json``."""
    try:
        raw = json.loads(data)
        if raw.get("version") != META_VERSION:
            raise CorruptionError(f"unsupported {META_FILE} version {raw.get('version')}", location)
        states = {int(s["id"]): StateMeta.from_dict(s["meta"]) for s in raw["states"]}
        return str(raw["key_serializer"]), int(raw["max_parallelism"]), states
    except CorruptionError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(f"invalid {META_FILE} ({exc})", location) from exc


class RocksDBKeyedStateBackend:
    """Keyed state in a local RocksDB (rocksdict, raw mode, WAL off).

    ``RocksDBKeyedStateBackend(key_serializer, key_group_range, max_parallelism=128,
    path=None, clock=wall_clock_ms)``: ``path`` is a directory for the database and its
    snapshots; by default a fresh temp directory. :meth:`close` deletes the directory if
    the backend created it; while open it is locked (:mod:`backends.localdirs`), so the
    directory of a killed process is reclaimed by the next start or ``statectl gc``. Use it as a
    context manager or call :meth:`close`. Task thread only (snapshots it returns are
    immutable and may be read on any thread). Same API and invariants as
    :class:`~backends.heap.HeapKeyedStateBackend`.
    """

    MAX_LOG_RATIO = 0.2
    """This store's default ``materialization.max-log-ratio``: its compacted SSTs take
    ~1.0x the live state's Parquet bytes (the heap's tables ~0.6-0.8x), so its full
    checkpoint stays under 1.5x the live state only with a shorter log beside them."""

    def __init__(
        self,
        key_serializer: Serializer,
        key_group_range: KeyGroupRange,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        path: str | None = None,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        if not 0 < max_parallelism <= 1 << 16:
            raise ValueError(f"max parallelism {max_parallelism} must be in [1, 65536]")
        self.key_serializer = key_serializer
        self.key_group_range = key_group_range
        self.max_parallelism = max_parallelism
        self.clock = clock
        try:  # locked while open: a killed process's directory is reclaimed (localdirs)
            self._dir = owned_dir("rocksdb-state-", path=path)
        except OSError as exc:
            raise LocalStoreError(f"cannot take RocksDB directory {path} ({exc})") from exc
        self.path = self._dir.path
        db_dir = os.path.join(self.path, "db")
        try:
            if os.path.exists(db_dir):
                raise LocalStoreError(f"{db_dir} exists: a RocksDB backend needs a fresh directory")
            self._db = open_raw_db(db_dir)
        except BaseException:
            self._dir.release()
            raise
        self._kg_bytes = [kg.to_bytes(2, "big") for kg in range(max_parallelism)]
        self.current_key: Any = None
        self.current_key_bytes = b""
        self.current_key_group = -1
        self._kgb = b""
        self._kpart = b""
        self._metas: dict[str, StateMeta] = {}
        self._ids: dict[str, int] = {}
        self._raw: dict[str, Any] = {}
        self._states: dict[str, Any] = {}
        self._preflush = 0  # flushes prepare_snapshot started for the next snapshot
        self._prepared = False  # prepare_snapshot said ready since the last snapshot
        self._closed = False

    def __enter__(self) -> RocksDBKeyedStateBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys -------------------------------------------------------------------------
    def set_current_key(self, key: Any) -> None:
        """Make ``key`` the key every state call acts on."""
        key_bytes = self.key_serializer.serialize(key)
        kg = key_group_for(key_bytes, self.max_parallelism)
        rng = self.key_group_range
        if not rng.start <= kg < rng.end:
            raise KeyGroupOutOfRangeError(
                f"key {key!r} is in key group {kg}, outside this backend's "
                f"[{self.key_group_range.start}, {self.key_group_range.end})"
            )
        self.current_key = key
        self.current_key_bytes = key_bytes
        self.current_key_group = kg
        self._kgb = self._kg_bytes[kg]
        self._kpart = _LEN.pack(len(key_bytes)) + key_bytes

    def set_current_key_raw(self, key: Any, key_bytes: bytes, key_group: int) -> None:
        """Set the current key when its bytes and group are already known (replay)."""
        self.current_key = key
        self.current_key_bytes = key_bytes
        self.current_key_group = key_group
        self._kgb = self._kg_bytes[key_group]
        self._kpart = _LEN.pack(len(key_bytes)) + key_bytes

    # -- states -----------------------------------------------------------------------
    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``; the same object on every call.

        Raises :class:`SchemaMismatchError` on a conflicting declaration of the name.
        """
        meta = descriptor.meta
        state = self._states.get(meta.name)
        if state is not None:
            self._metas[meta.name].check_compatible(meta)
            return state
        state = wrap(descriptor, self.internal_state(meta), self.clock)
        self._states[meta.name] = state
        return state

    def _register(self, meta: StateMeta) -> int:
        existing = self._metas.get(meta.name)
        if existing is not None:
            existing.check_compatible(meta)
            return self._ids[meta.name]
        if len(self._ids) >= 1 << 16:
            raise LocalStoreError("too many states for one RocksDB backend (65536)")
        self._metas[meta.name] = meta
        self._ids[meta.name] = sid = len(self._ids)
        return sid

    def register_restored(self, meta: StateMeta) -> None:
        """Declare a state known from a checkpoint."""
        self._register(meta)

    def state_metas(self) -> dict[str, StateMeta]:
        """Every state declared or restored, by name."""
        return dict(self._metas)

    def internal_state(self, meta: StateMeta) -> Any:
        """The raw state of ``meta`` (registers it if needed)."""
        self._check_open()
        sid = self._register(meta).to_bytes(2, "big")
        raw = self._raw.get(meta.name)
        if raw is None:
            if meta.kind is StateKind.LIST:
                raw = _RocksListState(self, sid, meta.raw_value_ser())
            elif meta.kind in MAP_LIKE:
                raw = _RocksMapState(self, sid, meta.user_key_ser(), meta.raw_value_ser())
            else:
                raw = _RocksValueState(self, sid, meta.raw_value_ser())
            self._raw[meta.name] = raw
        return raw

    # -- snapshot, scans and bulk load ------------------------------------------------
    def metadata(self) -> bytes:
        """The content of ``STATE-META.json`` for the current states."""
        return encode_metadata(
            self.key_serializer.name,
            self.key_group_range,
            self.max_parallelism,
            self._metas,
            self._ids,
        )

    def snapshot(self, sqn: int | None = None) -> RocksDBSnapshot:
        """A RocksDB checkpoint (hard links) in a fresh temp dir. Task thread.

        What consistency needs: the snapshot holds exactly the changes made before it
        (the changelog resumes at ``sqn``; a change in both would be replayed twice, a
        list append doubled). With the WAL off, unflushed changes live only in the
        memtable, so the checkpoint must flush it, and only the task thread (the only
        writer) knows where the boundary is: RocksDB cannot flush "the memtable as of
        sequence number S" later, and rocksdict has no event listener to tell a later
        flush of newer writes apart. So the flush stays on the task thread, but it does not
        hold the GIL: :meth:`_flush_memtable` starts it and waits for RocksDB's
        background thread in short sleeps, while the other threads of the process (the
        source, the DSTL's and the materializer's uploads) run; the checkpoint then
        finds an empty memtable and only hard-links files (milliseconds, under the GIL:
        rocksdict holds it for the whole call, flush included, which stalled every
        thread of the process for the flush).

        Expired TTL entries are not purged here (that would scan the state); they are
        dropped on access and when a snapshot is restored.

        The writes flushed since RocksDB last compacted into the last level sit in L0 and
        the levels above it, repeating keys the last level holds. In a snapshot that
        :meth:`prepare_snapshot` prepared (a materialization's), when they are more than
        ``SNAPSHOT_COMPACT_UPPER`` of the bytes (and at least
        ``SNAPSHOT_COMPACT_MIN_BYTES``), the snapshot's copy is compacted on the upload
        thread before its files are read (:meth:`RocksDBSnapshot.compact_copy`): one
        level, each key once, after the boundary, off the task thread. The levels are
        the store's file list from before the checkpoint, or from after it when a
        background compaction ended meanwhile (deciding on that alone compacted, and
        so re-uploaded whole, a third of the snapshots of a hot-key state). Other
        snapshots (a checkpoint with the changelog off) are never compacted: every one
        would rewrite and upload the whole state (1.9 s per checkpoint at 1M keys,
        instead of 0.1 s) where it now shares all but its new files.

        The store itself is not compacted for a snapshot: it was, by
        :meth:`prepare_snapshot` before the boundary, and for uniform keys the writes made
        during that compaction (~2 s at 1M keys) then left enough above the last level
        for the copy to be compacted again, so a materialization rewrote the whole state
        twice. RocksDB's own compactions keep the store's levels in shape, and reads skip
        the files above the last level by their bloom filters (:func:`db_options`).
        """
        self._check_open()
        prepared = self._prepared
        self._preflush = 0
        self._prepared = False
        self._flush_memtable()
        live = self._db.live_files()  # before: a background compaction may end meanwhile
        directory = tempfile.mkdtemp(prefix="snapshot-", dir=self.path)
        cp = os.path.join(directory, "checkpoint")
        try:
            rocksdict.Checkpoint(self._db).create_checkpoint(cp)
        except Exception as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise LocalStoreError(f"RocksDB checkpoint into {cp} failed ({exc})") from exc
        ssts = {n for n in os.listdir(cp) if n.endswith(".sst")}
        # The checkpoint's files, with their levels from before or (a background
        # compaction ended meanwhile) after it; levels unknown: compact.
        levels = {f["name"].lstrip("/"): f for f in live}
        if not ssts <= levels.keys():
            levels.update((f["name"].lstrip("/"), f) for f in self._db.live_files())
        compact = prepared and (
            not ssts <= levels.keys() or _worth_compacting([levels[n] for n in ssts])
        )
        return RocksDBSnapshot(
            sqn, self.key_group_range, directory, cp, self.metadata(), compact=compact
        )

    def prepare_snapshot(self) -> bool:
        """Make the next :meth:`snapshot` small and short; True when it will be. Task
        thread.

        While the memtable holds more than ``SNAPSHOT_FLUSH_ENTRIES``, it flushes it in
        RocksDB's background thread and returns False until that flush finished, then
        looks again (at most ``PREPARE_FLUSH_ROUNDS`` flushes: a task writing faster than
        RocksDB flushes must not make many small L0 files). The snapshot's own flush (on
        the task thread, see :meth:`snapshot`) then only has what was written since:
        milliseconds. It marks the next snapshot as a materialization's, whose copy is
        compacted when much of it is above the last level (:meth:`snapshot`). It changes
        no state and no boundary: a snapshot is exact with or without it.
        """
        self._check_open()
        self._prepared = True
        db = self._db
        if self._preflush and db.property_int_value("rocksdb.num-immutable-mem-table"):
            return False  # our flush is still running
        entries = db.property_int_value("rocksdb.num-entries-active-mem-table") or 0
        if entries <= SNAPSHOT_FLUSH_ENTRIES or self._preflush >= PREPARE_FLUSH_ROUNDS:
            self._preflush = 0
            return True
        try:
            db.flush(False)
        except Exception as exc:
            raise LocalStoreError(f"RocksDB flush of {self.path} failed ({exc})") from exc
        self._preflush += 1
        return False

    def _flush_memtable(self) -> None:
        """Flush the memtable and wait for the flush without holding the GIL. Task
        thread (nothing writes meanwhile, so the memtable is empty after it)."""
        db = self._db
        try:
            db.flush(False)  # switches the memtable now; RocksDB's flush thread writes it
            deadline = time.monotonic() + FLUSH_WAIT_S
            while db.property_int_value("rocksdb.num-immutable-mem-table"):
                if time.monotonic() > deadline:  # a failing flush: let RocksDB say why
                    db.flush(True)
                    break
                time.sleep(FLUSH_POLL_S)
        except Exception as exc:
            raise LocalStoreError(f"RocksDB flush of {self.path} failed ({exc})") from exc

    def _state_rows(self, name: str, kg: int) -> Iterator[tuple[bytes, bytes]]:
        lo = self._kg_bytes[kg] + self._ids[name].to_bytes(2, "big")
        return iter_rows(self._db, lo, _prefix_end(lo))

    def entries(self, name: str) -> Iterator[tuple[int, Any, Any]]:
        """``(key_group, key, raw value)`` of state ``name``, one range scan per key group."""
        meta = self._metas.get(name)
        if meta is None:
            return
        for kg in self.key_group_range:
            rows = list(self._state_rows(name, kg))
            for group, keys, values in decode_state_rows(meta, self.key_serializer, rows):
                yield from ((group, k, v) for k, v in zip(keys, values, strict=True))

    def entry_count(self) -> int:
        """An estimate of the number of rows (RocksDB's ``estimate-num-keys``)."""
        self._check_open()
        n = self._db.property_int_value("rocksdb.estimate-num-keys")
        return int(n or 0)

    def load_entries(
        self,
        meta: StateMeta,
        runs: Iterable[tuple[int, list[Any], list[Any]]],
        only: KeyGroupRange | None = None,
    ) -> None:
        """Bulk-insert raw entries (``(key_group, keys, values)`` runs) with one write
        batch; groups outside ``only`` skipped."""
        sid = self._register(meta).to_bytes(2, "big")
        rng = only if only is not None else self.key_group_range
        vser = meta.raw_value_ser()
        kser = self.key_serializer.serialize
        wb = rocksdict.WriteBatch(raw_mode=True)
        is_list, is_map = meta.kind is StateKind.LIST, meta.kind in MAP_LIKE
        uks = meta.user_key_ser().serialize if is_map else None
        for kg, key, value in (
            (kg, k, v)
            for kg, keys, values in runs
            if kg in rng
            for k, v in zip(keys, values, strict=True)
        ):
            kb = kser(key)
            row = self._kg_bytes[kg] + sid + _LEN.pack(len(kb)) + kb
            if uks is not None:
                for uk, v in value.items():
                    wb.put(row + uks(uk), vser.serialize(v))
            elif is_list:
                if value:
                    wb.put(row, pack_list([vser.serialize(e) for e in value]))
            else:
                wb.put(row, vser.serialize(value))
        self._write(wb)

    def load_serialized_values(
        self, meta: StateMeta, key_groups: pa.Array, keys: pa.Array, values: pa.Array
    ) -> None:
        """Bulk-insert value-like entries given as serialized bytes (the log's ``key``
        and ``value`` columns: the bytes this store keeps), at most one row per key; the
        key groups must be this backend's (the caller filtered them). The rows are
        built and sorted in numpy or Arrow; no Python call per entry beyond one ``put``.

        From ``INGEST_MIN_ROWS`` rows on they are written into an SST file
        (:meth:`write_values_sst`) that RocksDB ingests (:meth:`ingest_ssts`). Fewer rows
        go in one write batch. The rows may come in any order.
        """
        self._register(meta)
        if len(keys) < INGEST_MIN_ROWS:
            rows, values = self._sorted_rows(meta, key_groups, keys, values)
            wb = rocksdict.WriteBatch(raw_mode=True)
            put = wb.put
            for row, value in zip(rows.to_pylist(), values.to_pylist(), strict=True):
                put(row, value)
            self._write(wb)
            return
        directory = self.ingest_dir()
        try:
            path = os.path.join(directory, "load.sst")
            if self.write_values_sst(meta, key_groups, keys, values, path):
                self.ingest_ssts([path])
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def ingest_dir(self) -> str:
        """A new empty directory in this store's directory for SST files to ingest
        (:meth:`ingest_ssts` moves them: same file system); the caller removes it."""
        self._check_open()
        return tempfile.mkdtemp(prefix="ingest-", dir=self.path)

    def write_values_sst(
        self, meta: StateMeta, key_groups: pa.Array, keys: pa.Array, values: pa.Array, path: str
    ) -> bool:
        """Write serialized value-like entries, as :meth:`load_serialized_values` takes
        them, as the SST file ``path`` for :meth:`ingest_ssts`; False (no file) if there
        are none. ``meta`` must be registered already. Safe in a forked child (a restore
        writes half of its states' rows there: :mod:`backends.halves`): reads only the
        registrations, writes only ``path``.

        Ingestion gives a file's entries a sequence number above every earlier write,
        so they replace older values of the same keys (a materialization loaded before,
        a clear of the log) as a write would; ingested files go to the last level that
        has room (the last one, restoring into an empty store), with no memtable inserts
        and no flush of them later.
        """
        if meta.name not in self._ids:
            raise LocalStoreError(f"state {meta.name!r} is not registered")
        rows, values = self._sorted_rows(meta, key_groups, keys, values)
        if not len(rows):
            return False
        write_sst(path, rows, values, ingest_writer_options())
        return True

    def ingest_ssts(self, paths: list[str]) -> None:
        """Ingest the SST files ``paths`` (moved, not copied), as one ingestion."""
        self._check_open()
        opts = rocksdict.IngestExternalFileOptions()
        opts.set_move_files(True)
        try:
            self._db.ingest_external_file(paths, opts)
        except Exception as exc:  # rocksdict raises plain Exception subclasses
            raise LocalStoreError(f"RocksDB ingestion of {paths} failed ({exc})") from exc

    def _sorted_rows(
        self, meta: StateMeta, key_groups: pa.Array, keys: pa.Array, values: pa.Array
    ) -> tuple[pa.Array, pa.Array]:
        """The stored rows of serialized ``keys`` of registered state ``meta``, and their
        ``values``, in RocksDB's (bytewise) order: 8-byte keys (int64, float64) in numpy
        (:func:`~backends.rocksload.sorted_rows8`), others in Arrow."""
        sid = self._ids[meta.name].to_bytes(2, "big")
        key8 = fixed8(keys)
        if key8 is not None:
            return sorted_rows8(key_groups, sid, key8, values, len(self._kg_bytes))
        lengths = pc.binary_length(keys)
        low, high = pc.min_max(lengths).values()
        if low.as_py() is None:
            return pa.array([], pa.binary()), values
        prefixes = pa.array([kgb + sid for kgb in self._kg_bytes], pa.binary())
        if low.as_py() == high.as_py():  # fixed-width keys: one length prefix for all
            framed = pc.binary_join_element_wise(
                prefixes.take(key_groups), _LEN.pack(low.as_py()), keys, b""
            )
        else:
            lens = pa.array([_LEN.pack(n) for n in lengths.to_pylist()], pa.binary())
            framed = pc.binary_join_element_wise(prefixes.take(key_groups), lens, keys, b"")
        if not ascending(framed):  # a writer takes RocksDB's (bytewise) order only
            order = pc.sort_indices(framed)
            framed, values = framed.take(order), values.take(order)
        return framed, values

    def _write(self, wb: rocksdict.WriteBatch) -> None:
        self._check_open()
        try:
            self._db.write(wb)
        except Exception as exc:
            raise LocalStoreError(f"RocksDB write batch failed ({exc})") from exc

    # -- the batch path ---------------------------------------------------------------
    def apply_batch(
        self, descriptor: StateDescriptor, keys: Any, values: Any, user_keys: Any = None
    ) -> None:
        """Value set / list add / map put for many keys in one write batch."""
        self.get_state(descriptor)
        meta, batch = prepare_batch(
            descriptor,
            self.key_serializer,
            self.key_group_range,
            self.max_parallelism,
            self.clock(),
            keys,
            values,
            user_keys,
        )
        self.apply_prepared(meta, batch)

    def apply_prepared(self, meta: StateMeta, batch: PreparedBatch) -> None:
        """Apply a prepared batch as one RocksDB write batch (fills its value bytes)."""
        sid = self._register(meta).to_bytes(2, "big")
        kgb = self._kg_bytes
        pack = _LEN.pack
        rows = [
            kgb[kg] + sid + pack(len(kb)) + kb
            for kg, kb in zip(batch.key_groups, batch.key_bytes, strict=True)
        ]
        vbytes = batch.value_bytes_with(meta.raw_value_ser())
        wb = rocksdict.WriteBatch(raw_mode=True)
        if batch.op is Op.VALUE_SET:
            for row, vb in zip(rows, vbytes, strict=True):
                wb.put(row, vb)
        elif batch.op is Op.LIST_ADD:
            grouped: dict[bytes, bytearray] = {}
            for row, vb in zip(rows, vbytes, strict=True):
                buf = grouped.get(row)
                if buf is None:
                    buf = grouped[row] = bytearray()
                buf += _LEN_LE.pack(len(vb))
                buf += vb
            order = list(grouped)
            db: Any = self._db
            old: list[bytes | None] = db.get(order) if order else []
            for row, prev in zip(order, old, strict=True):
                wb.put(row, bytes(grouped[row]) if prev is None else prev + bytes(grouped[row]))
        else:
            ukb = batch.user_key_bytes_with(meta.user_key_ser())
            for row, uk, vb in zip(rows, ukb, vbytes, strict=True):
                wb.put(row + uk, vb)
        self._write(wb)

    # -- lifecycle --------------------------------------------------------------------
    def purge_expired(self) -> int:
        """Delete expired TTL entries of every state (a full scan); returns rows deleted."""
        now = self.clock()
        deleted = 0
        for name, meta in self._metas.items():
            if meta.ttl is None:
                continue
            ser = meta.raw_value_ser()
            is_list = meta.kind is StateKind.LIST
            wb = rocksdict.WriteBatch(raw_mode=True)
            for kg in self.key_group_range:
                for k, v in list(self._state_rows(name, kg)):
                    if is_list:
                        kept = alive(
                            [ser.deserialize(e) for e in unpack_list(v)],
                            True,
                            False,
                            meta.ttl.ttl_ms,
                            now,
                        )
                        if kept is None:
                            wb.delete(k)
                            deleted += 1
                        else:
                            wb.put(k, pack_list([ser.serialize(e) for e in kept]))
                    elif alive(ser.deserialize(v), False, False, meta.ttl.ttl_ms, now) is None:
                        wb.delete(k)
                        deleted += 1
            self._write(wb)
        return deleted

    # -- adopting a materialized database (restore at the speed of the disk) ------------
    def can_adopt(self) -> bool:
        """Whether :meth:`adopt` may replace the database: no state was declared,
        restored or asked for yet (so there is no row and no state object)."""
        return not self._closed and not self._metas and not self._raw and not self._states

    def staging_dir(self) -> str:
        """A fresh directory inside this store's (same file system: :meth:`adopt` renames)."""
        self._check_open()
        return tempfile.mkdtemp(prefix="adopt-", dir=self.path)

    def adopt(self, db_dir: str, metas: dict[int, StateMeta]) -> None:
        """Make the RocksDB files in ``db_dir`` this store's database, with states
        ``metas`` (state id -> meta, ids ``0..n-1``), instead of loading its rows one by
        one. Only while :meth:`can_adopt`; the caller checked the files (their content
        hashes), the key serializer and that every row is in this store's key groups.
        The store is unusable if this raises (a restore then fails as a whole)."""
        if not self.can_adopt():
            raise LocalStoreError("a RocksDB store adopts a database only while empty")
        if sorted(metas) != list(range(len(metas))):
            raise CorruptionError(f"state ids {sorted(metas)} are not 0..n-1", db_dir)
        live = os.path.join(self.path, "db")
        self._db.close()
        shutil.rmtree(live)
        os.rename(db_dir, live)
        self._db = open_raw_db(live)
        for sid, meta in metas.items():
            self._metas[meta.name] = meta
            self._ids[meta.name] = sid

    def _check_open(self) -> None:
        if self._closed:
            raise LocalStoreError(f"RocksDB backend at {self.path} is closed")

    def close(self) -> None:
        """Close the database; delete its directory if the backend created it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._db.close()
        finally:
            self._dir.release()
