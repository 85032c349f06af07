"""``statectl savepoint|gc``: freeze a checkpoint; sweep what no record references."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from backends import localdirs
from coordinator import gc as gc_mod
from coordinator.savepoint import savepoint_from_checkpoint
from dstl.errors import CheckpointNotFoundError
from tools.cli.common import Context, checkpoint_ref

EXIT_OK = 0


def cmd_savepoint(ctx: Context) -> int:
    """Copy a retained checkpoint (default: the job's latest) into a savepoint."""
    if ctx.args.checkpoint is not None:
        cp = ctx.checkpoint(ctx.args.checkpoint)
    else:
        job = ctx.the_job()
        latest = ctx.store.latest(job, kind="checkpoint")
        if latest is None:
            raise CheckpointNotFoundError(f"job {job} has no completed checkpoint")
        cp = latest
    sp = savepoint_from_checkpoint(ctx.fileio, ctx.store, cp, time.time())
    files = sp.files()
    if ctx.args.json:
        ctx.out.json(
            {
                "job": sp.job_id,
                "savepoint": sp.checkpoint_id,
                "from_checkpoint": cp.checkpoint_id,
                "files": len(files),
            }
        )
    else:
        ctx.out.print(
            f"savepoint {sp.checkpoint_id} of job {sp.job_id} from checkpoint "
            f"{cp.checkpoint_id}: {len(files)} files copied; restore it with "
            f"--checkpoint {sp.checkpoint_id}"
        )
    return EXIT_OK


def cmd_gc(ctx: Context) -> int:
    """The orphan sweep of every job (or ``--job``), and this machine's dead working dirs."""
    args = ctx.args
    jobs = [args.job] if args.job else ctx.store.job_ids()
    reports = []
    for job in jobs:
        plan = gc_mod.plan_sweep(ctx.fileio, ctx.store, job, args.min_age_s)
        deleted = gc_mod.sweep(ctx.fileio, ctx.store, plan) if args.delete else []
        reports.append({**plan.describe(), "deleted": deleted})
        if not args.json:
            verb = "deleted" if args.delete else "would delete"
            paths = deleted if args.delete else [f.path for f in plan.orphans]
            for path in paths:
                ctx.out.print(f"{verb} {path}")
            ctx.out.print(
                f"job {job}: {plan.scanned} files, {plan.referenced} referenced, "
                f"{len(plan.too_young)} younger than {args.min_age_s:g}s, "
                f"{verb} {len(paths)} orphans ({plan.orphan_bytes} bytes)"
            )
    local: list[str] = []
    if args.delete:  # a directory whose lock is free has no live process: never a dry run
        local = localdirs.reclaim(min_age_s=args.min_age_s)
        if args.local_dir:
            local += localdirs.reclaim(args.local_dir, min_age_s=args.min_age_s, recursive=True)
    if args.json:
        ctx.out.json({"dry_run": not args.delete, "jobs": reports, "local_dirs_deleted": local})
    else:
        for path in local:
            ctx.out.print(f"deleted local working directory {path}")
        if not args.delete:
            ctx.out.print("dry run: nothing deleted (use --delete)")
    return EXIT_OK


def _age(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def register(sub: Any, make: Any) -> None:
    """Add ``savepoint`` and ``gc``."""
    svp = make(sub, "savepoint", "copy a retained checkpoint into a self-contained savepoint")
    svp.add_argument(
        "--checkpoint", type=checkpoint_ref, help="the checkpoint to copy (default: the latest)"
    )
    svp.set_defaults(func=cmd_savepoint)
    gc = make(sub, "gc", "find (and with --delete remove) files no checkpoint references")
    gc.add_argument("--delete", action="store_true", help="delete the orphans (default: dry run)")
    gc.add_argument(
        "--min-age-s",
        type=_age,
        default=gc_mod.DEFAULT_MIN_AGE_S,
        help="only files older than this are orphans (default: %(default)g, one day)",
    )
    gc.add_argument(
        "--local-dir",
        help="also reclaim dead RocksDB working directories under this directory "
        "(a runtime's local_dir); the system temp dir is always swept with --delete",
    )
    gc.set_defaults(func=cmd_gc)
