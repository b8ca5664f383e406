"""`concordia bench`: run the benchmark scripts of a checkout and plot their results.

Benchmarks live in ``benchmarks/bench_<name>.py`` of the source tree (they need the tree's data and write
``benchmarks/results/<name>-<device>.json``). ``--plot`` runs the checkout's ``benchmarks/plot.py``, which draws
the figure of each results JSON that has one as a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .output import console


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run benchmarks/bench_NAME.py and plot benchmarks/results/*.json")
    p.add_argument("names", nargs="*", help="benchmarks to run (e.g. log, delta_gpu, executor, llm)")
    p.add_argument("--list", action="store_true", help="list the benchmarks of this checkout")
    p.add_argument("--plot", action="store_true", help="draw the results' figures as PNGs beside them (benchmarks/plot.py; needs matplotlib)")
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
        plot = root / "benchmarks" / "plot.py"
        if not plot.is_file():
            c.print(f"[red]error:[/] no {plot.relative_to(root)} in this checkout")
            return 2
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
        rc = subprocess.run([sys.executable, str(plot), "--root", str(root)], cwd=root, env=env).returncode
        status = status or rc
    return status

