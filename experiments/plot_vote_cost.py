"""Plot a probe_vote_cost results file: per kernel case, each variant's extra GPU time per launch against plain
(us, median of rounds).  Run: python experiments/plot_vote_cost.py experiments/results/vote_cost-h200.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
from benchreport import save_figure  # noqa: E402


def main(path: str) -> Path:
    doc = json.loads(Path(path).read_text())
    rows = doc["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "plain"]
    by = {(r["case"], r["variant"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    width = 0.8 / len(variants)
    cmap = plt.get_cmap("tab20")
    for i, v in enumerate(variants):
        xs = [c + (i - len(variants) / 2 + 0.5) * width for c in range(len(cases))]
        ys = [by[(c, v)]["vs_plain_us"] if (c, v) in by else 0.0 for c in cases]
        ax.bar(xs, ys, width, label=v, color=cmap(i % 20))
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(cases)))
    labels = [c.replace(" (", "\n(") + f"\nplain {by[(c, 'plain')]['us_per_launch']:.2f} us" for c in cases]
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("us per launch vs plain (CUDA graph)")
    ax.legend(fontsize=7, ncol=2)
    out = save_figure(fig, doc, path, title="probe_vote_cost: the armed path taken apart")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "experiments/results/vote_cost-h200.json"))
