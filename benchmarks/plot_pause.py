"""Plot benchmarks/results/pause-h200.json: pause latency against one wave's run time, resume cost and probe
overhead, per kernel and size.  Run: python benchmarks/plot_pause.py [results.json]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from concordia_ft.benchreport import save_figure  # noqa: E402


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/pause-h200.json")
    doc = json.loads(src.read_text())
    rows = doc["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for (kernel, bp), marker in zip([("matmul", True), ("softmax", False), ("softmax", True),
                                     ("layernorm", False), ("layernorm", True)], "osxd^", strict=True):
        rs = [r for r in rows if r["kernel"] == kernel and r["barrier_probes_on"] == bp]
        if not rs:
            continue
        label = f"{kernel}{' +barrier probes' if bp and kernel != 'matmul' else ''}"
        blocks = [r["blocks"] for r in rs]
        axes[0].plot(blocks, [r["pause_latency_ms_median"] * 1e3 for r in rs], marker=marker, label=label)
        axes[0].plot(blocks, [r["wave_ms"] * 1e3 for r in rs], marker=marker, ls=":", color="grey")
        axes[1].plot(blocks, [r["resume_ms_median"] * 1e3 for r in rs], marker=marker, label=label)
        axes[1].plot(blocks, [r["empty_resume_ms"] * 1e3 for r in rs], marker=marker, ls=":", color="grey")
        axes[2].plot(blocks, [r["overhead_armed_pct"] for r in rs], marker=marker, label=label)
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
    out = save_figure(fig, doc, src, "cooperative pause/resume", fontsize=12)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
