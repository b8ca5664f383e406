"""Plot benchmarks/results/qwen3_probes-h200.json: the compiled Qwen3 layer's time per variant (plain, probes
disarmed, armed, plain + the armed variant's memset) and, per Inductor kernel, the pause latency beside one
block's run time.  Run: python benchmarks/plot_qwen3_probes.py [results.json]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from concordia_ft.benchreport import save_figure  # noqa: E402

VARIANTS = ("compiled", "compiled_probes", "compiled_probes_armed", "compiled_plus_reset")
LABELS = ("compiled\n(baseline)", "probes\ndisarmed", "probes armed\n(+ memset)", "baseline\n+ memset")


def short(name: str) -> str:
    parts = name.split("_")
    return f"{parts[1]}..{parts[-1]}" if len(parts) > 3 else name


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/qwen3_probes-h200.json")
    doc = json.loads(src.read_text())
    rows = doc["rows"]
    timing = {r["variant"]: r for r in rows if r.get("variant") in VARIANTS}
    pauses = [r for r in rows if r.get("variant") == "pause" and r.get("trials")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    if timing:
        base = timing["compiled"]["layer_ms"]
        ms = [timing[v]["layer_ms"] * 1e3 if v in timing else 0.0 for v in VARIANTS]
        bars = axes[0].bar(range(len(ms)), ms, color=["grey", "tab:blue", "tab:red", "silver"])
        for b, v in zip(bars, VARIANTS, strict=True):
            if v in timing:
                pct = 100 * (timing[v]["layer_ms"] / base - 1)
                axes[0].annotate(f"{pct:+.1f}%\n{timing[v]['tokens_per_s'] / 1e6:.2f} M tok/s",
                                 (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                                 fontsize=8)
        axes[0].set_xticks(range(len(ms)), LABELS, fontsize=8)
        axes[0].set(title="compiled Qwen3 layer (0.6B dims, 8x512 tokens)", ylabel="us per layer call")
    if pauses:
        x = range(len(pauses))
        w = 0.27
        axes[1].bar([i - w for i in x], [r["pause_latency_us_median"] or 0 for r in pauses], w,
                    label="pause latency (GPU write -> drained)")
        axes[1].bar(list(x), [r["drain_us_median"] or 0 for r in pauses], w,
                    label="latency less the skips of blocks not started")
        axes[1].bar([i + w for i in x], [r.get("block_us_one_wave", r["block_us_from_waves"]) for r in pauses], w,
                    label="one block's run time (one full wave)")
        axes[1].set_xticks(list(x), [f"{short(r['kernel'])}\n{r['blocks']} blocks" for r in pauses], fontsize=7)
        axes[1].set(title="Inductor kernels of the layer, paused mid-grid by the GPU trigger", ylabel="us")
        axes[1].legend(fontsize=8)
    out = save_figure(fig, doc, src.with_suffix(".png"))
    plt.close(fig)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
