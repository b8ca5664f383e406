"""The interposer on the H200: completeness against torch.profiler on a real workload, and its cost.

Runs experiments/interposer_workload.py in fresh processes:
- qwen3 (a random-weight Qwen3 decode of 16 tokens, a training step, a torch.compile'd MLP): once with the
  interposer, once with torch.profiler (the independent ground truth), once with both at the same time;
  coverage = sum over kernels of min(seen by interposer, seen by profiler) / launches the profiler saw;
- launch: host time per tiny torch launch with and without the interposer (the baseline: no interposer);
- load: median cuModuleLoadData of a small cubin with and without.
Writes experiments/results/interposer-<tag>.json.  Run: python3 experiments/bench_interposer.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments"))  # concordia_lab: the instrumentation and the executor
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchreport

from benchreport import median, print_table, write_results  # noqa: E402

from concordia_lab.instrument import interposer as ip  # noqa: E402


def run(workload: str, mode: str) -> dict:
    env = ip.child_env() if mode in ("interposer", "both") else dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{env.get('PYTHONPATH', '')}"
    # fresh compile caches per process: a cache hit skips Inductor's autotuning launches, and the runs compared
    # must launch the same kernels
    tmp = tempfile.mkdtemp(prefix=f"cft-{workload}-{mode}-")
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "interposer_workload.py"), "--workload", workload,
                        "--mode", mode], capture_output=True, text=True, timeout=400, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"workload": workload, "mode": mode, "error": (r.stderr or r.stdout)[-3000:]}
    return dict(json.loads(lines[-1]))


def coverage(seen: dict[str, int], truth: dict[str, int]) -> dict:
    hit = sum(min(seen.get(k, 0), v) for k, v in truth.items())
    total = sum(truth.values())
    missing = sorted(((v - seen.get(k, 0), k) for k, v in truth.items() if seen.get(k, 0) < v), reverse=True)
    extra = sorted(((v - truth.get(k, 0), k) for k, v in seen.items() if truth.get(k, 0) < v), reverse=True)
    return {"profiler_launches": total, "interposer_launches": sum(seen.values()), "matched": hit,
            "coverage": hit / total if total else float("nan"), "kernels_profiler": len(truth),
            "kernels_interposer": len(seen), "missing_top": missing[:8], "extra_top": extra[:8]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="interposer,profiler,both",
                    help="qwen3 runs: interposer and profiler (required), both (the two in one process)")
    ns = ap.parse_args()
    runs = {m: run("qwen3", m) for m in ns.modes.split(",")}
    rows = []
    for m, r in runs.items():
        if "error" in r:
            print(f"qwen3/{m} failed:\n{r['error']}")
    inter, prof = runs["interposer"], runs["profiler"]
    both = runs.get("both", {"error": "not run (--modes)"})
    cov = coverage(inter["interposer"]["launches"], prof["profiler_kernels"]) \
        if "error" not in inter and "error" not in prof else {}
    cov_both = coverage(both["interposer"]["launches"], both["profiler_kernels"]) if "error" not in both else {}
    rows.append({"what": "qwen3 separate runs", **cov})
    rows.append({"what": "qwen3 same process", **cov_both,
                 "shared_subscriber": both.get("interposer", {}).get("shared_subscriber")})
    samples: dict[str, list[float]] = {k: [] for k in ("launch_none", "launch_interposer", "load_none",
                                                       "load_interposer")}
    for _ in range(ns.repeats):  # alternate, so drift hits both sides alike
        for m in ("none", "interposer"):
            r = run("launch", m)
            if "error" in r:
                print(f"launch/{m} failed:\n{r['error']}")
            else:
                samples[f"launch_{m}"].append(r["result"]["us_per_launch"])
            r = run("load", m)
            if "error" in r:
                print(f"load/{m} failed:\n{r['error']}")
            else:
                samples[f"load_{m}"].append(r["result"]["us_per_load_median"])
    cost = {f"us_per_{k}_median": median(v) if v else None for k, v in samples.items()}
    cost["samples"] = samples
    inv_summary = {**inter.get("interposer", {}).get("summary", {}),
                   "load_calls": inter.get("interposer", {}).get("load_calls"),
                   "load_images": inter.get("interposer", {}).get("load_images")}
    path = write_results("interposer", rows, baseline=[cost], out_dir=ns.out_dir,
                         notes=json.dumps({"inventory": inv_summary, "cost": cost,
                                           "wall_s": {m: r.get("wall_s") for m, r in runs.items()}}))
    print_table("interposer completeness (ground truth: torch.profiler)", rows,
                ["what", "profiler_launches", "interposer_launches", "matched", "coverage", "kernels_profiler",
                 "kernels_interposer"])
    print(json.dumps({"cost": cost, "inventory": inv_summary}, indent=1))
    for r in rows:
        print(r["what"], "missing:", r.get("missing_top"), "extra:", r.get("extra_top"))
    print(path)
    return 0 if cov and cov.get("coverage", 0) >= 0.999 else 1


if __name__ == "__main__":
    raise SystemExit(main())
