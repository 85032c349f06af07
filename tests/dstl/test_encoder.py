"""dstl.encoder: segments encoded in a helper process, byte for byte as in-process, and
nothing lost when the helper is missing, dies, hangs, answers garbage or fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

import dstl.encoder as encoder_module
from dstl._durable import exchange
from dstl._records import KIND_BYTES, KIND_INT64, KIND_NONE, KIND_STR, RecordColumns
from dstl.buffer import ChangeBuffer
from dstl.encoder import PendingBlock, SegmentEncoder, shared_encoder
from dstl.integrity import content_hash
from dstl.segment import SegmentReader, encode_segment

READY = "import os, sys, time; os.write(1, b'R')"  # what a helper says once warmed up


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
    assert enc.wait_ready(60)  # before: encoded here (see the test of an unready helper)
    yield enc
    enc.close()


def test_the_helper_writes_the_bytes_encode_segment_writes(encoder: SegmentEncoder) -> None:
    blocks = _blocks()
    segment = encoder.encode(blocks)
    data = bytes(segment.data)
    assert data == _in_process(blocks)
    assert segment.content_hash == content_hash(data)  # hashed in the helper, what restore checks
    assert (encoder.started, encoder.fallbacks, encoder.unready) == (1, 0, 0)
    reader = SegmentReader(data, "mem")
    table = reader.read_block(0, "a")
    assert table.num_rows == blocks[0].changes.rows
    assert table["value"].null_count == 100  # the record buffer's nulls survived
    assert bytes(encoder.encode(blocks[1:]).data) == _in_process(blocks[1:])  # the helper is reused
    assert encoder.started == 1


def test_several_segments_in_one_round_trip_are_the_bytes_each_alone_writes(
    encoder: SegmentEncoder,
) -> None:
    a, b = _blocks()
    c = PendingBlock("c", 9, 12, _changes(5))
    segments = [[a], [b, c], [c]]
    got = encoder.encode_many(segments)
    assert [bytes(s.data) for s in got] == [_in_process(blocks) for blocks in segments]
    assert [s.content_hash for s in got] == [content_hash(bytes(s.data)) for s in got]
    assert (encoder.started, encoder.fallbacks) == (1, 0)
    with pytest.raises(ValueError, match="at least one block"):
        encoder.encode_many([[a], []])


@pytest.mark.parametrize("extra", [b"", b"x"], ids=["one-segment-short", "trailing-byte"])
def test_a_reply_of_the_wrong_shape_falls_back_and_replaces_the_helper(
    extra: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper that answers "ok" with one segment for a request of two (or with bytes
    after them) is not trusted: both are encoded here, and it is stopped."""
    one = b"s" * 10
    body = len(one).to_bytes(8, "little") + one + bytes(32) + extra
    reply = (0).to_bytes(8, "little") + len(body).to_bytes(8, "little") + body
    helper = f"{READY}; sys.stdin.buffer.read(8); os.write(1, {reply!r}); sys.stdin.buffer.read()"
    monkeypatch.setattr(encoder_module, "_helper_argv", lambda: [sys.executable, "-c", helper])
    enc = SegmentEncoder(timeout_s=10)
    try:
        assert enc.wait_ready(10)
        a, b = _blocks()
        got = enc.encode_many([[a], [b]])
        assert [bytes(s.data) for s in got] == [_in_process([a]), _in_process([b])]
        assert enc.fallbacks == 1 and enc.pid is None
    finally:
        enc.close()


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
        f"{READY}; sys.stdin.buffer.read(8)",  # exits mid-request
        f"{READY}; sys.stdin.buffer.read(8); time.sleep(60)",  # hangs
        f"{READY}; sys.stdin.buffer.read(8); os.write(1, b'\\xff' * 16)",  # garbage
    ],
    ids=["exits", "hangs", "garbage"],
)
def test_a_broken_helper_falls_back_to_encoding_here(
    helper: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(encoder_module, "_helper_argv", lambda: [sys.executable, "-c", helper])
    enc = SegmentEncoder(timeout_s=2)
    try:
        assert enc.wait_ready(10)
        blocks = _blocks()
        segment = enc.encode(blocks)
        assert bytes(segment.data) == _in_process(blocks)
        assert segment.content_hash == content_hash(bytes(segment.data))  # hashed here instead
        assert enc.fallbacks == 1 and enc.pid is None  # the broken helper was stopped
    finally:
        enc.close()


def test_until_the_helper_is_warmed_up_segments_are_encoded_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A request sent while the helper imports and warms up (0.2-0.9 s) waited for it:
    the first checkpoint after a start took 0.9 s. The caller encodes it instead, and
    the helper is not sent a byte until it says it is ready."""
    got = tmp_path / "stdin"
    helper = f"import sys; open({str(got)!r}, 'wb').write(sys.stdin.buffer.read())"
    monkeypatch.setattr(encoder_module, "_helper_argv", lambda: [sys.executable, "-c", helper])
    enc = SegmentEncoder(timeout_s=2)
    try:
        blocks = _blocks()
        assert bytes(enc.encode(blocks).data) == _in_process(blocks)
        assert bytes(enc.encode_many([blocks[:1]])[0].data) == _in_process(blocks[:1])
        assert (enc.unready, enc.fallbacks, enc.started) == (2, 0, 1)
        assert enc.pid is not None and not enc.wait_ready(0.1)  # kept: not failed
    finally:
        enc.close()  # its input ends: it writes down what it was sent
    assert got.read_bytes() == b""


def test_a_helper_that_starts_with_another_byte_is_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    helper = "import os, time; os.write(1, b'?'); time.sleep(60)"
    monkeypatch.setattr(encoder_module, "_helper_argv", lambda: [sys.executable, "-c", helper])
    enc = SegmentEncoder(timeout_s=2)
    try:
        assert not enc.wait_ready(10) and enc.pid is None
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
            child.wait_ready(60)
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
    parts, _ = encoder_module._request([_blocks()])
    request = b"".join(bytes(p) for p in parts)
    helper = subprocess.Popen(
        encoder_module._helper_argv(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert helper.stdin is not None and helper.stdout is not None
    assert helper.stdout.read(1) == b"R"  # warmed up
    helper.stdout.close()  # nobody reads the reply
    helper.stdin.write(request if cut == "reply" else request[: len(request) // 2])
    helper.stdin.close()
    assert helper.stderr is not None
    err = helper.stderr.read()  # until the helper has exited (or closed it)
    helper.stderr.close()
    assert helper.wait(timeout=60) == 0
    assert err == b""


def test_the_warm_up_segment_has_a_chunk_of_every_kind_and_a_real_size() -> None:
    """What the helper (and the upload thread, once per process) encodes before its
    first segment: every path a real one may take, at about a pre-emptive upload's
    size, so the first real one finds them set up."""
    (block,) = encoder_module.warm_up_blocks()
    kinds = {len(chunk) for chunk in block.changes.chunks}
    assert kinds == {3, 5, 9}  # single records, a record buffer's columns, Arrow columns
    assert block.changes.nbytes > 512 * 1024
    assert encoder_module.encode_here([block]).data
    encoder_module.warm_up_here()
    assert encoder_module._warmed
