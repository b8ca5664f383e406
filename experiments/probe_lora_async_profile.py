"""Where does an asynchronous LoRA epoch's time on the training thread go? The bench_llm LoRA setup
(Qwen2.5-0.5B dims, r=8, AdamW, weights registered immutable), two phases in one process:

1. clean timing (no profiler): per step, ``StepResult.checkpoint_s`` (what bench_llm's ``delta_ms_async``
   reports) split into its pieces by thin wrappers: reading the CPU RNG state (``torch.get_rng_state``, whose
   5 KB allocation is the first sizeable one after a step), building the metadata, ``Runtime.checkpoint_async``
   (``call_seconds``: backpressure, staging, the job; then the writer's wake-up), settling the previous step's
   result, and what is left (the copy of the RNG state into ``lora.state``, the timers);
2. cProfile of ``Runtime.checkpoint_async`` over the same number of steps.

It also prints how the runtime stages the dense regions (the batches and their D2D copies: the adapter and
both moments are one arena, so ONE copy when the adapter is a whole number of pages).

Usage: python experiments/probe_lora_async_profile.py [--steps 24] [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_llm  # noqa: E402


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            into.append((time.perf_counter_ns() - t0) / 1e3)

    return wrapper


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="on a CPU: 2 layers, vocab 4096 (the code path only)")
    a = ap.parse_args()
    import torch

    from concordia_ft.integrations import peft as lora
    from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch

    cfg, seq, _ = bench_llm.lora_config(a.device, a.quick)
    base = bench_llm.build(cfg, a.device)
    shm = Path("/dev/shm")
    d = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    t = LoraTrainer(base, d / "log", lr=1e-4, backend="dram" if shm.is_dir() else "file", log_weights=True,
                    async_checkpoint=True, runtime_options=bench_llm.RT_OPTS)
    rt = t.runtime

    def batch(k: int) -> dict[str, torch.Tensor]:
        return synthetic_batch(k, vocab=cfg.vocab_size, batch=1, seq=seq, device=a.device)

    for k in range(3):
        t.train_step(batch(k))
    t.wait()

    # 1. clean timing, the call split into its pieces
    parts: dict[str, list[float]] = {k: [] for k in ("rng_read", "meta", "checkpoint_async", "settle")}
    step_us, call_us = [], []
    real = (torch.get_rng_state, t._meta, rt.checkpoint_async, t._settle)
    lora.torch.get_rng_state = timed(torch.get_rng_state, parts["rng_read"])  # type: ignore[attr-defined]
    t._meta = timed(t._meta, parts["meta"])  # type: ignore[method-assign]
    rt.checkpoint_async = timed(rt.checkpoint_async, parts["checkpoint_async"])  # type: ignore[method-assign]
    t._settle = timed(t._settle, parts["settle"])  # type: ignore[method-assign]
    try:
        for _ in range(a.steps):
            res = t.train_step(batch(t.step))
            step_us.append(1e6 * res.checkpoint_s)
            call_us.append(1e6 * rt.in_flight.call_seconds)
        t.wait()
    finally:
        lora.torch.get_rng_state = real[0]  # type: ignore[attr-defined]
        t._meta, rt.checkpoint_async, t._settle = real[1], real[2], real[3]  # type: ignore[method-assign]
    n = len(step_us)
    settle = parts["settle"][:n]  # once per step after the call; the last one is the final wait()'s
    rest = [s - sum(p[i] for p in (parts["rng_read"], parts["meta"], parts["checkpoint_async"], settle))
            for i, s in enumerate(step_us)]
    print(f"per-step call on the training thread, medians of {n} steps (us):")
    print(f"  StepResult.checkpoint_s {med(step_us):8.1f}  (p90 {sorted(step_us)[int(0.9 * (n - 1))]:.1f})")
    print(f"    torch.get_rng_state   {med(parts['rng_read'][-n:]):8.1f}")
    print(f"    metadata dict         {med(parts['meta'][-n:]):8.1f}")
    print(f"    checkpoint_async      {med(parts['checkpoint_async'][-n:]):8.1f}   of which call_seconds "
          f"{med(call_us):.1f} (the rest: waking the writer)")
    print(f"    settle previous step  {med(settle[-n:]):8.1f}")
    print(f"    rest (RNG copy, timers) {med(rest):6.1f}")
    print("dense batches (region: D2D copies):")
    plan = getattr(rt, "_plan", None)  # None: a tree from before dense batches (one stage per region)
    for _, names, b in plan.batches if plan is not None else []:
        copies = getattr(b, "copies", None)
        print(f"  {type(b).__name__}: {list(names)} -> {len(copies) if copies is not None else 'host copies'}"
              + (f" copies of {[c[2] for c in copies]} bytes" if copies is not None else ""))
    print("regions:", [(nm, tr.spec.kind.value, tr.spec.nbytes) for nm, tr in rt._trackers.items()
                       if tr.spec.kind.value != "immutable"], "trackers in all:", len(rt._trackers))

    # 2. cProfile of the checkpoint_async call
    orig = rt.checkpoint_async
    prof = cProfile.Profile()
    calls: list[float] = []

    def profiled(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        prof.enable()
        try:
            return orig(*args, **kw)
        finally:
            prof.disable()
            calls.append(1e3 * (time.perf_counter() - t0))

    rt.checkpoint_async = profiled  # type: ignore[method-assign]
    for _ in range(a.steps):
        t.train_step(batch(t.step))
    t.wait()
    print("checkpoint_async ms under cProfile:", [round(c, 3) for c in calls])
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(25)
    t.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
