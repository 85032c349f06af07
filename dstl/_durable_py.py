"""Durable local writes and helper-process round trips with ``os`` calls: the fallback of
:mod:`dstl._durable_c`, with the same API, behaviour and errors.

The C module exists because each ``os`` call here releases and retakes the GIL, which
costs the busy task thread a forced switch per call (see dstl/_durable_c.c); this one
makes about fifteen such calls per local segment write where the C module makes one.

``write_new(directory, tmp_name, name, data)``
    In ``directory`` (which must exist): create ``tmp_name`` (O_EXCL), write all of
    ``data`` (a bytes-like object), fsync and close it, hard-link it as ``name``
    (FileExistsError if ``name`` exists: never replaces), unlink ``tmp_name`` and fsync
    the directory. On any failure the temporary file is removed and an OSError names the
    directory (as given) or ``directory/file`` (str, or bytes if the directory was bytes).
``exchange(wfd, rfd, parts, capacity, timeout) -> (status, bytes)``
    Write every buffer of ``parts`` to ``wfd``, then read a 16-byte header (status and
    length, little-endian int64) and ``length`` reply bytes from ``rfd``; both descriptors
    non-blocking, TimeoutError once ``timeout`` seconds have passed in total, EOFError
    when the peer closed its end, OSError otherwise. ``capacity`` (>= 0) is unused.

Thread-safe (no shared state).
"""

from __future__ import annotations

import contextlib
import operator
import os
import select
import struct
import time
from collections.abc import Sequence
from typing import Any

from dstl._records_py import as_double

_INT_MAX = (1 << 31) - 1
_HEADER = struct.Struct("<qq")
_CHUNK = 1 << 30
_IOV_MAX = os.sysconf("SC_IOV_MAX")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _named(exc: OSError, path: Any) -> OSError:
    """``exc`` naming ``path`` (the OSError subclass of its errno, as os.* would raise)."""
    return OSError(exc.errno, exc.strerror, path)


def _fs_path(path: Any) -> bytes:
    """``path`` as the C module's PyUnicode_FSConverter converts it, one at a time."""
    converted = os.fsencode(path)
    if b"\0" in converted:
        raise ValueError("embedded null byte")
    return converted


def write_new(directory: Any, tmp_name: Any, name: Any, data: Any, /) -> None:
    """Publish ``data`` as the new file ``directory/name`` (see the module doc)."""
    dir_b, tmp_b, name_b = (_fs_path(p) for p in (directory, tmp_name, name))
    with memoryview(data) as view:
        if b"/" in tmp_b or b"/" in name_b:
            raise ValueError("tmp_name and name must be plain file names")
        with view.cast("B") if view.format != "B" or view.ndim != 1 else view as flat:
            _publish(directory, dir_b, tmp_b, name_b, flat)


def _publish(directory: Any, dir_b: bytes, tmp_b: bytes, name_b: bytes, data: memoryview) -> None:
    def at(file: bytes) -> Any:
        joined = dir_b + b"/" + file
        return joined if isinstance(directory, bytes) else os.fsdecode(joined)

    try:
        dfd = os.open(dir_b, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _named(exc, directory) from None
    try:
        try:
            fd = os.open(tmp_b, _CREATE, 0o644, dir_fd=dfd)
        except OSError as exc:  # not created: nothing to remove
            raise _named(exc, at(tmp_b)) from None
        try:
            try:
                done = 0
                while done < len(data):
                    done += os.write(fd, data[done : done + _CHUNK])
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink_quietly(tmp_b, dfd)
            raise _named(exc, at(tmp_b)) from None
        try:
            os.link(tmp_b, name_b, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            raise _named(exc, at(name_b)) from None
        finally:
            _unlink_quietly(tmp_b, dfd)
        try:
            os.fsync(dfd)
        except OSError as exc:
            raise _named(exc, directory) from None
    finally:
        os.close(dfd)


def _unlink_quietly(name: bytes, dfd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def exchange(
    wfd: int, rfd: int, parts: Sequence[Any], capacity: int, timeout: float, /
) -> tuple[int, bytes]:
    """One request/reply round trip with a helper process (see the module doc)."""
    wfd, rfd, capacity = operator.index(wfd), operator.index(rfd), operator.index(capacity)
    timeout = as_double(timeout)
    if not (0 <= wfd <= _INT_MAX and 0 <= rfd <= _INT_MAX):
        raise ValueError("exchange: bad file descriptor")
    if capacity < 0 or not timeout >= 0:
        raise ValueError("exchange: capacity and timeout must be >= 0")
    views = [memoryview(p) for p in tuple(parts)]
    deadline = time.monotonic() + timeout
    try:
        _send(wfd, [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views], deadline)
        status, length = _HEADER.unpack(_recv(rfd, 16, deadline))
        if not (0 <= status <= 255 and 0 <= length <= 1 << 40):
            raise OSError("the helper process sent a malformed reply header")
        return status, _recv(rfd, length, deadline)
    finally:
        for v in views:
            v.release()


def _wait(fd: int, events: int, deadline: float) -> None:
    poller = select.poll()
    poller.register(fd, events)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the helper process did not answer in time")
        if poller.poll(min(left, 1e6) * 1000 + 1):
            return  # ready, or hung up: the next call says which


def _send(fd: int, views: list[memoryview], deadline: float) -> None:
    pending = [v for v in views if len(v)]
    while pending:
        try:
            n = os.writev(fd, pending[:_IOV_MAX])
        except BlockingIOError:
            _wait(fd, select.POLLOUT, deadline)
            continue
        while pending and n >= len(pending[0]):
            n -= len(pending.pop(0))
        if pending and n:
            pending[0] = pending[0][n:]


def _recv(fd: int, length: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < length:
        try:
            chunk = os.read(fd, min(length - len(out), _CHUNK))
        except BlockingIOError:
            _wait(fd, select.POLLIN, deadline)
            continue
        if not chunk:
            raise EOFError("the helper process closed its pipe")
        out += chunk
    return bytes(out)
