"""Restore = load materialized tables + replay the log, filtered by key group.

Works for any parallelism change: a backend restores from every handle whose key-group
range intersects its own and keeps only its own key groups. Nothing is applied partially:
every file is read and decoded before the first entry is loaded, so a corrupt or missing
file raises before the backend is touched (then it is discarded by the caller anyway).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from backends.backend import KeyedStateBackend
from backends.changelog import ChangelogKeyedStateBackend
from backends.errors import LocalStoreError
from backends.halves import run_halves
from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from backends.keygroups import KeyGroupRange
from backends.localdirs import owned_dir
from backends.rocksdb import META_FILE, decode_metadata, decode_state_rows, iter_rows, open_raw_db
from backends.rocksload import fixed8
from backends.serializers import Serializer, decode_column, unpack_list
from backends.state import MAP_LIKE, Op, StateKind, StateMeta
from backends.tables import Runs, parquet_to_table, table_entries, table_meta
from backends.wrappers import alive
from dstl.errors import CorruptionError, SchemaMismatchError
from dstl.fileio import FileIO
from dstl.handles import ChangelogHandle
from dstl.integrity import read_verified
from dstl.read import read_changes

log = logging.getLogger(__name__)

Decoded = list[tuple[StateMeta, Runs]]


def relevant(
    handles: Sequence[KeyedStateHandle], key_groups: KeyGroupRange
) -> list[KeyedStateHandle]:
    """The handles that hold any of ``key_groups``."""
    return [h for h in handles if h.key_group_range.intersects(key_groups)]


def _check_key_serializer(backend: KeyedStateBackend, name: str, what: str) -> None:
    if name != backend.key_serializer.name:
        raise SchemaMismatchError(
            f"{what} was written with key serializer {name!r}, "
            f"the backend declares {backend.key_serializer.name!r}"
        )


def _decode_heap_parquet(
    backend: KeyedStateBackend,
    fileio: FileIO,
    handle: MaterializationHandle,
    rng: KeyGroupRange,
    trusted: bool,
    states: Collection[str] | None,
) -> Decoded:
    decoded: Decoded = []
    for f in pieces_to_read(handle.state_files, rng, states):
        url = fileio.url(fileio.relative(f.location))
        table = parquet_to_table(read_verified(fileio, f.file_refs()[0]), url)
        meta, key_ser = table_meta(table, url)
        _check_key_serializer(backend, key_ser.name, f"state {meta.name!r}")
        meta = meta if trusted else meta.untrusted()
        if not _holds(f, rng):  # read for the state's declaration only
            table = table.slice(0, 0)
        decoded.append((meta, table_entries(meta, backend.key_serializer, table)))
    return decoded


def _holds(f: StateFileHandle, rng: KeyGroupRange) -> bool:
    """Whether ``f`` may hold entries of ``rng`` (files that record no range: always)."""
    return f.key_group_end <= f.key_group_start or (
        f.key_group_start < rng.end and rng.start < f.key_group_end
    )


def pieces_to_read(
    files: Sequence[StateFileHandle], rng: KeyGroupRange, states: Collection[str] | None = None
) -> list[StateFileHandle]:
    """The heap-parquet pieces a restore of ``rng`` (of ``states``, default all) reads.

    Pieces are cut along key groups (:func:`backends.tables.state_files`), so a restore
    of part of a materialization's range (a rescale, one Spark partition) reads the
    pieces that overlap it, plus, of a state none of whose pieces does, its smallest: a
    later change of that state must find it declared. Files that record no state or no
    key-group range (older records) are always read.
    """
    out: list[StateFileHandle] = []
    smallest: dict[str, StateFileHandle] = {}
    found: set[str] = set()
    for f in files:
        if f.state is None:
            out.append(f)
            continue
        if states is not None and f.state not in states:
            continue
        if _holds(f, rng):
            out.append(f)
            found.add(f.state)
        elif f.state not in smallest or f.size_bytes < smallest[f.state].size_bytes:
            smallest[f.state] = f
    out.extend(f for name, f in smallest.items() if name not in found)
    return out


_ROCKSDB_FILE = re.compile(
    r"^(\d+\.(sst|log|blob)|MANIFEST-\d+|CURRENT|OPTIONS-\d+|IDENTITY|[A-Za-z0-9_.-]+\.json)$"
)


def _file_name(location: str, name: str) -> str:
    """The RocksDB file name of a state file (its handle's name, else its basename)."""
    found = name or location.rstrip("/").rsplit("/", 1)[-1]
    if not _ROCKSDB_FILE.match(found):
        raise CorruptionError(
            f"state file {found!r} is not a RocksDB file name (the handle must record "
            "the snapshot file name in StateFileHandle.name)",
            location,
        )
    return found


def _decode_rocksdb_sst(
    backend: KeyedStateBackend,
    fileio: FileIO,
    handle: MaterializationHandle,
    rng: KeyGroupRange,
    trusted: bool,
    states: Collection[str] | None,
) -> Decoded:
    """Download the files, open them as a temporary RocksDB, scan ``rng`` once."""
    scratch = owned_dir("rocksdb-restore-")  # reclaimed after a kill (backends.localdirs)
    tmp = scratch.path
    try:
        db_dir = os.path.join(tmp, "db")
        os.makedirs(db_dir)
        metas = _download_rocksdb(backend, fileio, handle, db_dir)
        rows: dict[int, list[tuple[bytes, bytes]]] = {sid: [] for sid in metas}
        try:
            db = open_raw_db(db_dir)
        except LocalStoreError as exc:  # the files are what was recorded, or have no hash
            raise CorruptionError(
                f"RocksDB cannot open the materialization ({exc})", handle.writer_id
            ) from exc
        try:
            lo = rng.start.to_bytes(2, "big")
            hi = rng.end.to_bytes(2, "big") if rng.end < 1 << 16 else b"\xff\xff\xff"
            for k, v in iter_rows(db, lo, hi):
                sid = (k[2] << 8) | k[3]
                bucket = rows.get(sid)
                if bucket is None:
                    raise CorruptionError(f"row of unknown state id {sid}", handle.writer_id)
                bucket.append((k, v))
        except CorruptionError:
            raise
        except Exception as exc:  # rocksdict raises plain Exceptions on bad blocks
            raise CorruptionError(
                f"RocksDB cannot read the materialization ({exc})", handle.writer_id
            ) from exc
        finally:
            db.close()
        return [
            (m, decode_state_rows(m, backend.key_serializer, rows[sid]))
            for sid, meta in sorted(metas.items())
            if states is None or meta.name in states
            for m in (meta if trusted else meta.untrusted(),)
        ]
    except OSError as exc:  # the local scratch directory: a full disk is no corruption
        raise LocalStoreError(f"cannot unpack RocksDB files locally ({exc})") from exc
    finally:
        scratch.release()


def _download_rocksdb(
    backend: KeyedStateBackend, fileio: FileIO, handle: MaterializationHandle, db_dir: str
) -> dict[int, StateMeta]:
    """Write the files of ``handle`` (each checked against its content hash) into
    ``db_dir``; the state metas by id (the key serializer checked against ``backend``)."""
    metadata: bytes | None = None
    for f in handle.state_files:
        data = read_verified(fileio, f.file_refs()[0])
        name = _file_name(f.location, f.name)
        if name == META_FILE:
            metadata = data
        else:
            with open(os.path.join(db_dir, name), "wb") as fh:
                fh.write(data)
    if metadata is None:
        raise CorruptionError(
            f"RocksDB materialization of {handle.writer_id} has no {META_FILE}",
            handle.state_files[0].location if handle.state_files else None,
        )
    key_ser, _max_par, metas = decode_metadata(metadata, handle.writer_id)
    _check_key_serializer(backend, key_ser, f"RocksDB state of {handle.writer_id}")
    return metas


def _adopt_rocksdb(
    backend: KeyedStateBackend,
    fileio: FileIO,
    handle: MaterializationHandle,
    trusted: bool,
    states: Collection[str] | None,
) -> bool:
    """Restore a RocksDB materialization into a RocksDB store by making its files the
    store's database (no row is read: restore at the speed of the download). Only into
    a store still empty (:meth:`~backends.rocksdb.RocksDBKeyedStateBackend.can_adopt`),
    of a materialization whose key groups all belong to the store (no rescale that
    splits it), all states, trusted, and no TTL state (a row-by-row load drops expired
    entries). False: not adopted, nothing changed; load it row by row."""
    can_adopt = getattr(backend, "can_adopt", None)
    rng = backend.key_group_range
    if (
        can_adopt is None
        or not trusted
        or states is not None
        or not rng.start <= handle.key_group_start <= handle.key_group_end <= rng.end
        or not can_adopt()
    ):
        return False
    staging = backend.staging_dir()  # type: ignore[attr-defined]
    try:
        db_dir = os.path.join(staging, "db")
        os.makedirs(db_dir)
        metas = _download_rocksdb(backend, fileio, handle, db_dir)
        if any(m.ttl is not None for m in metas.values()):
            return False
        backend.adopt(db_dir, metas)  # type: ignore[attr-defined]
        return True
    except OSError as exc:  # the local staging directory: a full disk is no corruption
        raise LocalStoreError(f"cannot unpack RocksDB files locally ({exc})") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_DECODERS: dict[
    str,
    Callable[
        [
            KeyedStateBackend,
            FileIO,
            MaterializationHandle,
            KeyGroupRange,
            bool,
            Collection[str] | None,
        ],
        Decoded,
    ],
] = {"heap-parquet": _decode_heap_parquet, "rocksdb-sst": _decode_rocksdb_sst}


def _load_materialization(
    backend: KeyedStateBackend,
    fileio: FileIO,
    handle: MaterializationHandle,
    key_groups: KeyGroupRange,
    trusted: bool,
    states: Collection[str] | None,
) -> None:
    decoder = _DECODERS.get(handle.kind)
    if decoder is None:
        raise CorruptionError(f"unknown materialization kind {handle.kind!r} of {handle.writer_id}")
    if handle.kind == "rocksdb-sst" and _adopt_rocksdb(backend, fileio, handle, trusted, states):
        return
    decoded = decoder(backend, fileio, handle, key_groups, trusted, states)
    now = backend.clock()
    for meta, runs in decoded:
        known = backend.state_metas().get(meta.name)
        if known is not None:
            known.check_compatible(meta)
        if meta.ttl is not None:  # expired entries are not restored
            runs = [_alive_run(meta, meta.ttl.ttl_ms, now, run) for run in runs]
        backend.load_entries(meta, runs, key_groups)


def _alive_run(
    meta: StateMeta, ttl_ms: int, now: int, run: tuple[int, list[Any], list[Any]]
) -> tuple[int, list[Any], list[Any]]:
    kg, keys, values = run
    is_list, is_map = meta.kind is StateKind.LIST, meta.kind in MAP_LIKE
    kept = [(k, alive(v, is_list, is_map, ttl_ms, now)) for k, v in zip(keys, values, strict=True)]
    return kg, [k for k, v in kept if v is not None], [v for _, v in kept if v is not None]


_FOLDABLE = {
    StateKind.VALUE: int(Op.VALUE_SET),
    StateKind.REDUCING: int(Op.ACC_SET),
    StateKind.AGGREGATING: int(Op.ACC_SET),
}


HALVES_MIN_ROWS = 1 << 18
"""Gathered value-like changes from which a replay into a store of bytes (RocksDB) folds
and writes them in two halves on two cores (:meth:`_Replay._finish_in_halves`): a fork
of a restoring worker (a few hundred MB: 10-20 ms of page tables) then costs less than
the half it saves (fold, sort and SST writing: ~0.6 s per 1M keys in all)."""

_RUNS_PER_STATE = 16
"""Above this many runs of rows a state (on average) a block is put in state order
before its states are gathered (see :meth:`_Replay.add`)."""
FOLD_ROWS = 1 << 22
"""Value-like changes of one state gathered before they are folded (about 150 MiB of
log rows): the fold bounds them by the state's key count again. A state with more keys
than this folds again only once its rows have doubled since the last fold, so each row
is folded a bounded number of times (at a fixed threshold, a fold that kept more rows
than it would fold again at every next block: 1M keys under a 1M threshold took a 5M
change replay from 1.8 s to 36 s)."""


class _Replay:
    """Applies one writer's log, block by block, to ``backend``.

    META records register their state at once; list and map states replay change by
    change in order. Value-like states (value, reducing, aggregating) whose changes are
    all sets and clears gather their changes over *blocks* and fold them in Arrow to
    the last change per key (a set or a clear) before :meth:`finish` loads them in bulk:
    a key set in every block is decoded and loaded once, not once per block. Changes of
    one state keep their order; states are independent (so leaving out all but
    ``states`` changes none of them, and a folded state may load after a list state
    replayed). Restoring thread only.
    """

    def __init__(
        self,
        backend: KeyedStateBackend,
        location: str,
        trusted: bool,
        states: Collection[str] | None = None,
    ) -> None:
        self.backend = backend
        self.location = location
        self.trusted = trusted
        self.states = states
        self._pending: dict[str, list[pa.Table]] = {}  # state -> gathered changes
        self._rows: dict[str, int] = {}
        self._kept: dict[str, int] = {}  # state -> rows its last fold kept

    def add(self, table: pa.Table) -> None:
        """One block of changes (:data:`dstl.changelog.BLOCK_SCHEMA`), in log order."""
        backend, location, states = self.backend, self.location, self.states
        names, codes = _state_codes(table["state"])
        if states is not None:
            wanted = np.isin(codes, [i for i, name in enumerate(names) if name in states])
            table, codes = table.filter(pa.array(wanted)), codes[wanted]
        is_meta = pc.equal(table["op"], int(Op.META))
        if pc.any(is_meta).as_py():
            metas = table.filter(is_meta)
            for name, value in zip(
                metas["state"].to_pylist(), metas["value"].to_pylist(), strict=True
            ):
                meta = StateMeta.from_json(value)
                meta = meta if self.trusted else meta.untrusted()
                known = backend.state_metas().get(name)
                if known is not None:
                    known.check_compatible(meta)
                else:
                    backend.register_restored(meta)
            kept = pc.invert(is_meta)
            codes = codes[kept.to_numpy(zero_copy_only=False)]
            table = table.filter(kept)
        n = table.num_rows
        if n == 0:
            return
        # Where the state changes: a foldable state is gathered as zero-copy slices, one
        # per run of its rows. A writer hands each state's records over in runs (its
        # buffer of up to 4096), but a segment groups a block's rows by key group
        # (dstl.segment.by_key_group), which cuts them into runs of a few rows: then the
        # block is put in state order first (stable: each key's changes keep theirs). A
        # slice per short run made a log of 12.7M changes replay at 1.35M/s, not 5.2M/s.
        columns = table.select(["key_group", "key", "op", "value"])
        run_codes = codes
        starts = np.flatnonzero(codes[1:] != codes[:-1]) + 1
        if len(starts) >= _RUNS_PER_STATE * len(names):
            order = np.argsort(codes, kind="stable")
            columns, run_codes = columns.take(pa.array(order)), codes[order]
            starts = np.flatnonzero(run_codes[1:] != run_codes[:-1]) + 1
        bounds = list(zip([0, *starts.tolist()], [*starts.tolist(), n], strict=True))
        block_ops = set(pc.unique(table["op"]).to_pylist())
        present = np.flatnonzero(np.bincount(codes, minlength=len(names))).tolist()
        for i in present:
            name = names[i]
            declared = backend.state_metas().get(name)
            if declared is None:
                raise CorruptionError(f"change of undeclared state {name!r}", location)
            set_op = _FOLDABLE.get(declared.kind)
            ops = block_ops
            if set_op is not None and not ops <= {set_op, int(Op.CLEAR)} and len(present) > 1:
                ops = set(pc.unique(table["op"].filter(pa.array(codes == i))).to_pylist())
            if set_op is not None and ops <= {set_op, int(Op.CLEAR)}:
                for start, end in bounds:
                    if run_codes[start] == i:
                        self._gather(name, columns.slice(start, end - start))
            else:
                self._fold(name)  # whatever was gathered first (this raises as corrupt)
                part = table if len(present) == 1 else table.filter(pa.array(codes == i))
                _replay_rows(backend, declared, part, location)

    def _gather(self, name: str, part: pa.Table) -> None:
        self._pending.setdefault(name, []).append(part)
        self._rows[name] = self._rows.get(name, 0) + part.num_rows
        if self._rows[name] >= max(FOLD_ROWS, 2 * self._kept.get(name, 0)):
            folded = _last_per_key(pa.concat_tables(self._pending[name]))
            self._pending[name] = [folded]
            self._rows[name] = self._kept[name] = folded.num_rows

    def _fold(self, name: str) -> None:
        parts = self._pending.pop(name, None)
        self._rows.pop(name, None)
        self._kept.pop(name, None)
        if parts:
            meta = self.backend.state_metas()[name]
            _load_values(self.backend, meta, _last_per_key(pa.concat_tables(parts)))

    def finish(self) -> None:
        """Load every gathered state (its last change per key): into a store of bytes
        (RocksDB) in two halves on two cores once there are :data:`HALVES_MIN_ROWS`
        gathered rows (:meth:`_finish_in_halves`), else one state after the other."""
        rows = sum(self._rows.values())
        if rows >= HALVES_MIN_ROWS and hasattr(self.backend, "write_values_sst"):
            self._finish_in_halves()
        for name in list(self._pending):
            self._fold(name)

    def _finish_in_halves(self) -> None:
        """Fold, sort and write every gathered state as SST files in two halves of the
        backend's key groups, the upper half in a forked child
        (:func:`~backends.halves.run_halves`), then ingest each state's files and apply
        its clears. Key groups decide the halves: a key's changes all fall in one, the
        halves' rows are disjoint ranges of RocksDB's (key-group first) order, and a
        hash spreads the keys of any distribution evenly over them."""
        backend: Any = self.backend
        rng = backend.key_group_range
        mid = (rng.start + rng.end) // 2
        names = list(self._pending)
        parts = [pa.concat_tables(self._pending.pop(name)) for name in names]
        metas = [backend.state_metas()[name] for name in names]
        self._rows.clear()
        self._kept.clear()
        directory = backend.ingest_dir()

        def half(tag: str, lo: int, hi: int) -> None:
            out = os.path.join(directory, tag)
            shutil.rmtree(out, ignore_errors=True)  # what a run of it stopped left behind
            os.mkdir(out)
            for i, (meta, part) in enumerate(zip(metas, parts, strict=True)):
                rows = _last_per_key(part, (lo, hi))
                clears, rows = _split_clears(rows)
                if clears.num_rows:
                    with pa.ipc.new_file(os.path.join(out, f"{i}.clears"), clears.schema) as f:
                        f.write_table(clears)
                backend.write_values_sst(
                    meta,
                    rows["key_group"].combine_chunks(),
                    rows["key"].combine_chunks(),
                    rows["value"].combine_chunks(),
                    os.path.join(out, f"{i}.sst"),
                )

        try:
            run_halves(lambda: half("lower", rng.start, mid), lambda: half("upper", mid, rng.end))
            for i, meta in enumerate(metas):
                outs = [os.path.join(directory, tag, str(i)) for tag in ("lower", "upper")]
                for out in outs:
                    if os.path.exists(out + ".clears"):
                        with pa.ipc.open_file(out + ".clears") as f:
                            _load_values(backend, meta, f.read_all())
                ssts = [out + ".sst" for out in outs if os.path.exists(out + ".sst")]
                if ssts:
                    backend.ingest_ssts(ssts)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _state_codes(column: pa.ChunkedArray | pa.Array) -> tuple[list[str], np.ndarray[Any, Any]]:
    """The state names of a block's ``state`` column and each row's index into them."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            column = column.chunk(0)
        else:  # chunks may have different dictionaries: encode them again, together
            column = column.cast(pa.string()).combine_chunks()
    if not pa.types.is_dictionary(column.type):
        column = pc.dictionary_encode(column)
    codes = column.indices.to_numpy(zero_copy_only=False)
    return column.dictionary.to_pylist(), codes


def _last_per_key(part: pa.Table, groups: tuple[int, int] | None = None) -> pa.Table:
    """The last row per key of ``part`` (of its rows in key groups ``[lo, hi)``, if
    ``groups`` is given), in log order (a key's bytes decide its key group, so the key
    alone identifies the entry). One hash pass over the keys, no Python call per row:
    8-byte keys (int64, float64) hash as integers, read in place from each chunk, others
    by their codes in an Arrow dictionary. The range is picked in numpy, and the rows
    kept are taken once: filtering a restore's half out of the gathered rows first
    copied them twice (~0.1 s of ~0.6 s per half and 1M keys)."""
    import pandas as pd  # here: a restore with no log does not pay for the import

    if part.num_rows < 2 and groups is None:
        return part
    chunks = [c for c in part["key"].chunks if len(c)]
    codes8 = [c for c in map(fixed8, chunks) if c is not None]
    if chunks and len(codes8) == len(chunks):
        codes = np.concatenate(codes8)
    else:
        codes = pc.dictionary_encode(part["key"].combine_chunks()).indices.to_numpy()
    rows: np.ndarray[Any, Any] | None = None
    if groups is not None:
        kg = part["key_group"].to_numpy()
        rows = np.flatnonzero((kg >= groups[0]) & (kg < groups[1]))
        codes = codes[rows]
    last = np.flatnonzero(~pd.Series(codes, copy=False).duplicated(keep="last").to_numpy())
    return part.take(pa.array(last if rows is None else rows[last]))


def _split_clears(rows: pa.Table) -> tuple[pa.Table, pa.Table]:
    """Folded value-like changes ``rows`` as (clears, sets); no copy when there is no
    clear (the usual case)."""
    cleared = pc.equal(rows["op"], int(Op.CLEAR))
    if not pc.any(cleared).as_py():
        return rows.slice(0, 0), rows
    return rows.filter(cleared), rows.filter(pc.invert(cleared))


def _load_values(backend: KeyedStateBackend, meta: StateMeta, rows: pa.Table) -> None:
    """Set or clear, in bulk, the folded value-like changes ``rows`` (one per key)."""
    gone, rows = _split_clears(rows)
    key_ser = backend.key_serializer
    if gone.num_rows:
        state = backend.internal_state(meta)
        kbs = gone["key"].to_pylist()
        for kg, kb, key in zip(
            gone["key_group"].to_pylist(), kbs, decode_column(key_ser, gone["key"]), strict=True
        ):
            backend.set_current_key_raw(key, kb, kg)
            state.clear()
    if rows.num_rows == 0:
        return
    load_serialized = getattr(backend, "load_serialized_values", None)
    if load_serialized is not None:  # a store of bytes (RocksDB) takes the log's bytes
        # (and sorts them into its own order)
        load_serialized(
            meta,
            rows["key_group"].combine_chunks(),
            rows["key"].combine_chunks(),
            rows["value"].combine_chunks(),
        )
        return
    rows = rows.take(pc.sort_indices(rows["key_group"]))
    groups = pc.run_end_encode(rows["key_group"].combine_chunks())
    keys = decode_column(key_ser, rows["key"])
    values = decode_column(meta.raw_value_ser(), rows["value"])
    runs: Runs = []
    start = 0
    for kg, end in zip(groups.values.to_pylist(), groups.run_ends.to_pylist(), strict=True):
        runs.append((kg, keys[start:end], values[start:end]))
        start = end
    backend.load_entries(meta, runs)


def _replay_rows(
    backend: KeyedStateBackend, meta: StateMeta, part: pa.Table, location: str
) -> None:
    """Replay the changes of one list or map state one by one, in order."""
    key_ser: Serializer = backend.key_serializer
    state = backend.internal_state(meta)
    vser = meta.raw_value_ser()
    uks = meta.user_key_ser() if meta.kind in MAP_LIKE else None
    kind = meta.kind
    cols = [part[c].to_pylist() for c in ("key_group", "op", "key", "user_key", "value")]
    last_key: bytes | None = None
    for kg, op, key, user_key, value in zip(*cols, strict=True):
        if key != last_key or kg != backend.current_key_group:
            backend.set_current_key_raw(key_ser.deserialize(key), key, kg)
            last_key = key
        if op == Op.CLEAR:
            state.clear()
        elif (op == Op.VALUE_SET and kind is StateKind.VALUE) or (
            op == Op.ACC_SET and kind in (StateKind.REDUCING, StateKind.AGGREGATING)
        ):
            state.update(vser.deserialize(value))
        elif op == Op.LIST_ADD and kind is StateKind.LIST:
            state.add(vser.deserialize(value))
        elif op == Op.LIST_SET and kind is StateKind.LIST:
            state.update([vser.deserialize(v) for v in unpack_list(value)])
        elif uks is not None and (
            (op == Op.MAP_PUT and kind is StateKind.MAP)
            or (op == Op.TIMER_REGISTER and kind is StateKind.TIMER)
        ):
            state.put(uks.deserialize(user_key), vser.deserialize(value))
        elif uks is not None and (
            (op == Op.MAP_REMOVE and kind is StateKind.MAP)
            or (op == Op.TIMER_DELETE and kind is StateKind.TIMER)
        ):
            state.remove(uks.deserialize(user_key))
        else:
            raise CorruptionError(
                f"unknown change op {op} for {kind.value} state {meta.name!r}", location
            )


def restore_into(
    backend: KeyedStateBackend,
    fileio: FileIO,
    handles: Sequence[KeyedStateHandle],
    trusted: bool = True,
    states: Collection[str] | None = None,
) -> None:
    """Load ``handles`` into an empty ``backend`` (heap or RocksDB; no changelog written).

    Materializations of either kind (``heap-parquet``, ``rocksdb-sst``) load into either
    store, filtered to the backend's key groups (so any p -> q rescale works); of
    heap-parquet ones only the pieces that hold those key groups are read.
    ``trusted=False`` (tools reading somebody's store) runs none of the store's code:
    pickled values stay bytes; the backend's key serializer must be resolved the same way
    (``serializer_for(name, trusted=False)``). ``states`` restores only those states
    (a reader of one state; the others stay undeclared).
    """
    for h in handles:
        if (
            h.key_serializer != backend.key_serializer.name
            or h.max_parallelism != backend.max_parallelism
        ):
            raise SchemaMismatchError(
                f"checkpointed state of {h.backend_id} has keys {h.key_serializer!r} with max parallelism "
                f"{h.max_parallelism}; the backend declares {backend.key_serializer.name!r} with "
                f"{backend.max_parallelism}"
            )
    # Each key group is restored from the one handle whose range owns it: handles of one
    # checkpoint have disjoint ranges, but their files may hold other groups too (after a
    # rescale, several handles reference the same old files).
    for h in relevant(handles, backend.key_group_range):
        rng = _intersect(backend.key_group_range, h.key_group_range)
        started = time.perf_counter()
        for m in dict.fromkeys(h.materialized):
            _load_materialization(backend, fileio, m, rng, trusted, states)
        loaded, loaded_cpu = time.perf_counter(), time.process_time()
        by_writer: dict[str, list[ChangelogHandle]] = {}
        for c in dict.fromkeys(h.changelog):  # a block listed twice is replayed once
            by_writer.setdefault(c.writer_id, []).append(c)
        changes = 0
        for writer_id, logs in by_writer.items():
            replay = _Replay(backend, logs[0].location, trusted, states)
            for table in _uncovered_changes(fileio, h, writer_id, logs, rng):
                changes += table.num_rows
                replay.add(table)
            replay.finish()
        log.info(
            "restored backend=%s key_groups=%d-%d materialized_ms=%.1f changes=%d replay_ms=%.1f "
            "replay_cpu_ms=%.1f",
            h.backend_id,
            rng.start,
            rng.end,
            (loaded - started) * 1e3,
            changes,
            (time.perf_counter() - loaded) * 1e3,
            (time.process_time() - loaded_cpu) * 1e3,  # the process's: a loaded machine's
        )


def _uncovered_changes(
    fileio: FileIO,
    handle: KeyedStateHandle,
    writer_id: str,
    logs: Sequence[ChangelogHandle],
    rng: KeyGroupRange,
) -> Iterator[pa.Table]:
    """The changes of ``writer_id``'s ``logs`` in ``rng`` that no materialization of
    ``handle`` holds: each key group's from the sqn its own materialization covers
    (:meth:`~backends.handles.KeyedStateHandle.replay_segments`), in one read and at
    most one Arrow filter per block."""
    runs = handle.replay_segments(writer_id, rng)
    return read_changes(fileio, logs, runs=runs, state_dictionary=True)


def _intersect(a: KeyGroupRange, b: KeyGroupRange) -> KeyGroupRange:
    return KeyGroupRange(max(a.start, b.start), max(max(a.start, b.start), min(a.end, b.end)))


def restore_changelog_backend(
    backend: ChangelogKeyedStateBackend, fileio: FileIO, handles: Sequence[KeyedStateHandle]
) -> None:
    """Restore a changelog backend: its inner store, plus what its checkpoints reference.

    Until this backend materializes, its checkpoints reference the restored
    materializations and logs (files stay owned by the checkpoint they came from).
    """
    restore_into(backend.inner, fileio, handles)
    wanted = relevant(handles, backend.key_group_range)
    # After a rescale, several handles reference the same old writer's blocks and
    # materializations (each new range restored from the old range that held it): listed
    # once each, or a later restore replays a block twice (a list state's appends doubled).
    backend.base = tuple(dict.fromkeys(m for h in wanted for m in h.materialized))
    backend.restored_log = tuple(dict.fromkeys(c for h in wanted for c in h.changelog))
