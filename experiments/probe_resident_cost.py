"""Why does one resident block cost a bf16 GEMM 8-20 %? Isolate the cause (paper table T9).

One block stays resident on a non-blocking stream while PyTorch runs bf16 matmuls. The block's behaviour
varies, everything else is fixed:

- clock:        spins on the SM clock, touches no memory except a host flag every ~50 us (to stop)
- dev_poll:     one thread polls a word in device memory (volatile), host flag every ~50 us
- host_relaxed: one thread polls a host-mapped word with a plain volatile load (a PCIe read each)
- host_acquire: one thread polls it with ld.acquire.sys (what the executor does)
- host_warp9:   9 lanes each poll a host-mapped word (ld.relaxed.sys) in parallel (ring v2 polling)
- host_sleepN:  host_acquire with __nanosleep(N) between polls

each with 32 and 256 threads per block, and the SM the block landed on. Then placements of a clock-spinning
block: 2 or 4 separate blocks, a cluster of 2 blocks (a whole TPC), each with cuBLAS told to leave 0/1/2 SMs
(``torch._C._set_sm_carveout_experimental``). vs_none is the median over
interleaved rounds of (time with nothing resident / time with the block resident).

Usage: python experiments/probe_resident_cost.py [--quick] [--out-dir experiments/results]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import benchreport

from bench_executor import ev_ms  # noqa: E402 - beside this script, on sys.path when it runs
from concordia_ft.cuda import driver, nvrtc
from concordia_ft.cuda.memory import PinnedBuffer

SRC = r"""
#define BODY_ARGS unsigned* host, unsigned* dev, int mode, unsigned sleep_ns, unsigned long long* out
__device__ void body(BODY_ARGS);
extern "C" __global__ void resident(BODY_ARGS) { body(host, dev, mode, sleep_ns, out); }
extern "C" __global__ void __cluster_dims__(2, 1, 1) resident_c2(BODY_ARGS) { body(host, dev, mode, sleep_ns, out); }
__device__ void body(BODY_ARGS) {
  __shared__ int stop;
  unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (threadIdx.x == 0) { stop = 0; out[1 + 4 * blockIdx.x] = smid; }
  __syncthreads();
  unsigned long long polls = 0, sink = 0;
  if (threadIdx.x < 32) {
    unsigned lane = threadIdx.x;
    long long last = clock64();
    while (true) {
      bool check_host = false;
      if (mode == 0) {
        long long now = clock64();
        if (now - last > 100000) { check_host = true; last = now; }
      } else if (mode == 1) {
        if (lane == 0) sink += *(volatile unsigned*)dev;
        long long now = clock64();
        if (now - last > 100000) { check_host = true; last = now; }
      } else if (mode == 2) {
        if (lane == 0) sink += *(volatile unsigned*)(host + 16);
        check_host = true;
      } else if (mode == 3) {
        if (lane == 0) { unsigned v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(host + 16) : "memory"); sink += v; }
        check_host = true;
      } else if (mode == 4) {
        if (lane < 9) { unsigned long long v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(host + 32 + 2 * lane) : "memory"); sink += v; }
        check_host = true;
      }
      if (sleep_ns) __nanosleep(sleep_ns);
      ++polls;
      int s = 0;
      if (check_host && lane == 0) s = *(volatile unsigned*)host;
      s = __shfl_sync(0xffffffffu, s, 0);
      if (s) break;
    }
    if (lane == 0) { stop = 1; out[4 * blockIdx.x] = polls; out[2 + 4 * blockIdx.x] = sink; }
  }
  __syncthreads();
}
"""

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (8192, 2048, 8192), (16384, 8192, 1024)]
MODES = {"clock": (0, 0), "dev_poll": (1, 0), "host_relaxed": (2, 0), "host_acquire": (3, 0), "host_warp9": (4, 0),
         "host_sleep2000": (3, 2000), "host_sleep20000": (3, 20000)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    torch.zeros(1, device="cuda")
    dev = driver.ensure_context()
    mod = nvrtc.load_module(SRC, "probe_resident")
    fn = mod.function("resident")
    host = PinnedBuffer(4096)
    hv = host.numpy(np.uint32)
    hv[:] = 0
    dflag = torch.zeros(64, dtype=torch.int32, device="cuda")
    out = torch.zeros(16, dtype=torch.int64, device="cuda")
    stream = driver.Stream.create(non_blocking=True, device=dev)
    mats = {s: (torch.randn(s[0], s[2], device="cuda", dtype=torch.bfloat16),
                torch.randn(s[2], s[1], device="cuda", dtype=torch.bfloat16)) for s in SHAPES}
    for a, b in mats.values():
        (a @ b).sum().item()

    fn_c2 = mod.function("resident_c2")

    def start(mode: int, sleep: int, threads: int, placement: str) -> None:
        hv[0] = 0
        out.zero_()
        kargs = driver.KernelArgs([(ctypes.c_uint64, host.device_ptr), (ctypes.c_uint64, dflag.data_ptr()),
                                   (ctypes.c_int32, mode), (ctypes.c_uint32, sleep),
                                   (ctypes.c_uint64, out.data_ptr())])
        start.kargs = kargs  # type: ignore[attr-defined]  # keep alive until the launch is consumed
        f, grid = {"1 block": (fn, 1), "2 blocks": (fn, 2), "cluster of 2": (fn_c2, 2), "4 blocks": (fn, 4)}[placement]
        driver.launch(f, grid, threads, kargs, stream, what="probe resident")
        time.sleep(0.02)

    def stop() -> None:
        hv[0] = 1
        stream.synchronize()

    def carveout(n: int) -> None:
        torch._C._set_sm_carveout_experimental(n if n else None)

    # warm the probe and every carve-out with nothing else running
    for c in (0, 1, 2):
        carveout(c)
        for a_, b_ in mats.values():
            (a_ @ b_).sum().item()
    carveout(0)
    for pl in ("1 block", "cluster of 2"):
        start(0, 0, 32, pl)
        stop()
    # (label, mode, threads, placement, carve-out)
    configs: list[tuple[str, str | None, int, str, int]] = [("none", None, 0, "", 0)]
    configs += [(f"{m} x{t}", m, t, "1 block", 0) for m in MODES for t in (32, 256)]
    configs += [("clock x32 2 blocks", "clock", 32, "2 blocks", 0), ("clock x32 4 blocks", "clock", 32, "4 blocks", 0)]
    configs += [(f"clock x32 {pl}, carve-out {c}", "clock", 32, pl, c)
                for pl in ("1 block", "cluster of 2") for c in (0, 1, 2) if (pl, c) != ("1 block", 0)]
    configs += [("carve-out 2 alone", None, 0, "", 2)]
    samples: dict[tuple[str, tuple[int, int, int]], list[float]] = {}
    smids: dict[str, str] = {}
    for _ in range(2 if args.quick else 5):
        for label, m, t, pl, c in configs:
            carveout(c)
            if m is not None:
                start(MODES[m][0], MODES[m][1], t, pl)
            for s, (a, b) in mats.items():
                samples.setdefault((label, s), []).append(ev_ms(lambda a=a, b=b: a @ b, iters=8))
            if m is not None:
                stop()
                o = out.tolist()
                smids[label] = ",".join(str(o[1 + 4 * i]) for i in range(len(o) // 4) if o[4 * i])
            carveout(0)
    rows = []
    for s in SHAPES:
        flop = 2 * s[0] * s[1] * s[2]
        base = samples[("none", s)]
        for label, *_ in configs:
            ms = samples[(label, s)]
            rows.append({"table": "T9-probe", "shape_mnk": "x".join(map(str, s)), "resident": label,
                         "tflops": flop / benchreport.median(ms) / 1e9,
                         "vs_none": benchreport.median([b_ / x for b_, x in zip(base, ms, strict=True)]),
                         "smid": smids.get(label, "")})
    notes = ("one probe block resident on a non-blocking stream, bf16 torch matmul on the default stream; "
             "modes in the script's docstring")
    path = benchreport.write_results("resident_cost", rows, notes=notes, out_dir=args.out_dir, tag=args.tag)
    benchreport.print_table("T9 probe: what in a resident block costs the GEMM", rows,
                            ["shape_mnk", "resident", "tflops", "vs_none", "smid"])
    print(f"wrote {path}")
    host.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
