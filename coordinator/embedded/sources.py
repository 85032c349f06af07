"""Replayable sources: the protocol, a seeded generator, a directory of files.

Exactly-once output needs sources that can replay: a checkpoint records each source
subtask's *position* (a JSON value: an offset, or a dict of offsets per file) and a
restore reopens the source there, so the records after it come again, the same ones in
the same order. A source of your own implements two small protocols::

    class MySource:                                # one per source node; picklable not needed
        def open(self, subtask, parallelism, restored):
            # restored: None on a fresh start, else the positions every subtask of the
            # restored checkpoint recorded (index = old subtask), possibly at another
            # parallelism; raise ConfigError if the source cannot rescale
            return MyReader(...)

    class MyReader:                                # task thread only
        def read(self, max_records):   # up to max_records records; [] if none right now
            ...                        # (an unbounded source that is idle); None at the end
        def position(self):            # JSON: reopening here resumes after the last read
            ...
        def close(self): ...

Event time: a source node may have a :class:`WatermarkStrategy`; the source task then
stamps every record with ``timestamp(record)`` and, after each batch, emits the watermark
``max timestamp - max_out_of_orderness_ms - 1`` (records later than that are late); at the
end of a bounded input it emits the maximum watermark, so every event-time timer fires
before the final checkpoint.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, BinaryIO, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from dstl.errors import ConfigError, CorruptionError
from dstl.fileio import FileIO

MAX_WATERMARK = (1 << 63) - 1
"""The watermark of an input that ended: every event-time timer is due."""


class SourceReader(Protocol):
    """Reads one source subtask's records. Task thread only."""

    def read(self, max_records: int) -> list[Any] | None:
        """Up to ``max_records`` records, ``[]`` if none is available now, None at the end."""
        ...

    def position(self) -> Any:
        """A JSON value from which :meth:`ReplayableSource.open` resumes after the last read."""
        ...

    def close(self) -> None:
        """Release what the reader holds."""
        ...


class ReplayableSource(Protocol):
    """A source a checkpoint can rewind: see the module docstring."""

    def open(self, subtask: int, parallelism: int, restored: Sequence[Any] | None) -> SourceReader:
        """A reader for ``subtask`` of ``parallelism``, from the ``restored`` positions."""
        ...


@dataclass(frozen=True, slots=True)
class WatermarkStrategy:
    """Event time of a source: ``timestamp(record)`` (epoch milliseconds) and how late a
    record may be relative to the latest one seen (bounded out-of-orderness)."""

    timestamp: Callable[[Any], int]
    max_out_of_orderness_ms: int = 0

    def __post_init__(self) -> None:
        if self.max_out_of_orderness_ms < 0:
            raise ConfigError("max_out_of_orderness_ms must be >= 0")

    def watermark(self, max_timestamp: int) -> int:
        """The watermark after records up to ``max_timestamp``."""
        return max_timestamp - self.max_out_of_orderness_ms - 1


def _offset_of(restored: Sequence[Any] | None, subtask: int, parallelism: int, what: str) -> int:
    """The restored offset of ``subtask`` for a source that cannot rescale."""
    if restored is None:
        return 0
    if len(restored) != parallelism:
        raise ConfigError(
            f"the checkpoint has {len(restored)} subtasks of {what}; the pipeline declares "
            f"{parallelism} (this source cannot rescale)"
        )
    value = restored[subtask]
    if value is None:
        return 0
    if not isinstance(value, int) or value < 0:
        raise CorruptionError(f"position of {what} subtask {subtask} is not an offset: {value!r}")
    return value


class _CountingReader:
    """A reader over an iterator of records; its position is the number read."""

    def __init__(self, records: Iterator[Any], offset: int, count: int | None) -> None:
        self._records = records
        self._offset = offset
        self._count = count

    def read(self, max_records: int) -> list[Any] | None:
        n = max_records
        if self._count is not None:
            n = min(n, self._count - self._offset)
        batch = list(islice(self._records, max(0, n)))
        if not batch:
            return None
        self._offset += len(batch)
        return batch

    def position(self) -> int:
        return self._offset

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class GeneratorSource:
    """A seeded generator: subtask ``s`` draws records from ``random.Random(seed, s)``.

    ``generate(rng, index)`` makes record ``index`` of a subtask; the sequence depends on
    the seed and subtask only, so a restore regenerates and skips the first ``offset``
    records and goes on with the same ones. ``count`` per subtask, or None (unbounded).
    The position is an offset, so the parallelism cannot change across a restore.
    """

    generate: Callable[[random.Random, int], Any]
    count: int | None = None
    seed: int = 0

    def open(
        self, subtask: int, parallelism: int, restored: Sequence[Any] | None
    ) -> _CountingReader:
        offset = _offset_of(restored, subtask, parallelism, "the generator")
        rng = random.Random(self.seed * 1_000_003 + subtask)
        records = (self.generate(rng, i) for i in range(self.count or 1 << 62))
        for _ in islice(records, offset):
            pass
        return _CountingReader(records, offset, self.count)


@dataclass(frozen=True, slots=True)
class IteratorSource:
    """Adapts ``open(subtask, parallelism, offset) -> iterator`` (the records of a subtask
    from ``offset`` on) to the protocol; the position is the offset."""

    open_records: Callable[[int, int, int], Iterator[Any]]

    def open(
        self, subtask: int, parallelism: int, restored: Sequence[Any] | None
    ) -> _CountingReader:
        offset = _offset_of(restored, subtask, parallelism, "the source")
        return _CountingReader(iter(self.open_records(subtask, parallelism, offset)), offset, None)


FORMATS = ("jsonl", "csv", "parquet")

_PARQUET_BATCH = 1_024  # rows decoded at a time: memory is one batch, not the file


def _jsonl_records(stream: BinaryIO, skip: int) -> Iterator[Any]:
    """The non-blank lines of ``stream`` as JSON values, after the first ``skip`` of them
    (skipped lines are not parsed)."""
    n = 0
    for line in stream:
        if not line.strip():
            continue
        n += 1
        if n > skip:
            yield json.loads(line)


def _csv_records(stream: BinaryIO, skip: int) -> Iterator[Any]:
    """The rows of a CSV with a header, a dict of strings each, after the first ``skip``.

    Rows go through :mod:`csv` over a text wrapper, a line at a time: pyarrow's CSV reader
    would infer column types, and a record's values must not change with the reader (a
    restore replays the same records; the previous whole-file reader gave strings)."""
    rows = csv.DictReader(io.TextIOWrapper(stream, encoding="utf-8", newline=""))
    yield from islice(rows, skip, None)


def _parquet_records(stream: BinaryIO, skip: int) -> Iterator[Any]:
    """The rows of a Parquet file as dicts, after the first ``skip``: whole row groups
    before it are not read, then batches of :data:`_PARQUET_BATCH` rows are decoded."""
    pf = pq.ParquetFile(stream)
    groups: list[int] = []
    for g in range(pf.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if skip >= rows and not groups:
            skip -= rows
            continue
        groups.append(g)
    if not groups:
        return
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=groups):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        if skip:
            batch, skip = batch.slice(skip), 0
        yield from batch.to_pylist()


_RECORDS: dict[str, Callable[[BinaryIO, int], Iterator[Any]]] = {
    "jsonl": _jsonl_records,
    "csv": _csv_records,
    "parquet": _parquet_records,
}


@dataclass(frozen=True, slots=True)
class FileSource:
    """The files of a directory (local or any FileIO URL), each a split: JSON lines
    (``.jsonl``/``.json``), CSV with a header (``.csv``: a dict per row) or Parquet
    (``.parquet``: a dict per row).

    Files are listed once when a subtask opens, sorted by path, and file ``i`` goes to
    subtask ``i % parallelism``; a subtask reads its files in order. The position is
    ``{path: records read}`` per started file, so a restore at any parallelism resumes
    every file where it stopped. Bounded: the input ends when every file was read.
    """

    url: str
    format: str | None = None  # None: by file extension
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError(f"file source format must be one of {', '.join(FORMATS)}")

    def _format_of(self, path: str) -> str | None:
        if self.format is not None:
            return self.format
        suffix = path.rsplit(".", 1)[-1].lower()
        return {"jsonl": "jsonl", "json": "jsonl", "csv": "csv", "parquet": "parquet"}.get(suffix)

    def open(self, subtask: int, parallelism: int, restored: Sequence[Any] | None) -> _FileReader:
        fileio = FileIO(self.url, self.storage_options)
        files = sorted(i.path for i in fileio.list("") if self._format_of(i.path) is not None)
        done: dict[str, int] = {}
        for position in restored or ():
            if position is None:
                continue
            if not isinstance(position, dict):
                raise CorruptionError(f"file source position is not an object: {position!r}")
            done.update({str(k): int(v) for k, v in position.items()})
        mine = files[subtask::parallelism]
        return _FileReader(self, fileio, mine, {f: done.get(f, 0) for f in mine})


class _FileReader:
    """Streams the files of one subtask in order: one file open at a time, parsed
    lazily, so memory is a batch, not a file. Task thread only."""

    def __init__(
        self, source: FileSource, fileio: FileIO, files: list[str], offsets: dict[str, int]
    ) -> None:
        self._source = source
        self._fileio = fileio
        self._files = files
        self._offsets = offsets
        self._index = 0
        self._stream: BinaryIO | None = None
        self._records: Iterator[Any] | None = None

    def read(self, max_records: int) -> list[Any] | None:
        while self._index < len(self._files):
            path = self._files[self._index]
            fmt = self._source._format_of(path) or "jsonl"
            url = self._fileio.url(path)
            try:
                if self._records is None:
                    self._stream = self._fileio.open_read(self._fileio.relative(path))
                    self._records = _RECORDS[fmt](self._stream, self._offsets[path])
                batch = list(islice(self._records, max_records))
            except (ValueError, UnicodeDecodeError, csv.Error, pa.ArrowException) as exc:
                raise CorruptionError(f"unreadable {fmt} input: {exc}", url) from exc
            if batch:
                self._offsets[path] += len(batch)
                return batch
            self._index += 1
            self._close_file()
        return None

    def position(self) -> dict[str, int]:
        return {f: n for f, n in self._offsets.items() if n}

    def _close_file(self) -> None:
        self._records = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        self._close_file()
