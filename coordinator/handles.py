"""Every handle type a checkpoint's subtask state may hold, and their JSON codec.

A completed checkpoint records, per subtask, handles to durable bytes: keyed state
(:class:`~backends.handles.KeyedStateHandle`, with its materialization and changelog
handles), staged sink transactions and in-flight channel state. The coordinator's own two
types are defined here, beside the protocol, not in a host: the embedded runtime and the
Spark host both write them and every reader of the store (the CLI, Spark jobs) decodes
them. The metadata store encodes and decodes through this module, so whoever reads a
record has every type registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from backends.handles import KeyedStateHandle, MaterializationHandle, StateFileHandle
from dstl.handles import ChangelogHandle, register_handle
from dstl.handles import handle_from_json as _from_json
from dstl.handles import handle_to_json as _to_json
from dstl.integrity import FileRef
from dstl.layout import check_location

PART_SUFFIXES = ("jsonl", "parquet")
"""File types of committed sink parts."""


@register_handle("sink-transaction")
@dataclass(frozen=True, slots=True)
class SinkTransactionHandle:
    """A staged (pre-committed) sink transaction: its file and what it commits as.

    ``suffix`` is the committed part's file type: ``jsonl`` (the embedded runtime's JSON
    lines) or ``parquet`` (the Spark host's typed output).
    """

    location: str
    checkpoint_id: int
    subtask: int
    records: int
    size_bytes: int
    content_hash: str = ""
    suffix: str = "jsonl"

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        check_location(self.location)
        # checkpoint 0 exists on the Spark host: its checkpoint ids are the batch ids
        if self.checkpoint_id < 0 or self.records < 1 or self.suffix not in PART_SUFFIXES:
            raise ValueError(f"invalid sink transaction {self!r}")

    def files(self) -> list[str]:
        """The staged file."""
        return [self.location]

    def file_refs(self) -> list[FileRef]:
        """The staged file, with its size and content hash."""
        return [FileRef(self.location, self.size_bytes, self.content_hash)]


@register_handle("channel-state")
@dataclass(frozen=True, slots=True)
class ChannelStateHandle:
    """The in-flight input records of one subtask for one unaligned checkpoint."""

    location: str
    checkpoint_id: int
    operator: str
    subtask: int
    records: int
    size_bytes: int
    content_hash: str = ""

    TYPE_TAG: ClassVar[str]
    #: A file of this handle is never referenced by any other checkpoint.
    PRIVATE_TO_CHECKPOINT: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_location(self.location)
        if self.checkpoint_id < 1 or self.records < 0:
            raise ValueError(f"invalid channel state handle {self!r}")

    def files(self) -> list[str]:
        """The one file."""
        return [self.location]

    def file_refs(self) -> list[FileRef]:
        """The one file, with its size and content hash."""
        return [FileRef(self.location, self.size_bytes, self.content_hash)]


#: The handle types a subtask state holds directly (others nest inside them).
SUBTASK_HANDLE_TYPES: tuple[type[Any], ...] = (
    KeyedStateHandle,
    SinkTransactionHandle,
    ChannelStateHandle,
)
#: Every handle type a checkpoint record may contain, nested ones included.
CHECKPOINT_HANDLE_TYPES: tuple[type[Any], ...] = (
    *SUBTASK_HANDLE_TYPES,
    MaterializationHandle,
    StateFileHandle,
    ChangelogHandle,
)


def handle_to_json(handle: Any) -> dict[str, Any]:
    """The JSON-ready dict of one of :data:`CHECKPOINT_HANDLE_TYPES` (nested included)."""
    return _to_json(handle)


def handle_from_json(data: dict[str, Any]) -> Any:
    """Inverse of :func:`handle_to_json`; an unknown tag is a ``CorruptionError``."""
    return _from_json(data)
