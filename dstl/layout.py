"""The one module that knows the object layout of a store.

Every path shape is a pair of pure functions, format and parse. Counters are fixed-width
hex so that a listing sorts in numeric order. Paths are relative to the store root.

::

    metadata.db                                         (local stores: SQLite metadata)
    jobs/<job>/changelog/<worker>/<counter:016x>-<nonce>.parquet
    jobs/<job>/materialized/<operator>/<subtask:04x>/<mat:016x>-<nonce>/<state-file>
    jobs/<job>/compacted/<operator>/<subtask:04x>/<checkpoint:016x>-<nonce>/<state-file>
    jobs/<job>/sink/<operator>/<subtask:04x>/<checkpoint:016x>.jsonl
    jobs/<job>/sink/<operator>/<subtask:04x>/<checkpoint:016x>-<nonce>.parquet   (Spark host)
    jobs/<job>/channel-state/<operator>/<subtask:04x>/<checkpoint:016x>.bin
    savepoints/<job>/<checkpoint:016x>/...
    .../.<name>.<pid>-<nonce>-<n>.tmp                     (local stores: a write in progress)

A shared state file stays where the materialization that first uploaded it put it; later
materializations reference it there (no copy, no separate "shared" directory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dstl.errors import ConfigError, CorruptionError

_NAME = re.compile(r"^[A-Za-z0-9_.=-]+$")


def check_name(kind: str, name: str) -> str:
    """Validate one path component we write (job, operator, worker, state file name).

    Raises :class:`~dstl.errors.ConfigError` (a ``ValueError``): the name came from the
    job's own configuration or from a command line.
    """
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"invalid {kind} name {name!r}: use letters, digits, '_', '.', '=', '-'")
    return name


MAX_NAME_CHARS = 200


def plain_name(kind: str, name: object) -> str:
    """``name`` if it is safe as one file-system path component, else CorruptionError.

    For names read from a store (operators and jobs in the metadata, states in table
    metadata, ``STATE-META.json`` or the log) before a tool joins them into an output
    path: no separator, no ``..`` or ``.``, no NUL, no leading dot or ``~``, at most
    :data:`MAX_NAME_CHARS` characters. A name the job itself could not have written is
    corrupt metadata, never a path to follow.
    """
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_NAME_CHARS
        or name.startswith((".", "~"))
        or any(c in name for c in "/\\\x00")
        or not name.isprintable()
    ):
        raise CorruptionError(
            f"corrupt metadata: {kind} name {str(name)[:80]!r} is not a plain name"
        )
    return name


def check_location(location: str) -> str:
    """Validate a handle's location: a path relative to the store root (no leading ``/``,
    no ``..`` or empty component), or an absolute URL of an older record; ValueError if not.
    """
    if not isinstance(location, str) or not location:
        raise ValueError("a handle needs a location")
    if "://" in location:
        return location
    parts = location.split("/")
    if location.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"location {location!r} is not a plain path inside the store")
    return location


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


def compaction_dir(job: str, operator: str, subtask: int, checkpoint_id: int, nonce: str) -> str:
    """Directory of one offline compaction (of checkpoint ``checkpoint_id``) of one subtask."""
    return (
        f"{job_prefix(job)}/compacted/{check_name('operator', operator)}/"
        f"{subtask:04x}/{checkpoint_id:016x}-{check_name('nonce', nonce)}"
    )


def state_file_path(directory: str, name: str) -> str:
    """Path of one state file (a table chunk, an SST) inside a materialization directory."""
    return f"{directory}/{check_name('state file', name)}"


def sink_transaction_path(job: str, operator: str, subtask: int, checkpoint_id: int) -> str:
    """Staged (pre-committed) output of a transactional sink for one checkpoint."""
    return f"{job_prefix(job)}/sink/{check_name('operator', operator)}/{subtask:04x}/{checkpoint_id:016x}.jsonl"


def staged_output_path(
    job: str, operator: str, subtask: int, checkpoint_id: int, nonce: str
) -> str:
    """Staged output of one task attempt of the Spark host for one checkpoint (micro-batch).

    The nonce tells attempts of one batch apart: a retried or speculative task stages its
    own file, and only the attempt whose acknowledgement completes the checkpoint counts.
    """
    return (
        f"{job_prefix(job)}/sink/{check_name('operator', operator)}/"
        f"{subtask:04x}/{checkpoint_id:016x}-{check_name('nonce', nonce)}.parquet"
    )


def channel_state_path(job: str, operator: str, subtask: int, checkpoint_id: int) -> str:
    """In-flight records of an unaligned checkpoint for one subtask."""
    return (
        f"{job_prefix(job)}/channel-state/{check_name('operator', operator)}/"
        f"{subtask:04x}/{checkpoint_id:016x}.bin"
    )


def savepoints_of(job: str) -> str:
    """Everything the savepoints of a job hold lives below this prefix."""
    return f"savepoints/{check_name('job', job)}"


def savepoint_prefix(job: str, checkpoint_id: int) -> str:
    """The directory that holds one self-contained savepoint's files."""
    return f"savepoints/{check_name('job', job)}/{checkpoint_id:016x}"


_N = r"[A-Za-z0-9_.=-]+"
_JOB_FILE = (
    rf"jobs/{_N}/(changelog/{_N}/[0-9a-f]{{16}}-[0-9a-z]+\.parquet"
    rf"|(?:materialized|compacted)/{_N}/[0-9a-f]{{4}}/[0-9a-f]{{16}}-[0-9a-z]+/{_N}"
    rf"|sink/{_N}/[0-9a-f]{{4}}/[0-9a-f]{{16}}(?:\.jsonl|-[0-9a-z]+\.parquet)"
    rf"|channel-state/{_N}/[0-9a-f]{{4}}/[0-9a-f]{{16}}\.bin)"
)
_STORE_FILE = re.compile(rf"^(?:savepoints/{_N}/[0-9a-f]{{16}}/)?{_JOB_FILE}$")


def is_store_file(path: str) -> bool:
    """Whether ``path`` (relative to a store root) has the shape of a file this layout names."""
    return _STORE_FILE.match(path) is not None


def relative_of_url(url: str) -> str | None:
    """The store-relative path inside an absolute file URL of an older record, or None.

    Records written before locations were relative hold URLs such as
    ``file:///old/root/jobs/j/changelog/...``; the relative path is the longest tail that
    starts at a ``jobs/`` or ``savepoints/`` component and has the shape of a store file,
    whatever the old root was (so a store that moved still restores).
    """
    path = url.split("://", 1)[-1]
    for start in (i + 1 for i, ch in enumerate(path) if ch == "/"):
        tail = path[start:]
        if tail.startswith(("jobs/", "savepoints/")) and is_store_file(tail):
            return tail
    return None
