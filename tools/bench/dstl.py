"""DSTL benchmark: appends/s, bytes per change, persist latency, files and requests per checkpoint.

For 1, 4 and 16 writers sharing one :class:`~dstl.ChangelogStorage`, on local disk and on
an S3 endpoint (moto's server, started here on 127.0.0.1 with dummy credentials). Each
checkpoint every writer appends ``changes`` records, then all writers persist; a persist's
latency runs from the call to its future completing.

Same-run baselines (the machine is shared, so ratios hold better than absolutes):

- ``appends_vs_list``: DSTL appends/s divided by appending the same tuples to a list;
- ``files_vs_per_writer``: segment files per checkpoint divided by the files a naive
  "one file per writer per checkpoint" upload writes (1/writers when batching works);
- ``persist_vs_per_writer``: persist p50 divided by the p50 of that naive upload.

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


def _per_writer_baseline(
    fileio: FileIO, payload: list[list[tuple[int, bytes, bytes]]], checkpoint: int
) -> float:
    """Latency (s) of the naive scheme: one Parquet file per writer per checkpoint."""
    start = time.perf_counter()
    for w, rows in enumerate(payload):
        table = pa.table(
            {
                "key_group": pa.array([r[0] for r in rows], pa.int32()),
                "key": pa.array([r[1] for r in rows], pa.binary()),
                "value": pa.array([r[2] for r in rows], pa.binary()),
            }
        )
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        fileio.write_new(f"baseline/{checkpoint:08x}/{w:04x}.parquet", sink.getvalue())
    return time.perf_counter() - start


def _stamp(into: dict[int, float], index: int) -> Any:
    """A future callback recording when future ``index`` completed."""

    def callback(_future: Future[Any]) -> None:
        into[index] = time.perf_counter()

    return callback


def _run_case(
    storage_kind: str,
    root: str,
    options: Mapping[str, Any],
    writers: int,
    checkpoints: int,
    changes: int,
) -> dict[str, Any]:
    fileio = CountingFileIO(root, options)
    base_io = FileIO(root, options)
    append_s = 0.0
    appends = 0
    list_rates: list[float] = []
    latencies: list[float] = []
    baseline_latencies: list[float] = []
    files = 0
    requests = 0
    bytes_before = 0
    opts = ChangelogOptions(batch_delay_s=0.010)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    with ChangelogStorage(fileio, job, "worker0", opts) as storage:
        ws = [storage.create_writer(f"w{i:02d}") for i in range(writers)]
        from_sqn = [w.next_sqn() for w in ws]
        for checkpoint in range(checkpoints + 1):  # checkpoint 0 warms up (connections)
            payload = _payload(writers, changes, checkpoint)
            warm_up = checkpoint == 0
            start = time.perf_counter()
            for w, rows in zip(ws, payload, strict=True):
                append = w.append
                for kg, key, value in rows:
                    append(kg, "s", 1, key, None, value)
            elapsed = time.perf_counter() - start
            files_before, requests_before = storage.segments_written, fileio.requests
            done_at: dict[int, float] = {}
            called_at: dict[int, float] = {}
            futures: list[Future[Any]] = []
            for i, w in enumerate(ws):
                called_at[i] = time.perf_counter()
                fut = w.persist(from_sqn[i], checkpoint)
                fut.add_done_callback(_stamp(done_at, i))
                futures.append(fut)
            for fut in futures:
                fut.result(timeout=120)
            for i, w in enumerate(ws):
                w.confirm(checkpoint)
                from_sqn[i] = w.next_sqn()  # as if each checkpoint were materialized
                w.truncate(from_sqn[i])
            if warm_up:
                bytes_before = fileio.bytes_written
                continue
            append_s += elapsed
            appends += writers * changes
            list_rates.append(_list_baseline(payload))
            latencies += [done_at[i] - called_at[i] for i in range(writers)]
            files += storage.segments_written - files_before
            requests += fileio.requests - requests_before
            baseline_latencies.append(_per_writer_baseline(base_io, payload, checkpoint))
        bytes_written = fileio.bytes_written - bytes_before
    appends_per_s = appends / append_s if append_s > 0 else 0.0
    p50 = _percentile(latencies, 0.50) * 1000
    base_p50 = statistics.median(baseline_latencies) * 1000
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
        "files_per_checkpoint": files_per_checkpoint,
        "files_vs_per_writer": round(files_per_checkpoint / writers, 3),
        "requests_per_checkpoint": requests / checkpoints,
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
        # one file per upload batch by construction; per checkpoint it is 1 unless the
        # 16 persists took longer than the batch window to issue
        "files_per_checkpoint_at_16_writers": {
            c["storage"]: c["files_per_checkpoint"] for c in sixteen
        },
        "change_bytes": KEY_BYTES + VALUE_BYTES,
        "notes": "requests = FileIO writes+reads+deletes; deletes follow truncation",
    }
