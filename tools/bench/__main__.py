"""``python -m tools.bench run NAME|all [--quick] [--json OUT]`` and ``report [FILE...]``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tools.bench import harness


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a benchmark (or all)")
    run.add_argument("name", help=f"one of: all, {', '.join(harness.available())}")
    run.add_argument(
        "--quick", action="store_true", help="small sizes (a smoke run, minutes not tens)"
    )
    run.add_argument("--json", help="write the result(s) here")
    report = sub.add_parser(
        "report",
        help="saved JSON results as Markdown tables and PNG plots (newest of each benchmark)",
    )
    report.add_argument("files", nargs="*", default=["bench-results/latest.json"])
    report.add_argument("--out", default="docs/bench", help="directory of README.md and plots")
    report.add_argument(
        "--readme",
        default="README.md",
        help="replace this file's headline block (between its bench markers); '' for none",
    )
    args = parser.parse_args(argv)
    if args.command == "report":
        from tools.bench import report as bench_report

        return bench_report.main(args.files, args.out, args.readme or None)
    known = harness.available()
    if args.name != "all" and args.name not in known:
        print(
            f"bench: error: unknown benchmark {args.name!r}; known: {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    names = known if args.name == "all" else [args.name]
    results = []
    for name in names:
        result = harness.run(name, args.quick)
        harness.print_result(result)
        results.append(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(results[0] if len(results) == 1 else results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
