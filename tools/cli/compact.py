"""``statectl compact``: fold a checkpoint's log into new materialized tables, on Spark.

Runs :func:`tools.spark.compact.compact` on a local Spark session (``local[2]``, or
``--master``; under ``spark-submit`` the submitted one). The checkpoint and everything the
command can check are resolved before Spark starts, so a wrong store, job or id fails in
a second with one line. Spark's own output goes to a log file (``--json`` names it).
"""

from __future__ import annotations

import argparse
from typing import Any

from backends.tables import DEFAULT_PIECE_ROWS
from materializer.compaction import DEFAULT_TASK_ROWS
from tools.cli.common import Context, checkpoint_ref, resolve_checkpoint

EXIT_OK = 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cmd_compact(ctx: Context) -> int:
    """Compact the checkpoint and register the result; the job adopts it at its next
    checkpoint."""
    args = ctx.args
    cp = resolve_checkpoint(ctx.store, args.job, args.checkpoint)  # fails before Spark starts
    ctx.fileio.exists(f"jobs/{cp.job_id}")  # the store is reachable (S3: the credentials work)
    from tools.spark.compact import bytes_to_fold, compact  # pyspark: only for this command
    from tools.spark.session import get_session

    spark, spark_log = get_session(args.master, "statectl-compact")
    total = bytes_to_fold(ctx.store, cp.job_id, cp.checkpoint_id)
    progress = ctx.progress(f"compact {cp.checkpoint_id}", total)

    def on_progress(done: int, tasks: int) -> None:  # bytes in proportion to tasks done
        progress.advance(total * done // max(tasks, 1) - progress.done)

    report = compact(
        spark,
        ctx.fileio,
        ctx.store,
        cp.job_id,
        cp.checkpoint_id,
        piece_rows=args.piece_rows,
        task_rows=args.task_rows,
        on_progress=on_progress,
    )
    progress.finish()
    if args.json:
        ctx.out.json({**report.describe(), "spark_log": spark_log})
    elif report.compaction_id is None:
        ctx.out.print(
            f"checkpoint {cp.checkpoint_id} of job {cp.job_id} rests on no log: nothing to compact"
        )
    else:
        for s in report.subtasks:
            ctx.out.print(
                f"{s['operator']}/{s['subtask']}: {s['changes']} changes folded into "
                f"{s['files']} files ({s['bytes']} bytes, {s['entries']} entries)"
            )
        ctx.out.print(
            f"compacted checkpoint {cp.checkpoint_id} of job {cp.job_id} in "
            f"{report.duration_s:.1f} s ({report.tasks} Spark tasks): registered as "
            f"compaction {report.compaction_id}; the job rests on it from its next checkpoint"
        )
    return EXIT_OK


def register(sub: Any, make: Any) -> None:
    """Add ``compact``."""
    cmp = make(sub, "compact", "fold a checkpoint's log into new materialized tables, on Spark")
    cmp.add_argument(
        "--checkpoint", type=checkpoint_ref, default="latest", help="an id or 'latest' (default)"
    )
    cmp.add_argument(
        "--master", help="Spark master (default: local[2]; under spark-submit: the submitted one)"
    )
    cmp.add_argument(
        "--piece-rows",
        type=_positive,
        default=DEFAULT_PIECE_ROWS,
        help="about how many keys a table piece holds (default: %(default)s, as the job's own)",
    )
    cmp.add_argument(
        "--task-rows",
        type=_positive,
        default=DEFAULT_TASK_ROWS,
        help="about how many entries one Spark task folds (default: %(default)s)",
    )
    cmp.set_defaults(func=cmd_compact)
