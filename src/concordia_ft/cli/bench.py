"""`concordia bench`: run the benchmark scripts of a checkout and plot their results.

Benchmarks live in ``benchmarks/bench_<name>.py`` of the source tree (they need the tree's data and write
``benchmarks/results/<name>-<device>.json``). ``--plot`` draws every results JSON as a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .output import console


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run benchmarks/bench_NAME.py and plot benchmarks/results/*.json")
    p.add_argument("names", nargs="*", help="benchmarks to run (e.g. log, delta_gpu, executor, llm)")
    p.add_argument("--list", action="store_true", help="list the benchmarks of this checkout")
    p.add_argument("--plot", action="store_true", help="draw each results JSON as a PNG (needs matplotlib)")
    p.add_argument("--root", default=None, help="the checkout (default: found upwards from the current directory)")


def find_root(start: Path) -> Path | None:
    for d in [start, *start.parents]:
        if (d / "benchmarks").is_dir() and (d / "pyproject.toml").exists():
            return d
    return None


def run(args: argparse.Namespace) -> int:
    c = console()
    root = Path(args.root) if args.root else find_root(Path.cwd())
    if root is None:
        c.print("[red]error:[/] no benchmarks/ folder here or above; run from a Concordia-FT checkout or pass --root")
        return 2
    scripts = {p.stem.removeprefix("bench_"): p for p in sorted((root / "benchmarks").glob("bench_*.py"))}
    if args.list or (not args.names and not args.plot):
        for name, p in scripts.items():
            c.print(f"  {name:14s} {p.relative_to(root)}")
        return 0
    status = 0
    for name in args.names:
        if name not in scripts:
            c.print(f"[red]error:[/] no benchmark {name!r}; have: {', '.join(scripts)}")
            return 2
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
        rc = subprocess.run([sys.executable, str(scripts[name])], cwd=root, env=env).returncode
        status = status or rc
    if args.plot:
        for path in sorted((root / "benchmarks" / "results").glob("*.json")):
            try:
                out = plot_results(path)
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # not a results document we know
                c.print(f"[yellow]skipped[/] {path.relative_to(root)}: not a results file this version can plot "
                        f"({type(e).__name__}: {e})", soft_wrap=True)
                status = status or 1
                continue
            if out:
                c.print(f"plotted {out.relative_to(root)}")
    return status


_KEYS = ("case", "op", "what", "n", "path", "region_mib", "dirty_pages", "dirty_pct", "mode", "staging", "backend",
         "fsync", "shape_mnk", "config", "resident")
_BARE = ("case", "op", "what", "config", "resident")  # shown as their value alone
_METRICS = ("vs_none", "wall_ms", "p50_us", "value", "total_ms", "overhead_pct", "seconds", "delta_ms_gpu_handlers",
            "cpu_wall_ms", "dtoh_ms", "gb_s")


def _label(row: dict[str, Any]) -> str:
    parts = [f"{k}={row[k]}" if k not in _BARE else str(row[k]) for k in _KEYS if k in row]
    return ", ".join(parts) or "row"


def _metric(rows: list[dict[str, Any]]) -> str | None:
    for m in _METRICS:
        if any(isinstance(r.get(m), int | float) for r in rows):
            return m
    for r in rows:
        for k, v in r.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                return k
    return None


def plot_results(path: Path) -> Path | None:
    """One PNG per results JSON: a horizontal bar chart per table (its main metric, log scale when it spans
    decades), baseline rows in grey beside the measured ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    rows = [dict(r, _base=False) for r in doc.get("rows", [])] + [dict(r, _base=True) for r in doc.get("baseline", [])]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r.get("table") or r.get("section") or doc.get("benchmark", "results")), []).append(r)
    plots = [(g, rs, m) for g, rs in groups.items() if (m := _metric(rs)) is not None]
    if not plots:
        return None
    heights = [max(1.2, 0.22 * len(rs) + 0.8) for _, rs, _ in plots]
    fig, axes = plt.subplots(len(plots), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (group, rs, metric) in zip(axes[:, 0], plots, strict=True):
        rs = [r for r in rs if isinstance(r.get(metric), int | float)]
        vals = [float(r[metric]) for r in rs]
        labels = [("baseline: " if r["_base"] else "") + _label(r) for r in rs]
        ax.barh(range(len(rs)), vals, color=["tab:gray" if r["_base"] else "tab:blue" for r in rs])
        ax.set_yticks(range(len(rs)), labels, fontsize=6)
        ax.invert_yaxis()
        pos = [v for v in vals if v > 0]
        if pos and max(pos) / min(pos) > 50:
            ax.set_xscale("log")
        ax.set_title(f"{group}: {metric}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    from ..benchreport import save_figure

    out = save_figure(fig, doc, path)
    plt.close(fig)
    return out
