"""What one resident block costs a GEMM, and whether telling cuBLAS about it wins that back (paper table T9).

The resident executor holds one SM. A GEMM whose kernel was chosen for all SMs (a persistent kernel sized to
the SM count, or clusters that need SM pairs) then waits on that SM. cuBLAS can be told to plan for fewer
SMs (PyTorch: ``torch._C._set_sm_carveout_experimental(n)``, cuBLAS's SM-count target). This script
measures, in one interleaved run, bf16 matmul throughput for several shapes under:

- none: nothing resident, no carve-out (the baseline);
- carveout N: no executor, cuBLAS told to leave N SMs;
- executor: the resident block spinning on its ring;
- executor + carveout N.

and the kernel name cuBLAS picked in each configuration (torch profiler).

Usage: python experiments/bench_sm_share.py [--quick] [--out-dir experiments/results]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
import benchreport  # noqa: E402

from bench_executor import ev_ms  # noqa: E402 - beside this script, on sys.path when it runs
from concordia_lab.executor import ring as R  # noqa: E402
from concordia_lab.executor.resident import ExecutorOptions, LaunchExecutor, ResidentExecutor  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 1024), (2048, 4864, 896), (8192, 2048, 8192)]


def kernel_name(fn: Any) -> str:
    """The longest-named CUDA kernel ``fn`` runs, with its grid, cluster and shared memory (profiler trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return "?"
    k = max(kernels, key=lambda e: len(e.get("name", "")))
    a = k.get("args", {})
    return (f"{k['name']} grid={a.get('grid')} block={a.get('block')} cluster={a.get('cluster', '?')} "
            f"smem={a.get('shared memory')} regs={a.get('registers per thread')}")


def set_carveout(n: int) -> None:
    torch._C._set_sm_carveout_experimental(n if n else None)


def duty_cycle(ex: ResidentExecutor | None, a: Any, b: Any, k: int, rounds: int) -> list[float]:
    """Rounds of: one ring round trip (a checkpoint trigger; it relaunches the block if it has exited), then
    ``k`` matmuls timed by CUDA events (the trigger itself is outside the timed window)."""
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(rounds):
        if ex is not None:
            ex.wait(ex.submit(R.Opcode.NOP))
        e0.record()
        for _ in range(k):
            a @ b
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--carveouts", default="1")
    ap.add_argument("--period-ms", type=float, default=20.0, help="matmul time between two triggers (duty cycle)")
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    carve = [int(x) for x in args.carveouts.split(",") if x]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mats = {s: (torch.randn(s[0], s[2], device="cuda", dtype=torch.bfloat16),
                torch.randn(s[2], s[1], device="cuda", dtype=torch.bfloat16)) for s in SHAPES}
    # warm every (shape, carve-out) pair with nothing resident: a first cuBLAS call loads modules
    for c in [0] + carve:
        set_carveout(c)
        for a, b in mats.values():
            (a @ b).sum().item()
    set_carveout(0)
    ex = ResidentExecutor(ExecutorOptions(capacity=64, idle_timeout_ms=60_000, lease_ms=600_000), start=False)
    configs = [("none", False, 0)] + [(f"carveout {c}", False, c) for c in carve] + [("executor", True, 0)] + \
              [(f"executor + carveout {c}", True, c) for c in carve]
    names: dict[tuple[str, str], str] = {}
    for label, resident, c in configs:
        set_carveout(c)
        if resident:
            ex.resume()
        for s, (a, b) in mats.items():
            names[(label, str(s))] = kernel_name(lambda a=a, b=b: a @ b)
        ex.suspend()
    set_carveout(0)
    samples: dict[tuple[str, tuple[int, int, int]], list[float]] = {}
    still = True
    for _ in range(2 if args.quick else 5):  # interleaved rounds: clocks drift over a run
        for label, resident, c in configs:
            set_carveout(c)
            if resident:
                ex.resume()
                n0 = ex.launches
            for s, (a, b) in mats.items():
                samples.setdefault((label, s), []).append(ev_ms(lambda a=a, b=b: a @ b, iters=10))
            if resident:
                still = still and ex.state == R.ConsumerState.RUNNING and ex.launches == n0
                ex.suspend()
    set_carveout(0)
    ex.suspend()
    rows = []
    for s in SHAPES:
        flop = 2 * s[0] * s[1] * s[2]
        base = samples[("none", s)]
        for label, _, _ in configs:
            ms = samples[(label, s)]
            ratio = [b / x for b, x in zip(base, ms, strict=True)]
            rows.append({"table": "T9", "shape_mnk": "x".join(map(str, s)), "config": label,
                         "tflops": flop / benchreport.median(ms) / 1e9, "vs_none": benchreport.median(ratio),
                         "kernel": names[(label, str(s))][:200]})

    # duty cycle: a trigger every period_ms of GEMM work, the block exiting after idle_timeout_ms without tasks
    duty: list[dict[str, Any]] = []
    idles = [60_000.0, 5.0, 1.0, 0.25]
    execs = {t: ResidentExecutor(ExecutorOptions(capacity=64, idle_timeout_ms=t, lease_ms=600_000), start=False)
             for t in idles}
    for s in SHAPES[:3]:
        a, b = mats[s]
        k = max(1, round(args.period_ms / ev_ms(lambda a=a, b=b: a @ b, iters=5)))
        dsamples: dict[str, list[float]] = {}
        relaunches: dict[str, int] = {}
        rtt: dict[str, list[float]] = {}
        for _ in range(2 if args.quick else 5):
            for t in [None, *idles]:
                label = "none" if t is None else f"idle_timeout {t:g} ms"
                e = None if t is None else execs[t]
                if e is not None:
                    e.resume()
                n0 = e.launches if e is not None else 0
                dsamples.setdefault(label, []).extend(duty_cycle(e, a, b, k, 8))
                if e is not None:
                    relaunches[label] = relaunches.get(label, 0) + e.launches - n0
                    for _ in range(k):  # the trigger as the application sees it right after a GEMM batch
                        a @ b
                    torch.cuda.current_stream().synchronize()
                    t0 = time.perf_counter_ns()
                    e.wait(e.submit(R.Opcode.NOP))
                    rtt.setdefault(label, []).append((time.perf_counter_ns() - t0) / 1e3)
                    e.suspend()
        base = benchreport.median(dsamples["none"])
        for label, xs in dsamples.items():
            duty.append({"table": "T9 duty cycle", "shape_mnk": "x".join(map(str, s)), "config": label,
                         "period_ms": round(base, 2), "matmuls_per_trigger": k,
                         "vs_none": base / benchreport.median(xs), "relaunches": relaunches.get(label, 0),
                         "trigger_rtt_after_batch_us": benchreport.median(rtt[label]) if label in rtt else None})
    # baseline for the trigger after a batch: a plain launch of the same NOP + stream sync
    launcher = LaunchExecutor(ex.image)
    for s in SHAPES[:3]:
        a, b = mats[s]
        xs = []
        for _ in range(10):
            for _ in range(5):
                a @ b
            torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter_ns()
            launcher.wait(launcher.submit(R.Opcode.NOP))
            xs.append((time.perf_counter_ns() - t0) / 1e3)
        for row in duty:
            if row["shape_mnk"] == "x".join(map(str, s)) and row["config"] == "none":
                row["trigger_rtt_after_batch_us"] = benchreport.median(xs)
                row["config"] = "none (trigger = plain launch + sync)"
    for e in execs.values():
        e.close()
    notes = (f"bf16 matmul, {sms} SMs; executor = 1 resident block x {ex.image.threads} threads spinning on its ring; "
             f"carve-out via torch._C._set_sm_carveout_experimental; vs_none = median over interleaved rounds of "
             f"(time with nothing resident / time in this config); executor stayed resident: {still}. Duty cycle: "
             f"rounds of one ring NOP round trip then ~{args.period_ms:g} ms of matmuls (events around the matmuls "
             "only); the block exits after idle_timeout_ms without a task and the next submit relaunches it; "
             "trigger_rtt_after_batch_us = submit+wait of a NOP right after a synced GEMM batch (includes the "
             "relaunch when the block had exited).")
    rows += duty
    ex.close()
    path = benchreport.write_results("sm_share", rows, notes=notes, out_dir=args.out_dir, tag=args.tag)
    benchreport.print_table("T9: bf16 matmul with the executor resident, with and without a cuBLAS SM carve-out",
                            rows[:len(rows) - len(duty)], ["shape_mnk", "config", "tflops", "vs_none", "kernel"])
    benchreport.print_table("T9: duty-cycled residency", duty)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
