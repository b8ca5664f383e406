"""Safe points in an Inductor-compiled Qwen3 decoder layer (Qwen3-0.6B dimensions, bf16, random weights).

In one process (Inductor compiling in-process, so Triton's stages hook sees every kernel):
- the layer compiled by torch.compile WITHOUT probes (the baseline a user runs) and compiled again with
  ``triton_hook.install()`` (every Triton kernel Inductor generates gets entry/exit probes, disarmed, as they
  run between pauses); each variant has its own Inductor and Triton caches; the two are timed alternately
  (median of rounds of triton.testing.do_bench): layer time, tokens/s, overhead;
- one Inductor-generated kernel of the instrumented layer, taken with the arguments it was launched with
  (captured at CachingAutotuner.run), launched as a PausableLaunch and paused mid-grid: the pause is written by
  a GPU stream after a calibrated torch.cuda._sleep, so it lands inside a kernel of a few microseconds
  (a host write takes ~100 us); resumed, its output is compared bit for bit with the same kernel compiled
  without probes.
Writes benchmarks/results/qwen3_probes-<tag>.json.  Run: python3 benchmarks/bench_qwen3_probes.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
_TMP = tempfile.mkdtemp(prefix="cft-qwen3-probes-")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # in-process: the stages hook sees the compiles
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_TMP, "inductor-plain")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from concordia_ft.benchreport import median, write_results  # noqa: E402
from concordia_ft.instrument import triton_hook  # noqa: E402


def make_layer(batch: int, seq: int) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, max_position_embeddings=40960)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(cfg, layer_idx=0).to("cuda", torch.bfloat16).eval()
    rot = Qwen3RotaryEmbedding(cfg).to("cuda")
    x = torch.randn(batch, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    cos, sin = rot(x, pos)

    def fwd(h: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        o = layer(h, attention_mask=None, position_ids=pos, position_embeddings=(c, s))
        return o[0] if isinstance(o, tuple) else o

    shape = {"batch": batch, "seq": seq, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
             "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}
    return fwd, (x, cos, sin), shape


def _clear_inductor_memory_caches() -> None:
    from torch._inductor import codecache

    for owner, name in ((codecache.PyCodeCache, "cache_clear"),):
        fn = getattr(owner, name, None)
        if fn is not None:
            try:
                fn(purge=False)
            except TypeError:
                fn()
    try:
        from torch._inductor.async_compile import CompiledTritonKernels

        CompiledTritonKernels.cache_clear()
    except (ImportError, AttributeError):
        pass


def compile_variant(fwd: Any, inputs: tuple[Any, ...], tag: str) -> tuple[Any, Any, list[str]]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _clear_inductor_memory_caches()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_TMP, f"inductor-{tag}")
    f = torch.compile(fwd, dynamic=False)
    with torch.no_grad():
        y, codes = run_and_get_code(f, *inputs)
    torch.cuda.synchronize()
    names = sorted(set(re.findall(r"def (triton_\w+)\(", "\n".join(codes))))
    return f, y, names


def time_alternating(fs: dict[str, Any], inputs: tuple[Any, ...], rounds: int) -> dict[str, list[float]]:
    ts: dict[str, list[float]] = {k: [] for k in fs}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in fs.items():
                ts[k].append(float(triton.testing.do_bench(lambda f=f: f(*inputs), warmup=10, rep=150,
                                                           return_mode="median")))
    return ts


def capture_launches(f: Any, inputs: tuple[Any, ...]) -> list[tuple[Any, list[Any]]]:
    """Every Inductor kernel launch of one call: (CachingAutotuner, its arguments cloned at launch)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    seen: list[tuple[Any, list[Any]]] = []
    orig = CachingAutotuner.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((self, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
        return orig(self, *args, **kwargs)

    CachingAutotuner.run = run
    try:
        with torch.no_grad():
            f(*inputs)
        torch.cuda.synchronize()
    finally:
        CachingAutotuner.run = orig
    return seen


def pause_inductor_kernel(seen: list[tuple[Any, list[Any]]], trials: int) -> dict[str, Any]:
    from cuda.bindings import driver as drv

    from concordia_ft.instrument.pause import PausableLaunch
    from concordia_ft.instrument.safepoints import CTL_PAUSE

    cands = []
    for kern, args in seen:
        cfg = kern.launchers[0].config
        names = [n for n in kern.fn.arg_names if n not in cfg.kwargs]
        if "ynumel" in names or "xnumel" not in names or len(names) != len(args):
            continue
        xnumel = int(args[names.index("xnumel")])
        xblock = int(cfg.kwargs.get("XBLOCK", 1))
        if kern.inductor_meta.get("grid_type", "Grid1D") not in ("Grid1D",):
            continue
        cands.append((triton.cdiv(xnumel, xblock), kern, args, cfg, names))
    if not cands:
        return {"error": "no 1-D Inductor kernel found", "kernels": [k.fn.__name__ for k, _ in seen]}
    nblk, kern, args, cfg, names = max(cands, key=lambda c: c[0])
    grid = (nblk, 1, 1)
    kw = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    fresh = lambda: [a.clone() if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
    outs = [i for i, n in enumerate(names) if n.startswith(("out_ptr", "in_out_ptr"))]
    with triton_hook.suspended():
        plain = triton.JITFunction(kern.fn.fn)
        ref_args = fresh()
        plain[grid](*ref_args, **kw)
    torch.cuda.synchronize()
    inst = triton.JITFunction(kern.fn.fn)
    run_args = fresh()
    launch = PausableLaunch(inst, grid, run_args, kw)
    # one full armed launch: its time, and the blocks the GPU runs at once
    launch.start()
    launch.drain()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    launch.start()
    e1.record()
    launch.drain()
    kernel_us = 1e3 * e0.elapsed_time(e1)
    side = torch.cuda.Stream()
    rows = []
    hz = torch.cuda.get_device_properties(0).clock_rate * 1e3 if hasattr(torch.cuda.get_device_properties(0),
                                                                           "clock_rate") else 1.98e9
    for i in range(trials):
        frac = 0.05 + 0.6 * i / max(1, trials - 1)
        cycles = max(1, int(frac * kernel_us * 1e-6 * hz))
        for j, a in enumerate(run_args):
            if isinstance(a, torch.Tensor):
                a.copy_(args[j])
        launch.ctl.zero_()
        # hold the stream while the host enqueues: the kernel then starts right after the start event, and the
        # pause (side stream) lands `cycles` later whatever the host's launch latency
        torch.cuda._sleep(int(300e-6 * hz))
        start = torch.cuda.Event()
        start.record()
        with torch.cuda.stream(side):  # the pause, written by the GPU `cycles` after the launch starts
            side.wait_event(start)
            torch.cuda._sleep(cycles)
            res = drv.cuStreamWriteValue32(drv.CUstream(side.cuda_stream), launch.ctl.data_ptr() + CTL_PAUSE, 1, 0)
            if int(res[0]) != 0:  # no stream memory ops: a copy from pinned memory, ordered the same way
                one = torch.ones(1, dtype=torch.int32).pin_memory()
                launch.ctl[CTL_PAUSE // 4 : CTL_PAUSE // 4 + 1].copy_(one, non_blocking=True)
        launch._launch()
        torch.cuda.synchronize()
        pending = len(launch.pending())
        launch.resume()
        launch.drain()
        torch.cuda.synchronize()
        eq = all(torch.equal(run_args[k], ref_args[k]) for k in outs) and not launch.pending()
        rows.append({"sleep_cycles": cycles, "pending_after_pause": pending, "bit_equal": bool(eq),
                     "write_ok": int(res[0]) == 0})
    rep = triton_hook.report(launch.name)
    return {"kernel": kern.fn.__name__, "blocks": nblk, "config": {k: str(v) for k, v in kw.items()},
            "kernel_us_armed": kernel_us, "instrumented": bool(rep and rep.instrumented),
            "deferred_vote": bool(rep and rep.deferred_vote), "outputs": [names[k] for k in outs],
            "trials": rows, "partial_pauses": sum(1 for r in rows if 0 < r["pending_after_pause"] < nblk),
            "bit_equal_all": all(r["bit_equal"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--pause-only", action="store_true", help="compile the instrumented layer and pause one of "
                                                                "its kernels; no timing (name: qwen3_pause)")
    ns = ap.parse_args()
    t_start = time.perf_counter()
    fwd, inputs, shape = make_layer(ns.batch, ns.seq)
    tokens = ns.batch * ns.seq
    summary: dict[str, Any] = {"shape": shape, "tokens_per_call": tokens}
    rows: list[dict[str, Any]] = []
    if ns.pause_only:
        try:
            triton_hook.install()
            f_probe, _, k_probe = compile_variant(fwd, inputs, "probes")
            summary["kernels_probes"] = k_probe
            summary["pause"] = pause_inductor_kernel(capture_launches(f_probe, inputs), ns.trials)
        except Exception:  # noqa: BLE001
            summary["pause"] = {"error": traceback.format_exc()[-2500:]}
        print("pause:", json.dumps(summary["pause"])[:1500], flush=True)
        summary["wall_s"] = time.perf_counter() - t_start
        path = write_results("qwen3_pause", [{"variant": "summary", **summary}], out_dir=ns.out_dir,
                             notes="an Inductor kernel of the compiled layer paused mid-grid (GPU-timed stream "
                                   "write) and resumed, against the same kernel compiled without probes")
        print(path)
        return 0 if summary["pause"].get("bit_equal_all") and summary["pause"].get("partial_pauses") else 1
    try:
        with torch.no_grad():
            y_eager = fwd(*inputs)
        triton_hook.uninstall()
        f_plain, y_plain, k_plain = compile_variant(fwd, inputs, "plain")
        triton_hook.install()
        f_probe, y_probe, k_probe = compile_variant(fwd, inputs, "probes")
        reps = triton_hook.reports()
        inst = [k for k in k_probe if k in reps and reps[k].instrumented]
        refused = {k: reps[k].refused for k in k_probe if k in reps and not reps[k].instrumented}
        summary.update(kernels_plain=len(k_plain), kernels_probes=len(k_probe), kernels_instrumented=len(inst),
                       kernels_refused=refused, kernels_unseen_by_hook=[k for k in k_probe if k not in reps],
                       deferred_votes=sum(1 for k in inst if reps[k].deferred_vote),
                       probes_output_equal_plain=bool(torch.equal(y_plain, y_probe)),
                       compiled_vs_eager_max_abs=float((y_plain.float() - y_eager.float()).abs().max()))
        ts = time_alternating({"eager": fwd, "compiled": f_plain, "compiled_probes": f_probe}, inputs, ns.rounds)
        med = {k: median(v) for k, v in ts.items()}
        for k, v in ts.items():
            rows.append({"variant": k, "layer_ms": med[k], "tokens_per_s": tokens / (med[k] / 1e3),
                         "rounds_ms": v})
        summary.update(layer_ms_compiled=med["compiled"], layer_ms_probes=med["compiled_probes"],
                       probe_overhead_pct=100 * (med["compiled_probes"] / med["compiled"] - 1),
                       tokens_per_s_compiled=tokens / (med["compiled"] / 1e3),
                       tokens_per_s_probes=tokens / (med["compiled_probes"] / 1e3))
        print(f"layer: compiled {med['compiled']:.3f} ms, with probes {med['compiled_probes']:.3f} ms "
              f"({summary['probe_overhead_pct']:+.2f}%), eager {med['eager']:.3f} ms; "
              f"{len(inst)}/{len(k_probe)} kernels instrumented", flush=True)
        try:
            seen = capture_launches(f_probe, inputs)
            summary["pause"] = pause_inductor_kernel(seen, ns.trials)
        except Exception:  # noqa: BLE001 - reported in the results, the timing above stays
            summary["pause"] = {"error": traceback.format_exc()[-2500:]}
        print("pause:", {k: v for k, v in summary["pause"].items() if k != "trials"}, flush=True)
    except Exception:  # noqa: BLE001
        summary["error"] = traceback.format_exc()[-3000:]
        print(summary["error"], flush=True)
    summary["wall_s"] = time.perf_counter() - t_start
    path = write_results("qwen3_probes", rows + [{"variant": "summary", **summary}],
                         baseline=[r for r in rows if r["variant"] == "compiled"],
                         notes="baseline = the same layer compiled by torch.compile without probes; probes are "
                               "entry/exit safe points, disarmed (how they run between pauses)",
                         out_dir=ns.out_dir)
    print(path)
    ok = "error" not in summary and summary.get("pause", {}).get("bit_equal_all") is True
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
