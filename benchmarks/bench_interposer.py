"""The interposer on the H200: completeness against torch.profiler on a real workload, and its cost.

Runs benchmarks/interposer_workload.py in fresh processes:
- qwen3 (a random-weight Qwen3 decode of 16 tokens, a training step, a torch.compile'd MLP): once with the
  interposer, once with torch.profiler (the independent ground truth), once with both at the same time;
  coverage = sum over kernels of min(seen by interposer, seen by profiler) / launches the profiler saw;
- launch: host time per tiny torch launch with and without the interposer (the baseline: no interposer);
- load: median cuModuleLoadData of a small cubin with and without.
Writes benchmarks/results/interposer-<tag>.json.  Run: python3 benchmarks/bench_interposer.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from concordia_ft.benchreport import print_table, write_results  # noqa: E402
from concordia_ft.instrument import interposer as ip  # noqa: E402


def run(workload: str, mode: str) -> dict:
    env = ip.child_env() if mode in ("interposer", "both") else dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "interposer_workload.py"), "--workload", workload,
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
    ap.add_argument("--out-dir", default="benchmarks/results")
    ns = ap.parse_args()
    runs = {m: run("qwen3", m) for m in ("interposer", "profiler", "both")}
    rows = []
    for m, r in runs.items():
        if "error" in r:
            print(f"qwen3/{m} failed:\n{r['error']}")
    inter, prof, both = runs["interposer"], runs["profiler"], runs["both"]
    cov = coverage(inter["interposer"]["launches"], prof["profiler_kernels"]) \
        if "error" not in inter and "error" not in prof else {}
    cov_both = coverage(both["interposer"]["launches"], both["profiler_kernels"]) if "error" not in both else {}
    rows.append({"what": "qwen3 separate runs", **cov})
    rows.append({"what": "qwen3 same process", **cov_both,
                 "shared_subscriber": both.get("interposer", {}).get("shared_subscriber")})
    launch = {m: run("launch", m) for m in ("none", "interposer")}
    load = {m: run("load", m) for m in ("none", "interposer")}
    cost = {
        "us_per_launch_none": launch["none"].get("result", {}).get("us_per_launch"),
        "us_per_launch_interposer": launch["interposer"].get("result", {}).get("us_per_launch"),
        "us_per_load_none": load["none"].get("result", {}).get("us_per_load_median"),
        "us_per_load_interposer": load["interposer"].get("result", {}).get("us_per_load_median"),
    }
    for k in ("launch", "load"):
        for m, r in {"launch": launch, "load": load}[k].items():
            if "error" in r:
                print(f"{k}/{m} failed:\n{r['error']}")
    modules = inter.get("interposer", {}).get("modules", [])
    inv_summary = {**inter.get("interposer", {}).get("summary", {}),
                   "load_calls": inter.get("interposer", {}).get("load_calls"),
                   "modules_by_api": {str(a): sum(1 for m in modules if m["api"] == a)
                                      for a in sorted({str(m["api"]) for m in modules})}}
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
