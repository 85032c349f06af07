"""Content hashes of durable files, and the verified read every reader goes through.

Every file a checkpoint references is recorded, when it is written, with its size and a
content hash: SHA-256, as 64 hex characters (what ``sha256sum`` prints, so an operator
can check a file by hand). Every read of such a
file (restore, savepoints, the sink's commit, channel state, the CLI, Spark jobs) goes
through :func:`read_verified`, which checks both before a byte is interpreted, so a
flipped bit, a truncation, an empty file or a file swapped for another valid one raises
:class:`~dstl.errors.CorruptionError` naming the file instead of restoring wrong state.

Why SHA-256: it is in the standard library, releases the GIL on large buffers, runs on
the CPU's SHA instructions at about 1.5 GB/s here (BLAKE2b: 0.8 GB/s; both measured on 64
MiB), faster than the disk reads it checks, and, unlike a CRC or xxHash, it is collision
resistant, so a file crafted to pass the check is not an option either. The
formats' own checksums (Parquet page CRCs, segment block CRCs, channel state CRC) stay:
they name the damaged block, this names the damaged file.

Handles written before hashes were recorded carry an empty hash: their reads check the
size and the format's own checksums only (:attr:`FileRef.content_hash` is ``""``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dstl.errors import CorruptionError

if TYPE_CHECKING:
    from dstl.fileio import FileIO

HASH_NAME = "sha256"
_HASH_TEXT = re.compile(r"[0-9a-f]{64}")  # one C call: a FileRef is built per file per record


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """The content hash of ``data`` (64 lowercase hex characters)."""
    return hashlib.sha256(data).hexdigest()


def is_content_hash(text: str) -> bool:
    """Whether ``text`` has the form :func:`content_hash` returns."""
    return _HASH_TEXT.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class FileRef:
    """One durable file a handle references: where, how big, and its content hash.

    ``location`` is relative to the store root (older records: an absolute URL);
    ``content_hash`` is ``""`` for records written before hashes were kept.
    """

    location: str
    size_bytes: int
    content_hash: str = ""

    def __post_init__(self) -> None:
        if not self.location or self.size_bytes < 0:
            raise ValueError(f"invalid file reference {self!r}")
        if self.content_hash and not is_content_hash(self.content_hash):
            raise ValueError(f"invalid content hash {self.content_hash!r} of {self.location}")


def verify_bytes(data: bytes | memoryview, ref: FileRef, url: str) -> None:
    """Raise :class:`CorruptionError` naming ``url`` unless ``data`` is ``ref``'s content."""
    if len(data) != ref.size_bytes:
        raise CorruptionError(
            f"file has {len(data)} bytes, its checkpoint recorded {ref.size_bytes} "
            "(truncated, replaced or damaged)",
            url,
        )
    if ref.content_hash and content_hash(data) != ref.content_hash:
        raise CorruptionError(
            f"content hash mismatch ({HASH_NAME}): the file is damaged or was replaced", url
        )


def read_verified(fileio: FileIO, ref: FileRef) -> bytes:
    """All bytes of ``ref``'s file, checked against its recorded size and content hash.

    Raises :class:`~dstl.errors.StorageNotFoundError` if the file is gone and
    :class:`CorruptionError` if it is not what was written; both name the file's URL.
    """
    path = fileio.relative(ref.location)
    data = fileio.read(path)
    verify_bytes(data, ref, fileio.url(path))
    return data
