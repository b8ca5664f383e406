"""Can the resident executor share its SM with a cuBLAS GEMM CTA instead of holding it (paper table T9)?

cuBLAS's Hopper GEMMs here are persistent: 132 CTAs of 384 threads x 168 registers (64,512 of an SM's 65,536)
with 184-208 KB of shared memory, in 2-CTA clusters. A resident block that leaves room next to such a CTA --
one warp capped at 32 registers (1,024), ~1.4 KB of shared memory -- and that runs with the SM's shared-memory
carve-out already at its maximum (a GEMM CTA cannot land on an SM configured for less, and the SM cannot be
reconfigured while a block runs on it) should cost the GEMM nothing. This probe measures isolated, synchronised
bf16 GEMMs (the case the block hurts most) with the real executor image resident in several configurations,
interleaved with rounds of nothing resident; vs_none = median over rounds of (time alone / time with it).
Each configuration also runs a ring round trip, to show the block still works.

Usage: python experiments/probe_coresident.py [--quick] [--out-dir experiments/results]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import benchreport

from bench_executor import ev_ms  # noqa: E402 - beside this script, on sys.path when it runs
from concordia_lab.executor import guard
from concordia_lab.executor import ring as R
from concordia_lab.executor.resident import ExecutorImage, ExecutorOptions, ResidentExecutor, compile_executor

SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (8192, 2048, 8192), (2048, 4864, 896))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default="experiments/results")
    args = ap.parse_args()
    torch.cuda.init()
    mats = {}
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        _ = a @ b
        mats[m, n, k] = (a, b)
    torch.cuda.synchronize()
    variants: list[tuple[str, int, int, int | None]] = [  # name, threads, max_regs (0: uncapped), carveout %
        ("256 thr", 256, 0, None),
        ("256 thr, carveout 100", 256, 0, 100),
        ("32 thr x 32 regs", 32, 32, None),
        ("32 thr x 32 regs, carveout 100", 32, 32, 100),
        ("32 thr x 24 regs, carveout 100", 32, 24, 100),
    ]
    exs: dict[str, ResidentExecutor] = {}
    info: dict[str, dict[str, Any]] = {}
    for i, (name, threads, regs, carve) in enumerate(variants):
        with guard.quiesced():
            img = ExecutorImage(50 + i, threads, compiled=compile_executor(50 + i, threads, max_regs=regs))
            if carve is not None:
                img.set_attribute(img.resident, "PREFERRED_SHARED_MEMORY_CARVEOUT", carve)
        e = ResidentExecutor(ExecutorOptions(capacity=64, threads=threads, idle_timeout_ms=60_000, lease_ms=600_000),
                             image=img, start=False)
        exs[name] = e
        info[name] = {"regs": img.attribute(img.resident, "NUM_REGS"),
                      "static_smem": img.attribute(img.resident, "SHARED_SIZE_BYTES"),
                      "local_bytes": img.attribute(img.resident, "LOCAL_SIZE_BYTES")}
    configs = ["none", *exs]
    samples: dict[tuple[str, tuple[int, int, int]], list[float]] = {}
    rtt: dict[str, list[float]] = {c: [] for c in exs}
    for _ in range(2 if args.quick else 6):
        for c in configs:
            for e in exs.values():
                e.suspend()
            live = exs.get(c)
            if live is not None:
                live.resume()
                for _ in range(50):
                    live.wait(live.submit(R.Opcode.NOP))
                t = time.perf_counter_ns()
                for _ in range(200):
                    live.wait(live.submit(R.Opcode.NOP))
                rtt[c].append((time.perf_counter_ns() - t) / 200 / 1e3)
            for shape, (a, b) in mats.items():
                samples.setdefault((c, shape), []).append(ev_ms(lambda a=a, b=b: a @ b, iters=10))
            if live is not None:
                assert live.state == R.ConsumerState.RUNNING, f"{c}: the block left ({live.state.name})"
    for e in exs.values():
        e.close()
    rows = []
    for shape in mats:
        m, n, k = shape
        for c in configs:
            ts = samples[c, shape]
            ratio = [x / y for x, y in zip(samples["none", shape], ts, strict=True)]
            row = {"table": "T9 co-residence", "shape_mnk": f"{m}x{n}x{k}", "config": c,
                   "tflops": 2 * m * n * k / benchreport.median(ts) / 1e9, "vs_none": benchreport.median(ratio)}
            if c in info:
                row.update(info[c])
                row["ring_rtt_us"] = benchreport.median(rtt[c])
            rows.append(row)
    path = benchreport.write_results(
        "coresident", rows, out_dir=args.out_dir,
        notes="isolated synchronised bf16 GEMMs (events around each, 10 per sample) with the executor image "
              "resident in each configuration, interleaved rounds; vs_none = median(time alone / time with it); "
              f"ring fast path {R.fast_path_status()}")
    print(f"wrote {path}")
    benchreport.print_table("T9: can the executor share an SM with a GEMM CTA?", rows,
                            ["shape_mnk", "config", "tflops", "vs_none", "regs", "static_smem", "local_bytes",
                             "ring_rtt_us"])


if __name__ == "__main__":
    main()
