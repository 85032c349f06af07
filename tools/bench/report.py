"""``python -m tools.bench report [FILE...]``: saved results as Markdown and PNG plots.

Reads result files as ``run --json`` writes them (one result, or a list of them) and keeps,
per benchmark, the newest result among all the files (by ``started_at``): so
``report bench-results/*.json`` shows the latest run of every benchmark, whichever file
holds it. Writes into ``--out`` (default ``docs/bench``):

- ``README.md``: a header with the dates of the runs and the machine (cores, RAM, CPU
  model, Python version, platform), the table of headlines (one line per headline field
  of every benchmark, with its target and whether this run met it), then one section per
  benchmark: ours against the peer or baseline of the same run with ratios (when its
  cases name a ``system``), its summary fields, its plot, and the full table of its cases;
- ``<benchmark>.png``: a plot of the benchmark's cases, for those that have one.

With ``--readme PATH`` (default ``README.md``) the block between the lines
:data:`BEGIN` and :data:`END` in that file is replaced with the table of headlines, its
date and machine, and a link to the full report; a file without the markers is left
alone. Plots need matplotlib (the ``bench`` extra); without it the Markdown is still
written, and says that the plots are missing.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tools.bench.harness import META_FIELDS

BEGIN = "<!-- bench:begin (python -m tools.bench report) -->"
END = "<!-- bench:end -->"


@dataclass(frozen=True, slots=True)
class Headline:
    """A headline field of a benchmark: what it means and its target (``op`` one of
    ``<=``, ``>=``, or empty for none)."""

    field: str
    label: str
    op: str = ""
    target: float = 0.0

    def verdict(self, value: Any) -> str:
        """``met`` or ``missed`` against the target; empty without a target or value."""
        if not self.op or not isinstance(value, int | float) or isinstance(value, bool):
            return ""
        ok = value <= self.target if self.op == "<=" else value >= self.target
        return "met" if ok else "missed"


# The headline fields of each benchmark, in the order shown (fields a result lacks are
# skipped; every other summary field still appears in the benchmark's own section).
HEADLINES: dict[str, list[Headline]] = {
    "end-to-end": [
        Headline("records_per_s_heap", "records/s, heap store"),
        Headline("records_per_s_rocksdb", "records/s, RocksDB store"),
        Headline("records_per_s_peer", "records/s, peer"),
        Headline("ratio_records_per_s_rocksdb_vs_peer", "records/s RocksDB / peer", ">=", 0.8),
        Headline("restore_s_heap", "restore after SIGKILL, heap (s)"),
        Headline("restore_s_rocksdb", "restore after SIGKILL, RocksDB (s)"),
        Headline("restore_s_peer", "restore after SIGKILL, peer (s)"),
        Headline("ratio_restore_s_heap_vs_peer", "restore heap / peer", "<=", 0.2),
        Headline("ratio_restore_s_rocksdb_vs_peer", "restore RocksDB / peer", "<=", 0.2),
        Headline("replay_changes_per_s", "log replay at restore (changes/s)", ">=", 2e6),
        Headline("materialization_s_max_heap", "heap materialization, max (s)", "<=", 2.0),
        Headline(
            "materialization_throughput_ratio_heap",
            "records/s during / outside a materialization",
            ">=",
            0.9,
        ),
        Headline(
            "materialization_whole_run_ratio_heap",
            "records/s with heap materialization / log only (whole run, both orders)",
            ">=",
            0.9,
        ),
        Headline("space_amplification", "full checkpoint / live state, uniform keys", "<=", 1.5),
        Headline(
            "space_amplification_hot",
            "full checkpoint / live state, hot keys (labelled)",
            "<=",
            1.5,
        ),
        Headline("own_checkpoint_p99_ms", "our own part of a checkpoint, p99 (ms)", "<=", 20),
        Headline("own_checkpoint_max_ms", "our own part of a checkpoint, max (ms)"),
        Headline("materialization_sync_max_ms_rocksdb", "RocksDB materialization sync, max (ms)"),
    ],
    "peers": [
        Headline("ratio_records_per_s_heap", "records/s heap / peer"),
        Headline("ratio_records_per_s_rocksdb", "records/s RocksDB / peer", ">=", 0.8),
        Headline("ratio_restore_s_heap", "restore heap / peer", "<=", 0.2),
        Headline("ratio_restore_s_rocksdb", "restore RocksDB / peer", "<=", 0.2),
    ],
    "materialization": [
        # the target is issue 16's for 1M keys, the largest state of a full run
        Headline(
            "materialization_ms", "heap materialization at 10 S, uniform keys (ms)", "<=", 2000
        ),
        Headline(
            "materialization_ms_hot", "heap materialization at 10 S, hot keys (ms)", "<=", 2000
        ),
        Headline("new_bytes_ratio_10x_state", "heap new bytes at 10 S / at S, uniform keys"),
        Headline("materialization_ms_rocksdb", "RocksDB materialization at 10 S, uniform (ms)"),
        Headline("new_bytes_ratio_10x_state_rocksdb", "RocksDB new bytes at 10 S / at S, uniform"),
        Headline("new_bytes_ratio_10x_state_hot", "heap new bytes at 10 S / at S, hot keys"),
        Headline("space_amplification", "heap full checkpoint / live state", "<=", 1.5),
        Headline("space_amplification_rocksdb", "RocksDB full checkpoint / live state", "<=", 1.5),
    ],
    "checkpoint": [
        Headline("changelog_p99_ms_largest", "checkpoint p99 at the largest state (ms)"),
        Headline("changelog_duration_ratio_largest", "checkpoint p50, largest / smallest state"),
        Headline("changelog_bytes_ratio_largest", "bytes per checkpoint, largest / smallest"),
        Headline("snapshot_bytes_ratio_largest", "the same, changelog off (snapshots)"),
    ],
    "dstl": [
        Headline("files_per_checkpoint_at_16_writers.local", "files per checkpoint, 16 writers"),
        Headline("files_per_checkpoint_at_16_writers.s3", "the same on S3"),
    ],
    "pipeline": [
        Headline(
            "checkpoint_p99_ms_debloated", "checkpoint p99 under backpressure, debloated (ms)"
        ),
        Headline("checkpoint_p99_ms_unaligned", "the same, unaligned (ms)"),
        Headline("checkpoint_p99_ms_aligned", "the same, aligned, no debloating (ms)"),
    ],
    "spark-pipeline": [
        Headline("records_per_s", "records/s on Spark, our state"),
        Headline("spark_records_per_s", "records/s on Spark, Spark's RocksDB state store"),
        Headline("restore_s", "restore on Spark, our state (s)"),
        Headline("spark_restore_s", "restore on Spark, Spark's state store (s)"),
    ],
    "compaction": [
        Headline("offline_cp_p99_ratio", "checkpoint p99, offline / online compaction"),
        Headline("offline_cpu_ratio", "worker CPU, offline / online compaction"),
    ],
    "state-ops": [
        Headline("changelog_overhead_ratio", "per-record time, changelog on / off", "<=", 1.15),
        Headline("operator_overhead_ratio", "keyed function time, changelog on / off"),
        Headline("batch_updates_per_s_heap", "batch updates/s, heap", ">=", 1e6),
        Headline("changelog_bytes_per_change", "uploaded bytes per change"),
    ],
}


# -- reading ----------------------------------------------------------------------------
def load(paths: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """The newest result of each benchmark among ``paths`` with the file it came from,
    ordered by benchmark name."""
    newest: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        for result in data if isinstance(data, list) else [data]:
            name = result["benchmark"]
            if name not in newest or result["started_at"] >= newest[name][1]["started_at"]:
                newest[name] = (path, result)
    return [newest[n] for n in sorted(newest)]


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The summary fields of a result (nested objects flattened as ``field.key``)."""
    out: dict[str, Any] = {}
    for key, value in result.items():
        if key in META_FIELDS:
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{key}.{k}"] = v
        else:
            out[key] = value
    return out


# -- formatting -------------------------------------------------------------------------
def cell(value: Any) -> str:
    """A value as a table cell: thousands separated, 3 significant decimals below 100."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.2f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def describe_machine(results: Sequence[dict[str, Any]]) -> str:
    """The machine(s) the results were measured on, one phrase each.

    Results of the same cores, Python and platform are one machine, described by the
    fields any of them recorded (older results lack RAM and the CPU model).
    """
    machines: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in results:
        m = r.get("machine", {})
        known = machines.setdefault((m.get("cpus"), m.get("python"), m.get("platform")), {})
        known.update({k: v for k, v in m.items() if v is not None})
    phrases = []
    for m in machines.values():
        ram = m.get("ram_bytes")
        phrases.append(
            ", ".join(
                [
                    f"{m.get('cpus', '?')} cores",
                    f"{ram / 2**30:.0f} GiB RAM" if ram else "RAM not recorded",
                    m.get("cpu_model", "CPU model not recorded"),
                    f"Python {m.get('python', '?')}",
                    m.get("platform", "?"),
                ]
            )
        )
    return "; ".join(phrases)


def describe_dates(results: Sequence[dict[str, Any]]) -> str:
    """When the results were measured: one date, or the first and the last."""
    stamps = sorted(r["started_at"] for r in results)
    first, last = _utc(stamps[0]), _utc(stamps[-1])
    return first if first == last else f"{first} to {last}"


def headline_rows(results: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """One row per headline field present: benchmark, label, value, target, verdict."""
    rows: list[list[Any]] = []
    for r in results:
        fields = summary(r)
        mode = "quick" if r.get("quick") else "full"
        for h in HEADLINES.get(r["benchmark"], []):
            if h.field not in fields:
                continue
            value = fields[h.field]
            target = f"{h.op} {cell(h.target)}" if h.op else ""
            rows.append([f"{r['benchmark']} ({mode})", h.label, value, target, h.verdict(value)])
    return rows


def _label(case: dict[str, Any], keys: Sequence[str]) -> str:
    return " ".join(str(case[k]) for k in keys if case.get(k) not in (None, ""))


def comparison(result: dict[str, Any]) -> str:
    """Ours against the peer (cases with another ``system``) on every shared numeric
    column, with ratios ours / peer; empty when the result has no peer case.

    Ours are the cases at the peer's settings (keys, pattern, changelog, where the peer
    names them).
    """
    cases = result.get("cases", [])
    peers = [c for c in cases if c.get("system") not in (None, "ours")]
    if not peers:
        return ""
    peer = peers[0]
    same = [k for k in ("keys", "pattern", "changelog") if k in peer]
    ours = [
        c
        for c in cases
        if c.get("system") == "ours" and all(c.get(k) == peer[k] for k in same if k in c)
    ]
    if not ours:
        return ""
    columns = result.get("columns", [])
    name_keys = [k for k in ("store", "state", "changelog", "pattern") if k in columns]
    varying = [k for k in name_keys if len({str(c.get(k)) for c in ours}) > 1] or name_keys[:1]
    metrics = [
        k
        for k in columns
        if any(isinstance(c.get(k), int | float) for c in ours)
        and isinstance(peer.get(k), int | float)
        and k not in ("keys",)
    ]
    peer_name = str(peer.get("peer_label") or peer.get("system"))
    header = ["metric", *(_label(c, varying) for c in ours), peer_name]
    header += [f"{_label(c, varying)} / peer" for c in ours]
    rows = []
    for k in metrics:
        p = peer[k]
        values = [c.get(k) for c in ours]
        ratios = [round(v / p, 3) if isinstance(v, int | float) and p else None for v in values]
        rows.append([k, *values, p, *ratios])
    at = ", ".join(f"{k} {cell(peer[k])}" for k in same)
    return f"Ours against {peer_name} in the same run ({at}):\n\n" + table(header, rows)


# -- plots ------------------------------------------------------------------------------
def _bars(
    ax: Any,
    labels: list[str],
    values: list[float],
    title: str,
    peer: Sequence[bool] = (),
) -> None:
    """Horizontal bars, the peer's (``peer[i]`` true) in another colour."""
    colors = ["#d08040" if i < len(peer) and peer[i] else "#4878a8" for i in range(len(values))]
    ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    if not ax.yaxis_inverted():  # the first case on top (once: the axes may be shared)
        ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    for i, v in enumerate(values):
        ax.text(v, i, f" {cell(v)}", va="center", fontsize=6)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def _count(n: Any) -> str:
    """1000000 -> 1M, 100000 -> 100k."""
    if not isinstance(n, int):
        return ""
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _plot_system(fig: Any, result: dict[str, Any]) -> bool:
    """end-to-end, peers: records/s and restore seconds per case, the peer's in orange."""
    cases = result.get("cases", [])

    def label(c: dict[str, Any]) -> str:
        changelog = f"log {c['changelog']}" if c.get("changelog") else ""
        keys = f"{_count(c.get('keys'))} keys" if c.get("keys") else ""
        parts = [c.get("system", ""), c.get("store", ""), changelog, c.get("pattern", ""), keys]
        return " ".join(str(p) for p in parts if p)

    labels = [label(c) for c in cases]
    peer = [c.get("system") not in (None, "ours") for c in cases]
    axes = fig.subplots(1, 2, sharey=True)
    _bars(axes[0], labels, [_num(c.get("records_per_s")) for c in cases], "records/s", peer)
    _bars(
        axes[1], labels, [_num(c.get("restore_s")) for c in cases], "restore after kill (s)", peer
    )
    return bool(cases)


def _plot_series(
    fig: Any, result: dict[str, Any], group: Sequence[str], x: str, ys: Sequence[str]
) -> bool:
    """One line per ``group`` value of ``y`` against ``x``, one panel per ``y``."""
    cases = result.get("cases", [])
    axes = fig.subplots(1, len(ys))
    for ax, y in zip(axes, ys, strict=True):
        series: dict[str, list[tuple[float, float]]] = {}
        for c in cases:
            if isinstance(c.get(y), int | float):
                series.setdefault(_label(c, group), []).append((_num(c.get(x)), _num(c[y])))
        for name, points in series.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel(x, fontsize=8)
        ax.set_title(y, fontsize=9)
        ax.tick_params(labelsize=7)
        if series:
            ax.legend(fontsize=6)
    return bool(cases)


def _plot_bars(fig: Any, result: dict[str, Any], name: Sequence[str], ys: Sequence[str]) -> bool:
    """One panel of bars per ``y``, one bar per case, named by its ``name`` columns."""
    cases = result.get("cases", [])
    labels = [_label(c, name) for c in cases]
    axes = fig.subplots(1, len(ys), sharey=True)
    for ax, y in zip(axes, ys, strict=True):
        _bars(ax, labels, [_num(c.get(y)) for c in cases], y)
    return bool(cases)


def _plot_state_ops(fig: Any, result: dict[str, Any]) -> bool:
    cases = result.get("cases", [])
    on = [c for c in cases if c.get("changelog") == "on"]
    labels = [_label(c, ("store", "state", "api")) for c in on]
    axes = fig.subplots(1, 2)
    off = {_label(c, ("store", "state", "api")): c for c in cases if c.get("changelog") == "off"}
    _bars(
        axes[0],
        labels,
        [_num(off[n].get("updates_per_s")) if n in off else 0.0 for n in labels],
        "updates/s, changelog off",
    )
    _bars(axes[1], labels, [_num(c.get("overhead")) for c in on], "time on / off (overhead)")
    axes[1].axvline(1.0, color="grey", linewidth=0.5)
    return bool(on)


PLOTS: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "end-to-end": _plot_system,
    "peers": _plot_system,
    "checkpoint": lambda fig, r: _plot_series(
        fig, r, ("mode",), "keys", ("p50_ms", "p99_ms", "bytes_per_checkpoint")
    ),
    "materialization": lambda fig, r: _plot_series(
        fig, r, ("store", "pattern"), "keys", ("mat_ms", "bytes_new")
    ),
    "dstl": lambda fig, r: _plot_series(
        fig, r, ("storage",), "writers", ("persist_p50_ms", "files_per_checkpoint")
    ),
    "state-ops": _plot_state_ops,
    "pipeline": lambda fig, r: _plot_bars(fig, r, ("case",), ("cp_p99_ms", "records_per_s")),
    "spark-pipeline": lambda fig, r: _plot_bars(
        fig, r, ("system", "state"), ("records_per_s", "batch_p99_ms", "restore_s")
    ),
}
"""How each benchmark is drawn: fills the figure, False if there was nothing to draw."""


def plot(result: dict[str, Any], path: str) -> bool:
    """Draw ``result`` into the PNG ``path``; False if its benchmark has no plot.

    Raises ImportError without matplotlib.
    """
    draw = PLOTS.get(result["benchmark"])
    if draw is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    if not draw(fig, result):
        return False
    mode = "quick" if result.get("quick") else "full"
    fig.suptitle(f"{result['benchmark']} ({mode}, {_utc(result['started_at'])})", fontsize=10)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    return True


# -- the report -------------------------------------------------------------------------
def section(result: dict[str, Any], image: str | None) -> str:
    """The Markdown section of one benchmark."""
    name = result["benchmark"]
    mode = "quick" if result.get("quick") else "full"
    parts = [
        f"## {name}",
        f"{mode} run, {_utc(result['started_at'])}, {cell(result.get('duration_s'))} s "
        f"(`python -m tools.bench run {name}{' --quick' if result.get('quick') else ''}`)",
    ]
    versus = comparison(result)
    if versus:
        parts.append(versus)
    fields = summary(result)
    nested = {k: rows for k, v in fields.items() if (rows := _rows_of(v))}
    plain = [(k, v) for k, v in fields.items() if k not in nested]
    if plain:
        parts.append(table(["field", "value"], plain))
    for key, rows in nested.items():  # a table each: one Markdown cell of dicts was unreadable
        columns = list(dict.fromkeys(c for row in rows for c in row))
        parts.append(f"`{key}`\n\n" + table(columns, ([r.get(c) for c in columns] for r in rows)))
    if image:
        parts.append(f"![{name}]({image})")
    columns = result.get("columns") or sorted({k for c in result.get("cases", []) for k in c})
    cases = result.get("cases", [])
    if cases:
        parts.append(
            "<details><summary>every case</summary>\n\n"
            + table(columns, ([c.get(k) for k in columns] for c in cases))
            + "\n\n</details>"
        )
    again = result.get("repeated_cases", [])
    if again:  # run once more at the end, for a headline that sums both runs
        parts.append(
            "<details><summary>cases run again at the end</summary>\n\n"
            + table(columns, ([c.get(k) for k in columns] for c in again))
            + "\n\n</details>"
        )
    return "\n\n".join(parts)


def _rows_of(value: Any) -> list[dict[str, Any]]:
    """A summary value as the rows of a table of its own, or [] for a value that fits a
    cell: a list of flat dicts (a row each), or a dict of flat dicts (a row each, its key
    first, as ``name``)."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        rows = value
    elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        rows = [{"name": k, **v} for k, v in value.items()]
    else:
        return []
    flat = all(not isinstance(x, dict | list) for r in rows for x in r.values())
    return rows if flat else []


def headline_block(results: Sequence[dict[str, Any]], link: str) -> str:
    """The table of headlines with its date and machine, and a link to the full report."""
    return "\n\n".join(
        [
            f"Latest results ({describe_dates(results)}; {describe_machine(results)}); "
            f"every table and plot: [{link}]({link}).",
            table(["benchmark", "headline", "value", "target", "met?"], headline_rows(results)),
        ]
    )


def write(results: Sequence[dict[str, Any]], out: str, sources: Sequence[str]) -> str:
    """Write ``out``/README.md and the plots; returns the README's path.

    ``sources``: the files the results came from.
    """
    os.makedirs(out, exist_ok=True)
    sections = []
    missing_plots = ""
    for r in results:
        name = f"{r['benchmark']}.png"
        image: str | None = name
        try:
            if not plot(r, os.path.join(out, name)):
                image = None
        except ImportError:
            image, missing_plots = None, "\n\nPlots are missing: matplotlib is not installed."
        sections.append(section(r, image))
    files = ", ".join(f"`{os.path.basename(s)}`" for s in dict.fromkeys(sources))
    head = [
        "# Benchmark results",
        f"Measured {describe_dates(results)} on {describe_machine(results)}. Generated by "
        f"`python -m tools.bench report` from {files} (the newest result of each benchmark); "
        "regenerate with `make bench-report` (see the README's Benchmarks section)."
        + missing_plots,
        table(["benchmark", "headline", "value", "target", "met?"], headline_rows(results)),
    ]
    path = os.path.join(out, "README.md")
    with open(path, "w") as fh:
        fh.write("\n\n".join(head + sections) + "\n")
    return path


def update_readme(readme: str, block: str) -> bool:
    """Replace the text between :data:`BEGIN` and :data:`END`; False if absent."""
    if not os.path.exists(readme):
        return False
    with open(readme) as fh:
        text = fh.read()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(text):
        return False
    new = pattern.sub(lambda _m: f"{BEGIN}\n{block}\n{END}", text, count=1)
    with open(readme, "w") as fh:
        fh.write(new)
    return True


def main(files: Sequence[str], out: str, readme: str | None) -> int:
    """Write the report of ``files`` into ``out`` and, if given, ``readme``'s block."""
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        print(f"bench report: no such file: {', '.join(missing)} (run a benchmark with --json)")
        return 2
    loaded = load(files)
    results = [r for _, r in loaded]
    if not results:
        print("bench report: no results in " + ", ".join(files))
        return 1
    path = write(results, out, [source for source, _ in loaded])
    print(f"bench report: {len(results)} benchmark(s) -> {path}")
    if readme:
        link = os.path.relpath(path, os.path.dirname(os.path.abspath(readme)) or ".")
        if update_readme(readme, headline_block(results, link)):
            print(f"bench report: headlines -> {readme}")
        else:
            print(f"bench report: {readme} has no {BEGIN} block; left alone")
    return 0
