"""In-flight records of an unaligned checkpoint (FLIP-76 channel state): write and read.

With unaligned barriers a task snapshots its state as soon as the *first* barrier of a
checkpoint arrives; the records that arrive afterwards on channels whose barrier is still
ahead are "in flight": logically before the barrier, physically after the snapshot. They
are written here, once per checkpoint and subtask, and replayed before any new input on
restore. Unlike changelog segments, materialized files and sink transactions, a channel
state file belongs to exactly one checkpoint and is never reused by a later one: it is the
only kind of file the coordinator deletes for an aborted checkpoint (see
:func:`coordinator.checkpoint.checkpoint_private_files`).

File format: ``CSTATE1\\n`` + crc32 (4 bytes, big endian) + a pickle of the record
batches. The store is as trusted as the state itself.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from coordinator.handles import ChannelStateHandle
from dstl import layout
from dstl.errors import CorruptionError
from dstl.fileio import FileIO
from dstl.integrity import content_hash, read_verified

_MAGIC = b"CSTATE1\n"


def write_channel_state(
    fileio: FileIO,
    job: str,
    operator: str,
    subtask: int,
    checkpoint_id: int,
    batches: Sequence[Any],
) -> ChannelStateHandle:
    """Durably write the in-flight batches (write-once) and return their handle."""
    body = pickle.dumps(list(batches), protocol=pickle.HIGHEST_PROTOCOL)
    data = _MAGIC + struct.pack(">I", zlib.crc32(body)) + body
    path = layout.channel_state_path(job, operator, subtask, checkpoint_id)
    fileio.write_new(path, data)
    records = sum(len(b) if isinstance(b, list | tuple) else 1 for b in batches)
    return ChannelStateHandle(
        path, checkpoint_id, operator, subtask, records, len(data), content_hash(data)
    )


def read_channel_state(fileio: FileIO, handle: ChannelStateHandle) -> list[Any]:
    """The batches of ``handle``; :class:`CorruptionError` on a bad file."""
    data = read_verified(fileio, handle.file_refs()[0])
    url = fileio.url(fileio.relative(handle.location))
    head = len(_MAGIC)
    if len(data) < head + 4 or not data.startswith(_MAGIC):
        raise CorruptionError("not a channel state file", url)
    (crc,) = struct.unpack(">I", data[head : head + 4])
    body = data[head + 4 :]
    if zlib.crc32(body) != crc:
        raise CorruptionError("channel state checksum mismatch", url)
    try:
        batches = pickle.loads(body)
    except Exception as exc:  # pickle raises many types on bad bytes
        raise CorruptionError(f"unreadable channel state: {exc}", url) from exc
    if not isinstance(batches, list):
        raise CorruptionError("channel state is not a list of batches", url)
    return batches
