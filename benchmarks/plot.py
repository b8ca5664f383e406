"""Draw the figures of benchmarks/results/: one PNG beside each results JSON that has a figure worth looking at.

    python benchmarks/plot.py [--root DIR] [RESULTS.json ...]

A results file gets the figure of its benchmark (the JSON's "benchmark" field): the serving engine's epoch cost
and restart time (serve), or a bar chart per table of its main metric (the benchmarks in GENERIC). Others are
tables, not pictures: the README row and the JSON say all there is. A file that is not a results document is
reported and skipped (exit status 1); the others are still drawn. experiments/plot_lab.py draws the lab
measurements' figures (experiments/results/) with the same chart and command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# ------------------------------------------------------------------------------------------ the generic chart

_KEYS = ("case", "op", "what", "n", "path", "region_mib", "dirty_pages", "dirty_pct", "mode", "staging", "backend",
         "fsync", "shape_mnk", "config", "resident")
_BARE = ("case", "op", "what", "config", "resident")  # shown as their value alone
_METRICS = ("vs_none", "wall_ms", "p50_us", "value", "total_ms", "overhead_pct", "seconds", "delta_ms_gpu_handlers",
            "cpu_wall_ms", "dtoh_ms", "gb_s")
GENERIC = ("delta_gpu", "log")


def label(row: dict[str, Any]) -> str:
    parts = [f"{k}={row[k]}" if k not in _BARE else str(row[k]) for k in _KEYS if k in row]
    return ", ".join(parts) or "row"


def metric(rows: list[dict[str, Any]]) -> str | None:
    """The table's main number: the first of _METRICS any row has, else the first numeric field."""
    for m in _METRICS:
        if any(isinstance(r.get(m), int | float) for r in rows):
            return m
    for r in rows:
        for k, v in r.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                return k
    return None


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def generic(doc: dict[str, Any], path: Path) -> Path | None:
    """A horizontal bar chart per table (its main metric, log scale when it spans decades), baseline rows in
    grey beside the measured ones; None when no table has a number."""
    from benchreport import save_figure

    rows = [dict(r, _base=False) for r in doc.get("rows", [])] + [dict(r, _base=True) for r in doc.get("baseline", [])]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r.get("table") or r.get("section") or doc.get("benchmark", "results")), []).append(r)
    plots = [(g, rs, m) for g, rs in groups.items() if (m := metric(rs)) is not None]
    if not plots:
        return None
    plt = pyplot()
    heights = [max(1.2, 0.22 * len(rs) + 0.8) for _, rs, _ in plots]
    fig, axes = plt.subplots(len(plots), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (group, rs, m) in zip(axes[:, 0], plots, strict=True):
        rs = [r for r in rs if isinstance(r.get(m), int | float)]
        vals = [float(r[m]) for r in rs]
        ax.barh(range(len(rs)), vals, color=["tab:gray" if r["_base"] else "tab:blue" for r in rs])
        ax.set_yticks(range(len(rs)), [("baseline: " if r["_base"] else "") + label(r) for r in rs], fontsize=6)
        ax.invert_yaxis()
        pos = [v for v in vals if v > 0]
        if pos and max(pos) / min(pos) > 50:
            ax.set_xscale("log")
        ax.set_title(f"{group}: {m}", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    out = save_figure(fig, doc, path)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------------- the serving engine

def _serve_throughput(ax_cost: Any, ax_itl: Any, rows: list[dict[str, Any]]) -> None:
    modes = sorted({k[len("cost_run_"):-len("_pct")] for r in rows for k in r if k.startswith("cost_run_")})
    conc = [r["concurrent"] for r in rows]
    x = range(len(conc))
    w = 0.8 / max(1, 2 * len(modes))
    for i, m in enumerate(modes):
        ax_cost.bar([j + (2 * i) * w for j in x], [r[f"cost_run_{m}_pct"] for r in rows], w,
                    label=f"{m}: whole run")
        ax_cost.bar([j + (2 * i + 1) * w for j in x], [r[f"cost_step_{m}_pct"] for r in rows], w,
                    label=f"{m}: decode step")
    ax_cost.axhline(5.0, color="red", ls="--", lw=1, label="target at 32: <= 5%")
    ax_cost.set_xticks([j + w * (len(modes) - 0.5) for j in x], [str(c) for c in conc])
    ax_cost.set(xlabel="concurrent requests", ylabel="cost vs no log (%)", title="an epoch every engine step")
    ax_cost.legend(fontsize=8)
    for m in ["none", *modes]:
        ax_itl.plot(conc, [r[f"itl_p50_ms_{m}"] for r in rows], marker="o", label=f"{m} p50")
        ax_itl.plot(conc, [r[f"itl_p99_ms_{m}"] for r in rows], marker="x", ls=":", label=f"{m} p99")
    ax_itl.set_xscale("log", base=2)
    ax_itl.set_xticks(conc, [str(c) for c in conc])
    ax_itl.set(xlabel="concurrent requests", ylabel="inter-token latency (ms)",
               title="per request, as tokens leave the engine")
    ax_itl.legend(fontsize=8)


def _serve_recovery(ax: Any, rows: list[dict[str, Any]]) -> None:
    modes = [k[: -len(".first_token_all_s")] for k in rows[0] if k.endswith(".first_token_all_s")
             and ".rounds." not in k and not k.startswith("reprefill")]
    ticks: list[float] = []
    names: list[str] = []
    x = 0.0
    for r in rows:
        h2d = r["h2d_pinned_gbps"]
        for m in modes:
            t = r[f"{m}.first_token_all_s"]
            ax.bar(x, t, 0.8, color="tab:green")
            rounds = r.get(f"{m}.rounds.first_token_all_s", [])
            ax.scatter([x] * len(rounds), rounds, s=8, color="black", zorder=3)
            g = r.get(f"{m}.copy_gbps", 0.0)
            ax.text(x, max([t, *rounds]) + 0.05, f"{t:.2f} s\n{g:.0f} GB/s\n{100 * g / h2d:.0f}%", ha="center",
                    va="bottom", fontsize=7)
            ticks.append(x)
            names.append(f"{r['dims']} {m.removeprefix('streamed_')}")
            x += 1
        t = r["reprefill_first_token_all_s"]
        ax.bar(x, t, 0.8, color="tab:gray")
        best = min(r[f"{m}.first_token_all_s"] for m in modes)
        ax.text(x, t, f"{t:.2f} s\n{t / best:.1f}x", ha="center", va="bottom", fontsize=7)
        ticks.append(x)
        names.append(f"{r['dims']} re-prefill")
        x += 1.5
    ax.set_xticks(ticks, names, fontsize=8, rotation=35, ha="right")
    ax.axhline(1.0, color="red", ls="--", lw=1, label="target at 0.6B: <= 1 s")
    ax.set_ylabel("restart to every stream's next token (s)")
    ax.set_ylim(0, max(r["reprefill_first_token_all_s"] for r in rows) * 1.15)
    r0 = rows[0]
    ax.set_title(f"{r0['requests']} in-flight requests x {r0['tokens_each']} tokens; label: copy phase, share "
                 f"of {r0['h2d_pinned_gbps']:.1f} GB/s H2D", fontsize=9)
    ax.legend(fontsize=8)


def serve(doc: dict[str, Any], path: Path) -> Path | None:
    """bench_serve.py's parts the file holds: throughput (epoch cost per concurrency with the 5% target,
    inter-token latency with and without epochs) and recovery (per model dims, the first token of every
    stream after a restart per mode, every round a dot, beside re-prefill; labelled with the copy phase's GB/s
    and its share of the pinned host-to-device rate of the same run)."""
    from benchreport import save_figure

    thr = [r for r in doc["rows"] if r.get("part") == "throughput"]
    rec = [r for r in doc["rows"] if r.get("part") == "recovery"]
    if not thr and not rec:
        return None
    plt = pyplot()
    widths = ([1.1, 1] if thr else []) + ([1.6] if rec else [])
    fig, axes = plt.subplots(1, len(widths), figsize=(6.5 * len(widths), 5.2), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    if thr:
        _serve_throughput(axes[0, 0], axes[0, 1], thr)
    if rec:
        _serve_recovery(axes[0, -1], rec)
    out = save_figure(fig, doc, path, title="concordia serve")
    plt.close(fig)
    return out


Figure = Callable[[dict[str, Any], Path], Path | None]
FIGURES: dict[str, Figure] = {"serve": serve, **{name: generic for name in GENERIC}}


def plot(path: Path, figures: dict[str, Figure] | None = None) -> Path | None:
    """The PNG drawn for one results JSON (by ``figures``, default FIGURES), or None when its benchmark has no
    figure. ValueError, KeyError, TypeError or AttributeError: not a results document this version can draw."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise TypeError(f"a results document is a JSON object, not {type(doc).__name__}")
    draw = (FIGURES if figures is None else figures).get(str(doc.get("benchmark", "")))
    return draw(doc, path) if draw else None


def main(argv: list[str] | None = None, *, figures: dict[str, Figure] | None = None,
         results: str = "benchmarks/results", description: str = __doc__) -> int:
    ap = argparse.ArgumentParser(description=description.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help=f"results JSONs (default: every one in ROOT/{results})")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this script's)")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    files = a.files or sorted((root / results).glob("*.json"))
    status = 0
    for path in files:
        shown = path.resolve().relative_to(root) if path.resolve().is_relative_to(root) else path
        try:
            out = plot(path, figures)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"skipped {shown}: not a results file this version can plot ({type(e).__name__}: {e})")
            status = 1
            continue
        if out is not None:
            print(f"plotted {out.resolve().relative_to(root) if out.resolve().is_relative_to(root) else out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
