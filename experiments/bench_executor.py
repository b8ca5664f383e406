"""Executor benchmarks on one GPU (paper tables T2-4, T7, T9).

T2-4: round trip and per-op latency from Python for N = 64 .. 262,144 float32 elements: the resident ring,
      a pre-armed launch fired by a host store, a plain launch of the same dispatcher, vs PyTorch eager
      (launch + stream sync) and CUDA-graph replay (+ sync), all in this run.
T7:   trigger cost: Python ring submit (NOP and a full 6-argument descriptor), ring round trip, armed trigger
      (host store, or the resident block's TRIGGER task), a plain launch from Python; and a full-width page-diff
      scan through each path. T7h: the same Python fast paths (ResidentExecutor's submit/wait closures) over
      ordinary memory, no GPU: the interpreter's share of the cost, comparable across machines.
T9:   the executor's SM footprint; bf16 matmul and HBM copy throughput with the executor resident vs not.

Usage: python experiments/bench_executor.py [--quick] [--host-only] [--out-dir experiments/results]
Writes experiments/results/executor-<tag>.json via benchreport.py (``--host-only``: only T7h, no GPU,
executor-host-<tag>.json); prints the tables last.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import timeit
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
import benchreport  # noqa: E402

from concordia_lab.executor import guard  # noqa: E402
from concordia_lab.executor import ring as R  # noqa: E402
from concordia_lab.executor.resident import (  # noqa: E402
    ArmedChannel,
    ExecutorImage,
    ExecutorOptions,
    LaunchExecutor,
    ResidentExecutor,
    compile_executor,
)

OPS = {
    "add": (R.Opcode.ADD, lambda a, b, o: torch.add(a, b, out=o)),
    "mul": (R.Opcode.MUL, lambda a, b, o: torch.mul(a, b, out=o)),
    "sub": (R.Opcode.SUB, lambda a, b, o: torch.sub(a, b, out=o)),
    "relu": (R.Opcode.RELU, lambda a, b, o: torch.clamp_min(a, 0.0, out=o)),
    "silu": (R.Opcode.SILU, lambda a, b, o: torch.ops.aten.silu.out(a, out=o)),
    "scale": (R.Opcode.SCALE, lambda a, b, o: torch.mul(a, 0.5, out=o)),
    "add_relu": (R.Opcode.ADD_RELU, lambda a, b, o: torch.add(a, b, out=o).relu_()),
}
SIZES = [64, 256, 1024, 4096, 16384, 65536, 262144]
PTRS = (0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 1 << 20, 0x7F0000004000, 7)  # plausible 6-arg task
AUX = 0x3F000000  # 0.5f


def stream_sync() -> None:
    torch.cuda.current_stream().synchronize()


def host_fast_paths(batches: int, batch: int = 4096) -> list[dict[str, Any]]:
    """T7h: ResidentExecutor's submit/wait fast paths (executor.ring.make_submit / make_wait, the same code) over
    ordinary memory with the state word RUNNING and no consumer; tail is advanced between timed batches. Both
    producers: C (executor/_ringfast.c) and pure Python, interleaved batch by batch.
    Per-call ns = batch time / batch, loop included; p50 and min over ``batches`` batches."""

    def never(*_: Any) -> Any:
        raise AssertionError("the host-only benchmark must stay on the fast path")

    impls = ["python"] + (["c"] if R._ringfast is not None else [])
    a0, a1, a2, a3, a4, a5 = PTRS
    op = R.Opcode.NOP
    fns: dict[tuple[str, str], Any] = {}
    lays: dict[str, tuple[R.RingLayout, R.RingProducer]] = {}
    for impl in impls:
        lay = R.RingLayout(memoryview(bytearray(R.ring_bytes(R.MAX_CAPACITY))), R.MAX_CAPACITY)
        lay.initialise()
        prod = R.RingProducer(lay, fast=impl == "c")
        lay.store32(R.OFF_STATE, R.ConsumerState.RUNNING)
        submit = R.make_submit(prod, threading.Lock(), never)
        wait = R.make_wait(prod, never, never)
        done = submit(R.Opcode.NOP)
        q = lay.q
        ri = lay.result_off(done) >> 3
        q[ri], q[ri + 1] = 5, done  # as the device would complete it: value 5, status OK
        lays[impl] = (lay, prod)

        def nop(submit: Any = submit) -> None:
            for _ in range(batch):
                submit(op)

        def six(submit: Any = submit) -> None:
            for _ in range(batch):
                submit(op, a0, a1, a2, a3, a4, a5, AUX)

        def waits(wait: Any = wait, done: int = done) -> None:
            for _ in range(batch):
                wait(done)

        fns[impl, "host-only submit NOP (fast path, no GPU)"] = nop
        fns[impl, "host-only submit 6 args + aux (fast path, no GPU)"] = six
        fns[impl, "host-only wait on a completed task (no GPU)"] = waits
    per: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    for _ in range(batches):
        for (impl, what), fn in fns.items():
            lay, prod = lays[impl]
            lay.store(R.OFF_TAIL, prod.head)  # the "consumer" catches up outside the timing
            per[impl, what].append(timeit.timeit(fn, number=1) / batch * 1e6)
    rows = []
    for (impl, what), xs in per.items():
        row = {"table": "T7h", "what": f"{what} [{impl} producer]", "impl": impl, "p50_us": benchreport.median(xs),
               "p99_us": max(xs), "min_us": min(xs)}
        if impl == "c":
            row["speedup_vs_python"] = benchreport.median(per["python", what]) / row["p50_us"]
        rows.append(row)
    return rows


def lat(fn: Any, reps: int, warm: int = 5) -> list[float]:
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t) / 1e3)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50_us": benchreport.median(xs), "p99_us": benchreport.percentile(xs, 99), "min_us": min(xs)}


def ev_ms(fn: Any, iters: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    stream_sync()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--host-only", action="store_true", help="only T7h (Python fast paths, no GPU)")
    args = ap.parse_args()
    reps = 50 if args.quick else 200
    host = host_fast_paths(20 if args.quick else 100)
    if args.host_only:
        path = benchreport.write_results("executor-host", host, notes=f"T7h only: host fast paths, no GPU; ring fast path {R.fast_path_status()}",
                                         out_dir=args.out_dir)
        print(f"wrote {path}")
        benchreport.print_table("T7h: host fast paths (C and Python) over ordinary memory (no GPU)", host,
                                ["what", "impl", "p50_us", "p99_us", "min_us", "speedup_vs_python"])
        return
    torch.cuda.init()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []

    # ---- data + torch warm-up + CUDA graphs, all before anything is resident
    data = {}
    for n in SIZES:
        a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        data[n] = (a, b, torch.empty(n, device="cuda"))
    graphs = {}
    side = torch.cuda.Stream()
    for name, (_, fn) in OPS.items():
        for n in SIZES:
            a, b, o = data[n]
            fn(a, b, o)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(a, b, o)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(a, b, o)
            graphs[name, n] = g
    tiny = torch.zeros(16, device="cuda")
    tiny.add_(1)
    mm_a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_b = torch.randn_like(mm_a)
    cp_x = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    cp_y = torch.empty_like(cp_x)
    _ = mm_a @ mm_b
    cp_y.copy_(cp_x)
    regions = {}
    for mb in (1, 16, 256):
        cur = torch.randint(0, 2**31, ((mb << 20) // 4,), dtype=torch.int32, device="cuda")
        sh = cur.clone()
        cur[4096 // 4 * 3] ^= 1
        regions[mb] = (cur, sh, torch.zeros(1, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()

    ex = ResidentExecutor(ExecutorOptions(capacity=4096, idle_timeout_ms=20_000, lease_ms=600_000))
    with guard.quiesced():
        launch = LaunchExecutor(ex.image)
        armed = ArmedChannel(ex.image, depth=2)
        armed_x = ArmedChannel(ex.image, depth=2, fired_by=ex)
        torch.cuda.synchronize()

    def via(path: Any, op: int, *a: int, aux: int = 0) -> Any:
        if isinstance(path, ArmedChannel):
            def f() -> None:
                path.wait(path.fire(op, *a, aux=aux))
                path.rearm()
            return f
        return lambda: path.wait(path.submit(op, *a, aux=aux))

    # ---- T2-4
    for name, (op, fn) in OPS.items():
        for n in SIZES:
            a, b, o = data[n]
            args_ = (a.data_ptr(), b.data_ptr(), o.data_ptr(), n)
            aux = R.float_bits(0.5)
            r = {}
            for pname, path in (("resident", ex), ("armed_host", armed), ("launch", launch)):
                r[pname] = summary(lat(via(path, op, *args_, aux=aux), reps))
            eager = summary(lat(lambda: (fn(a, b, o), stream_sync()), reps))  # noqa: B023 - called here
            g = graphs[name, n]
            graph = summary(lat(lambda: (g.replay(), stream_sync()), reps))  # noqa: B023 - called here
            for pname, s in r.items():
                rows.append({"table": "T2-4", "op": name, "n": n, "path": pname, **s,
                             "speedup_vs_eager": eager["p50_us"] / s["p50_us"],
                             "speedup_vs_graph": graph["p50_us"] / s["p50_us"]})
            base.append({"table": "T2-4", "op": name, "n": n, "path": "torch_eager", **eager})
            base.append({"table": "T2-4", "op": name, "n": n, "path": "cuda_graph", **graph})
    # correctness spot check: a fresh output through the ring, against torch
    a, b, o = data[SIZES[-1]]
    with guard.quiesced():
        o.fill_(float("nan"))
        stream_sync()
    ex.wait(ex.submit(R.Opcode.ADD_RELU, a.data_ptr(), b.data_ptr(), o.data_ptr(), SIZES[-1]))
    with guard.quiesced():
        ok = bool(torch.equal(o, torch.relu(a + b)))

    # ---- T7: trigger costs. The ring's host fast paths in C (the default, ``ex``) and in pure Python (``exp``,
    # the same image and device code): one resident at a time.
    t7: list[dict[str, Any]] = []
    a0, a1, a2, a3, a4, a5 = PTRS  # a NOP carrying a full descriptor: the device ignores the arguments
    ex.suspend()
    exp = ResidentExecutor(ExecutorOptions(capacity=4096, idle_timeout_ms=20_000, lease_ms=600_000,
                                           fast_ring=False), image=ex.image, start=False)
    for path, impl in ((exp, "python"), (ex, "c")):
        path.resume()
        sfx = f" [{impl} producer]"
        rt = lat(lambda: path.wait(path.submit(R.Opcode.NOP)), 20 * reps)  # noqa: B023 - called here
        t7.append({"table": "T7", "what": "ring round trip (NOP, submit+wait)" + sfx, "impl": impl, **summary(rt)})
        for what, targs in (("ring submit from Python (no wait)", ()),
                            ("ring submit from Python, 6 args + aux (no wait)", (a0, a1, a2, a3, a4, a5, AUX))):
            per = []
            for _ in range(10):
                t = time.perf_counter_ns()
                for _ in range(2000):
                    s = path.submit(R.Opcode.NOP, *targs)
                per.append((time.perf_counter_ns() - t) / 2000 / 1e3)
                path.wait(s)
            t7.append({"table": "T7", "what": what + sfx, "impl": impl, "p50_us": benchreport.median(per),
                       "p99_us": max(per), "min_us": min(per)})
        rt6 = lat(lambda: path.wait(path.submit(R.Opcode.NOP, a0, a1, a2, a3, a4, a5, AUX)), 20 * reps)  # noqa: B023
        t7.append({"table": "T7", "what": "ring round trip (NOP with 6 args + aux, submit+wait)" + sfx, "impl": impl,
                   **summary(rt6)})
        path.suspend()
    exp.close()
    ex.resume()
    t7.append({"table": "T7", "what": "armed trigger, host store -> done (NOP)",
               **summary(lat(lambda: armed.wait(armed.fire(R.Opcode.NOP)) or armed.rearm(), reps))})
    rearm = lat(lambda: (armed.fire(R.Opcode.NOP), armed.rearm()), reps)
    t7.append({"table": "T7", "what": "armed fire + re-arm host cost (no wait)", **summary(rearm)})
    armed.wait(armed.fired)
    t7.append({"table": "T7", "what": "armed trigger by the resident block (TRIGGER task) -> done",
               **summary(lat(lambda: armed_x.wait(armed_x.fire(R.Opcode.NOP)) or armed_x.rearm(), reps))})
    t7.append({"table": "T7", "what": "plain launch from Python, call only",
               **summary(lat(lambda: launch.submit(R.Opcode.NOP), reps))})
    launch.wait(0)
    t7.append({"table": "T7", "what": "plain launch + stream sync (NOP)",
               **summary(lat(lambda: launch.wait(launch.submit(R.Opcode.NOP)), reps))})
    t7.append({"table": "T7", "what": "torch tiny op + stream sync (baseline)",
               **summary(lat(lambda: (tiny.add_(1), stream_sync()), reps))})
    for mb, (cur, sh, cnt) in regions.items():
        npages = (mb << 20) // 4096
        a_ = (cur.data_ptr(), sh.data_ptr(), 0, npages, cnt.data_ptr())
        for pname, path in (("resident (one block)", ex), ("armed_host", armed), ("armed_by_executor", armed_x),
                            ("launch", launch)):
            n_rep = 3 if (pname.startswith("resident") and mb == 256) else 20
            s = summary(lat(via(path, R.Opcode.PAGE_DIFF, *a_, aux=4096), n_rep, warm=1))
            t7.append({"table": "T7", "what": f"page-diff scan {mb} MiB via {pname}", **s,
                       "gb_s": 2 * (mb << 20) / (s["p50_us"] * 1e3)})
    with guard.quiesced():
        counted = [int(c.item()) for (_, _, c) in regions.values()]

    # ---- T9: footprint and interference
    regs = ex.image.attribute(ex.image.resident, "NUM_REGS")
    smem = ex.image.attribute(ex.image.resident, "SHARED_SIZE_BYTES")
    t9: list[dict[str, Any]] = []

    small = compile_executor(99, 32, max_regs=32)  # the alternative: one warp capped at 32 registers
    with guard.quiesced():
        small_image = ExecutorImage(99, 32, compiled=small)
    ex2 = ResidentExecutor(ExecutorOptions(capacity=64, idle_timeout_ms=20_000, lease_ms=600_000, threads=32),
                           image=small_image, start=False)
    small_regs = small_image.attribute(small_image.resident, "NUM_REGS")
    configs = ("none", f"executor 1x{ex.image.threads} ({regs} regs)", f"executor 1x32 ({small_regs} regs)",
               "executor + armed waits")

    def set_config(c: str) -> ResidentExecutor | None:
        ex.suspend()
        ex2.suspend()
        armed.suspend()
        if c == configs[1]:
            ex.resume()
            return ex
        if c == configs[2]:
            ex2.resume()
            return ex2
        if c == configs[3]:
            ex.resume()
            armed.resume()
            return ex
        return None

    samples: dict[str, list[tuple[float, float]]] = {c: [] for c in configs}
    still = True
    for _ in range(2 if args.quick else 5):  # interleaved rounds: clocks drift by several % over a run
        for c in configs:
            live = set_config(c)
            n0 = live.launches if live else 0
            samples[c].append((ev_ms(lambda: mm_a @ mm_b, iters=10), ev_ms(lambda: cp_y.copy_(cp_x), iters=10)))
            if live is not None:
                still = still and live.state == R.ConsumerState.RUNNING and live.launches == n0
    set_config("none")
    ex2.close()
    for c in configs:
        mm = [x[0] for x in samples[c]]
        cp = [x[1] for x in samples[c]]
        mm_ratio = [n[0] / x[0] for n, x in zip(samples["none"], samples[c], strict=True)]  # per round: none time / this time
        cp_ratio = [n[1] / x[1] for n, x in zip(samples["none"], samples[c], strict=True)]
        t9.append({"table": "T9", "resident": c, "matmul_tflops": 2 * 8192**3 / benchreport.median(mm) / 1e9,
                   "copy_tb_s": 2 * (1 << 30) / benchreport.median(cp) / 1e9,
                   "matmul_vs_none": benchreport.median(mm_ratio), "copy_vs_none": benchreport.median(cp_ratio),
                   "rounds": len(mm)})
    footprint = {"table": "T9", "resident": "footprint", "blocks": 1, "threads": ex.image.threads,
                 "regs_per_thread": regs, "static_smem_bytes": smem, "sm_count": sms,
                 "register_file_share_of_one_sm": regs * ex.image.threads / 65536,
                 "stayed_resident_during_run": still}

    armed.close()
    armed_x.close()
    ex.close()
    t2_ring = {r["n"]: r for r in rows if r["op"] == "add" and r["path"] == "resident"}
    notes = (f"ring correctness spot check (add_relu, N={SIZES[-1]}) {ok}; page-diff dirty counts "
             f"{counted} (cumulative over paths); executor 1 block x {ex.image.threads} threads, {regs} regs/thread; "
             f"ring host fast path {R.fast_path_status()} (T7 rows name their producer)")
    path = benchreport.write_results("executor", rows + t7 + host + t9 + [footprint], baseline=base, notes=notes,
                                     out_dir=args.out_dir)
    print(f"wrote {path}")
    summary_rows = []
    for n in SIZES:
        e = next(x for x in base if x["op"] == "add" and x["n"] == n and x["path"] == "torch_eager")
        g = next(x for x in base if x["op"] == "add" and x["n"] == n and x["path"] == "cuda_graph")
        ar = next(x for x in rows if x["op"] == "add" and x["n"] == n and x["path"] == "armed_host")
        ln = next(x for x in rows if x["op"] == "add" and x["n"] == n and x["path"] == "launch")
        summary_rows.append({"N": n, "ring_p50_us": t2_ring[n]["p50_us"], "armed_p50_us": ar["p50_us"],
                             "launch_p50_us": ln["p50_us"], "eager_p50_us": e["p50_us"],
                             "graph_p50_us": g["p50_us"], "ring_vs_eager": e["p50_us"] / t2_ring[n]["p50_us"]})
    benchreport.print_table("T9: SM footprint / interference", t9 + [footprint])
    benchreport.print_table("T7: trigger cost", t7, ["what", "p50_us", "p99_us", "min_us", "gb_s"])
    benchreport.print_table("T7h: host fast paths (C and Python) over ordinary memory (no GPU)", host,
                            ["what", "impl", "p50_us", "p99_us", "min_us", "speedup_vs_python"])
    benchreport.print_table("T2-4: add, round trip from Python (all ops in the JSON)", summary_rows)


if __name__ == "__main__":
    main()
    import os

    os._exit(0)
