"""Cooperative pause/resume of Triton kernels on the GPU: probe overhead, pause latency, resume cost.

For matmul, softmax and layernorm at several sizes, in one process:
- time (triton.testing.do_bench, median) the kernel compiled WITHOUT probes (the baseline a user runs), the
  instrumented kernel disarmed, and armed but never paused: the probe overhead;
- pause mid-kernel at several delays: latency from the flag write to the drained launch, next to one wave's
  run time (the bound: a block that passed entry finishes); the resume launch's time; bit-equality of the
  resumed output with the uninterrupted one (every trial);
- the cost of a resume launch in which every block already ran (all exit at entry) vs grid size.
Writes experiments/results/pause-<tag>.json.  Run: python3 experiments/bench_pause.py --out-dir DIR

``--drain``: does a pause drain within one block's run time? A kernel whose blocks each run long (``--block-us``,
default ~100 us, each block's length drawn from 0.5-1.5x so the waves do not stay in step), several waves of
resident blocks, every block stamping its own start and end on the GPU's global timer. Paused by the GPU
(``GpuPauseTrigger``, at a count of finished blocks), the drain is measured on that same clock: from the
trigger's write of the pause word to the end of the last block that ran, against the run time of the blocks
that were running when the pause landed (the bound) and the median block. Resumed bit-equal to the kernel
compiled without probes. Writes pause_drain-<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "tests"))  # instrument_kernels
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments"))  # concordia_lab: the instrumentation and the executor
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchreport

from benchreport import median, print_table, write_results  # noqa: E402

import instrument_kernels as ik  # noqa: E402
from concordia_lab.instrument import triton_hook  # noqa: E402
from concordia_lab.instrument.pause import PausableLaunch  # noqa: E402
from concordia_lab.instrument.safepoints import SafepointOptions  # noqa: E402


def matmul_case(n: int):
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float32)
    grid = (triton.cdiv(n, 128), triton.cdiv(n, 128))
    args = [a, b, c, n, n, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1)]
    return ik.matmul_kernel, grid, args, dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3), c


def softmax_case(rows: int, cols: int = 1000):
    x = torch.randn(rows, cols, device="cuda")
    y = torch.empty_like(x)
    return ik.softmax_kernel, (rows,), [x, y, cols, x.stride(0)], dict(BLOCK=1024), y


def layernorm_case(rows: int, cols: int = 3000):
    x = torch.randn(rows, cols, device="cuda")
    w = torch.randn(cols, device="cuda")
    b = torch.randn(cols, device="cuda")
    y = torch.empty_like(x)
    return ik.layernorm_kernel, (rows,), [x, y, w, b, cols, x.stride(0), 1e-5], dict(BLOCK=512), y


CASES = [("matmul", matmul_case, [2048, 4096, 8192]), ("softmax", softmax_case, [16384, 65536, 262144]),
         ("layernorm", layernorm_case, [8192, 32768, 131072])]


def waves(kernel, nblocks: int) -> int:
    from cuda.bindings import driver as drv

    threads = kernel.metadata.num_warps * 32
    err, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, threads, kernel.metadata.shared)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return math.ceil(nblocks / max(1, int(per_sm) * sms)), int(per_sm)


def bench_case(name, make, size, trials: int, barrier_probes: bool = True, deferred_vote: bool = True) -> dict:
    fn, grid, args, kw, out = make(size)
    triton_hook.uninstall()
    plain = triton.JITFunction(fn.fn)
    plain[grid](*args, **kw)
    torch.cuda.synchronize()
    want = out.clone()
    plain_k = plain.warmup(*args, grid=grid, **kw)
    plain_k._init_handles()
    triton_hook.install(SafepointOptions(barrier_probes=barrier_probes, deferred_vote=deferred_vote))
    inst = triton.JITFunction(fn.fn)
    launch = PausableLaunch(inst, grid, args, kw)

    def armed():
        launch.ctl.zero_()
        inst[grid](*args, **kw)

    def bench(f) -> float:
        return float(triton.testing.do_bench(f, warmup=10, rep=100, return_mode="median"))

    # alternate the variants over rounds, so clock and thermal drift hit each alike; median per variant
    ts: dict[str, list[float]] = {"plain": [], "disarmed": [], "armed": [], "zero": []}
    for _ in range(5):
        ts["plain"].append(bench(lambda: plain[grid](*args, **kw)))
        launch.disarm()
        ts["disarmed"].append(bench(lambda: inst[grid](*args, **kw)))
        launch.arm()
        ts["armed"].append(bench(armed))
        ts["zero"].append(bench(lambda: launch.ctl.zero_()))
    t_plain, t_disarmed = median(ts["plain"]), median(ts["disarmed"])
    t_armed, t_zero = median(ts["armed"]), median(ts["zero"])
    nw, per_sm = waves(launch.kernel, launch.nblocks)
    wave_ms = t_plain / nw
    lat, pend, resume_ms, biteq = [], [], [], []
    for i in range(trials):
        delay_s = (t_plain / 1e3) * (0.2 + 0.6 * i / max(1, trials - 1))
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        launch.start()
        t_end = time.perf_counter() + delay_s
        while time.perf_counter() < t_end:
            pass
        st = launch.pause()
        lat.append(st.request_to_drained_s * 1e3)
        pend.append(st.pending_blocks)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launch.resume()
        e1.record()
        launch.drain()
        resume_ms.append(e0.elapsed_time(e1))
        biteq.append(bool(torch.equal(out, want)) and not launch.pending())
    # resume when nothing is left: every block exits at entry
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    empties = []
    for _ in range(20):
        e0.record()
        launch.resume()
        e1.record()
        launch.drain()
        empties.append(e0.elapsed_time(e1))
    launch.disarm()
    partial = [p for p in pend if 0 < p < launch.nblocks]
    rep = triton_hook.report(launch.name)
    return {
        "kernel": name, "size": size, "barrier_probes_on": barrier_probes, "blocks": launch.nblocks,
        "deferred_vote_on": deferred_vote, "deferred_vote": rep.deferred_vote if rep else None,
        "regs_plain": plain_k.n_regs, "regs_instrumented": launch.kernel.n_regs,
        "spills_plain": plain_k.n_spills, "spills_instrumented": launch.kernel.n_spills, "blocks_per_sm": per_sm, "waves": nw,
        "plain_ms": t_plain, "disarmed_ms": t_disarmed, "armed_ms": t_armed - t_zero,
        "plain_ms_rounds": ts["plain"], "armed_ms_rounds": ts["armed"],
        "overhead_disarmed_pct": 100 * (t_disarmed / t_plain - 1),
        "overhead_armed_pct": 100 * ((t_armed - t_zero) / t_plain - 1),
        "wave_ms": wave_ms, "pause_latency_ms_median": median(lat), "pause_latency_ms_max": max(lat),
        "latency_over_wave": median(lat) / wave_ms, "pending_blocks": pend, "partial_pauses": len(partial),
        "resume_ms_median": median(resume_ms), "empty_resume_ms": median(empties),
        "bit_equal_all": all(biteq), "trials": trials,
        "barrier_probes": rep.barrier_probes if rep else None,
        "empty_resume_ns_per_block": 1e6 * median(empties) / launch.nblocks,
    }


# a value a block's out word is taken not to hold (each trial's bit_equal checks the outputs against plain's)
SENTINEL = 0x7FC00000

STAMP_SOURCE = r"""
extern "C" __global__ void cft_stamp(unsigned long long *out) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  out[0] = t;
}
"""


def drain_case(block_us: float, waves_n: float, fractions: list[float], repeats: int,
               options: SafepointOptions | None = None) -> dict:
    """One long-block kernel paused by the GPU at each fraction of finished blocks (see the module docstring).
    ``options``: the probes' (None: ``triton_hook.install()``'s default). Protocol 5 has no done bits: the trigger
    watches ``out``, one word per block written at the block's end, filled with the sentinel before each trial."""
    import ctypes

    from concordia_ft.cuda import driver as cd
    from concordia_ft.cuda import nvrtc
    from concordia_lab.instrument.pause import GpuPauseTrigger

    fn = ik.spin_rows_timed_kernel
    blk = 128
    kw = dict(BLOCK=blk, num_warps=4)
    gen = torch.Generator(device="cpu").manual_seed(7)
    triton_hook.uninstall()
    plain = triton.JITFunction(fn.fn)
    # calibrate passes per microsecond with one full wave of blocks (every resident slot busy, as in the run)
    x1 = torch.randint(-5, 6, (1, blk), dtype=torch.int32, device="cuda")
    t1 = torch.zeros(2, dtype=torch.int64, device="cuda")
    o1 = torch.zeros(1, dtype=torch.int32, device="cuda")
    reps1 = torch.tensor([1000], dtype=torch.int32, device="cuda")
    k0 = plain.warmup(x1, reps1, o1, t1, grid=(1,), **kw)
    k0._init_handles()
    nw, per_sm = waves(k0, 1)
    slots = per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    r0 = 20000
    xw = torch.randint(-5, 6, (slots, blk), dtype=torch.int32, device="cuda")
    tw_ = torch.zeros(2 * slots, dtype=torch.int64, device="cuda")
    ow = torch.zeros(slots, dtype=torch.int32, device="cuda")
    repw = torch.full((slots,), r0, dtype=torch.int32, device="cuda")
    for _ in range(3):
        plain[(slots,)](xw, repw, ow, tw_, **kw)
    torch.cuda.synchronize()
    tw2 = tw_.view(slots, 2).cpu()
    ns_per_pass = float((tw2[:, 1] - tw2[:, 0]).double().median()) / r0
    base_reps = max(1, int(block_us * 1e3 / max(ns_per_pass, 1e-3)))
    rows = int(waves_n * slots)
    x = torch.randint(-5, 6, (rows, blk), dtype=torch.int32, device="cuda", generator=None)
    reps = (base_reps * (0.5 + torch.rand(rows, generator=gen))).to(torch.int32).cuda()
    out = torch.zeros(rows, dtype=torch.int32, device="cuda")
    times = torch.zeros(2 * rows, dtype=torch.int64, device="cuda")
    plain[(rows,)](x, reps, out, times, **kw)
    torch.cuda.synchronize()
    want = out.clone()
    pt = times.view(rows, 2).cpu()
    plain_block = (pt[:, 1] - pt[:, 0]).double() / 1e3
    plain_kernel_us = float((pt[:, 1].max() - pt[:, 0].min()) / 1e3)
    triton_hook.install(options)
    inst = triton.JITFunction(fn.fn)
    out.zero_()
    times.zero_()
    launch = PausableLaunch(inst, (rows,), [x, reps, out, times], kw)
    launch.start()
    launch.drain()
    torch.cuda.synchronize()
    at = times.view(rows, 2).cpu()
    armed_block = (at[:, 1] - at[:, 0]).double() / 1e3
    armed_kernel_us = float((at[:, 1].max() - at[:, 0].min()) / 1e3)
    uninterrupted_equal = bool(torch.equal(out, want))
    mod = nvrtc.load_module(STAMP_SOURCE, "cft_stamp")
    stamp_fn = mod.function("cft_stamp")
    stamp = torch.zeros(1, dtype=torch.int64, device="cuda")
    stamp_args = cd.KernelArgs([(ctypes.c_uint64, stamp.data_ptr())])
    trigger = GpuPauseTrigger()
    side = torch.cuda.Stream()
    trials = []
    for frac in fractions:
        for _ in range(repeats):
            after = max(1, int(frac * rows))
            v5 = launch.protocol == 5
            out.fill_(SENTINEL if v5 else 0)
            times.zero_()
            launch.ctl.zero_()
            zeroed = torch.cuda.Event()
            zeroed.record()
            side.wait_event(zeroed)
            trigger.arm(launch, after, cd.Stream.borrow(side.cuda_stream), timeout_s=2.0,
                        **(dict(watch=out, words_per_block=1, sentinel=SENTINEL) if v5 else {}))
            launch._launch()
            cd.launch(stamp_fn, 1, 1, stamp_args, cd.Stream.borrow(torch.cuda.current_stream().cuda_stream),
                      what="cft_stamp")
            torch.cuda.synchronize()
            res = trigger.result()
            tw = res["t_write_ns"]
            tt = times.view(rows, 2).cpu()
            ran = tt[:, 0] > 0
            start, end = tt[:, 0], tt[:, 1]
            running = ran & (start <= tw) & (end > tw)
            late = ran & (start > tw)
            last_end = int(end[ran].max()) if bool(ran.any()) else tw
            bound = float(((end - start)[running]).max() / 1e3) if bool(running.any()) else None
            remaining = float(((end - tw)[running]).max() / 1e3) if bool(running.any()) else None
            pending = len(launch.pending())
            launch.resume()
            launch.drain()
            torch.cuda.synchronize()
            trials.append({
                "after_blocks": after, "done_seen_at_write": res["done_seen"], "reached": bool(res["reached"]),
                "pending_after_pause": pending, "mid_grid": 0 < pending < rows,
                "running_at_write": int(running.sum()), "started_after_write": int(late.sum()),
                "drain_us": (last_end - tw) / 1e3,  # pause word written -> the last block that ran ended
                "stream_drained_us": (int(stamp[0]) - tw) / 1e3,  # -> a kernel after the launch ran
                "longest_running_block_us": bound, "remaining_of_running_us": remaining,
                "drain_over_longest_running_block": ((last_end - tw) / 1e3 / bound) if bound else None,
                "drain_over_median_block": (last_end - tw) / 1e3 / float(armed_block.median()),
                "bit_equal": bool(torch.equal(out, want)) and not launch.pending()})
    launch.disarm()
    mid = [t for t in trials if t["mid_grid"]]
    return {
        "kernel": "spin_rows_timed", "blocks": rows, "blocks_per_sm": per_sm, "resident_slots": slots,
        "waves": rows / slots, "target_block_us": block_us, "ns_per_pass": ns_per_pass,
        "plain_kernel_us": plain_kernel_us, "armed_kernel_us": armed_kernel_us,
        "plain_block_us_median": float(plain_block.median()), "plain_block_us_max": float(plain_block.max()),
        "armed_block_us_median": float(armed_block.median()), "armed_block_us_max": float(armed_block.max()),
        "armed_uninterrupted_equal": uninterrupted_equal, "trials": trials,
        "protocol": launch.protocol, "header_arg": bool(launch.header_arg),
        "options": "triton_hook.install() default" if options is None else repr(options),
        "mid_grid_pauses": len(mid), "drain_us_median": median([t["drain_us"] for t in mid]) if mid else None,
        "drain_over_longest_running_block_max": max((t["drain_over_longest_running_block"] or 0) for t in mid)
        if mid else None,
        "drain_within_one_block_all": bool(mid) and all(t["drain_over_longest_running_block"] is not None
                                                        and t["drain_over_longest_running_block"] <= 1.0
                                                        for t in mid),
        "bit_equal_all": all(t["bit_equal"] for t in trials),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated kernels (matmul,softmax,layernorm)")
    ap.add_argument("--name", default="pause", help="results file name")
    ap.add_argument("--sizes", default="", help="comma-separated sizes instead of each kernel's three")
    ap.add_argument("--votes", default="on", help="deferred entry vote: on, off or on,off (both, same run)")
    ap.add_argument("--no-barrier-variants", action="store_true", help="skip the barrier-probe variants")
    ap.add_argument("--drain", action="store_true", help="only the long-block drain measurement")
    ap.add_argument("--block-us", default="100", help="comma-separated block run times for --drain")
    ap.add_argument("--drain-waves", type=float, default=4.0)
    ap.add_argument("--drain-options", default="default",
                    help="--drain: the probes' SafepointOptions as JSON, or 'default' (triton_hook.install()'s)")
    ns = ap.parse_args()
    torch.manual_seed(0)
    if ns.drain:
        drows = []
        dopts = None if ns.drain_options == "default" else SafepointOptions(**json.loads(ns.drain_options))
        for bu in (float(v) for v in ns.block_us.split(",")):
            r = drain_case(bu, ns.drain_waves, [0.3, 0.5, 0.7], 3, dopts)
            drows.append(r)
            print({k: v for k, v in r.items() if k != "trials"}, flush=True)
        path = write_results("pause_drain", drows, baseline=[{"block_us": r["target_block_us"],
                                                              "plain_kernel_us": r["plain_kernel_us"]}
                                                             for r in drows],
                             notes="drain = GPU global timer from the trigger's pause-word write to the end of the "
                                   "last block that ran; bound = the run time of the longest block running at "
                                   "the write; plain = the same kernel compiled without probes",
                             out_dir=ns.out_dir)
        print(path)
        return 0 if all(r["bit_equal_all"] and r["armed_uninterrupted_equal"] for r in drows) else 1
    rows = []
    only = set(filter(None, ns.only.split(",")))
    sizes_arg = [int(x) for x in ns.sizes.split(",") if x]
    cases = [(n, m, sizes_arg or sz) for n, m, sz in CASES if not only or n in only]
    variants = [(n, m, sz, False) for n, m, sz in cases]
    if not ns.no_barrier_variants:
        variants += [(n, m, sz, True) for n, m, sz in cases if n != "matmul"]  # matmul gets none anyway
    votes = [v.strip() == "on" for v in ns.votes.split(",")]
    for name, make, sizes, bp in variants:
        for s, dv in ((s, dv) for s in sizes for dv in votes):
            rows.append(bench_case(name, make, s, ns.trials, bp, dv))
            r = rows[-1]
            print(f"{name} {s} barrier_probes={bp} deferred_vote={r['deferred_vote']}: plain {r['plain_ms']:.3f} ms, armed +{r['overhead_armed_pct']:.2f}%, pause "
                  f"{r['pause_latency_ms_median']:.3f} ms (wave {r['wave_ms']:.3f}), biteq {r['bit_equal_all']}",
                  flush=True)
    path = write_results(ns.name, rows, baseline=[{"kernel": r["kernel"], "size": r["size"],
                                                   "plain_ms": r["plain_ms"]} for r in rows],
                         notes="plain = the same Triton kernel compiled without probes (what a user runs); "
                               "latency = host clock from the pause flag write to the drained launch",
                         out_dir=ns.out_dir)
    print_table("pause/resume", rows, ["kernel", "size", "barrier_probes_on", "blocks", "waves", "plain_ms", "overhead_disarmed_pct",
                                       "overhead_armed_pct", "wave_ms", "pause_latency_ms_median",
                                       "latency_over_wave", "partial_pauses", "resume_ms_median",
                                       "empty_resume_ms", "bit_equal_all"])
    print(path)
    return 0 if all(r["bit_equal_all"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
