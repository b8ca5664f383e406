"""experiments/plot_lab.py draws the lab measurements' figures from their committed results files (pause,
qwen3_probes, sm_share), and benchmarks/plot.py, which draws the product's, leaves them alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plot_lab", REPO / "experiments" / "plot_lab.py")
assert _spec is not None and _spec.loader is not None
plot_lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_lab)


@pytest.mark.parametrize("name", ["pause-h200", "qwen3_probes-h200", "sm_share-h200"])
def test_the_lab_figures_draw_from_the_committed_results(tmp_path: Path, name: str) -> None:
    src = REPO / "experiments" / "results" / f"{name}.json"
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    png = plot_lab.plot(path)
    assert png == path.with_suffix(".png") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_lab.bench_plot.plot(path) is None  # not a figure of the product's benchmarks


def test_a_lab_results_file_without_a_figure_plots_nothing(tmp_path: Path) -> None:
    src = REPO / "experiments" / "results" / "guard-h200.json"
    path = tmp_path / src.name
    path.write_bytes(src.read_bytes())
    assert plot_lab.plot(path) is None
