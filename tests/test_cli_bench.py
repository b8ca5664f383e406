"""benchmarks/plot.py: a results JSON of a benchmark with a generic figure
becomes a PNG with one panel per table, rows labelled by what distinguishes them and the table's main metric on
the axis; the serve figures draw the README's results files (the lab figures: experiments/tests/test_plot_lab.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchreport: the benchmarks' results writer, not in the package

from benchreport import write_results  # noqa: E402

pytest.importorskip("matplotlib")
_spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "benchmarks" / "plot.py")
assert _spec is not None and _spec.loader is not None
plot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot)


def test_labels_and_metric_of_a_t9_table() -> None:
    rows = [{"table": "T9", "shape_mnk": "8192x8192x8192", "config": "executor", "tflops": 660.0, "vs_none": 0.9},
            {"table": "T9", "shape_mnk": "8192x8192x8192", "config": "none", "tflops": 740.0, "vs_none": 1.0}]
    assert plot.label(rows[0]) == "shape_mnk=8192x8192x8192, executor"
    assert plot.metric(rows) == "vs_none"  # the ratio, not the first number of the row
    assert plot.label({"what": "ring round trip", "p50_us": 5.5}) == "ring round trip"
    assert plot.metric([{"what": "x", "p50_us": 5.5, "p99_us": 9.0}]) == "p50_us"


def test_plot_writes_one_png_per_results_file(tmp_path: Path) -> None:
    rows = [{"table": "T7", "what": f"op {i}", "p50_us": 1.0 + i} for i in range(4)]
    rows += [{"table": "T9", "shape_mnk": "4096x4096x4096", "config": c, "vs_none": v}
             for c, v in (("none", 1.0), ("executor", 0.8))]
    path = write_results("delta_gpu", rows, notes="test", out_dir=tmp_path, tag="cpu")
    png = plot.plot(path)
    assert png is not None and png.suffix == ".png" and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(path.read_text())
    assert doc["rows"] == rows and "git_commit" in doc and "device" in doc  # stamped, rows unchanged


def test_a_results_file_without_numbers_or_a_figure_plots_nothing(tmp_path: Path) -> None:
    path = write_results("log", [{"table": "T0", "what": "nothing measured"}], out_dir=tmp_path, tag="cpu")
    assert plot.plot(path) is None
    other = write_results("guard", [{"what": "hangs", "value": 0}], out_dir=tmp_path, tag="cpu")
    assert plot.plot(other) is None  # a benchmark without a figure: its README row and JSON say it all


@pytest.mark.parametrize("name", ["serve-h200-throughput", "serve-h200-recovery"])
def test_the_readme_figures_draw_from_the_committed_results(tmp_path: Path, name: str) -> None:
    src = ROOT / "benchmarks" / "results" / f"{name}.json"
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    png = plot.plot(path)
    assert png == path.with_suffix(".png") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
