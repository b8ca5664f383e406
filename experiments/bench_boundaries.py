"""Cost per op of the dispatch-level boundary trigger (concordia_lab.instrument.boundaries).

Eager torch.add on a small tensor (the op is not a boundary: the trigger's fixed cost per op), and a gloo
all_reduce (world size 1) that is one (the boundary callback included), each without the trigger (the
baseline a user runs) and with it; 5 alternating rounds, medians. CPU tensors here: on the H200 host the
dispatch overhead is the same Python path.  Run: python experiments/bench_boundaries.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))  # concordia_lab
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport

from benchreport import median, print_table, write_results  # noqa: E402

from concordia_lab.instrument.boundaries import BoundaryTrigger  # noqa: E402


def per_op_us(fn, n: int, mode) -> float:
    with mode:
        for _ in range(n // 10):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e6 * (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--n", type=int, default=20000)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    x = torch.randn(16)
    hits: list[str] = []
    ops = {"add (not a boundary)": lambda: torch.add(x, 1.0),
           "all_reduce (a boundary)": lambda: dist.all_reduce(x)}
    rows = []
    for name, fn in ops.items():
        n = ns.n if "add" in name else ns.n // 10
        base, trig = [], []
        for _ in range(5):
            base.append(per_op_us(fn, n, nullcontext()))
            trig.append(per_op_us(fn, n, BoundaryTrigger(hits.append)))
        rows.append({"op": name, "n": n, "baseline_us": median(base), "trigger_us": median(trig),
                     "added_us_per_op": median(trig) - median(base), "ratio": median(trig) / median(base)})
    dist.destroy_process_group()
    path = write_results("boundaries", rows, baseline=[{"op": r["op"], "baseline_us": r["baseline_us"]} for r in rows],
                         notes="baseline = the same op without the trigger; medians of 5 alternating rounds",
                         out_dir=ns.out_dir)
    print_table("dispatch-level boundary trigger, per op", rows)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
