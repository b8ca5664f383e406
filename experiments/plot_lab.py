"""Draw the figures of experiments/results/ (the lab measurements): one PNG beside each results JSON that has one.

    python experiments/plot_lab.py [--root DIR] [RESULTS.json ...]

A results file gets the figure of its benchmark (the JSON's "benchmark" field): pause/resume latency and the
armed probes' cost (pause), the probe cost per shape and per Triton kernel (qwen3_probes), or benchmarks/plot.py's
bar chart per table of its main metric (sm_share). Others are tables, not pictures. The command line and the
handling of a file that is not a results document are benchmarks/plot.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # plot.py and benchreport
import plot as bench_plot  # noqa: E402
from benchreport import save_figure  # noqa: E402

# ------------------------------------------------------------------------------------------------ pause/resume

def pause(doc: dict[str, Any], path: Path) -> Path | None:
    """Pause latency against one wave's run time, the resume launch, and the armed probes' cost, per kernel and
    grid size."""
    rows = doc["rows"]
    plt = bench_plot.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for (kernel, bp), marker in zip([("matmul", True), ("softmax", False), ("softmax", True),
                                     ("layernorm", False), ("layernorm", True)], "osxd^", strict=True):
        rs = [r for r in rows if r["kernel"] == kernel and r["barrier_probes_on"] == bp]
        if not rs:
            continue
        name = f"{kernel}{' +barrier probes' if bp and kernel != 'matmul' else ''}"
        blocks = [r["blocks"] for r in rs]
        axes[0].plot(blocks, [r["pause_latency_ms_median"] * 1e3 for r in rs], marker=marker, label=name)
        axes[0].plot(blocks, [r["wave_ms"] * 1e3 for r in rs], marker=marker, ls=":", color="grey")
        axes[1].plot(blocks, [r["resume_ms_median"] * 1e3 for r in rs], marker=marker, label=name)
        axes[1].plot(blocks, [r["empty_resume_ms"] * 1e3 for r in rs], marker=marker, ls=":", color="grey")
        axes[2].plot(blocks, [r["overhead_armed_pct"] for r in rs], marker=marker, label=name)
    axes[0].set(title="pause: flag written -> drained (dotted: one wave)", ylabel="us")
    axes[1].set(title="resume launch (dotted: nothing left to run)", ylabel="us")
    axes[2].set(title="armed probes vs the kernel without probes", ylabel="% of plain kernel time")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("blocks in the grid")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].axhline(0, color="k", lw=0.5)
    axes[0].legend(fontsize=8)
    out = save_figure(fig, doc, path, "cooperative pause/resume", fontsize=12)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------- probes on the Qwen3 layer

_PROBE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                 "tab:olive", "tab:cyan")


def _short(kernel: str) -> str:
    parts = kernel.split("_")
    return f"{parts[1]}..{parts[-1]}" if len(parts) > 3 else kernel


def qwen3_probes(doc: dict[str, Any], path: Path) -> Path | None:
    """Left: each variant's time against the plain process per shape (plain_b/plain: a second plain process,
    the A/A control), the 2% target dashed. Right: per Triton kernel of one shape, GPU time against plain."""
    rows = [r for r in doc["rows"] if "target" in r]
    summary = next((r for r in doc["rows"] if r.get("variant") == "summary"), {})
    keys = sorted({f"{r['variant']}/{r['mode']}" for r in rows if r["variant"] != "plain"})
    colors = {k: ("black" if k.startswith("plain_b") else _PROBE_COLORS[i % len(_PROBE_COLORS)])
              for i, k in enumerate(keys)}
    plt = bench_plot.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(16, 5))
    groups = sorted({(r["target"], r["shape"], r["how"]) for r in rows})
    plain = {(r["target"], r["shape"], r["how"]): r for r in rows if r["mode"] == "plain" and r["variant"] == "plain"}
    ticks = []
    for g in groups:
        p = plain.get(g)
        tok = f"\n{p['tokens_per_s']:.3g} tok/s" if p else ""
        ticks.append(f"{g[0]} {g[1]}\n{'graph' if g[2] == 'graph' else 'host-bound'}{tok}")
    w = 0.8 / max(1, len(keys))
    for j, key in enumerate(keys):
        ys = []
        for g in groups:
            r = next((r for r in rows if (r["target"], r["shape"], r["how"]) == g
                      and f"{r['variant']}/{r['mode']}" == key), None)
            ys.append(r.get("vs_plain_pct", 0.0) if r else 0.0)
        axes[0].bar([i + (j - (len(keys) - 1) / 2) * w for i in range(len(groups))], ys, w, label=key,
                    color=colors[key])
    axes[0].set_xticks(range(len(groups)), ticks, fontsize=7)
    axes[0].axhline(2, color="red", lw=0.8, ls="--")
    axes[0].axhline(0, color="black", lw=0.6)
    axes[0].set(title=f"vs the plain process; stack = {summary.get('stack_layers')} layers",
                ylabel="% time (median of rounds)")
    axes[0].title.set_fontsize(9)
    if keys:
        axes[0].legend(fontsize=7)
    pk = [r for r in summary.get("per_kernel", []) if r.get("kernel", "").startswith("triton_")]
    if pk:
        shape = pk[0]["shape"]
        pk = [r for r in pk if r["shape"] == shape]
        for j, key in enumerate(keys):
            col = key.replace("/", "_") + "_pct"
            axes[1].bar([i + (j - (len(keys) - 1) / 2) * w for i in range(len(pk))],
                        [r.get(col, 0.0) for r in pk], w, label=key, color=colors[key])
        axes[1].set_xticks(range(len(pk)), [f"{_short(r['kernel'])}\n{r.get('blocks', '?')} blk\n"
                                             f"{r['plain_us']:.1f} us" for r in pk], fontsize=7)
        axes[1].axhline(0, color="black", lw=0.6)
        axes[1].set(title=f"Triton kernels at {shape}: GPU time vs plain (torch.profiler medians)", ylabel="%")
        axes[1].legend(fontsize=8)
    out = save_figure(fig, doc, path)
    plt.close(fig)
    return out


FIGURES: dict[str, bench_plot.Figure] = {"pause": pause, "qwen3_probes": qwen3_probes, "sm_share": bench_plot.generic}


def plot(path: Path) -> Path | None:
    """The PNG drawn for one lab results JSON, or None when its benchmark has no figure (errors: bench_plot.plot's)."""
    return bench_plot.plot(path, FIGURES)


if __name__ == "__main__":
    raise SystemExit(bench_plot.main(figures=FIGURES, results="experiments/results", description=__doc__))
