"""dstl.encoder: segments encoded in a helper process, byte for byte as in-process, and
nothing lost when the helper is missing, dies, hangs, answers garbage or fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from array import array
from collections.abc import Iterator

import pyarrow as pa
import pytest

import dstl.encoder as encoder_module
from dstl._durable import exchange
from dstl._records import KIND_BYTES, KIND_INT64, KIND_NONE, KIND_STR, RecordColumns
from dstl.buffer import ChangeBuffer
from dstl.encoder import PendingBlock, SegmentEncoder, shared_encoder
from dstl.integrity import content_hash
from dstl.segment import SegmentReader, encode_segment


def _changes(seed: int) -> ChangeBuffer:
    """A sealed buffer with every chunk shape: record-buffer takes (with and without a
    user-key column, with nulls), Arrow columns (one op, and an op per row; sliced
    arrays) and single records."""
    buf = ChangeBuffer()
    buf.append(-1, seed, "meta", 0, b"", None, b"registration")
    records = RecordColumns(4096, 1 << 20, KIND_STR, KIND_INT64)
    for i in range(3000):
        records.append_typed(3, b"key-%d" % (i % 97), i % 128, f"u{i % 8}", i * seed)
    buf.add_records(seed, "m", records.take())
    plain = RecordColumns(4096, 1 << 20, KIND_NONE, KIND_BYTES)
    for i in range(500):
        plain.append(1, b"k%d" % i, i % 128, None, None if i % 5 == 0 else b"v%d" % i)
    buf.add_records(seed + 1, "v", plain.take())
    keys = pa.array([b"batch-%d" % i for i in range(300)])
    buf.add_columns(
        seed + 1,
        "v",
        1,
        pa.array(range(300), pa.int32()).slice(50),
        keys.slice(50),
        None,
        pa.array([b"x"] * 300).slice(50),
    )
    ops = pa.array([i % 3 for i in range(40)], pa.int8())
    uks = pa.array([None if i % 2 else b"uk" for i in range(40)], pa.binary())
    kgs = pa.array(array("i", range(40)), pa.int32())
    buf.add_columns(seed + 2, "m", ops, kgs, keys.slice(0, 40), uks, keys.slice(1, 40))
    buf.append(7, seed + 2, "t", 5, b"x", b"u", b"y")
    buf.seal()
    return buf


def _blocks() -> list[PendingBlock]:
    return [PendingBlock("a", 0, 4, _changes(1)), PendingBlock("b", 2, 5, _changes(3))]


def _in_process(blocks: list[PendingBlock]) -> bytes:
    return encode_segment([b.to_block() for b in blocks])


@pytest.fixture
def encoder() -> Iterator[SegmentEncoder]:
    enc = SegmentEncoder(timeout_s=30)
    yield enc
    enc.close()


def test_the_helper_writes_the_bytes_encode_segment_writes(encoder: SegmentEncoder) -> None:
    blocks = _blocks()
    segment = encoder.encode(blocks)
    data = bytes(segment.data)
    assert data == _in_process(blocks)
    assert segment.content_hash == content_hash(data)  # hashed in the helper, what restore checks
    assert (encoder.started, encoder.fallbacks) == (1, 0)
    reader = SegmentReader(data, "mem")
    table = reader.read_block(0, "a")
    assert table.num_rows == blocks[0].changes.rows
    assert table["value"].null_count == 100  # the record buffer's nulls survived
    assert bytes(encoder.encode(blocks[1:]).data) == _in_process(blocks[1:])  # the helper is reused
    assert encoder.started == 1


def test_a_helper_killed_between_requests_is_replaced(encoder: SegmentEncoder) -> None:
    encoder.start()
    first = encoder.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    os.waitpid(first, 0)
    blocks = _blocks()
    assert bytes(encoder.encode(blocks).data) == _in_process(blocks)  # found dead by writing to it
    assert (encoder.fallbacks, encoder.pid) == (1, None)
    assert bytes(encoder.encode(blocks).data) == _in_process(blocks)
    assert (encoder.fallbacks, encoder.started) == (1, 2) and encoder.pid != first


@pytest.mark.parametrize(
    "helper",
    [
        "import sys; sys.stdin.buffer.read(8)",  # exits mid-request
        "import sys, time; sys.stdin.buffer.read(8); time.sleep(60)",  # hangs
        "import sys, os; sys.stdin.buffer.read(8); os.write(1, b'\\xff' * 16)",  # garbage
    ],
    ids=["exits", "hangs", "garbage"],
)
def test_a_broken_helper_falls_back_to_encoding_here(
    helper: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoder_module, "_helper_argv", lambda: [sys.executable, "-c", helper])
    enc = SegmentEncoder(timeout_s=2)
    try:
        blocks = _blocks()
        segment = enc.encode(blocks)
        assert bytes(segment.data) == _in_process(blocks)
        assert segment.content_hash == content_hash(bytes(segment.data))  # hashed here instead
        assert enc.fallbacks == 1 and enc.pid is None  # the broken helper was stopped
    finally:
        enc.close()


def test_a_data_error_raises_as_in_process_and_keeps_the_helper(
    encoder: SegmentEncoder,
) -> None:
    empty = ChangeBuffer()
    empty.seal()
    encoder.start()
    pid = encoder.pid
    with pytest.raises(ValueError, match="empty block for writer 'e'"):
        encoder.encode([PendingBlock("e", 0, 1, empty)])
    assert encoder.fallbacks == 1 and encoder.pid == pid
    blocks = _blocks()
    assert bytes(encoder.encode(blocks).data) == _in_process(blocks)


def test_a_forked_child_starts_its_own_helper() -> None:
    parent_helper = shared_encoder()
    parent_helper.start()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child; its exit code is the result
        code = 1
        try:
            child = shared_encoder()
            blocks = _blocks()
            ok = child is not parent_helper and bytes(child.encode(blocks).data) == _in_process(
                blocks
            )
            code = 0 if ok and child.fallbacks == 0 and child.pid != parent_helper.pid else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    blocks = _blocks()
    assert bytes(parent_helper.encode(blocks).data) == _in_process(
        blocks
    )  # the parent's still works


def test_exchange_reads_a_reply_longer_than_its_guess() -> None:
    """A reply above ``capacity`` costs a second read, and arrives whole."""
    reply = os.urandom(3 << 20)
    request = bytes(range(256)) * (5 << 12)  # 5 MiB: many times the pipe's buffer
    rfd, child_w = os.pipe()
    child_r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the peer: read the request, answer
        code = 1
        try:
            os.close(rfd)
            os.close(wfd)
            got = b""
            while len(got) < 5 << 20:
                got += os.read(child_r, 1 << 20)
            header = (7).to_bytes(8, "little") + len(reply).to_bytes(8, "little")
            view = memoryview(header + reply)
            while view:
                view = view[os.write(child_w, view) :]
            code = 0 if got == request else 1
        finally:
            os._exit(code)
    os.close(child_w)
    os.close(child_r)
    for fd in (rfd, wfd):
        os.set_blocking(fd, False)
    status, got = exchange(wfd, rfd, [request[:100], memoryview(request)[100:]], 1000, 30.0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0  # the request arrived whole
    assert (status, got) == (7, reply)
    os.close(rfd)
    os.close(wfd)


@pytest.mark.parametrize("cut", ["reply", "request"])
def test_a_helper_whose_parent_went_away_exits_quietly(cut: str) -> None:
    """A worker killed mid-request closes the helper's pipes: the helper's reply meets a
    broken pipe, or its request ends early. It exits without a traceback on the stderr
    it shares with the worker."""
    parts, _ = encoder_module._request(_blocks())
    request = b"".join(bytes(p) for p in parts)
    helper = subprocess.Popen(
        encoder_module._helper_argv(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert helper.stdin is not None and helper.stdout is not None
    helper.stdout.close()  # nobody reads the reply
    helper.stdin.write(request if cut == "reply" else request[: len(request) // 2])
    helper.stdin.close()
    assert helper.stderr is not None
    err = helper.stderr.read()  # until the helper has exited (or closed it)
    helper.stderr.close()
    assert helper.wait(timeout=60) == 0
    assert err == b""
