"""Plot the serving engine's results: the cost of an epoch every step against no log (bench_serve.py
--only throughput) and a restart's time to every stream's next token against re-prefill (--only recovery).

    python benchmarks/plot_serve.py benchmarks/results/serve_epochs-h200-s12-new64.json \
        benchmarks/results/serve_restore-h200-s13b.json [--out benchmarks/results/serve-h200-s13.png]

Left: whole-run and decode-step cost per concurrency, with the 5% target. Middle: inter-token latency p50/p99
with and without epochs. Right: per model dims, the first token of every stream after a restart for each
recovery mode (medians, every round as a dot) beside re-prefill, labelled with the copy phase's GB/s and its
share of the pinned host-to-device rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from concordia_ft.benchreport import save_figure  # noqa: E402


def _rows(path: str, part: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    d = json.loads(Path(path).read_text())
    return d, [r for r in d["rows"] if r.get("part") == part]


def _throughput(ax_cost: Any, ax_itl: Any, rows: list[dict[str, Any]]) -> None:
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
    ax_cost.set_xlabel("concurrent requests")
    ax_cost.set_ylabel("cost vs no log (%)")
    ax_cost.set_title("an epoch every engine step")
    ax_cost.legend(fontsize=8)
    for m in ["none", *modes]:
        ax_itl.plot(conc, [r[f"itl_p50_ms_{m}"] for r in rows], marker="o", label=f"{m} p50")
        ax_itl.plot(conc, [r[f"itl_p99_ms_{m}"] for r in rows], marker="x", ls=":", label=f"{m} p99")
    ax_itl.set_xscale("log", base=2)
    ax_itl.set_xticks(conc, [str(c) for c in conc])
    ax_itl.set_xlabel("concurrent requests")
    ax_itl.set_ylabel("inter-token latency (ms)")
    ax_itl.set_title("per request, as tokens leave the engine")
    ax_itl.legend(fontsize=8)


def _recovery(ax: Any, rows: list[dict[str, Any]]) -> None:
    modes = [k[: -len(".first_token_all_s")] for k in rows[0] if k.endswith(".first_token_all_s")
             and ".rounds." not in k and not k.startswith("reprefill")]
    labels: list[str] = []
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
            labels.append(f"{r['dims']} {m.removeprefix('streamed_')}")
            x += 1
        t = r["reprefill_first_token_all_s"]
        ax.bar(x, t, 0.8, color="tab:gray")
        best = min(r[f"{m}.first_token_all_s"] for m in modes)
        ax.text(x, t, f"{t:.2f} s\n{t / best:.1f}x", ha="center", va="bottom", fontsize=7)
        labels.append(f"{r['dims']} re-prefill")
        x += 1.5
    ticks = []
    x = 0.0
    for _r in rows:
        for _ in range(len(modes) + 1):
            ticks.append(x)
            x += 1
        x += 0.5
    ax.set_xticks(ticks, labels, fontsize=8, rotation=35, ha="right")
    ax.axhline(1.0, color="red", ls="--", lw=1, label="target at 0.6B: <= 1 s")
    ax.set_ylabel("restart to every stream's next token (s)")
    ax.set_ylim(0, max(r["reprefill_first_token_all_s"] for r in rows) * 1.15)
    r0 = rows[0]
    ax.set_title(f"{r0['requests']} in-flight requests x {r0['tokens_each']} tokens; label: copy phase, share "
                 f"of {r0['h2d_pinned_gbps']:.1f} GB/s H2D", fontsize=9)
    ax.legend(fontsize=8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("throughput", help="a bench_serve.py results JSON with throughput rows")
    ap.add_argument("recovery", help="a bench_serve.py results JSON with recovery rows")
    ap.add_argument("--out", default=None, help="the PNG (default: beside the recovery JSON, .png)")
    a = ap.parse_args()
    dt, thr = _rows(a.throughput, "throughput")
    dr, rec = _rows(a.recovery, "recovery")
    if not thr or not rec:
        print(f"no {'throughput' if not thr else 'recovery'} rows in "
              f"{a.throughput if not thr else a.recovery}", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.2), gridspec_kw={"width_ratios": [1.1, 1, 1.6]})
    _throughput(axes[0], axes[1], thr)
    _recovery(axes[2], rec)
    out = Path(a.out) if a.out else Path(a.recovery).with_suffix(".png")
    out = save_figure(fig, dr, out, title=f"concordia serve (throughput: {Path(a.throughput).name}, "
                      f"{dt['date'][:10]}, commit {dt['git_commit'][:10]}; recovery: {Path(a.recovery).name})")
    plt.close(fig)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
