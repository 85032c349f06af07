"""``statectl run MODULE:FUNCTION``: run a pipeline on the embedded runtime until it ends.

``FUNCTION()`` (imported from ``MODULE``, which may live in the current directory)
returns the job: a :class:`~coordinator.embedded.PipelineBuilder` (``--parallelism``
then replaces the default of every node declared without one), a built ``JobGraph``
or the old ``Pipeline`` spec. The run resumes from the job's latest completed
checkpoint when there is one, or from ``--from-checkpoint ID`` / ``--from-savepoint
ID``; a finite input ends with a final checkpoint. SIGINT or SIGTERM stops the job
cleanly: the sources stop reading, a final checkpoint commits every sink, then the
command exits 0. ``--option KEY=VALUE`` sets the runtime's documented dotted keys
(``checkpoint.interval-s=1``, ``checkpoint.barrier-mode=unaligned``, ...).

The runtime runs on this (the CLI's) thread; the signal handlers only ask it to stop.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from coordinator.embedded import EmbeddedRuntime, PipelineBuilder, RuntimeOptions
from dstl.errors import CheckpointNotFoundError, ConfigError
from tools.cli.common import Context

EXIT_OK = 0


def load_job(target: str, parallelism: int | None) -> Any:
    """The job that ``MODULE:FUNCTION`` returns (anything with ``graph()``)."""
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise ConfigError(f"expected MODULE:FUNCTION, not {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's own modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name}: {exc}") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(f"{module_name} has no function {function_name}")
    job = function()
    if isinstance(job, PipelineBuilder):
        return job.build(parallelism)
    if not callable(getattr(job, "graph", None)):
        raise ConfigError(f"{target} returned {type(job).__name__}, not a pipeline")
    if parallelism is not None:
        raise ConfigError("--parallelism needs a function that returns a PipelineBuilder")
    return job


def parse_options(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` pairs (the values parse in :meth:`RuntimeOptions.from_dict`)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option expects KEY=VALUE, not {item!r}")
        out[key] = value
    return out


@contextmanager
def stop_on_signals(runtime: EmbeddedRuntime) -> Iterator[None]:
    """SIGINT and SIGTERM ask ``runtime`` to stop cleanly while the block runs."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        runtime.stop()

    for s in previous:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _restore_point(ctx: Context, job_id: str, options: RuntimeOptions) -> int | None:
    """The checkpoint or savepoint id asked for, after checking it is one of that kind."""
    args = ctx.args
    wanted, kind = (
        (args.from_checkpoint, "checkpoint")
        if args.from_checkpoint is not None
        else (args.from_savepoint, "savepoint")
    )
    if wanted is None:
        return None
    store = options.metadata_store(create=False)
    try:
        cp = store.get(job_id, wanted)
    finally:
        store.close()
    if cp.kind != kind:
        raise CheckpointNotFoundError(f"{kind} {wanted} of job {job_id}: it is a {cp.kind}")
    return int(wanted)


def cmd_run(ctx: Context) -> int:
    """Run the job until its input ends or a signal stops it."""
    args = ctx.args
    if not ctx.store_url:
        raise ConfigError("no store given: use --store URL (or store = in --config)")
    job = load_job(args.target, args.parallelism)
    options = RuntimeOptions.from_dict(
        ctx.store_url,
        parse_options(args.option),
        metadata_url=ctx.metadata_url,
        storage_options=ctx.storage_options,
    )
    graph = job.graph()
    restore_from = _restore_point(ctx, graph.job_id, options)
    runtime = EmbeddedRuntime(graph, options)
    with stop_on_signals(runtime):
        result = runtime.run(restore=True, restore_from=restore_from)
    last = result.checkpoints[-1].checkpoint_id if result.checkpoints else None
    report = {
        "job": graph.job_id,
        "attempt": result.attempt,
        "restored_from": result.restored_from,
        "checkpoints": len(result.checkpoints),
        "last_checkpoint": last,
    }
    if args.json:
        ctx.out.json(report)
    else:
        restored = (
            f"restored from {result.restored_from}"
            if result.restored_from is not None
            else "fresh start"
        )
        ctx.out.print(
            f"job {graph.job_id} stopped cleanly (attempt {result.attempt}, {restored}): "
            f"{len(result.checkpoints)} checkpoints, last {last}"
        )
    return EXIT_OK


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def register(sub: Any, make: Any) -> None:
    """Add ``run``."""
    run = make(sub, "run", "run a pipeline (MODULE:FUNCTION) on the embedded runtime")
    run.add_argument("target", metavar="MODULE:FUNCTION", help="returns the pipeline")
    origin = run.add_mutually_exclusive_group()
    origin.add_argument("--from-checkpoint", type=_positive, metavar="ID", help="restore it")
    origin.add_argument("--from-savepoint", type=_positive, metavar="ID", help="restore it")
    run.add_argument(
        "--parallelism", type=_positive, help="default parallelism of the builder's nodes"
    )
    run.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a runtime option, repeatable (checkpoint.interval-s=1)",
    )
    run.set_defaults(func=cmd_run)
