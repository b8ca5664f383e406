"""One process of the guard benchmark (run by bench_guard.py and tests/gpu/test_instrument_guard_gpu.py).

  python3 experiments/guard_workload.py [--steps a,b,...] [--step-timeout S]

A resident executor that never leaves by itself (idle timeout and lease 10 minutes) stays attached while the
process does what a user's program does: eager kernels launched for the first time, cuBLAS's first call, a new
Triton kernel, a torch.compile'd function, empty_cache, a device-wide synchronize, a Qwen3 model built and
decoding. Nothing here calls the guard: no Python hooks are installed (guard.install() is called and must
report the native guard). Before every step the executor runs a task (it is resident again); each step runs
under faulthandler's watchdog, a C thread that needs no GIL, so a step stuck inside a driver call prints its
stack and exits with code 1 instead of hanging CI. Prints "STEP <name>" as each starts, a JSON line per step,
and a final JSON line.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments"))  # concordia_lab: the instrumentation and the executor

STEPS = ("eager", "cublas", "triton", "compile", "empty_cache", "synchronize", "qwen3")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--step-timeout", type=float, default=120.0)
    ap.add_argument("--compile-timeout", type=float, default=300.0)
    ap.add_argument("--no-hooks", action="store_true", help="install no guard hooks at all (the control run)")
    ns = ap.parse_args()

    import torch

    from concordia_lab.executor import guard
    from concordia_lab.executor import ring as R
    from concordia_lab.executor.resident import ExecutorOptions, ResidentExecutor

    torch.cuda.init()
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")  # the context; first kernels come in the steps
    ng = guard.native()
    hooks = [] if ns.no_hooks else guard.install()
    ex = ResidentExecutor(ExecutorOptions(capacity=256, idle_timeout_ms=600_000, lease_ms=600_000))

    def attached() -> None:
        t = ex.submit(R.Opcode.NOP)
        ex.wait(t, 60.0)
        assert ex.state == R.ConsumerState.RUNNING, ex.state

    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x, y, out, n, a, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(out + i, a * tl.load(x + i, mask=m) + tl.load(y + i, mask=m), mask=m)

    def eager() -> None:
        x = torch.randn(4096, 257, device="cuda")
        y = (x.sin() * x.cos()).softmax(-1).cumsum(-1)
        z = torch.nn.functional.layer_norm(y, (257,)).topk(3, dim=-1).values
        float(z.abs().sum())

    def cublas() -> None:
        a = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16)
        c = torch.randn(333, 777, device="cuda") @ torch.randn(777, 129, device="cuda")
        float((a @ b).float().sum() + c.sum())

    def triton_kernel() -> None:
        x = torch.randn(100_000, device="cuda")
        y = torch.randn_like(x)
        out = torch.empty_like(x)
        axpy[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), 2.5, BLOCK=1024)
        ref = 2.5 * x.double() + y.double()  # the kernel fuses to one FMA: compare against float64
        err = float((out.double() - ref).abs().max())
        assert err < 1e-5, f"axpy differs from the float64 reference by {err}"

    def compiled() -> None:
        @torch.compile
        def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x @ w) * x.sum(-1, keepdim=True).sigmoid()

        x = torch.randn(64, 256, device="cuda")
        w = torch.randn(256, 256, device="cuda")
        for _ in range(3):
            y = f(x, w)
        ref = torch.nn.functional.silu(x @ w) * x.sum(-1, keepdim=True).sigmoid()
        assert torch.allclose(y, ref, atol=1e-3, rtol=1e-3)

    def empty_cache() -> None:
        big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        big.fill_(1)
        del big
        torch.cuda.empty_cache()  # cudaFree of the cached segment

    extra: dict[str, dict[str, object]] = {}

    def sync_calls(st: dict[str, object]) -> int:
        calls = st.get("calls", {})
        assert isinstance(calls, dict)
        return int(calls.get("cuCtxSynchronize", 0)) + int(calls.get("cuCtxSynchronize_v2", 0))

    def synchronize() -> None:
        torch.ones(8, device="cuda").mul_(3)  # any first launches here, before the executor is resident again
        attached()
        before = ng.stats() if ng else {}
        torch.cuda.synchronize()  # cuCtxSynchronize(_v2): waits for every stream, the executor's included
        after = ng.stats() if ng else {}
        if after:  # the synchronize call alone: which driver entry it reached, and that it stepped aside
            tb, ta = before.get("trace_calls", {}), after.get("trace_calls", {})
            extra["synchronize"] = {
                "sync_calls": sync_calls(after) - sync_calls(before),
                "sync_stepped_aside": after["stepped_aside"] - before["stepped_aside"],
                "sync_driver_calls": {k: v - tb.get(k, 0) for k, v in ta.items() if v != tb.get(k, 0)}}

    def qwen3() -> None:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
        model = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.shape[1] == 28

    actions: dict[str, Callable[[], None]] = {"eager": eager, "cublas": cublas, "triton": triton_kernel,
                                              "compile": compiled, "empty_cache": empty_cache,
                                              "synchronize": synchronize, "qwen3": qwen3}
    # a runtime's traffic: tasks every ~0.5 ms from another thread, so the executor is relaunched right after
    # each hazard and is resident again for the next one (not only at the start of a step)
    pulse = {"tasks": 0, "run": True, "error": ""}

    def pulser() -> None:
        while pulse["run"]:
            try:
                ex.wait(ex.submit(R.Opcode.NOP), 600.0)
            except Exception as e:  # noqa: BLE001 - reported in the final line
                pulse["error"] = repr(e)
                return
            pulse["tasks"] += 1
            time.sleep(0.0005)

    th = threading.Thread(target=pulser, daemon=True)
    th.start()
    rows = []
    for name in ns.steps.split(","):
        attached()
        before = ng.stats() if ng else {}
        launches, tasks = ex.launches, pulse["tasks"]
        print(f"STEP {name}", flush=True)
        faulthandler.dump_traceback_later(ns.compile_timeout if name == "compile" else ns.step_timeout, exit=True)
        t0 = time.perf_counter()
        actions[name]()
        dt = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        attached()  # still serving tasks after the step
        after = ng.stats() if ng else {}
        row = {"step": name, "s": round(dt, 3), "executor_relaunches": ex.launches - launches,
               "tasks_during": pulse["tasks"] - tasks}
        for k in ("hazards", "stepped_aside", "first_launches", "timeouts", "unguarded_loads"):
            if k in after:
                row[k] = after[k] - before[k]
        if after:
            row["wait_ms_max"] = round(after["wait_ns_max"] / 1e6, 3)
            row["unguarded"] = after["unguarded"][len(before["unguarded"]):]
        row.update(extra.get(name, {}))
        rows.append(row)
        print(json.dumps(row), flush=True)
    pulse["run"] = False
    th.join(60)
    ex.close()
    if pulse["error"]:
        print(f"pulse thread failed: {pulse['error']}", flush=True)
        return 2
    final = ng.stats() if ng else {}
    print(json.dumps({"native_guard": ng is not None, "hooks": hooks, "rows": rows,
                      "guard": {k: v for k, v in final.items() if k not in ("unguarded", "trace_calls")},
                      "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default: LAZY)")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
