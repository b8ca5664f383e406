"""The per-step cost of an asynchronous LoRA epoch on the training thread, on a CPU: before vs after.

What is timed is exactly what bench_llm's ``delta_ms_async`` times on the GPU: ``StepResult.checkpoint_s`` of
``LoraTrainer.train_step`` with ``async_checkpoint=True`` (copy the RNG state, build the metadata,
``Runtime.checkpoint_async``, settle the previous step's result), plus ``PendingEpoch.call_seconds`` (the
``checkpoint_async`` call alone). The model has Qwen2.5-0.5B's structure (24 layers, r on all seven projections:
336 adapter tensors, so as many AdamW step counters) with tiny dimensions, so the adapter and moments are a
few hundred KB: on a CPU they are host tensors (a memcpy each), and what the number shows is the Python of the
call, which is what the H200 run was missing its target on. GPU-only work (the CUDA dense batch's D2D copy
and event) is not in this number: bench_llm.py --only lora measures it.

"Before vs after in the same run": ``--baseline-src DIR`` names the ``src`` folder of another tree (e.g.
``git archive <commit> src | tar -x -C /tmp/cft-base`` gives ``/tmp/cft-base/src``); child processes of the
two trees then run in alternating rounds (same machine, same minutes), each round its own process, and the
table compares their medians.

Usage: python experiments/bench_lora_call.py [--baseline-src DIR [--baseline-commit C]] [--rounds 6] [--steps 100]
       [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


# ------------------------------------------------------------------------------------------------ child
def run_child(steps: int, warmup: int, rank: int, profile: bool) -> dict[str, Any]:
    """One process: train ``warmup + steps`` async steps, return the per-step call times (us)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import concordia_ft
    from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch

    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=24,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    log_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="cft-lora-call-", dir=log_root))
    t = LoraTrainer(model, d / "log", lora_config=default_lora_config(r=rank), lr=1e-3,
                    backend="dram" if log_root else "file", async_checkpoint=True,
                    runtime_options={"compact_after_bytes": None})
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        orig = t.runtime.checkpoint_async

        def profiled(*a: Any, **kw: Any) -> Any:
            prof.enable()
            try:
                return orig(*a, **kw)
            finally:
                prof.disable()

        t.runtime.checkpoint_async = profiled  # type: ignore[method-assign]
    step_us, call_us, waited = [], [], 0
    try:
        for k in range(warmup + steps):
            res = t.train_step(synthetic_batch(k, vocab=cfg.vocab_size, batch=1, seq=8))
            if k < warmup:
                continue
            step_us.append(1e6 * res.checkpoint_s)
            call_us.append(1e6 * t.runtime.in_flight.call_seconds)
            waited += res.backpressure_s > 50e-6
        t.wait()
        regions = sorted(sp.name for sp in t.runtime.table)
        ok = all(r.durable for r in t.stats.results)
    finally:
        t.close()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
    from benchreport import git_commit

    out = {"commit": git_commit(Path(concordia_ft.__file__).resolve().parent), "checkpoint_s_us": step_us,
           "call_us": call_us, "backpressure_waits": waited, "regions": regions, "all_durable": ok,
           "adapter_params": t.n_adapter_params, "adapter_tensors": len(t.param_names)}
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out["profile"] = buf.getvalue()
    return out


# ------------------------------------------------------------------------------------------------ parent
def spawn(src: Path, a: argparse.Namespace, profile: bool = False) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(a.steps), "--warmup",
            str(a.warmup), "--rank", str(a.rank)] + (["--profile"] if profile else [])
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"child for {src} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-src", type=Path, default=None, help="src/ of the tree to compare against")
    ap.add_argument("--baseline-commit", default=None, help="the commit that tree is (recorded in the results)")
    ap.add_argument("--rounds", type=int, default=6, help="processes per tree, alternating")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rank", type=int, default=1, help="LoRA r (1: the smallest host copies)")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of checkpoint_async per tree")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_child(a.steps, a.warmup, a.rank, a.profile)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
    from benchreport import median, percentile, print_table, write_results

    trees = {"this tree": SRC}
    if a.baseline_src is not None:
        trees = {"baseline": a.baseline_src.resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(a.rounds):
        for name, src in trees.items():
            t0 = time.time()
            runs[name].append(spawn(src, a))
            print(f"round {r + 1}/{a.rounds} {name}: median {median(runs[name][-1]['checkpoint_s_us']):.1f} us "
                  f"({time.time() - t0:.0f} s)", flush=True)
    rows = []
    for name, rs in runs.items():
        step = [x for r in rs for x in r["checkpoint_s_us"]]
        call = [x for r in rs for x in r["call_us"]]
        rows.append({"tree": name, "commit": rs[0]["commit"], "regions": ",".join(rs[0]["regions"]),
                     "steps": len(step), "checkpoint_s_us_median": median(step),
                     "checkpoint_s_us_p90": percentile(step, 90),
                     "call_us_median": median(call), "call_us_p90": percentile(call, 90),
                     "round_medians_us": [round(median(r["checkpoint_s_us"]), 1) for r in rs],
                     "backpressure_waits": sum(r["backpressure_waits"] for r in rs),
                     "all_durable": all(r["all_durable"] for r in rs),
                     "adapter_params": rs[0]["adapter_params"], "adapter_tensors": rs[0]["adapter_tensors"]})
    if len(rows) == 2:
        base, new = rows
        if a.baseline_commit:
            base["commit"] = a.baseline_commit
        new["vs_baseline_x"] = base["checkpoint_s_us_median"] / max(1e-9, new["checkpoint_s_us_median"])
        new["call_vs_baseline_x"] = base["call_us_median"] / max(1e-9, new["call_us_median"])
    if a.profile:
        for name, src in trees.items():
            print(f"\n=== cProfile of checkpoint_async, {name} ({src})\n{spawn(src, a, profile=True)['profile']}")
    note = ("CPU; tiny Qwen2-structured model (24 layers, r on 7 projections); per-step call on the training "
            "thread (StepResult.checkpoint_s) and the checkpoint_async call alone; trees alternate by process")
    path = write_results("lora_call", rows[-1:], baseline=rows[:-1], notes=note, out_dir=a.out_dir)
    print_table("async LoRA epoch: the call on the training thread (us)", rows,
                ["tree", "regions", "steps", "checkpoint_s_us_median", "checkpoint_s_us_p90", "call_us_median",
                 "call_us_p90", "round_medians_us", "vs_baseline_x", "call_vs_baseline_x"])
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
