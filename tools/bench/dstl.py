"""DSTL benchmark: appends/s, bytes per change, persist latency, files and requests per checkpoint.

For 1, 4 and 16 writers sharing one :class:`~dstl.ChangelogStorage`, on local disk and on
an S3 endpoint (moto's server, started here on 127.0.0.1 with dummy credentials). Each
writer is a task on its own thread, as in a worker: per checkpoint every writer appends
``changes`` records; then the checkpoint's barrier is injected, and reaches each task at
its own time, uniformly within :data:`BARRIER_SKEW_S` of the injection (barriers queue
behind records in each task's input), when that task persists on its thread and waits
for its handles. A persist's latency runs from the call to its future completing. Persists
that arrive within the batch window (``dstl.batch.delay-s``, 10 ms) share a segment file;
later ones start their own, so ``files_per_checkpoint`` is what the skew leaves of the
batching (until 2026-11-25 every persist came from one thread in a tight loop, and one
file per checkpoint was given).

Same-run baselines (the machine is shared, so ratios hold better than absolutes):

- ``appends_vs_list``: DSTL appends/s (all writer threads appending at once) divided by
  appending the same tuples to a list on one thread;
- ``files_vs_per_writer``: segment files per checkpoint divided by the files a naive
  "one file per writer per checkpoint" upload writes (1/writers when batching works);
- ``persist_vs_per_writer``: persist p50 divided by the p50 of that naive upload, made by
  the same threads at the same barrier offsets after a second injection.

Usage: ``python -m tools.bench run dstl [--quick] --json OUT``.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dstl import ChangelogStorage, FileIO
from dstl.changelog import ChangelogOptions

COLUMNS = [
    "storage",
    "writers",
    "appends_per_s",
    "appends_vs_list",
    "bytes_per_change",
    "persist_p50_ms",
    "persist_p99_ms",
    "persist_vs_per_writer",
    "files_per_checkpoint",
    "files_vs_per_writer",
    "requests_per_checkpoint",
]

WRITERS = (1, 4, 16)
BARRIER_SKEW_S = 0.050  # a barrier reaches each task within this long after its injection
KEY_BYTES = 8
VALUE_BYTES = 32


class CountingFileIO(FileIO):
    """A FileIO counting its storage requests (writes, reads, deletes, lists). Thread-safe."""

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(root, storage_options)
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_written = 0

    def _count(self, nbytes: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_written += nbytes

    def write_new(self, path: str, data: bytes | memoryview) -> None:
        self._count(len(data))
        super().write_new(path, data)

    def read(self, path: str) -> bytes:
        self._count()
        return super().read(path)

    def delete(self, path: str) -> bool:
        self._count()
        return super().delete(path)


@contextlib.contextmanager
def _moto_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto S3 server on 127.0.0.1 and a fresh bucket: (bucket url, storage options)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:16]}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        # No region_name for s3fs: moto's bucket handling fails with it.
        options = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}
        yield f"s3://{bucket}", options
    finally:
        server.stop()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _payload(writers: int, changes: int, checkpoint: int) -> list[list[tuple[int, bytes, bytes]]]:
    """Per writer: (key group, key, value) records, prepared outside the timed loop."""
    rng = random.Random(checkpoint)
    out = []
    for w in range(writers):
        rows = []
        for i in range(changes):
            key = (w * 1_000_000 + i).to_bytes(KEY_BYTES, "big")
            # half random, half structured: compresses like typical serialized values
            value = rng.randbytes(VALUE_BYTES // 2) + f"{checkpoint:08d}{i:08d}".encode()
            rows.append((i % 128, key, value))
        out.append(rows)
    return out


def _list_baseline(payload: list[list[tuple[int, bytes, bytes]]]) -> float:
    """Appends/s of a plain list append of the same records (the floor of any buffer)."""
    sink: list[tuple[int, str, int, bytes, None, bytes]] = []
    start = time.perf_counter()
    for rows in payload:
        append = sink.append
        for kg, key, value in rows:
            append((kg, "s", 1, key, None, value))
    elapsed = time.perf_counter() - start
    return len(sink) / elapsed if elapsed > 0 else 0.0


def _naive_file(rows: list[tuple[int, bytes, bytes]]) -> bytes:
    """The naive scheme's upload: one zstd Parquet file of one writer's records."""
    table = pa.table(
        {
            "key_group": pa.array([r[0] for r in rows], pa.int32()),
            "key": pa.array([r[1] for r in rows], pa.binary()),
            "value": pa.array([r[2] for r in rows], pa.binary()),
        }
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def _stamp(into: dict[int, float], index: int) -> Any:
    """A future callback recording when future ``index`` completed."""

    def callback(_future: Future[Any]) -> None:
        into[index] = time.perf_counter()

    return callback


class _Round:
    """One checkpoint round, shared by the main thread and the writer threads.

    The main thread writes the inputs (``payload``, ``offsets_s``, ``checkpoint``) before
    the round's start barrier and reads the results after its end barrier; each writer
    thread writes only its own index of the results in between. ``barrier_at`` is set by
    a barrier action (one thread, while the others wait).
    """

    def __init__(self, writers: int) -> None:
        self.payload: list[list[tuple[int, bytes, bytes]]] = []
        self.offsets_s: list[float] = [0.0] * writers
        self.checkpoint = 0
        self.append_span: list[tuple[float, float]] = [(0.0, 0.0)] * writers
        self.persist_s: list[float] = [0.0] * writers
        self.naive_s: list[float] = [0.0] * writers
        self.barrier_at = 0.0
        self.errors: list[BaseException] = []

    def wait_for_barrier(self, index: int) -> None:
        """Sleep until this writer's barrier arrives (its offset after the injection)."""
        time.sleep(max(0.0, self.barrier_at + self.offsets_s[index] - time.perf_counter()))


def _writer_thread(
    index: int,
    writer: Any,
    naive_io: FileIO,
    prefix: str,
    rounds: int,
    state: _Round,
    barriers: tuple[threading.Barrier, ...],
) -> None:
    """One task's thread, the only one using ``writer``: per round, append its records;
    when its barrier arrives, persist and wait for the handles; then, at the same offset
    after a second injection, the naive upload of the same records."""
    start, appended, persisted, end = barriers
    from_sqn = writer.next_sqn()
    for _ in range(rounds):
        start.wait()
        try:
            rows, cp = state.payload[index], state.checkpoint
            began = time.perf_counter()
            append = writer.append
            for kg, key, value in rows:
                append(kg, "s", 1, key, None, value)
            state.append_span[index] = (began, time.perf_counter())
            appended.wait()
            state.wait_for_barrier(index)
            done_at: dict[int, float] = {}
            called = time.perf_counter()
            fut = writer.persist(from_sqn, cp)
            fut.add_done_callback(_stamp(done_at, 0))
            fut.result(timeout=120)
            state.persist_s[index] = done_at[0] - called
            writer.confirm(cp)
            from_sqn = writer.next_sqn()  # as if each checkpoint were materialized
            writer.truncate(from_sqn)
            data = _naive_file(rows)
            persisted.wait()
            state.wait_for_barrier(index)
            began = time.perf_counter()
            naive_io.write_new(f"{prefix}/{cp:08x}/{index:04x}.parquet", data)
            state.naive_s[index] = time.perf_counter() - began
        except BaseException as exc:  # reported by the main thread after the round
            state.errors.append(exc)
            appended.abort()
            persisted.abort()
        end.wait()


def _run_case(
    storage_kind: str,
    root: str,
    options: Mapping[str, Any],
    writers: int,
    checkpoints: int,
    changes: int,
) -> dict[str, Any]:
    fileio = CountingFileIO(root, options)
    naive_io = FileIO(root, options)
    rng = random.Random(writers)
    append_s = 0.0
    appends = 0
    list_rates: list[float] = []
    latencies: list[float] = []
    naive_latencies: list[float] = []
    files = 0
    requests = 0
    bytes_before = 0
    opts = ChangelogOptions(batch_delay_s=0.010)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    state = _Round(writers)

    def inject() -> None:  # barrier action: the checkpoint's barriers start now
        state.barrier_at = time.perf_counter()

    barriers = (
        threading.Barrier(writers + 1),  # start: the main thread has set the round up
        threading.Barrier(writers, action=inject),  # appended: barriers injected
        threading.Barrier(writers, action=inject),  # persisted: naive uploads' turn
        threading.Barrier(writers + 1),  # end: the main thread reads the results
    )
    with ChangelogStorage(fileio, job, "worker0", opts) as storage:
        ws = [storage.create_writer(f"w{i:02d}") for i in range(writers)]
        threads = [
            threading.Thread(
                target=_writer_thread,
                args=(i, ws[i], naive_io, f"{job}-naive", checkpoints + 1, state, barriers),
                name=f"bench-task-{i}",
                daemon=True,  # a failed round leaves the others waiting: never hang the exit
            )
            for i in range(writers)
        ]
        for t in threads:
            t.start()
        for checkpoint in range(checkpoints + 1):  # checkpoint 0 warms up (connections)
            state.payload = _payload(writers, changes, checkpoint)
            state.offsets_s = [rng.uniform(0.0, BARRIER_SKEW_S) for _ in range(writers)]
            state.checkpoint = checkpoint
            files_before, requests_before = storage.segments_written, fileio.requests
            barriers[0].wait()
            barriers[3].wait()
            if state.errors:
                raise state.errors[0]
            if checkpoint == 0:
                bytes_before = fileio.bytes_written
                continue
            spans = state.append_span
            append_s += max(b for _, b in spans) - min(a for a, _ in spans)
            appends += writers * changes
            list_rates.append(_list_baseline(state.payload))
            latencies += state.persist_s
            naive_latencies += state.naive_s
            files += storage.segments_written - files_before
            requests += fileio.requests - requests_before
        for t in threads:
            t.join()
        bytes_written = fileio.bytes_written - bytes_before
    appends_per_s = appends / append_s if append_s > 0 else 0.0
    p50 = _percentile(latencies, 0.50) * 1000
    base_p50 = statistics.median(naive_latencies) * 1000
    files_per_checkpoint = files / checkpoints
    return {
        "storage": storage_kind,
        "writers": writers,
        "checkpoints": checkpoints,
        "changes_per_writer_per_checkpoint": changes,
        "appends_per_s": round(appends_per_s),
        "appends_vs_list": round(appends_per_s / statistics.median(list_rates), 3),
        "bytes_per_change": round(bytes_written / appends, 2),
        "persist_p50_ms": round(p50, 2),
        "persist_p99_ms": round(_percentile(latencies, 0.99) * 1000, 2),
        "per_writer_upload_p50_ms": round(base_p50, 2),
        "persist_vs_per_writer": round(p50 / base_p50, 3) if base_p50 > 0 else None,
        "files_per_checkpoint": round(files_per_checkpoint, 2),
        "files_vs_per_writer": round(files_per_checkpoint / writers, 3),
        "requests_per_checkpoint": round(requests / checkpoints, 2),
    }


def run(quick: bool) -> dict[str, Any]:
    """Run every (storage, writers) case; see the module docstring for the columns."""
    checkpoints = 5 if quick else 30
    changes = 1_000 if quick else 5_000
    s3_checkpoints = 4 if quick else 15
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-dstl-") as tmp:
        for writers in WRITERS:
            root = f"file://{os.path.join(tmp, f'local-{writers}')}"
            cases.append(_run_case("local", root, {}, writers, checkpoints, changes))
    with _moto_s3() as (bucket, options):
        for writers in WRITERS:
            cases.append(
                _run_case("s3", f"{bucket}/w{writers}", options, writers, s3_checkpoints, changes)
            )
    sixteen = [c for c in cases if c["writers"] == 16]
    return {
        "cases": cases,
        # one file per upload batch: persists within the batch window share one
        "files_per_checkpoint_at_16_writers": {
            c["storage"]: c["files_per_checkpoint"] for c in sixteen
        },
        "change_bytes": KEY_BYTES + VALUE_BYTES,
        "barrier_skew_ms": BARRIER_SKEW_S * 1e3,
        "notes": "requests = FileIO writes+reads+deletes; deletes follow truncation",
    }
