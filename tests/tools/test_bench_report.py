"""`python -m tools.bench report`: saved results become Markdown tables and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tools.bench import report
from tools.bench.__main__ import main

MACHINE = {
    "python": "3.11.7",
    "cpus": 2,
    "ram_bytes": 24 * 2**30,
    "cpu_model": "Test CPU 9000",
    "platform": "Linux-test",
}


def _e2e(started_at: float, heap_rate: int) -> dict[str, Any]:
    ours = {"system": "ours", "changelog": "on", "keys": 1000, "pattern": "uniform"}
    return {
        "benchmark": "end-to-end",
        "quick": True,
        "started_at": started_at,
        "duration_s": 12.5,
        "machine": MACHINE,
        "columns": [
            "system",
            "store",
            "changelog",
            "keys",
            "pattern",
            "records_per_s",
            "restore_s",
        ],
        "cases": [
            {**ours, "store": "heap", "records_per_s": heap_rate, "restore_s": 2.0},
            {**ours, "store": "rocksdb", "records_per_s": 20_000, "restore_s": 1.0},
            {**ours, "store": "heap", "pattern": "hot", "records_per_s": 1, "restore_s": 9.0},
            {
                "system": "flink",
                "peer_label": "Flink 2.3 (sql)",
                "store": "rocksdb",
                "changelog": "on",
                "keys": 1000,
                "pattern": "uniform",
                "records_per_s": 50_000,
                "restore_s": 4.0,
            },
        ],
        "records_per_s_heap": heap_rate,
        "ratio_records_per_s_rocksdb_vs_peer": 0.4,
        "restore_s_heap": 2.0,
        "ratio_restore_s_heap_vs_peer": 0.5,
        "own_checkpoint_p99_ms": 12.0,
    }


def _checkpoint() -> dict[str, Any]:
    return {
        "benchmark": "checkpoint",
        "quick": False,
        "started_at": 1_764_000_000.0,
        "duration_s": 40.0,
        # recorded before the harness kept RAM and the CPU model: the same machine
        "machine": {k: MACHINE[k] for k in ("python", "cpus", "platform")},
        "columns": ["mode", "keys", "p50_ms", "p99_ms", "bytes_per_checkpoint"],
        "cases": [
            {"mode": m, "keys": k, "p50_ms": 10.0 * f, "p99_ms": 20.0, "bytes_per_checkpoint": k}
            for m, f in (("changelog", 1), ("snapshot", 3))
            for k in (10_000, 100_000)
        ],
        "changelog_p99_ms_largest": 20.0,
        "changelog_bytes_ratio_largest": 10.0,
        "nested": {"local": 1.5},
    }


@pytest.fixture
def results(tmp_path: Path) -> list[Path]:
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_e2e(1_764_000_000.0, heap_rate=11)))
    new = tmp_path / "new.json"
    new.write_text(json.dumps([_e2e(1_764_003_600.0, heap_rate=80_000), _checkpoint()]))
    return [old, new]


def test_report_writes_tables_plots_and_the_readme_block(
    tmp_path: Path, results: list[Path]
) -> None:
    out = tmp_path / "docs"
    readme = tmp_path / "README.md"
    readme.write_text(f"# Project\n\nbefore\n\n{report.BEGIN}\nstale\n{report.END}\n\nafter\n")
    assert main(["report", *map(str, results), "--out", str(out), "--readme", str(readme)]) == 0

    text = (out / "README.md").read_text()
    # date and machine in the header
    assert "2025-11-24 16:00 UTC" in text and "2025-11-24 17:00 UTC" in text
    assert "on 2 cores, 24 GiB RAM, Test CPU 9000, Python 3.11.7, Linux-test. " in text
    # the newest end-to-end result wins over the older file's
    assert "| end-to-end (quick) | records/s, heap store | 80,000 |" in text
    assert "| 11 |" not in text
    assert "from `new.json` (the newest result" in text and "old.json" not in text
    # headline targets judged
    assert "| records/s RocksDB / peer | 0.4 | >= 0.8 | missed |" in text
    assert "| our own part of a checkpoint, p99 (ms) | 12 | <= 20 | met |" in text
    # ours against the peer with ratios, at the peer's settings (the hot case left out)
    assert "Ours against Flink 2.3 (sql)" in text
    assert "| records_per_s | 80,000 | 20,000 | 50,000 | 1.6 | 0.4 |" in text
    assert "| restore_s | 2 | 1 | 4 | 0.5 | 0.25 |" in text
    # every summary field, nested ones flattened
    assert "| nested.local | 1.5 |" in text
    assert "![end-to-end](end-to-end.png)" in text and "![checkpoint](checkpoint.png)" in text

    for name in ("end-to-end.png", "checkpoint.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        import matplotlib.image

        pixels = matplotlib.image.imread(str(out / name))
        assert pixels.shape[0] > 100 and pixels.shape[1] > 300

    block = readme.read_text()
    assert block.startswith("# Project\n\nbefore\n\n") and block.endswith("\n\nafter\n")
    assert "stale" not in block
    assert "2 cores, 24 GiB RAM" in block and "(docs/README.md)" in block
    assert "| end-to-end (quick) | restore after SIGKILL, heap (s) | 2 |" in block


def test_report_leaves_a_readme_without_markers_alone(tmp_path: Path, results: list[Path]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# no block here\n")
    out = tmp_path / "docs"
    assert main(["report", str(results[1]), "--out", str(out), "--readme", str(readme)]) == 0
    assert readme.read_text() == "# no block here\n"
    assert (out / "README.md").exists()


def test_cells() -> None:
    assert report.cell(1234567) == "1,234,567"
    assert report.cell(1234.5) == "1,234"
    assert report.cell(12.3456) == "12.35"
    assert report.cell(0.012345) == "0.0123"
    assert report.cell(None) == "-"
    assert report.cell("a|b") == "a\\|b"


def test_report_of_a_missing_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "none.json"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def test_cases_run_again_get_a_table_of_their_own_not_a_summary_row() -> None:
    result = _e2e(1_764_000_000.0, heap_rate=80_000)
    ours = {"system": "ours", "store": "heap", "changelog": "on", "keys": 1000}
    result["repeated_cases"] = [
        {**ours, "pattern": "long-log", "records_per_s": 71_234, "restore_s": 3.0},
        {**ours, "pattern": "uniform", "records_per_s": 69_876, "restore_s": 2.0},
    ]
    text = report.section(result, None)
    summary, again = text.split("cases run again at the end")
    assert "repeated_cases" not in summary and "71,234" not in summary
    assert "| ours | heap | on | 1,000 | long-log | 71,234 | 3 |" in again
    assert "| ours | heap | on | 1,000 | uniform | 69,876 | 2 |" in again


def test_lists_and_dicts_of_dicts_get_a_table_each_not_a_cell() -> None:
    result = _e2e(1_764_000_000.0, heap_rate=80_000)
    result["own_checkpoint_slowest"] = [
        {"case": "heap 1000000", "id": 27, "own_ms": 17.9, "encode_ms@operator": 5.5},
        {"case": "rocksdb 100000", "id": 10, "own_ms": 17.8, "write_ms@operator": 1.8},
    ]
    result["own_checkpoint_steps_ms"] = {
        "heap": {
            "operator.encode_ms": {"p50": 2.6, "p99": 7.4},
            "operator.upload_blocks": {"p50": 1, "max": 2},
        },
    }
    text = report.section(result, None)
    assert "{'case'" not in text and "{'p50'" not in text  # no dict in a cell
    assert "| case | id | own_ms | encode_ms@operator | write_ms@operator |" in text
    assert "| heap 1000000 | 27 | 17.9 | 5.5 | - |" in text
    assert "| rocksdb 100000 | 10 | 17.8 | - | 1.8 |" in text
    assert "`own_checkpoint_steps_ms.heap`" in text
    assert "| name | p50 | p99 | max |" in text
    assert "| operator.encode_ms | 2.6 | 7.4 | - |" in text
    assert "| operator.upload_blocks | 1 | - | 2 |" in text
    assert "| field | value |" in text  # the plain fields keep their table
