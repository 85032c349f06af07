"""``statectl``: inspect, verify, restore and export checkpoints; savepoints; orphan sweep;
run a pipeline.

Exit codes:

=====  =================================================================================
0      success
1      another failure (the metadata store or S3 unreachable, an unexpected error)
2      usage error (an unknown option, a malformed value: a checkpoint id out of range,
       an age that is not a finite number >= 0)
3      not found (store, metadata store, checkpoint, config file, a referenced file)
4      corrupt (a file whose size or hash is not the recorded one, a damaged metadata
       database or record, state that does not match its declaration)
5      refused (the target exists or is inside the store or holds it, an option the
       store refuses: an invalid job name, a storage option s3fs does not take; a
       compaction that newer state of its job superseded)
6      local I/O error (a full disk, a target that cannot be written)
=====  =================================================================================

Every failure is one line on stderr, ``statectl: error: <what and where>``, with every
secret the command was given (a metadata URL's password, storage-option credentials)
masked; a closed output pipe (``statectl ... | head``) ends the command quietly with 1.
``STATECTL_DEBUG=1`` adds the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from coordinator.errors import CompactionSupersededError
from coordinator.metadata import one_line
from dstl.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptionError,
    MetadataNotFoundError,
    SchemaMismatchError,
    StateBackendError,
    StorageError,
    StorageNotFoundError,
)
from tools.cli import checkpoints, compact, maintain, run, state
from tools.cli.common import Context, Output, Parser, add_common

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CORRUPT, EXIT_REFUSED, EXIT_IO = range(7)

EXAMPLES = """examples:
  statectl checkpoints list --store demo-data
  statectl checkpoints show latest --store demo-data --json
  statectl verify --store demo-data --checkpoint all
  statectl restore --store demo-data --checkpoint latest -o restored/
  statectl export --store demo-data --checkpoint 7 -o s3://bucket/exports/7 \\
      --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000
  statectl restore --store s3://bucket/state --metadata postgresql+psycopg://host/db \\
      --checkpoint 7 -o out --dry-run
  statectl savepoint --store demo-data                (the latest checkpoint, self-contained)
  statectl gc --store demo-data                       (dry run: orphans older than a day)
  statectl gc --store demo-data --job demo --min-age-s 3600 --delete
  statectl compact --store demo-data --job demo       (on a local Spark session)
  statectl run myjobs:clicks --store data --parallelism 2   (Ctrl-C: final checkpoint)
  statectl run myjobs:clicks --store data --from-savepoint 12 \\
      --option checkpoint.barrier-mode=unaligned
"""


def _make(sub: Any, name: str, help_text: str, common: bool = True) -> Parser:
    parser: Parser = sub.add_parser(
        name,
        help=help_text,
        description=help_text,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if common:
        add_common(parser)
    return parser


def build_parser() -> Parser:
    """The argument parser (exposed for tests and docs)."""
    parser = Parser(
        prog="statectl",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (checkpoints, state, maintain, compact, run):
        module.register(sub, _make)
    return parser


_LOCAL_IO = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.ENOTDIR,
        errno.EISDIR,
    }
)


def _exit_code(exc: BaseException) -> int:
    cause = exc.__cause__
    if isinstance(exc, StorageError) and isinstance(cause, OSError) and cause.errno in _LOCAL_IO:
        return EXIT_IO  # a local target (export -o DIR) that cannot be written
    if isinstance(exc, CheckpointNotFoundError | StorageNotFoundError | MetadataNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, CorruptionError | SchemaMismatchError):
        return EXIT_CORRUPT
    if isinstance(exc, ConfigError | CompactionSupersededError):
        return EXIT_REFUSED
    if isinstance(exc, StateBackendError):
        return EXIT_FAIL
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, OSError):
        return EXIT_IO
    return EXIT_FAIL


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``statectl`` console script."""
    out = Output()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0) if isinstance(exc.code, int | None) else EXIT_USAGE
    ctx: Context | None = None
    try:
        ctx = Context(args, out)
        return int(args.func(ctx))
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAIL
    except KeyboardInterrupt:
        out.error("statectl: interrupted")
        return 130
    except Exception as exc:
        code = _exit_code(exc)
        text = one_line(exc)
        if not isinstance(exc, StateBackendError):
            text = f"{type(exc).__name__}: {text}" if code == EXIT_FAIL else text
        if code == EXIT_FAIL and not isinstance(exc, StateBackendError):
            text = f"unexpected error: {text}"
        out.error(f"statectl: error: {text}")
        if os.environ.get("STATECTL_DEBUG") and code == EXIT_FAIL:
            out.error(traceback.format_exc())
        return code
    finally:
        if ctx is not None:
            ctx.close()


__all__ = [
    "EXIT_CORRUPT",
    "EXIT_FAIL",
    "EXIT_IO",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "build_parser",
    "main",
]
