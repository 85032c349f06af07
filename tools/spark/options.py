"""The options of the ``changelog-state`` Spark data source, parsed once, typed.

===========================  =========================================================
option                       meaning
===========================  =========================================================
``store``                    the store's URL or path (``file://``, ``s3://``); required
``metadata``                 SQLAlchemy URL of the metadata store (default: the SQLite
                             file of a local store)
``job``                      the job (needed only when several share the store)
``operator``                 the keyed operator (needed only when there are several)
``state``                    the state (needed only when the operator has one)
``checkpoint``               a checkpoint or savepoint id, or ``latest`` (default)
``rowsPerPartition``         about how many entries one Spark partition restores
                             (default 500000; partitions follow key-group ranges and
                             the materialized pieces)
``readChangeFeed``           ``true``: the changes between two checkpoints, not the state
``changeStartCheckpoint``    the change feed starts after this checkpoint (``0``: at the
                             start of the job's log); required with ``readChangeFeed``
``changeEndCheckpoint``      ...and ends with this one (default ``latest``)
``storage.<key>``            an s3fs option; dotted keys nest, values are JSON when they
                             parse as JSON (``storage.client_kwargs.endpoint_url``)
===========================  =========================================================

Spark hands options over case-insensitively (lowercased); unknown options are refused,
so a misspelt one is an error rather than silently ignored. Credentials are best left to
s3fs's usual sources (environment, config files): options show up in Spark's plans.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dstl.errors import ConfigError
from tools.cli.common import checkpoint_ref, parse_storage_options

FORMAT = "changelog-state"
DEFAULT_ROWS_PER_PARTITION = 500_000
STORAGE_PREFIX = "storage."
_KNOWN = {
    "store",
    "metadata",
    "job",
    "operator",
    "state",
    "checkpoint",
    "rowsperpartition",
    "readchangefeed",
    "changestartcheckpoint",
    "changeendcheckpoint",
    "path",  # .load(path): the store
}


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What one read asks for (see the module docstring). Picklable."""

    store: str
    metadata: str | None = None
    job: str | None = None
    operator: str | None = None
    state: str | None = None
    checkpoint: int | str = "latest"
    rows_per_partition: int = DEFAULT_ROWS_PER_PARTITION
    change_feed: bool = False
    change_start: int = 0
    change_end: int | str = "latest"
    storage_options: dict[str, Any] = field(default_factory=dict)


def _ref(name: str, text: str) -> int | str:
    try:
        return checkpoint_ref(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"option {name}: {exc}") from None


def _int(name: str, text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"option {name}: not an integer: {text!r}") from None
    if value < low:
        raise ConfigError(f"option {name} must be >= {low}, got {value}")
    return value


def parse(options: Mapping[str, str]) -> ReadOptions:
    """The typed options of a read; :class:`ConfigError` for a missing, unknown or
    malformed one."""
    opts = {k.lower(): str(v) for k, v in options.items()}
    unknown = sorted(k for k in opts if k not in _KNOWN and not k.startswith(STORAGE_PREFIX))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} of format {FORMAT!r}")
    store = opts.get("store") or opts.get("path")
    if not store:
        raise ConfigError(f'format {FORMAT!r} needs .option("store", URL)')
    feed = opts.get("readchangefeed", "false").strip().lower()
    if feed not in ("true", "false"):
        raise ConfigError(f"option readChangeFeed must be true or false, got {feed!r}")
    if feed == "false" and ("changestartcheckpoint" in opts or "changeendcheckpoint" in opts):
        raise ConfigError("changeStartCheckpoint and changeEndCheckpoint need readChangeFeed=true")
    if feed == "true" and "changestartcheckpoint" not in opts:
        raise ConfigError("readChangeFeed needs changeStartCheckpoint (0: the start of the log)")
    if feed == "true" and "checkpoint" in opts:
        raise ConfigError("readChangeFeed reads between checkpoints: use changeEndCheckpoint")
    storage = parse_storage_options(
        f"{k[len(STORAGE_PREFIX) :]}={v}" for k, v in opts.items() if k.startswith(STORAGE_PREFIX)
    )
    return ReadOptions(
        store=store,
        metadata=opts.get("metadata"),
        job=opts.get("job"),
        operator=opts.get("operator"),
        state=opts.get("state"),
        checkpoint=_ref("checkpoint", opts.get("checkpoint", "latest")),
        rows_per_partition=_int(
            "rowsPerPartition", opts.get("rowsperpartition", str(DEFAULT_ROWS_PER_PARTITION)), 1
        ),
        change_feed=feed == "true",
        change_start=_int("changeStartCheckpoint", opts.get("changestartcheckpoint", "0"), 0),
        change_end=_ref("changeEndCheckpoint", opts.get("changeendcheckpoint", "latest")),
        storage_options=storage,
    )
