"""Handles: immutable values that say where durable bytes are.

A handle is a frozen, slotted dataclass that validates itself in ``__post_init__`` and
round-trips through JSON as ``{"type": TAG, "v": VERSION, ...fields}``. Handle types of
higher packages register themselves with :func:`register_handle`, so the metadata store can
decode any handle without knowing its package. Sequence ranges are half-open ``[start, end)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeVar

from dstl.errors import CorruptionError
from dstl.integrity import FileRef
from dstl.layout import check_location

FORMAT_VERSION = 1


class Handle(Protocol):
    """What every handle offers: a type tag and the durable files it references.

    Locations are relative to the store root (``jobs/<job>/...``), so a store can be
    copied or synced elsewhere and still restore; records written before that hold
    absolute URLs, which :meth:`dstl.fileio.FileIO.relative` still resolves.
    """

    TYPE_TAG: ClassVar[str]

    def files(self) -> list[str]:
        """Locations of every durable file this handle needs."""
        ...

    def file_refs(self) -> list[FileRef]:
        """Every durable file this handle needs, with its size and content hash."""
        ...


_REGISTRY: dict[str, type[Any]] = {}
H = TypeVar("H")


def register_handle(tag: str) -> Callable[[type[H]], type[H]]:
    """Class decorator: make a handle dataclass decodable by :func:`handle_from_json`."""

    def wrap(cls: type[H]) -> type[H]:
        if tag in _REGISTRY and _REGISTRY[tag] is not cls:
            raise ValueError(f"handle tag {tag!r} registered twice")
        cls.TYPE_TAG = tag  # type: ignore[attr-defined]
        _REGISTRY[tag] = cls
        return cls

    return wrap


_PLAIN = (str, int, float, bool, type(None))
_FIELDS: dict[type[Any], tuple[str, ...]] = {}  # field names per handle class


def _encode(value: Any) -> Any:
    # On the coordinator's commit path (a record holds hundreds of values): the plain
    # ones first, and no dataclasses.fields() per handle.
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return handle_to_json(value)
    return value


def handle_to_json(handle: Any) -> dict[str, Any]:
    """The JSON-ready dict of a registered handle (nested handles included)."""
    cls = type(handle)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(handle))
    out: dict[str, Any] = {"type": cls.TYPE_TAG, "v": FORMAT_VERSION}
    for name in names:
        out[name] = _encode(getattr(handle, name))
    return out


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "type" in value and "v" in value:
        return handle_from_json(value)
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def handle_from_json(data: dict[str, Any]) -> Any:
    """Rebuild a handle from :func:`handle_to_json` output; unknown tags are corruption."""
    try:
        tag = data["type"]
        version = data["v"]
        cls = _REGISTRY[tag]
    except (KeyError, TypeError) as exc:
        raise CorruptionError(f"not a known handle: {str(data)[:200]}") from exc
    if version != FORMAT_VERSION:
        raise CorruptionError(f"handle {tag!r} has unsupported format version {version}")
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in data:
            kwargs[field.name] = _decode(data[field.name])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise CorruptionError(f"invalid {tag!r} handle: {exc}") from exc


@register_handle("changelog")
@dataclasses.dataclass(frozen=True, slots=True)
class ChangelogHandle:
    """One writer's contiguous block of changes inside a segment file.

    ``location`` is the segment's path in the store, ``block`` the Parquet row group
    holding exactly this writer's changes with sequence numbers in ``[sqn_start,
    sqn_end)``; ``rows`` counts them; ``size_bytes`` and ``content_hash`` are the whole
    segment's (shared with other writers' blocks; see :mod:`dstl.integrity`).
    """

    location: str
    block: int
    writer_id: str
    sqn_start: int
    sqn_end: int
    rows: int
    size_bytes: int
    content_hash: str = ""

    TYPE_TAG: ClassVar[str]

    def __post_init__(self) -> None:
        check_location(self.location)
        if self.block < 0 or self.rows < 0 or self.size_bytes < 0:
            raise ValueError(f"negative block/rows/size in {self!r}")
        if not 0 <= self.sqn_start < self.sqn_end:
            raise ValueError(f"bad sequence range [{self.sqn_start}, {self.sqn_end})")

    def files(self) -> list[str]:
        """The segment file this block lives in."""
        return [self.location]

    def file_refs(self) -> list[FileRef]:
        """The segment file, with the size and hash recorded at its upload."""
        return [FileRef(self.location, self.size_bytes, self.content_hash)]
