"""`concordia bench --plot`: every results JSON becomes a PNG with one panel per table, rows labelled by what
distinguishes them and the table's main metric on the axis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from concordia_ft.benchreport import write_results
from concordia_ft.cli.bench import _label, _metric, plot_results

pytest.importorskip("matplotlib")


def test_labels_and_metric_of_a_t9_table() -> None:
    rows = [{"table": "T9", "shape_mnk": "8192x8192x8192", "config": "executor", "tflops": 660.0, "vs_none": 0.9},
            {"table": "T9", "shape_mnk": "8192x8192x8192", "config": "none", "tflops": 740.0, "vs_none": 1.0}]
    assert _label(rows[0]) == "shape_mnk=8192x8192x8192, executor"
    assert _metric(rows) == "vs_none"  # the ratio, not the first number of the row
    assert _label({"what": "ring round trip", "p50_us": 5.5}) == "ring round trip"
    assert _metric([{"what": "x", "p50_us": 5.5, "p99_us": 9.0}]) == "p50_us"


def test_plot_writes_one_png_per_results_file(tmp_path: Path) -> None:
    rows = [{"table": "T7", "what": f"op {i}", "p50_us": 1.0 + i} for i in range(4)]
    rows += [{"table": "T9", "shape_mnk": "4096x4096x4096", "config": c, "vs_none": v}
             for c, v in (("none", 1.0), ("executor", 0.8))]
    path = write_results("demo", rows, notes="test", out_dir=tmp_path, tag="cpu")
    png = plot_results(path)
    assert png is not None and png.suffix == ".png" and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(path.read_text())
    assert doc["rows"] == rows and "git_commit" in doc and "device" in doc  # stamped, rows unchanged


def test_a_results_file_without_numbers_plots_nothing(tmp_path: Path) -> None:
    path = write_results("empty", [{"table": "T0", "what": "nothing measured"}], out_dir=tmp_path, tag="cpu")
    assert plot_results(path) is None
