"""``statectl checkpoints list|show``: what the metadata store holds."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from tools.cli.common import Context, checkpoint_ref

EXIT_OK = 0


def _time(ts: float) -> str:
    try:
        return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # a damaged timestamp is shown, not fatal
        return repr(ts)


def cmd_list(ctx: Context) -> int:
    """Every retained checkpoint and savepoint, oldest first."""
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
        for c in ctx.store.list(ctx.args.job)
    ]
    if ctx.args.json:
        ctx.out.json(rows)
        return EXIT_OK
    if not rows:
        ctx.out.print("no completed checkpoints")
        return EXIT_OK
    header = list(rows[0])
    widths = {h: max(len(h), *(len(str(r[h])) for r in rows)) for h in header}
    ctx.out.print("  ".join(h.ljust(widths[h]) for h in header))
    for r in rows:
        ctx.out.print("  ".join(str(r[h]).ljust(widths[h]) for h in header))
    return EXIT_OK


def cmd_show(ctx: Context) -> int:
    """One checkpoint: offsets, statistics, files per subtask."""
    cp = ctx.checkpoint(ctx.args.id)
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
    if ctx.args.json:
        ctx.out.json(data)
        return EXIT_OK
    for key in ("job", "checkpoint", "kind", "triggered_at", "completed_at"):
        ctx.out.print(f"{key:14} {data[key]}")
    ctx.out.print(
        f"{'source offsets':14} {json.dumps(cp.source_offsets, sort_keys=True, default=str)}"
    )
    summary = {k: v for k, v in cp.stats.items() if k != "subtask_stats"}
    ctx.out.print(f"{'stats':14} {json.dumps(summary, sort_keys=True, default=str)}")
    per_subtask = cp.stats.get("subtask_stats", {})
    for s in data["subtasks"]:
        name = f"{s['operator']}/{s['subtask']}"
        line = f"  {name}: {len(s['files'])} files"
        mat = (
            per_subtask.get(name, {}).get("materialization")
            if isinstance(per_subtask, dict)
            else None
        )
        if isinstance(mat, dict):
            line += (
                f"; materialization {mat.get('materialization_id')}: "
                f"{mat.get('duration_ms')} ms, files new {mat.get('files_new')} / shared "
                f"{mat.get('files_shared')}, bytes new {mat.get('bytes_new')} / total "
                f"{mat.get('bytes_total')}"
            )
        ctx.out.print(line)
    return EXIT_OK


def register(sub: Any, make: Any) -> None:
    """Add ``checkpoints list`` and ``checkpoints show`` to the parser."""
    cps = make(sub, "checkpoints", "list or show completed checkpoints", common=False)
    cps_sub = cps.add_subparsers(dest="action", required=True, parser_class=type(cps))
    lst = make(cps_sub, "list", "list retained checkpoints and savepoints")
    lst.set_defaults(func=cmd_list)
    show = make(cps_sub, "show", "show one checkpoint (an id or 'latest')")
    show.add_argument("id", type=checkpoint_ref)
    show.set_defaults(func=cmd_show)
