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
            out = plot_results(path)
            if out:
                c.print(f"plotted {out.relative_to(root)}")
    return status


def _numeric_columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k, v in r.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in cols:
                cols.append(k)
    timed = [k for k in cols if k.endswith(("_us", "_ms", "_s", "gbps", "GBps", "_x", "ratio", "tok_s"))]
    return timed or cols[:4]


def plot_results(path: Path) -> Path | None:
    """One PNG per results JSON: every timed column as grouped bars per row (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    rows = list(doc.get("rows", [])) + [dict(r, case=f"baseline: {r.get('case', '')}") for r in doc.get("baseline", [])]
    if not rows:
        return None
    cols = _numeric_columns(rows)
    labels = [str(r.get("case") or r.get("name") or i) for i, r in enumerate(rows)]
    fig, axes = plt.subplots(len(cols), 1, figsize=(max(6, 0.45 * len(rows) + 3), 2.6 * len(cols)), squeeze=False)
    for ax, col in zip(axes[:, 0], cols, strict=True):
        vals = [float(r.get(col, float("nan"))) for r in rows]
        ax.bar(range(len(rows)), vals, color=["tab:gray" if lab.startswith("baseline") else "tab:blue" for lab in labels])
        ax.set_ylabel(col)
        if all(v > 0 for v in vals if v == v) and max(vals) / max(min(v for v in vals if v == v), 1e-12) > 50:
            ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    dev = doc.get("device", {})
    fig.suptitle(f"{doc.get('benchmark', path.stem)} on {dev.get('gpu', dev.get('cpu', '?'))} "
                 f"({doc.get('date', '')[:10]}, {str(doc.get('git_commit', ''))[:10]})", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
