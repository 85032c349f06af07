"""Segment encoding in a helper process, off the GIL of the process that runs the tasks.

Why a process: encoding a segment (:func:`dstl.segment.encode_segment`) on the upload
thread makes ~15 pyarrow calls that release and retake the GIL. While a task thread is
busy running Python, each retake is a forced hand-off that costs the task thread
150-300 us on this VM, and wrapping the change buffers as Arrow tables held the GIL for
~0.5 ms per upload; so every pre-emptive upload slowed the per-record state path (issue
4). Here the upload thread hands the change buffers' chunks (plain bytes and Arrow
buffers, described in a little JSON) to a helper process and gets the segment back in one
call that releases the GIL once (:func:`dstl._durable.exchange`); the helper wraps and
encodes them with its own GIL. The bytes are the same as :func:`encode_segment` writes
in-process (tests check that).

Nothing is lost when the helper is not there: if it cannot be started, dies, hangs for
``timeout_s`` or reports an error, the blocks are encoded in the calling thread instead
(a data error then raises exactly as :func:`encode_segment` raises it) and the failure is
logged. A helper that did not answer is killed, and the next call starts a new one; one
that reported an error answered properly and is kept. Nothing waits for a helper that is
still starting either: it warms up first (:func:`_warm_up`), says so with one byte, and
until then the calling thread encodes.

Wire format (private to this module, both ends are this file): a request is an 8-byte
little-endian length, that many bytes of JSON describing the blocks (writer, sqn range,
and each chunk of its change buffer, with its buffers as indices; Arrow arrays as type,
length, null count, offset and buffers) and how many blocks each segment takes, then the
buffers themselves, each starting at a multiple of 64 bytes. A reply is two little-endian
int64 (status, length) and ``length`` bytes: for each segment its length (int64), its
bytes and their 32-byte SHA-256 digest (status 0), or an error message (status 1).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from dstl._durable import exchange
from dstl._records import KIND_BYTES, KIND_FLOAT64, KIND_INT64, RecordColumns
from dstl.buffer import ChangeBuffer
from dstl.integrity import content_hash
from dstl.pages import disable_huge_pages
from dstl.segment import BLOCK_SCHEMA, Block, encode_segment

log = logging.getLogger(__name__)

_ALIGN = 64  # Arrow's buffer alignment: the helper's arrays point into one payload buffer
_PIPE_BYTES = 1 << 20  # fewer wake-ups per request than the default 64 KiB pipe
_OK, _FAILED = 0, 1
_READY = b"R"  # the helper's first byte: warmed up (see _warm_up), requests welcome
_HASH_BYTES = 32  # each segment of a reply is followed by its SHA-256 (dstl.integrity)
_PADS = [bytes(n) for n in range(_ALIGN)]


@dataclass(frozen=True, slots=True)
class EncodedSegment:
    """A segment's bytes (a view of the helper's reply: not copied) and content hash."""

    data: bytes | memoryview
    content_hash: str


@dataclass(frozen=True, slots=True)
class PendingBlock:
    """One writer's changes for a segment, not yet encoded: a sealed change buffer."""

    writer_id: str
    sqn_start: int
    sqn_end: int
    changes: ChangeBuffer

    def to_block(self) -> Block:
        """The block :func:`~dstl.segment.encode_segment` takes (wraps, does not copy)."""
        return Block(self.writer_id, self.sqn_start, self.sqn_end, self.changes.to_table())


class SegmentEncoder:
    """Encodes segments in a helper process; falls back to the calling thread.

    Thread-safe: any thread may call :meth:`encode`; one request is in flight at a
    time (``self._lock``, held across the round trip only). The helper is started by
    :meth:`start` or by the first :meth:`encode`, and replaced after any failure.
    ``started`` counts helpers started; ``fallbacks`` the calls it failed, and
    ``unready`` those made before it was warmed up (both then encoded in-process).
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the running helper said it is warmed up
        self.started = 0
        self.fallbacks = 0
        self.unready = 0

    def start(self) -> None:
        """Start the helper if none runs (it imports pyarrow while the caller goes on)."""
        with self._lock:
            self._ensure_started()

    @property
    def pid(self) -> int | None:
        """The helper's process id, or None when none is running."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def encode(self, blocks: list[PendingBlock]) -> EncodedSegment:
        """The segment of ``blocks``, as :func:`~dstl.segment.encode_segment` writes it,
        with its content hash (computed in the helper: no hashing on this process's GIL).
        """
        return self.encode_many([blocks])[0]

    def encode_many(self, segments: list[list[PendingBlock]]) -> list[EncodedSegment]:
        """:meth:`encode` of each of ``segments``, in one round trip.

        Why: a round trip costs the calling thread a fixed latency beside a busy task
        (waiting for the helper to be scheduled, then for the GIL); one per segment
        capped what the pre-emptive lane uploads at one segment per trip, while a heap
        materialization ends a segment up to 20 times a second at 100k keys.
        A data error raises as :func:`encode_here` raises it, for the first segment that
        has one (the caller encodes them one by one to find which).
        """
        if not segments or not all(segments):
            raise ValueError("a segment needs at least one block")
        with self._lock:
            answer = self._round_trip(segments)
        if isinstance(answer, list):
            return answer
        if answer is not None:
            log.warning("segment encoder process failed (%s); encoding in this process", answer)
        return [encode_here(blocks) for blocks in segments]

    def _round_trip(self, segments: list[list[PendingBlock]]) -> list[EncodedSegment] | str | None:
        """The helper's segments; else why it failed (counted in ``fallbacks``), or None
        while it is not ready (counted in ``unready``). Under ``self._lock``."""
        try:
            proc = self._ensure_started()
            assert proc.stdin is not None and proc.stdout is not None
            if not self._poll_ready(proc, 0.0):
                self.unready += 1
                return None
            parts, payload = _request(segments)
            status, reply = exchange(
                proc.stdin.fileno(),
                proc.stdout.fileno(),
                parts,
                payload + (1 << 16),  # the guess at the reply size: it is compressed
                self.timeout_s,
            )
        except (OSError, EOFError) as exc:  # TimeoutError is an OSError
            self._stop(kill=True)
            self.fallbacks += 1
            return f"{type(exc).__name__}: {exc}"
        if status != _OK:  # a data error, reported: the helper is fine
            reason = reply.decode("utf-8", "replace")
        else:
            encoded = _segments_of(reply, len(segments))
            if encoded is not None:
                return encoded
            self._stop(kill=True)  # the helper is not what we think it is
            reason = f"a reply of {len(reply)} bytes that is not {len(segments)} segments"
        self.fallbacks += 1
        return reason

    def wait_ready(self, timeout_s: float) -> bool:
        """Start the helper if none runs and wait up to ``timeout_s`` for it to be warmed
        up; whether it is. Until then :meth:`encode_many` encodes in the calling thread
        (counted in ``unready``)."""
        with self._lock:
            try:
                return self._poll_ready(self._ensure_started(), timeout_s)
            except (OSError, EOFError) as exc:
                log.warning("segment encoder process failed (%s)", exc)
                self._stop(kill=True)
                return False

    def _poll_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
        """Whether the helper said it is ready (its first byte), waiting ``timeout_s``.

        Why: the helper takes 0.2-0.9 s to import and warm up. A request sent meanwhile
        waited for it: a checkpoint right after the start took 0.85-0.95 s. The caller
        encodes in-process until then instead. Raises EOFError for a helper that exited
        or wrote something else."""
        if self._ready:
            return True
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        if not select.select([fd], [], [], timeout_s)[0]:
            return False
        first = os.read(fd, 1)
        if first != _READY:
            raise EOFError(f"the helper's first byte was {first!r}, not {_READY!r}")
        self._ready = True
        return True

    def close(self) -> None:
        """Stop the helper: it exits when its input closes (killed after 5 s)."""
        with self._lock:
            self._stop(kill=False)

    def _ensure_started(self) -> subprocess.Popen[bytes]:
        # No poll() for a dead helper here: it is a syscall, so on the upload thread one
        # more GIL hand-off per request. A dead helper fails the exchange (broken pipe,
        # end of input), which replaces it.
        if self._proc is not None:
            return self._proc
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            _helper_argv(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        for fd in (proc.stdin.fileno(), proc.stdout.fileno()):
            os.set_blocking(fd, False)  # exchange() polls, so a hung helper times out
            with contextlib.suppress(OSError):  # a lower pipe-max-size: the default works
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        self._proc = proc
        self._ready = False
        self.started += 1
        return proc

    def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        self._ready = False
        if proc is None:
            return
        if kill:
            proc.kill()
        assert proc.stdin is not None and proc.stdout is not None
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):  # a broken pipe: the helper is gone already
                stream.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _forget(self) -> None:
        """In a forked child: drop the parent's helper without touching it."""
        self._lock = threading.Lock()
        proc, self._proc = self._proc, None
        self._ready = False
        if proc is not None and proc.stdin is not None and proc.stdout is not None:
            for fd in (proc.stdin.fileno(), proc.stdout.fileno()):
                with contextlib.suppress(OSError):
                    os.close(fd)


def encode_here(blocks: list[PendingBlock], grouped: bool = True) -> EncodedSegment:
    """The segment of ``blocks`` encoded on the calling thread (no helper round trip):
    the helper's bytes, or with ``grouped`` false its rows as appended (see
    :func:`~dstl.segment.encode_segment`).

    For a barrier's small segment: beside a busy task thread (0.2 ms GIL slices, as
    while a checkpoint is in flight) a 28k-change segment took p50 28 / p90 52 ms here
    against 44 / 206 ms through the helper on a loaded VM, where every round trip waits
    for the helper process to be scheduled and then for the caller to be again."""
    data = encode_segment([b.to_block() for b in blocks], grouped)
    return EncodedSegment(data, content_hash(data))


def _helper_argv() -> list[str]:
    """The helper's command line (tests put a broken helper here)."""
    return [sys.executable, "-c", "from dstl.encoder import main; main()"]


_shared: SegmentEncoder | None = None
_shared_lock = threading.Lock()


def shared_encoder() -> SegmentEncoder:
    """The process's encoder, shared by every changelog storage (one helper per process).

    Closed at interpreter exit; a forked child gets a fresh one on first use.
    """
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SegmentEncoder()
        return _shared


def _close_shared() -> None:
    if _shared is not None:
        _shared.close()


def _forget_shared() -> None:
    global _shared, _shared_lock
    _shared_lock = threading.Lock()
    if _shared is not None:
        _shared._forget()
    _shared = None


atexit.register(_close_shared)
os.register_at_fork(after_in_child=_forget_shared)


# -- the wire format -----------------------------------------------------------------------


class _Payload:
    """The buffers of a request, each starting 64-byte aligned in the payload.

    Hot (~300 buffers per 5 MB upload, run while the upload thread holds the GIL): no
    de-duplication, no per-buffer allocation but the list entries.
    """

    __slots__ = ("parts", "size", "sizes")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.sizes: list[int] = []
        self.size = 0

    def ref(self, buf: Any) -> int:
        """The index of ``buf`` (bytes or an Arrow buffer), -1 for None."""
        if buf is None:
            return -1
        if type(buf) is bytes:
            n = len(buf)
        else:
            n = buf.size if isinstance(buf, pa.Buffer) else memoryview(buf).nbytes
        self.sizes.append(n)
        self.parts.append(buf)
        pad = -n % _ALIGN
        if pad:
            self.parts.append(_PADS[pad])
        self.size += n + pad
        return len(self.sizes) - 1

    def array(self, array: pa.Array) -> list[Any]:
        return [
            str(array.type),
            len(array),
            array.null_count,
            array.offset,
            [self.ref(b) for b in array.buffers()],
        ]

    def column(self, column: tuple[Any, ...] | None) -> list[int] | None:
        """A record-buffer binary column (nulls, validity, offsets, data)."""
        if column is None:
            return None
        nulls, validity, offsets, data = column
        return [nulls, self.ref(validity), self.ref(offsets), self.ref(data)]


def _request(segments: list[list[PendingBlock]]) -> tuple[list[Any], int]:
    """The request's parts (header, JSON, buffers and padding) and its payload size:
    the blocks of every segment in order, and how many each segment has.

    Describes the chunks of each block's :class:`~dstl.buffer.ChangeBuffer` as they
    are (see ``ChangeBuffer.__init__``): the helper rebuilds the buffer and calls its
    ``to_table``, so this process makes no pyarrow call for the record-buffer chunks.
    """
    payload = _Payload()
    described: list[Any] = []
    for block in itertools.chain.from_iterable(segments):
        chunks: list[Any] = []
        for chunk in block.changes.chunks:
            if len(chunk) == 5:  # (rows, nbytes, sqn, state, RecordColumns.take())
                rows, nbytes, sqn, state, taken = chunk
                _, key_groups, ops, key_offsets, key_data, user_keys, values = taken
                refs = [payload.ref(b) for b in (key_groups, ops, key_offsets, key_data)]
                uks, vals = payload.column(user_keys), payload.column(values)
                chunks.append([0, rows, nbytes, sqn, state, refs, uks, vals])
            elif len(chunk) == 9:  # Arrow columns of one sqn and state
                n, nbytes, sqn, state, op, kgs, keys, uks, vals = chunk
                op_desc = op if isinstance(op, int) else payload.array(op)
                arrays = [kgs, keys, uks, vals]
                descs = [None if a is None else payload.array(a) for a in arrays]
                chunks.append([1, n, nbytes, sqn, state, op_desc, *descs])
            else:  # (rows, nbytes, RecordBatch) of single records
                rows, nbytes, batch = chunk
                chunks.append([2, rows, nbytes, [payload.array(a) for a in batch.columns]])
        described.append((block.writer_id, block.sqn_start, block.sqn_end, chunks))
    meta = json.dumps(
        {
            "blocks": described,
            "segments": [len(blocks) for blocks in segments],
            "sizes": payload.sizes,
            "payload": payload.size,
        },
        separators=(",", ":"),
    ).encode()
    return [len(meta).to_bytes(8, "little"), meta, *payload.parts], payload.size


def _blocks(meta: dict[str, Any], payload: pa.Buffer) -> list[Block]:
    """The blocks a request describes, their arrays pointing into ``payload`` (checked)."""
    buffers: list[pa.Buffer] = []
    offset = 0
    for size in meta["sizes"]:
        buffers.append(payload.slice(offset, size))
        offset += size + -size % _ALIGN

    def buf(ref: int) -> pa.Buffer | None:
        return None if ref < 0 else buffers[ref]

    def array(desc: list[Any]) -> pa.Array:
        type_, length, null_count, offset, refs = desc
        return pa.Array.from_buffers(
            pa.type_for_alias(type_),
            length,
            [buf(r) for r in refs],
            null_count=null_count,
            offset=offset,
        )

    def column(desc: list[Any] | None) -> tuple[Any, ...] | None:
        return None if desc is None else (desc[0], buf(desc[1]), buf(desc[2]), buf(desc[3]))

    blocks: list[Block] = []
    for writer, sqn_start, sqn_end, described in meta["blocks"]:
        chunks: list[tuple[Any, ...]] = []
        for desc in described:
            if desc[0] == 0:
                _, rows, nbytes, sqn, state, refs, uks, vals = desc
                taken = (rows, *map(buf, refs), column(uks), column(vals))
                chunks.append((rows, nbytes, sqn, state, taken))
            elif desc[0] == 1:
                _, n, nbytes, sqn, state, op, *arrays = desc
                op = op if isinstance(op, int) else array(op)
                kgs, keys, uks, vals = (None if a is None else array(a) for a in arrays)
                chunks.append((n, nbytes, sqn, state, op, kgs, keys, uks, vals))
            else:
                _, rows, nbytes, arrays = desc
                batch = pa.RecordBatch.from_arrays(list(map(array, arrays)), schema=BLOCK_SCHEMA)
                chunks.append((rows, nbytes, batch))
        table = ChangeBuffer.from_chunks(chunks).to_table()
        table.validate(full=True)
        blocks.append(Block(writer, sqn_start, sqn_end, table))
    return blocks


def _segments_of(reply: bytes, count: int) -> list[EncodedSegment] | None:
    """The ``count`` segments of a successful reply (views, not copies): each an 8-byte
    little-endian length, that many bytes, and their SHA-256; None if it is not that."""
    view = memoryview(reply)
    out: list[EncodedSegment] = []
    at = 0
    while at + 8 <= len(view) and len(out) < count:
        n = int.from_bytes(view[at : at + 8], "little")
        end = at + 8 + n + _HASH_BYTES
        if n <= 0 or end > len(view):
            return None
        digest = view[end - _HASH_BYTES : end].hex()
        out.append(EncodedSegment(view[at + 8 : end - _HASH_BYTES], digest))
        at = end
    return out if len(out) == count and at == len(view) else None


def _read_exact(fd: int, view: memoryview) -> bool:
    """Fill ``view`` from ``fd``; False on end of input before the first byte."""
    done = 0
    while done < len(view):
        n = os.readv(fd, [view[done:]])
        if n == 0:
            if done == 0:
                return False
            raise EOFError("request cut short")
        done += n
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main() -> None:
    """The helper's loop: read a request, encode it, answer; exit at end of input, and
    quietly when the parent went away mid-request (killed: its pipes closed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent to handle
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the replies
    disable_huge_pages()  # see dstl.pages
    _warm_up()
    with contextlib.suppress(BrokenPipeError, EOFError):  # no traceback on its stderr
        _write_all(wfd, _READY)
        _serve(rfd, wfd)


def warm_up_blocks() -> list[PendingBlock]:
    """A segment's worth of changes with a chunk of every kind, for :func:`warm_up_here`
    and the helper to encode once before their first real segment."""
    buffer = ChangeBuffer()
    buffer.append(0, 0, "warm-up", 0, b"k", None, b"v")
    buffer.add_columns(
        0, "warm-up", 0, pa.array([0], pa.int32()), pa.array([b"k"]), None, pa.array([b"v"])
    )
    for kind in (KIND_BYTES, KIND_INT64, KIND_FLOAT64):
        rows = _WARM_UP_ROWS if kind == KIND_INT64 else 1
        records = RecordColumns(rows, 1 << 30, KIND_BYTES, kind)
        value = {KIND_BYTES: b"v", KIND_INT64: 1}.get(kind, 0.5)
        for i in range(rows):
            records.append_typed(
                1, (i * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "little"), i % 128, b"u", value
            )
        taken = records.take()
        assert taken is not None
        buffer.add_records(0, "warm-up", taken)
    buffer.seal()
    return [PendingBlock("warm-up", 0, 1, buffer)]


_WARM_UP_ROWS = 32_768
"""Rows in the warm-up segment: about a pre-emptive upload's, so the memory pool and the
compressor have grown to what the first real segment needs."""

_warmed = False
_warm_lock = threading.Lock()


def warm_up_here() -> None:
    """Encode :func:`warm_up_blocks` in this process, once per process (later calls
    return at once). Any thread; the changelog storage's upload thread calls it when it
    starts, so a barrier's first segment is not the one that pays for it.

    Why: pyarrow sets up some of what the first segment needs on first use. It imports
    pandas at its first conversion of a Python list (150 ms on an idle machine), and its
    first segment of 40k changes took 46 ms against 7 ms for the next ones even then
    (Parquet writer, compressor, memory pool). Paid by a request made right after the
    start, while the task was busy: at 100k keys the lane's first upload took 0.69 s,
    and the first checkpoint's own part 632 ms.
    """
    global _warmed
    with _warm_lock:
        if not _warmed:
            encode_here(warm_up_blocks())
            _warmed = True


def _warm_up() -> None:
    """The helper's :func:`warm_up_here`: through the wire format too, before the
    first request (the helper starts with the changelog storage)."""
    parts, _ = _request([warm_up_blocks()])
    _reply(json.loads(parts[1]), pa.py_buffer(b"".join(parts[2:])))


def _reply(meta: dict[str, Any], payload: pa.Buffer) -> bytes:
    """A successful reply's bytes: each segment of the request, encoded, with its length
    and SHA-256 (see the module doc)."""
    blocks = iter(_blocks(meta, payload))
    replies = []
    for count in meta["segments"]:
        segment = encode_segment(list(itertools.islice(blocks, count)))
        replies += [len(segment).to_bytes(8, "little"), segment, hashlib.sha256(segment).digest()]
    return b"".join(replies)


def _serve(rfd: int, wfd: int) -> None:
    head = bytearray(8)
    while _read_exact(rfd, memoryview(head)):
        meta_bytes = bytearray(int.from_bytes(head, "little"))
        _read_exact(rfd, memoryview(meta_bytes))
        meta = json.loads(meta_bytes)
        payload = pa.allocate_buffer(int(meta["payload"]))  # 64-byte aligned
        if payload.size:
            _read_exact(rfd, memoryview(payload).cast("B"))
        try:
            data, status = _reply(meta, payload), _OK
        except Exception as exc:  # reported; the parent encodes again and raises it
            data, status = f"{type(exc).__name__}: {exc}".encode(), _FAILED
        _write_all(wfd, status.to_bytes(8, "little") + len(data).to_bytes(8, "little"))
        _write_all(wfd, data)


if __name__ == "__main__":
    main()
