"""The one module that knows the object layout of a store.

Every path shape is a pair of pure functions, format and parse. Counters are fixed-width
hex so that a listing sorts in numeric order. Paths are relative to the store root.

::

    metadata.db                                         (local stores: SQLite metadata)
    jobs/<job>/changelog/<worker>/<counter:016x>-<nonce>.parquet
    jobs/<job>/materialized/<operator>/<subtask:04x>/<mat:016x>-<nonce>/<state-file>
    jobs/<job>/sink/<operator>/<subtask:04x>/<checkpoint:016x>.jsonl
    jobs/<job>/channel-state/<operator>/<subtask:04x>/<checkpoint:016x>.bin
    savepoints/<job>/<checkpoint:016x>/...

A shared state file stays where the materialization that first uploaded it put it; later
materializations reference it there (no copy, no separate "shared" directory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9_.=-]+$")


def check_name(kind: str, name: str) -> str:
    """Validate one path component (job, operator, worker, state name)."""
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"invalid {kind} name {name!r}: use letters, digits, '_', '.', '=', '-'")
    return name


def job_prefix(job: str) -> str:
    """Everything a job owns lives below this prefix."""
    return f"jobs/{check_name('job', job)}"


def segment_path(job: str, worker: str, counter: int, nonce: str) -> str:
    """Path of a changelog segment uploaded by ``worker``."""
    return (
        f"{job_prefix(job)}/changelog/{check_name('worker', worker)}/{counter:016x}-{nonce}.parquet"
    )


@dataclass(frozen=True, slots=True)
class SegmentPath:
    """The parts of a parsed segment path."""

    job: str
    worker: str
    counter: int
    nonce: str


_SEGMENT = re.compile(r"^jobs/([^/]+)/changelog/([^/]+)/([0-9a-f]{16})-([0-9a-z]+)\.parquet$")


def parse_segment_path(path: str) -> SegmentPath | None:
    """Inverse of :func:`segment_path`; ``None`` if ``path`` is not a segment."""
    m = _SEGMENT.match(path)
    if not m:
        return None
    return SegmentPath(m.group(1), m.group(2), int(m.group(3), 16), m.group(4))


def materialization_dir(job: str, operator: str, subtask: int, mat_id: int, nonce: str) -> str:
    """Directory of one materialization of one operator subtask."""
    return (
        f"{job_prefix(job)}/materialized/{check_name('operator', operator)}/"
        f"{subtask:04x}/{mat_id:016x}-{nonce}"
    )


def state_file_path(directory: str, name: str) -> str:
    """Path of one state file (a table chunk, an SST) inside a materialization directory."""
    return f"{directory}/{check_name('state file', name)}"


def sink_transaction_path(job: str, operator: str, subtask: int, checkpoint_id: int) -> str:
    """Staged (pre-committed) output of a transactional sink for one checkpoint."""
    return f"{job_prefix(job)}/sink/{check_name('operator', operator)}/{subtask:04x}/{checkpoint_id:016x}.jsonl"


def channel_state_path(job: str, operator: str, subtask: int, checkpoint_id: int) -> str:
    """In-flight records of an unaligned checkpoint for one subtask."""
    return (
        f"{job_prefix(job)}/channel-state/{check_name('operator', operator)}/"
        f"{subtask:04x}/{checkpoint_id:016x}.bin"
    )


def savepoint_prefix(job: str, checkpoint_id: int) -> str:
    """The directory that holds one self-contained savepoint's files."""
    return f"savepoints/{check_name('job', job)}/{checkpoint_id:016x}"
