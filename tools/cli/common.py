"""What every ``statectl`` command shares: options, opening a store, ids, output, secrets.

- Options common to the commands: ``--store``, ``--metadata``, ``--job``, ``--json``,
  ``--storage-option KEY=VALUE`` (repeatable; dotted keys nest:
  ``client_kwargs.endpoint_url=http://...``; values are JSON when they parse as JSON),
  ``--config FILE`` (TOML with ``store``, ``metadata`` and a ``[storage_options]``
  table; flags win), ``--quiet`` (no progress).
- :class:`Context` opens the store (FileIO) and the metadata store lazily, resolves
  checkpoint references (``ID``, ``latest``), prints (a closed pipe ends the command
  quietly) and masks every secret it was given (metadata password, storage-option
  credentials) in everything it prints.

One thread: the CLI's. Nothing here keeps credentials beyond the process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from coordinator.metadata import MAX_ID, CompletedCheckpoint, MetadataStore, url_secrets
from dstl.errors import CheckpointNotFoundError, ConfigError, StorageNotFoundError
from dstl.fileio import FileIO

_SECRET_KEYS = re.compile(r"pass|secret|token|credential|key|session", re.IGNORECASE)
_NOT_SECRET = frozenset({"key_group", "endpoint_url", "region_name", "use_ssl"})


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit code 2)."""

    def error(self, message: str) -> Any:  # argparse's signature is NoReturn
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_common(parser: argparse.ArgumentParser) -> None:
    """The options every store command takes."""
    parser.add_argument("--store", help="directory or URL of the durable store (file://, s3://)")
    parser.add_argument(
        "--metadata", help="SQLAlchemy URL of the metadata store (default: <store>/metadata.db)"
    )
    parser.add_argument("--job", help="job id (needed only when several jobs share the store)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an s3fs/fsspec option, repeatable (client_kwargs.endpoint_url=http://...)",
    )
    parser.add_argument("--config", help="TOML file with store, metadata, [storage_options]")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def checkpoint_ref(text: str) -> int | str:
    """An argparse type: a checkpoint id (1 .. 2^63-1) or ``latest``."""
    if text == "latest":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a checkpoint id or 'latest': {text!r}") from None
    if not 1 <= value <= MAX_ID:
        raise argparse.ArgumentTypeError(f"checkpoint id {text} is out of range 1..{MAX_ID}")
    return value


def parse_storage_options(items: Iterable[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as nested s3fs options (dotted keys nest; JSON values parse)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or any(not p for p in key.split(".")):
            raise ConfigError(f"--storage-option wants KEY=VALUE, got {key.strip()!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--storage-option {key}: {part} is already a value")
            node = child
        node[leaf] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def secrets_of(options: Any) -> list[str]:
    """Every credential-looking string value in nested storage options."""
    found: list[str] = []
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, str) and _SECRET_KEYS.search(str(k)) and k not in _NOT_SECRET:
                found.append(v)
            else:
                found.extend(secrets_of(v))
    elif isinstance(options, list):
        for v in options:
            found.extend(secrets_of(v))
    return [s for s in found if s]


@dataclass
class Output:
    """Prints to stdout/stderr with every known secret masked. CLI thread only."""

    secrets: list[str] = field(default_factory=list)
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)

    def redact(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    def print(self, text: str = "") -> None:
        """One line (or block) to stdout."""
        self.stdout.write(self.redact(text) + "\n")

    def json(self, value: Any) -> None:
        """``value`` as indented JSON on stdout."""
        self.print(json.dumps(value, indent=2, default=str))

    def error(self, text: str) -> None:
        """One line on stderr."""
        self.stderr.write(self.redact(text) + "\n")
        self.stderr.flush()


class Progress:
    """Progress of long work on stderr: a bar on a terminal, plain lines otherwise.

    ``advance(n)`` adds done units (bytes); a terminal gets a redrawn bar (at most every
    ``redraw_s``), anything else a plain line at most every ``line_s``, plus a last line
    when work that printed anything is done. CLI thread only; ``clock`` is injectable.
    """

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
        line_s: float = 5.0,
        redraw_s: float = 0.1,
    ) -> None:
        self.label = label
        self.total = max(total, 0)
        self.done = 0
        self._stream = stream
        self._clock = clock
        self._enabled = enabled
        self._tty = enabled and bool(getattr(stream, "isatty", lambda: False)())
        self._every = redraw_s if self._tty else line_s
        self._last = clock()
        self._printed = False

    def advance(self, n: int) -> None:
        """``n`` more units done."""
        self.done += n
        now = self._clock()
        if self._enabled and now - self._last >= self._every:
            self._last = now
            self._show()

    def finish(self) -> None:
        """The work ended: end the bar's line, or print a last line if any was printed."""
        if self._tty and self._printed:
            self._show()
            self._stream.write("\n")
        elif self._printed:
            self._show()
        self._stream.flush()

    def _show(self) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        text = f"{self.label}: {frac:6.1%} ({self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB)"
        if self._tty:
            bar = "#" * int(frac * 30)
            self._stream.write(f"\r{self.label} [{bar:<30}] {frac:6.1%}")
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
        self._printed = True


class CountingFileIO(FileIO):
    """A FileIO that reports the bytes every read returns (to a :class:`Progress`)."""

    def __init__(self, fileio: FileIO, on_read: Callable[[int], None]) -> None:
        super().__init__(fileio.root_url, fileio._options)
        self._on_read = on_read

    def read(self, path: str) -> bytes:
        """All bytes of ``path``, counted."""
        data = super().read(path)
        self._on_read(len(data))
        return data


class Context:
    """A command's view of its store: options resolved, store and metadata opened lazily.

    CLI thread only. Owns the metadata store it opens (closed by :meth:`close`).
    """

    def __init__(self, args: argparse.Namespace, output: Output) -> None:
        self.args = args
        self.out = output
        config: dict[str, Any] = {}
        if getattr(args, "config", None):
            config = _read_config(args.config)
        self.store_url: str | None = getattr(args, "store", None) or config.get("store")
        self.metadata_url: str | None = getattr(args, "metadata", None) or config.get("metadata")
        options = config.get("storage_options", {})
        if not isinstance(options, dict):
            raise ConfigError("config: storage_options must be a table")
        self.storage_options = _merge(
            options, parse_storage_options(getattr(args, "storage_option", []) or [])
        )
        output.secrets.extend(secrets_of(self.storage_options))
        if self.metadata_url:
            output.secrets.extend(url_secrets(self.metadata_url))
        self._fileio: FileIO | None = None
        self._store: MetadataStore | None = None

    @property
    def fileio(self) -> FileIO:
        """The store (it must exist)."""
        if self._fileio is None:
            if not self.store_url:
                raise ConfigError("no store given: use --store URL (or store = in --config)")
            fileio = FileIO(self.store_url, self.storage_options)
            if fileio.scheme == "file" and not os.path.isdir(fileio.root_url[len("file://") :]):
                raise StorageNotFoundError("store does not exist", self.store_url)
            self._fileio = fileio
        return self._fileio

    @property
    def store(self) -> MetadataStore:
        """The metadata store (it must exist: opening never creates one)."""
        if self._store is None:
            self._store = open_metadata(self.metadata_url, self.fileio, self.store_url)
        return self._store

    def progress(self, label: str, total: int) -> Progress:
        """A progress reporter on stderr (silent with ``--quiet``)."""
        return Progress(label, total, self.out.stderr, enabled=not self.args.quiet)

    def the_job(self) -> str:
        """``--job``, or the store's only job."""
        return the_job(self.store, self.args.job)

    def checkpoint(self, ref: int | str) -> CompletedCheckpoint:
        """The checkpoint (or savepoint) ``ref``: an id, or ``latest`` of the job."""
        return resolve_checkpoint(self.store, self.args.job, ref)

    def close(self) -> None:
        """Release the metadata store's connections."""
        if self._store is not None:
            self._store.close()


def open_metadata(metadata_url: str | None, fileio: FileIO, store_url: str | None) -> MetadataStore:
    """The metadata store at ``metadata_url``, else the SQLite file of a local store;
    never created (a missing one is :class:`~dstl.errors.MetadataNotFoundError`)."""
    if metadata_url:
        return MetadataStore(metadata_url, create=False)
    if fileio.scheme != "file":
        raise ConfigError(
            f"store {store_url} is not local: give --metadata URL (Spark: option metadata)"
        )
    return MetadataStore.for_local_store(fileio.root_url[len("file://") :], create=False)


def the_job(store: MetadataStore, job: str | None) -> str:
    """``job``, or the store's only job (ConfigError if there are several or none)."""
    if job:
        return str(job)
    jobs = store.job_ids()
    if len(jobs) != 1:
        raise ConfigError(
            f"the store holds jobs {', '.join(jobs) or '(none)'}: give --job (Spark: option job)"
        )
    return jobs[0]


def resolve_checkpoint(
    store: MetadataStore, job: str | None, ref: int | str
) -> CompletedCheckpoint:
    """The checkpoint (or savepoint) ``ref`` of ``job``: an id, or ``latest``."""
    if ref == "latest":
        name = the_job(store, job)
        latest = store.latest(name)
        if latest is None:
            raise CheckpointNotFoundError(f"job {name} has no completed checkpoint")
        return latest
    return store.get(job, int(ref))


def _read_config(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise StorageNotFoundError("config file does not exist", path) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    unknown = set(data) - {"store", "metadata", "storage_options"}
    if unknown:
        raise ConfigError(f"config {path}: unknown keys {sorted(unknown)}")
    return data
