"""Plot benchmarks/results/qwen3_probes-h200.json: per shape and timing (CUDA graph / host launched), the layer
and the stack with probes disarmed and armed against the plain process (with the A/A control of two plain
processes), and per Triton kernel the GPU time change.  Run: python benchmarks/plot_qwen3_probes.py [results.json]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from concordia_ft.benchreport import save_figure  # noqa: E402

COLORS = {"probes_v3/disarmed": "lightsteelblue", "probes_v3/armed": "tab:blue",
          "probes/disarmed": "navajowhite", "probes/armed": "tab:orange",
          "probes_lazy/disarmed": "palegreen", "probes_lazy/armed": "tab:green",
          "probes_late/disarmed": "thistle", "probes_late/armed": "tab:purple", "probes/reset_only": "silver",
          "probes_v5/disarmed": "lightcoral", "probes_v5/armed": "tab:red",
          "probes_v5e/disarmed": "peachpuff", "probes_v5e/armed": "tab:brown",
          "probes_v5s/disarmed": "lightgray", "probes_v5s/armed": "tab:gray",
          "probes_v5c/disarmed": "lightcyan", "probes_v5c/armed": "tab:cyan",
          "probes_v5ce/disarmed": "khaki", "probes_v5ce/armed": "tab:olive",
          "probes_v5ces/disarmed": "lightgreen", "probes_v5ces/armed": "darkgreen",
          "probes_v5cls/disarmed": "pink", "probes_v5cls/armed": "tab:pink",
          "probes_v5n/disarmed": "wheat", "probes_v5n/armed": "goldenrod",
          "probes_v5cesx/disarmed": "lightskyblue", "probes_v5cesx/armed": "navy",
          "probes_v5cesw/disarmed": "plum", "probes_v5cesw/armed": "purple",
          "probes_v5cesh/disarmed": "moccasin", "probes_v5cesh/armed": "darkorange",
          "probes_v5ceshg/disarmed": "lightpink", "probes_v5ceshg/armed": "crimson",
          "probes_v5cesg/disarmed": "powderblue", "probes_v5cesg/armed": "teal",
          "plain_b/plain": "black"}  # the A/A control: a second plain process


def short(name: str) -> str:
    parts = name.split("_")
    return f"{parts[1]}..{parts[-1]}" if len(parts) > 3 else name


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/qwen3_probes-h200.json")
    doc = json.loads(src.read_text())
    rows = [r for r in doc["rows"] if "target" in r]
    summary = next((r for r in doc["rows"] if r.get("variant") == "summary"), {})
    fig, axes = plt.subplots(1, 2, figsize=(16, 5))
    groups = sorted({(r["target"], r["shape"], r["how"]) for r in rows})
    plain = {(r["target"], r["shape"], r["how"]): r for r in rows if r["mode"] == "plain" and r["variant"] == "plain"}
    labels = []
    for g in groups:
        p = plain.get(g)
        tok = f"\n{p['tokens_per_s']:.3g} tok/s" if p else ""
        labels.append(f"{g[0]} {g[1]}\n{'graph' if g[2] == 'graph' else 'host-bound'}{tok}")
    for ax, col, title in ((axes[0], "vs_plain_pct", "vs the plain process (plain_b/plain: two plain processes, "
                            "the A/A control)"),):
        series = [k for k in COLORS if any(f"{r['variant']}/{r['mode']}" == k and col in r for r in rows)]
        w = 0.8 / max(1, len(series))
        for j, key in enumerate(series):
            ys = []
            for g in groups:
                r = next((r for r in rows if (r["target"], r["shape"], r["how"]) == g
                          and f"{r['variant']}/{r['mode']}" == key), None)
                ys.append(r.get(col, 0.0) if r else 0.0)
            ax.bar([i + (j - (len(series) - 1) / 2) * w for i in range(len(groups))], ys, w, label=key,
                   color=COLORS[key])
        ax.set_xticks(range(len(groups)), labels, fontsize=7)
        ax.axhline(2, color="red", lw=0.8, ls="--")
        ax.axhline(0, color="black", lw=0.6)
        ax.set(title=f"{title}; stack = {summary.get('stack_layers')} layers", ylabel="% time (median of rounds)")
        if series:
            ax.legend(fontsize=7)
    axes[0].title.set_fontsize(9)
    series = [k for k in COLORS if any(f"{r['variant']}/{r['mode']}" == k for r in rows)]
    w = 0.8 / max(1, len(series))
    pk = [r for r in summary.get("per_kernel", []) if r.get("kernel", "").startswith("triton_")]
    if pk:
        shape = pk[0]["shape"]
        pk = [r for r in pk if r["shape"] == shape]
        for j, key in enumerate(series):
            col = key.replace("/", "_") + "_pct"
            axes[1].bar([i + (j - (len(series) - 1) / 2) * w for i in range(len(pk))],
                        [r.get(col, 0.0) for r in pk], w, label=key, color=COLORS[key])
        axes[1].set_xticks(range(len(pk)), [f"{short(r['kernel'])}\n{r.get('blocks', '?')} blk\n"
                                             f"{r['plain_us']:.1f} us" for r in pk], fontsize=7)
        axes[1].axhline(0, color="black", lw=0.6)
        axes[1].set(title=f"Triton kernels at {shape}: GPU time vs plain (torch.profiler medians)", ylabel="%")
        axes[1].legend(fontsize=8)
    out = save_figure(fig, doc, src.with_suffix(".png"))
    plt.close(fig)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
