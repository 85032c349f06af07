"""``statectl restore|export|verify``: a checkpoint's state out of the store, or checked.

All three read every file through the verified read (size and SHA-256 as recorded), never
unpickle anything, accept ``latest``, and show progress by bytes read on stderr.
"""

from __future__ import annotations

from typing import Any

from dstl.errors import CheckpointNotFoundError
from dstl.fileio import FileIO
from tools import restore as restore_mod
from tools.cli.common import Context, CountingFileIO, checkpoint_ref
from tools.verify import CORRUPT, INCONSISTENT, MISSING, Problem, verify_checkpoint

EXIT_OK, EXIT_NOT_FOUND, EXIT_CORRUPT = 0, 3, 4


def _plan_text(plan: restore_mod.RestorePlan) -> str:
    d = plan.describe()
    lines = [f"restore job {d['job']} checkpoint {d['checkpoint']} into {d['output']}"]
    for op, info in plan.describe()["operators"].items():  # type: ignore[attr-defined]
        lines.append(f"  {op}: {info}")
    lines.append(f"  reads {len(plan.files)} files, {plan.bytes_total} bytes (all present)")
    return "\n".join(lines)


def _report(
    ctx: Context, plan: restore_mod.RestorePlan, counts: dict[str, dict[str, int]], verb: str
) -> None:
    cp = plan.checkpoint
    if ctx.args.json:
        ctx.out.json(
            {
                "job": cp.job_id,
                "checkpoint": cp.checkpoint_id,
                "output": plan.output_dir,
                "rows": counts,
            }
        )
        return
    for op, states in counts.items():
        for name, n in states.items():
            ctx.out.print(f"{op}/{name}.parquet  {n} rows")
    ctx.out.print(f"{verb} checkpoint {cp.checkpoint_id} of job {cp.job_id} into {plan.output_dir}")


def cmd_restore(ctx: Context) -> int:
    """Restore into a local directory (atomically: a temp dir renamed into place)."""
    cp = ctx.checkpoint(ctx.args.checkpoint)
    plan = restore_mod.plan_restore(cp, ctx.args.output)
    if ctx.args.dry_run:
        restore_mod.check_target(ctx.fileio.root_url, ctx.args.output)
        restore_mod.check_plan(plan, ctx.fileio)
        if ctx.args.json:
            ctx.out.json(plan.describe())
        else:
            ctx.out.print(_plan_text(plan))
        return EXIT_OK
    progress = ctx.progress(f"restore {cp.checkpoint_id}", plan.bytes_total)
    counts = restore_mod.write_local(
        plan, CountingFileIO(ctx.fileio, progress.advance), force=ctx.args.force
    )
    progress.finish()
    _report(ctx, plan, counts, "restored")
    return EXIT_OK


def cmd_export(ctx: Context) -> int:
    """Export as Parquet to a local directory or an S3 prefix (marker file written last)."""
    cp = ctx.checkpoint(ctx.args.checkpoint)
    plan = restore_mod.plan_restore(cp, ctx.args.output)
    output = FileIO(ctx.args.output, ctx.storage_options)
    progress = ctx.progress(f"export {cp.checkpoint_id}", plan.bytes_total)
    counts = restore_mod.write_url(
        plan, CountingFileIO(ctx.fileio, progress.advance), output, force=ctx.args.force
    )
    progress.finish()
    _report(ctx, plan, counts, "exported")
    return EXIT_OK


def cmd_verify(ctx: Context) -> int:
    """Check every file and handle of one, the latest or all checkpoints; name each problem.

    Exit 0 when all is well, 3 when files are missing (and nothing is corrupt), 4 when
    anything is corrupt or inconsistent.
    """
    if ctx.args.checkpoint == "all":
        listed = ctx.store.list(ctx.args.job)
        if not listed:
            raise CheckpointNotFoundError("the store has no completed checkpoint")
        checkpoints = [ctx.store.get(c.job_id, c.checkpoint_id) for c in listed]
    else:
        checkpoints = [ctx.checkpoint(ctx.args.checkpoint)]
    total = sum(r.size_bytes for cp in checkpoints for r in cp.file_refs())
    progress = ctx.progress("verify", total)
    problems: list[Problem] = []
    files = 0
    for cp in checkpoints:
        problems.extend(verify_checkpoint(ctx.fileio, cp, progress.advance))
        files += len(cp.file_refs())
    progress.finish()
    kinds = {p.kind for p in problems}
    code = (
        EXIT_CORRUPT
        if kinds & {CORRUPT, INCONSISTENT}
        else EXIT_NOT_FOUND
        if MISSING in kinds
        else EXIT_OK
    )
    if ctx.args.json:
        ctx.out.json(
            {
                "checkpoints": [c.checkpoint_id for c in checkpoints],
                "files": files,
                "ok": not problems,
                "problems": [
                    {
                        "checkpoint": p.checkpoint_id,
                        "kind": p.kind,
                        "where": p.where,
                        "detail": p.detail,
                    }
                    for p in problems
                ],
            }
        )
    else:
        for p in problems:
            ctx.out.error(f"statectl: {p.line()}")
        ids = ", ".join(str(c.checkpoint_id) for c in checkpoints)
        verdict = "ok" if not problems else f"{len(problems)} problem(s)"
        ctx.out.print(f"verified checkpoint(s) {ids}: {files} files, {verdict}")
    return code


def register(sub: Any, make: Any) -> None:
    """Add ``restore``, ``export`` and ``verify``."""
    rst = make(
        sub, "restore", "restore a checkpoint's state as Parquet tables in a local directory"
    )
    rst.add_argument("--checkpoint", type=checkpoint_ref, required=True, help="an id or 'latest'")
    rst.add_argument("-o", "--output", required=True, help="target directory (one table per state)")
    rst.add_argument(
        "--force", action="store_true", help="replace a previous statectl output at the target"
    )
    rst.add_argument(
        "--dry-run", action="store_true", help="print the plan, check files, write nothing"
    )
    rst.set_defaults(func=cmd_restore)
    exp = make(sub, "export", "export a checkpoint's state as Parquet to a directory or S3 prefix")
    exp.add_argument("--checkpoint", type=checkpoint_ref, required=True, help="an id or 'latest'")
    exp.add_argument("-o", "--output", required=True, help="target URL (a path, file://, s3://)")
    exp.add_argument(
        "--force", action="store_true", help="replace a previous statectl export there"
    )
    exp.set_defaults(func=cmd_export)
    ver = make(sub, "verify", "check that a checkpoint's files exist, are intact and consistent")
    ver.add_argument(
        "--checkpoint",
        type=lambda t: "all" if t == "all" else checkpoint_ref(t),
        required=True,
        help="an id, 'latest' or 'all'",
    )
    ver.set_defaults(func=cmd_verify)
