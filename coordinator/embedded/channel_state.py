"""In-flight records of an unaligned checkpoint (FLIP-76 channel state): write and read.

With unaligned barriers a task snapshots its state as soon as the *first* barrier of a
checkpoint arrives; the records that arrive afterwards on channels whose barrier is still
ahead are "in flight": logically before the barrier, physically after the snapshot. They
are written here, once per checkpoint and subtask, and replayed before any new input on
restore. Unlike changelog segments, materialized files and sink transactions, a channel
state file belongs to exactly one checkpoint and is never reused by a later one: it is the
only kind of file the coordinator deletes for an aborted checkpoint (see
:func:`coordinator.checkpoint.checkpoint_private_files`).

File format: ``CSTATE2\\n`` + crc32 (4 bytes, big endian) + a pickle of the
``(input, batch)`` entries (records as the channel carried them: keyed records with their
key bytes and group, so a rescaled restore filters them without hashing again).
``CSTATE1`` files (batches only, one input) are still read. The store is as trusted as
the state itself.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.handles import ChannelStateHandle
from dstl import layout
from dstl.errors import CorruptionError
from dstl.fileio import FileIO
from dstl.integrity import content_hash, read_verified
from dstl.upload import Uploader

_MAGIC = b"CSTATE2\n"
_LEGACY = b"CSTATE1\n"


@dataclass(frozen=True, slots=True)
class ChannelState:
    """What a channel state file holds: ``(input, batch)`` entries in delivery order.

    ``legacy``: a file of the single-input runtime (``CSTATE1``): batches of ``(key,
    value)`` pairs (operator) or rows (sink), every one on input 0; the task converts
    them to its record shape."""

    entries: list[tuple[int, list[Any]]]
    legacy: bool = False


def write_channel_state(
    uploader: Uploader,
    job: str,
    operator: str,
    subtask: int,
    checkpoint_id: int,
    entries: Sequence[tuple[int, list[Any]]],
) -> ChannelStateHandle:
    """Durably write the in-flight ``(input, batch)`` entries (write-once, through the
    worker's ``uploader``: retried, hedged, within its byte budget); their handle."""
    body = pickle.dumps(list(entries), protocol=pickle.HIGHEST_PROTOCOL)
    data = _MAGIC + struct.pack(">I", zlib.crc32(body)) + body
    path = layout.channel_state_path(job, operator, subtask, checkpoint_id)
    location = uploader.upload(path, data)  # an attempt's name if a retry won
    records = sum(len(batch) for _, batch in entries)
    return ChannelStateHandle(
        location, checkpoint_id, operator, subtask, records, len(data), content_hash(data)
    )


def check_channel_state(data: bytes, url: str) -> tuple[bytes, bool]:
    """The pickled body of a channel state file and whether it is a legacy one, after
    checking its header and checksum (nothing is unpickled: tools call this too)."""
    head = len(_MAGIC)
    legacy = data.startswith(_LEGACY)
    if len(data) < head + 4 or not (legacy or data.startswith(_MAGIC)):
        raise CorruptionError("not a channel state file", url)
    (crc,) = struct.unpack(">I", data[head : head + 4])
    body = data[head + 4 :]
    if zlib.crc32(body) != crc:
        raise CorruptionError("channel state checksum mismatch", url)
    return body, legacy


def read_channel_state(fileio: FileIO, handle: ChannelStateHandle) -> ChannelState:
    """The entries of ``handle``; :class:`CorruptionError` on a bad file."""
    data = read_verified(fileio, handle.file_refs()[0])
    url = fileio.url(fileio.relative(handle.location))
    body, legacy = check_channel_state(data, url)
    try:
        entries = pickle.loads(body)
    except Exception as exc:  # pickle raises many types on bad bytes
        raise CorruptionError(f"unreadable channel state: {exc}", url) from exc
    if not isinstance(entries, list):
        raise CorruptionError("channel state is not a list of batches", url)
    if legacy:
        return ChannelState([(0, list(batch)) for batch in entries], legacy=True)
    if not all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], list) for e in entries):
        raise CorruptionError("channel state entries are not (input, batch) pairs", url)
    return ChannelState(entries)
