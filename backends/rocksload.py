"""Bulk loads into RocksDB: rows in RocksDB's order, and SST files written on two cores.

A restore loads each folded value-like state of the log as SST files that RocksDB
ingests (:meth:`~backends.rocksdb.RocksDBKeyedStateBackend.load_serialized_values`).
Per 1M rows, building the Python bytes the writer takes (~0.08 s) and ``rocksdict``'s
``SstFileWriter`` (~0.2 s, holding the GIL: a second thread gains nothing) were the
largest part of a replay into RocksDB. :func:`write_ssts` writes a large load as two
files of disjoint key ranges, the upper half in a forked child (:func:`_child`) while
the calling thread writes the lower half, and RocksDB ingests both in one call.

The child runs nothing but :func:`_write_sst` on the rows and values it inherited
(read only, so the kernel copies none of their pages), with the garbage collector off,
on the system allocator (pyarrow's own may hold locks of threads that do not exist in
the child), with the writer's options built by the parent, and ends with ``os._exit``:
its exit status is its answer. A child that fails, dies, or runs past
:func:`_child_deadline_s` is killed and reaped, and its half is written by the caller
instead: the load is the same either way, only slower. A fork that fails (no memory for
the page tables, a process limit) writes both halves in the caller.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import sys
import time
import warnings
from collections import deque
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import rocksdict

log = logging.getLogger(__name__)

FORK_MIN_ROWS = 1 << 18
"""From this many rows on, :func:`write_ssts` writes half of them in a forked child: a
fork of a restoring worker (a few hundred MB: 10-20 ms of page tables) then costs less
than the half it saves (~0.07 s per 256k rows)."""

_LEN8 = (8).to_bytes(4, "big")  # the length field of an 8-byte key


def fixed8(values: pa.Array) -> np.ndarray[Any, Any] | None:
    """The bytes of a binary column of 8-byte values as native uint64s (no copy: each
    holds its 8 bytes as they are), or None if there are none or some value is another
    length (or null). Shared with the restore's fold (:mod:`backends.restore`)."""
    if not len(values) or values.null_count:
        return None
    low, high = (s.as_py() for s in pc.min_max(pc.binary_length(values)).values())
    if not low == high == 8:
        return None
    first = np.frombuffer(values.buffers()[1], np.int32, 1, values.offset * 4)[0]
    return np.frombuffer(values.buffers()[2], np.uint64, len(values), int(first))


def sorted_rows8(
    key_groups: pa.Array, sid: bytes, key8: np.ndarray[Any, Any], values: pa.Array, groups: int
) -> tuple[pa.Array, pa.Array]:
    """The stored rows of 8-byte keys (``key8``: :func:`fixed8` of them; key group, state
    id ``sid``, length, key: 16 bytes each) in RocksDB's (bytewise) order, and ``values``
    in that order.

    Built in numpy from the keys' data buffer: no Arrow take of a binary column and no
    join, which took 0.12 s of a replay's 0.5 s per state of 1M keys. Bytewise order of
    such rows is key group, then the key as a big-endian unsigned integer (state id and
    length are the same in every row): a sort of the keys, then a stable (radix) sort of
    the 16-bit key groups. Raises ``ValueError`` for a key group outside ``[0, groups)``
    or a null one.
    """
    n = len(key8)
    kg = key_groups.to_numpy(zero_copy_only=False)
    if key_groups.null_count or kg.min() < 0 or kg.max() >= groups:
        raise ValueError(f"key groups outside [0, {groups}) in a bulk load")
    order = np.argsort(key8.byteswap())  # byteswapped: the keys as big-endian numbers
    order = order[np.argsort(kg[order].astype(np.uint16), kind="stable")]
    # a row is two uint64 (native byte order, so each holds its 8 bytes as they are):
    # key group (2 bytes, big-endian), state id and length, then the key
    head = int.from_bytes(b"\0\0" + sid + _LEN8, sys.byteorder)
    kgo = kg[order].astype(np.uint64)
    swapped = (kgo >> 8) | ((kgo & 0xFF) << 8)  # the group's 2 big-endian bytes, first
    rows = np.empty((n, 2), np.uint64)
    rows[:, 0] = (swapped if sys.byteorder == "little" else kgo << 48) | head
    rows[:, 1] = key8[order]
    offsets = pa.py_buffer(np.arange(0, 16 * n + 1, 16, dtype=np.int32))
    # binary, not fixed_size_binary: its to_pylist is 8x faster (0.05 s for 1M rows)
    framed = pa.Array.from_buffers(pa.binary(), n, [None, offsets, pa.py_buffer(rows)])
    return framed, values.take(pa.array(order))


def ascending(rows: pa.Array) -> bool:
    """Whether binary ``rows`` are strictly ascending, bytewise (Arrow compares binary
    as unsigned bytes, as RocksDB's default comparator does); vectorized."""
    n = len(rows)
    if n < 2:
        return True
    rising = pc.greater(rows.slice(1), rows.slice(0, n - 1))
    return bool(pc.all(rising, skip_nulls=False).as_py())


def write_ssts(
    directory: str, rows: pa.Array, values: pa.Array, options: rocksdict.Options
) -> list[str]:
    """Write strictly ascending binary ``rows`` with ``values`` as SST files in
    ``directory`` (which the caller owns and removes) and return their paths, in key
    order: one file below :data:`FORK_MIN_ROWS` rows, else two, the upper half written
    by a forked child (see the module docstring). Calling thread only; the child is
    reaped before this returns or raises."""
    n = len(rows)
    first = os.path.join(directory, "0.sst")
    if n < FORK_MIN_ROWS or not hasattr(os, "fork"):
        _write_sst(first, rows, values, options)
        return [first]
    half = n // 2
    second = os.path.join(directory, "1.sst")
    upper = (rows.slice(half), values.slice(half))
    pid = _fork_writer(second, *upper, options)
    started = time.monotonic()
    try:
        _write_sst(first, rows.slice(0, half), values.slice(0, half), options)
        wrote = pid is not None and _child_wrote(pid, _child_deadline_s(time.monotonic() - started))
    except BaseException:  # the child is not reaped yet (_child_wrote reaps it last)
        if pid is not None:
            _kill(pid)
        raise
    if not wrote:
        _write_sst(second, *upper, options)
    return [first, second]


def _write_sst(path: str, rows: pa.Array, values: pa.Array, options: rocksdict.Options) -> None:
    writer = rocksdict.SstFileWriter(options)
    writer.open(path)
    deque(map(writer.__setitem__, rows.to_pylist(), values.to_pylist()), maxlen=0)
    writer.finish()


def _fork_writer(
    path: str, rows: pa.Array, values: pa.Array, options: rocksdict.Options
) -> int | None:
    """Fork a child that writes ``rows`` to ``path``; its pid, or None if the fork failed."""
    try:
        with warnings.catch_warnings():
            # 3.12+ warns that a multi-threaded process forks: the child runs only
            # _write_sst (see the module docstring), never the other threads' locks.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        log.warning("bulk load: fork failed (%s); writing every row on this thread", exc)
        return None
    if pid == 0:  # pragma: no cover - the child; its exit ends this branch
        _child(path, rows, values, options)
    return pid


def _child(
    path: str, rows: pa.Array, values: pa.Array, options: rocksdict.Options
) -> None:  # pragma: no cover
    """The forked child: write the SST file, then ``os._exit`` (0: written).

    Coverage cannot see it (the child never returns); tests check it by its file."""
    code = 1
    try:
        gc.disable()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        pa.set_memory_pool(pa.system_memory_pool())
        _write_sst(path, rows, values, options)
        code = 0
    finally:
        os._exit(code)


def _child_deadline_s(own_s: float) -> float:
    """How long the caller waits for the child once its own half is written: the halves
    are the same size, so a child still running after this (``10 s`` plus four times
    the caller's own time) is stuck, not slow."""
    return 10.0 + 4.0 * own_s


def _child_wrote(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for child ``pid`` and reap it; whether it exited 0.
    A child still running then is killed (and its half is the caller's again)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): wait without a bound
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)
    if not ready:
        log.warning("bulk load: the SST writer child %d ran past %.1f s; killed", pid, timeout_s)
        _kill(pid)
        return False
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        log.warning(
            "bulk load: the SST writer child %d exited %d; writing its rows here", pid, code
        )
    return code == 0


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
