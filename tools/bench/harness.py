"""The benchmark harness: discover, run, print a table, write JSON."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import platform
import time
from types import ModuleType
from typing import Any

import tools.bench

_NOT_BENCHMARKS = {"harness", "__main__", "report", "workload", "flink_job", "spark_processors"}


def available() -> list[str]:
    """Names of every benchmark module (with dashes)."""
    names = [
        m.name for m in pkgutil.iter_modules(tools.bench.__path__) if m.name not in _NOT_BENCHMARKS
    ]
    return sorted(n.replace("_", "-") for n in names)


def load(name: str) -> ModuleType:
    """The module of benchmark ``name``; ValueError if there is none."""
    if name not in available():
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(available())}")
    return importlib.import_module(f"tools.bench.{name.replace('-', '_')}")


def format_table(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """A plain-text table of ``rows`` restricted to ``columns``."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
        for i, c in enumerate(columns)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    """Where a result is measured: cores, RAM, CPU model, Python version, platform."""
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
    }


def run(name: str, quick: bool) -> dict[str, Any]:
    """Run one benchmark and wrap its result with run metadata."""
    module = load(name)
    started = time.time()
    result: dict[str, Any] = module.run(quick)
    return {
        "benchmark": name,
        "quick": quick,
        "started_at": started,
        "duration_s": round(time.time() - started, 3),
        "machine": machine(),
        "columns": list(module.COLUMNS),
        **result,
    }


META_FIELDS = frozenset(
    {
        "benchmark",
        "quick",
        "started_at",
        "duration_s",
        "machine",
        "columns",
        "cases",
        "repeated_cases",  # cases run twice, for a headline that sums both runs
    }
)
"""A result's fields that are not summary fields: what ran, where, and its cases."""


def print_result(result: dict[str, Any]) -> None:
    """The table of one result, then its summary fields."""
    print(
        f"== {result['benchmark']} ({'quick' if result['quick'] else 'full'}, {result['duration_s']} s)"
    )
    print(format_table(result["columns"], result.get("cases", [])))
    if result.get("repeated_cases"):
        print("-- cases run again at the end")
        print(format_table(result["columns"], result["repeated_cases"]))
    for key, value in result.items():
        if key not in META_FIELDS:
            print(f"{key}: {json.dumps(value) if not isinstance(value, str) else value}")


def live_parquet_bytes(table: Any) -> int:
    """The bench's reference size of a live state table (the denominator of every
    ``space_amp``): one compact zstd Parquet table with page checksums and Parquet's
    default encodings (dictionary, falling back to plain past 128 KiB). Fixed here, apart
    from how the stores encode their own files, so a better encoding of theirs shows as
    a smaller ratio instead of moving the reference with it."""
    import io

    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        write_page_checksum=True,
        dictionary_pagesize_limit=128 << 10,
    )
    return len(sink.getvalue())
