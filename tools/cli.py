"""``statectl``: inspect checkpoints, restore state, make savepoints, sweep orphans.

Exit codes: 0 success, 1 unexpected failure, 2 usage error, 3 not found (store, metadata,
checkpoint, file), 4 corrupt data, 5 refused (target exists, bad option value).
Errors print one line to stderr: ``statectl: error: <what and where>``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import backends.handles  # noqa: F401 - registers the handle types stored in checkpoints
import coordinator.sink  # noqa: F401 - registers the sink transaction handle
from coordinator import gc as gc_mod
from coordinator.metadata import MetadataStore
from coordinator.savepoint import savepoint_from_checkpoint
from dstl.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptionError,
    MetadataNotFoundError,
    SchemaMismatchError,
    StateBackendError,
    StorageNotFoundError,
)
from dstl.fileio import FileIO
from tools import restore as restore_mod

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CORRUPT, EXIT_REFUSED = 0, 1, 2, 3, 4, 5

EXAMPLES = """examples:
  statectl checkpoints list --store demo-data
  statectl checkpoints show 7 --store demo-data --json
  statectl restore --store demo-data --checkpoint 7 -o restored/
  statectl restore --store s3://bucket/state --metadata postgresql+psycopg://host/db --checkpoint 7 -o out --dry-run
  statectl savepoint --store demo-data                (the latest checkpoint, self-contained)
  statectl gc --store demo-data                       (dry run: list orphans older than a day)
  statectl gc --store demo-data --job demo --min-age-s 3600 --delete
"""


def _open(args: argparse.Namespace) -> tuple[FileIO, MetadataStore]:
    fileio = FileIO(args.store)
    if fileio.scheme == "file" and not os.path.isdir(fileio.root_url[len("file://") :]):
        raise StorageNotFoundError("store does not exist", args.store)
    if args.metadata:
        return fileio, MetadataStore(args.metadata, create=False)
    if fileio.scheme != "file":
        raise ConfigError(f"store {args.store} is not local: give --metadata URL")
    return fileio, MetadataStore.for_local_store(fileio.root_url[len("file://") :], create=False)


def _time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _cmd_list(args: argparse.Namespace) -> int:
    _, store = _open(args)
    cps = store.list(args.job)
    rows = [
        {
            "job": c.job_id,
            "checkpoint": c.checkpoint_id,
            "kind": c.kind,
            "completed_at": _time(c.completed_at),
            "duration_ms": c.stats.get("duration_ms"),
            "bytes_total": c.stats.get("bytes_total"),
            "bytes_new": c.stats.get("bytes_new"),
            "files": c.stats.get("files_total"),
        }
        for c in cps
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if not rows:
        print("no completed checkpoints")
        return EXIT_OK
    header = [
        "job",
        "checkpoint",
        "kind",
        "completed_at",
        "duration_ms",
        "bytes_total",
        "bytes_new",
        "files",
    ]
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in header}
    print("  ".join(h.ljust(widths[h]) for h in header))
    for r in rows:
        print("  ".join(str(r[h]).ljust(widths[h]) for h in header))
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    _, store = _open(args)
    cp = store.get(args.job, args.id)
    data: dict[str, Any] = {
        "job": cp.job_id,
        "checkpoint": cp.checkpoint_id,
        "kind": cp.kind,
        "triggered_at": _time(cp.triggered_at),
        "completed_at": _time(cp.completed_at),
        "source_offsets": cp.source_offsets,
        "stats": cp.stats,
        "subtasks": [
            {"operator": s.operator, "subtask": s.subtask, "files": s.files()} for s in cp.subtasks
        ],
    }
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    for key in ("job", "checkpoint", "kind", "triggered_at", "completed_at"):
        print(f"{key:14} {data[key]}")
    print(f"{'source offsets':14} {json.dumps(cp.source_offsets, sort_keys=True)}")
    print(
        f"{'stats':14} {json.dumps({k: v for k, v in cp.stats.items() if k != 'subtask_stats'}, sort_keys=True)}"
    )
    per_subtask = cp.stats.get("subtask_stats", {})
    for s in data["subtasks"]:
        name = f"{s['operator']}/{s['subtask']}"
        line = f"  {name}: {len(s['files'])} files"
        mat = per_subtask.get(name, {}).get("materialization")
        if mat:
            line += (
                f"; materialization {mat.get('materialization_id')}: "
                f"{mat.get('duration_ms')} ms, files new {mat.get('files_new')} / shared "
                f"{mat.get('files_shared')}, bytes new {mat.get('bytes_new')} / total "
                f"{mat.get('bytes_total')}"
            )
        print(line)
    return EXIT_OK


def _cmd_restore(args: argparse.Namespace) -> int:
    fileio, store = _open(args)
    cp = store.get(args.job, args.checkpoint)
    plan = restore_mod.plan_restore(cp, args.output)
    if args.dry_run:
        restore_mod.check_plan(plan, fileio)
        print(json.dumps(plan.describe(), indent=2) if args.json else _plan_text(plan))
        return EXIT_OK
    counts = restore_mod.execute(plan, fileio, force=args.force)
    if args.json:
        print(
            json.dumps(
                {"checkpoint": cp.checkpoint_id, "output": plan.output_dir, "rows": counts},
                indent=2,
            )
        )
    else:
        for op, states in counts.items():
            for name, n in states.items():
                print(f"{op}/{name}.parquet  {n} rows")
        print(f"restored checkpoint {cp.checkpoint_id} of job {cp.job_id} into {plan.output_dir}")
    return EXIT_OK


def _cmd_savepoint(args: argparse.Namespace) -> int:
    fileio, store = _open(args)
    if args.checkpoint is not None:
        cp = store.get(args.job, args.checkpoint)
    else:
        jobs = [args.job] if args.job else store.job_ids()
        if len(jobs) != 1:
            raise ConfigError(f"the store holds jobs {', '.join(jobs) or '(none)'}: give --job")
        latest = store.latest(jobs[0], kind="checkpoint")
        if latest is None:
            raise CheckpointNotFoundError(f"job {jobs[0]} has no completed checkpoint")
        cp = latest
    sp = savepoint_from_checkpoint(fileio, store, cp, time.time())
    files = sp.files()
    if args.json:
        print(
            json.dumps(
                {
                    "job": sp.job_id,
                    "savepoint": sp.checkpoint_id,
                    "from_checkpoint": cp.checkpoint_id,
                    "files": len(files),
                },
                indent=2,
            )
        )
    else:
        print(
            f"savepoint {sp.checkpoint_id} of job {sp.job_id} from checkpoint "
            f"{cp.checkpoint_id}: {len(files)} files copied; restore it with "
            f"--checkpoint {sp.checkpoint_id}"
        )
    return EXIT_OK


def _plan_text(plan: restore_mod.RestorePlan) -> str:
    d = plan.describe()
    lines = [f"restore job {d['job']} checkpoint {d['checkpoint']} into {d['output']}"]
    for op, info in plan.describe()["operators"].items():  # type: ignore[attr-defined]
        lines.append(f"  {op}: {info}")
    lines.append(f"  reads {len(plan.files)} files (all present)")
    return "\n".join(lines)


def _cmd_gc(args: argparse.Namespace) -> int:
    fileio, store = _open(args)
    if args.min_age_s < 0:
        raise ConfigError(f"--min-age-s must be >= 0, got {args.min_age_s}")
    jobs = [args.job] if args.job else store.job_ids()
    reports = []
    for job in jobs:
        plan = gc_mod.plan_sweep(fileio, store, job, args.min_age_s)
        deleted = gc_mod.sweep(fileio, store, plan) if args.delete else []
        reports.append({**plan.describe(), "deleted": deleted})
        if not args.json:
            verb = "deleted" if args.delete else "would delete"
            paths = deleted if args.delete else [f.path for f in plan.orphans]
            for path in paths:
                print(f"{verb} {path}")
            print(
                f"job {job}: {plan.scanned} files, {plan.referenced} referenced, "
                f"{len(plan.too_young)} younger than {args.min_age_s:g}s, "
                f"{verb} {len(paths)} orphans ({plan.orphan_bytes} bytes)"
            )
    if args.json:
        print(json.dumps({"dry_run": not args.delete, "jobs": reports}, indent=2))
    elif not args.delete:
        print("dry run: nothing deleted (use --delete)")
    return EXIT_OK


def _command(
    subparsers: Any, name: str, help_text: str, common: argparse.ArgumentParser | None = None
) -> argparse.ArgumentParser:
    """A subcommand with the shared examples epilog (and the common options if given)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        parents=[common] if common is not None else [],
        help=help_text,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--store", required=True, help="directory or URL of the durable store (file://, s3://)"
    )
    common.add_argument(
        "--metadata", help="SQLAlchemy URL of the metadata store (default: <store>/metadata.db)"
    )
    common.add_argument("--job", help="job id (needed only when several jobs share the store)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    parser = argparse.ArgumentParser(
        prog="statectl",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    cps = _command(sub, "checkpoints", "list or show completed checkpoints")
    cps_sub = cps.add_subparsers(dest="action", required=True)
    lst = _command(cps_sub, "list", "list retained checkpoints", common)
    lst.set_defaults(func=_cmd_list)
    show = _command(cps_sub, "show", "show one checkpoint", common)
    show.add_argument("id", type=int)
    show.set_defaults(func=_cmd_show)
    rst = _command(sub, "restore", "restore a checkpoint's state as Parquet tables", common)
    rst.add_argument("--checkpoint", type=int, required=True)
    rst.add_argument(
        "-o", "--output", required=True, help="target directory (one table per operator state)"
    )
    rst.add_argument("--force", action="store_true", help="replace an existing target directory")
    rst.add_argument(
        "--dry-run", action="store_true", help="print the plan and check files; write nothing"
    )
    rst.set_defaults(func=_cmd_restore)
    svp = _command(
        sub, "savepoint", "copy a retained checkpoint into a self-contained savepoint", common
    )
    svp.add_argument(
        "--checkpoint", type=int, help="the checkpoint to copy (default: the job's latest)"
    )
    svp.set_defaults(func=_cmd_savepoint)
    gc = _command(
        sub, "gc", "find (and with --delete remove) unreferenced files under a job's prefix", common
    )
    gc.add_argument("--delete", action="store_true", help="delete the orphans (default: dry run)")
    gc.add_argument(
        "--min-age-s",
        type=float,
        default=gc_mod.DEFAULT_MIN_AGE_S,
        help="only files older than this are orphans (default: %(default)g, one day)",
    )
    gc.set_defaults(func=_cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``statectl`` console script."""
    args = build_parser().parse_args(argv)
    err: StateBackendError
    try:
        return int(args.func(args))
    except (CheckpointNotFoundError, StorageNotFoundError, MetadataNotFoundError) as exc:
        code, err = EXIT_NOT_FOUND, exc
    except (CorruptionError, SchemaMismatchError) as exc:
        code, err = EXIT_CORRUPT, exc
    except ConfigError as exc:
        code, err = EXIT_REFUSED, exc
    except StateBackendError as exc:
        code, err = EXIT_FAIL, exc
    print(f"statectl: error: {one_line(err)}", file=sys.stderr)
    return code


def one_line(exc: BaseException) -> str:
    """The error as one line: drivers' multi-line messages and doc links folded away."""
    lines = [
        ln.strip()
        for ln in str(exc).splitlines()
        if ln.strip() and not ln.startswith("(Background")
    ]
    return " ".join(lines)


if __name__ == "__main__":
    sys.exit(main())
