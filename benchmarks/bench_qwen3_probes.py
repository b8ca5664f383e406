"""Safe points in an Inductor-compiled Qwen3 decoder layer (Qwen3-0.6B dimensions, bf16, random weights).

In one process (Inductor compiling in-process, so Triton's stages hook sees every kernel):
- probe cost: the layer compiled by torch.compile WITHOUT probes (the baseline a user runs) and compiled again
  with ``triton_hook.install()`` (each variant with its own Inductor and Triton caches), timed alternately
  (median of rounds of triton.testing.do_bench): the probes disarmed (how they run between pauses) and ARMED
  (every kernel's module global points at a zeroed control block: each probe loads the pause word and its done
  word, votes, and each block sets its done bit at exit), the armed call preceded by the one memset that
  zeroes the control blocks (what an armed caller does before each call; the baseline plus that memset alone
  is timed too); layer time, tokens/s, overheads; armed output bit-equal to the plain variant's and every block
  of every kernel recorded done;
- pause mid-grid, per Inductor kernel of the layer (largest grids first): the kernel taken with the arguments
  and grid it was launched with, as a PausableLaunch, paused by the GPU itself: a one-block trigger kernel on a
  side stream counts the launch's done bits while it runs and writes the pause word once 1/4, 1/2, 3/4 of the
  blocks have finished (``pause.GpuPauseTrigger``: a definite point, no host timer); pause latency = trigger's
  write -> launch drained (CUDA events); resumed, the output is compared bit for bit with the same kernel
  compiled without probes; beside it one block's run time (the plain kernel launched with one wave of
  blocks: every resident slot busy, as during the pause) and one block alone.
Writes benchmarks/results/qwen3_probes-<tag>.json (rewritten after each stage, so a run cut short keeps what
it measured).  Run: python3 benchmarks/bench_qwen3_probes.py --out-dir DIR [--budget-s S]
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


def make_layers(n: int, batch: int, seq: int) -> tuple[Any, list[dict[str, Any]], tuple[Any, ...], dict[str, Any]]:
    """n Qwen3 decoder layers (distinct random weights) and fwd(params, h, cos, sin): one layer's forward with
    the given layer's parameters (torch.func.functional_call), so that one compiled graph serves every layer
    of a stack (the parameters are its inputs) with no recompilation."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, max_position_embeddings=40960)
    cfg._attn_implementation = "sdpa"
    layers = []
    for i in range(n):
        torch.manual_seed(i)
        with torch.device("cuda"):
            layers.append(Qwen3DecoderLayer(cfg, layer_idx=0).to(torch.bfloat16).eval())
    layer0 = layers[0]
    params = [{k: v.detach() for k, v in lay.named_parameters()} for lay in layers]
    rot = Qwen3RotaryEmbedding(cfg).to("cuda")
    torch.manual_seed(1234)
    x = torch.randn(batch, seq, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    cos, sin = rot(x, pos)

    def fwd(p: dict[str, Any], h: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        o = torch.func.functional_call(layer0, p, (h,), {"attention_mask": None, "position_ids": pos,
                                                          "position_embeddings": (c, s)})
        return o[0] if isinstance(o, tuple) else o

    shape = {"batch": batch, "seq": seq, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
             "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim}
    return fwd, params, (x, cos, sin), shape


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
    """torch.compile a copy of fwd with a code object of its own: Dynamo keeps compiled code per code object,
    so the plain and the instrumented variant never share (or replace) each other's cache entry."""
    import types

    from torch._inductor.utils import run_and_get_code

    _clear_inductor_memory_caches()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_TMP, f"inductor-{tag}")
    code = fwd.__code__.replace(co_name=f"{fwd.__name__}_{tag}")
    g = types.FunctionType(code, fwd.__globals__, code.co_name, fwd.__defaults__, fwd.__closure__)
    f = torch.compile(g, dynamic=False)
    with torch.no_grad():
        y, codes = run_and_get_code(f, *inputs)
    torch.cuda.synchronize()
    names = sorted(set(re.findall(r"def (triton_\w+)\(", "\n".join(codes))))
    return f, y, names


def time_alternating(fs: dict[str, Any], inputs: tuple[Any, ...], rounds: int, rep: int,
                     before: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """Median ms of each variant per round, variants alternating; before[k]() runs ahead of variant k's round
    (arming or disarming the probes' globals: an untimed host write)."""
    ts: dict[str, list[float]] = {k: [] for k in fs}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in fs.items():
                if before and k in before:
                    before[k]()
                ts[k].append(float(triton.testing.do_bench(lambda f=f: f(*inputs), warmup=10, rep=rep,
                                                           return_mode="median")))
    return ts


def ev_ms(fn: Any, reps: int) -> float:
    """Median GPU time of fn() by CUDA events, ms."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return median(out)


def pause_kernel(k: Any, trigger: Any, fractions: tuple[float, ...]) -> dict[str, Any]:
    """One Inductor kernel of the layer, launched with its captured arguments and grid: paused by the GPU
    trigger at each fraction of finished blocks, resumed, compared bit for bit with the plain compile."""
    from cuda.bindings import driver as drv

    from concordia_ft.cuda import driver as cd
    from concordia_ft.instrument.pause import PausableLaunch

    kern, args, grid = k.autotuner, k.args, k.grid
    cfg = kern.launchers[0].config
    names = [n for n in kern.fn.arg_names if n not in cfg.kwargs]
    if len(names) != len(args):
        return {"kernel": k.name, "skipped": f"{len(args)} launch arguments for {len(names)} parameters"}
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
    nblk = launch.nblocks
    # resident slots: blocks of this kernel the GPU runs at once
    per_sm = int(cd.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        launch.kernel.function, 32 * cfg.num_warps, int(launch.kernel.metadata.shared)), "occupancy"))
    slots = per_sm * cd.sm_count()
    row: dict[str, Any] = {"kernel": k.name, "grid": list(grid), "blocks": nblk, "num_warps": cfg.num_warps,
                           "config": {kk: str(v) for kk, v in cfg.kwargs.items()}, "blocks_per_sm": per_sm,
                           "resident_slots": slots, "waves": round(nblk / max(1, slots), 2)}
    rep = triton_hook.report(launch.name)
    row["deferred_vote"] = bool(rep and rep.deferred_vote)
    scratch = fresh()
    with triton_hook.suspended():
        row["plain_kernel_us"] = 1e3 * ev_ms(lambda: plain[grid](*scratch, **kw), 7)
        if grid[1] == grid[2] == 1:  # one wave of the same blocks (rows from the start): one block's run time
            wave = (min(slots, nblk), 1, 1)
            row["block_us_one_wave"] = 1e3 * ev_ms(lambda: plain[wave](*scratch, **kw), 7)
            row["block_us_alone"] = 1e3 * ev_ms(lambda: plain[(1, 1, 1)](*scratch, **kw), 7)
    row["block_us_from_waves"] = row["plain_kernel_us"] / max(1.0, nblk / max(1, slots))

    def full_armed() -> None:
        launch.ctl.zero_()
        launch._launch()

    row["armed_kernel_us"] = 1e3 * ev_ms(full_armed, 7)
    # a launch in which every block is done (they all leave at entry): what the blocks not started yet cost
    # a pause, per block, beside the drain of the running ones
    row["all_done_launch_us"] = 1e3 * ev_ms(launch._launch, 7)
    row["skip_ns_per_block"] = 1e3 * row["all_done_launch_us"] / nblk
    side = torch.cuda.Stream()
    side_d = cd.Stream.borrow(side.cuda_stream)
    trials = []
    for frac in fractions:
        thr = max(1, int(frac * nblk))
        for j, a in enumerate(run_args):
            if isinstance(a, torch.Tensor):
                a.copy_(args[j])
        launch.ctl.zero_()
        zeroed = torch.cuda.Event()
        zeroed.record()
        side.wait_event(zeroed)  # the trigger must not read the previous trial's done bits
        trigger.arm(launch, thr, side_d, timeout_s=0.5)
        flag = torch.cuda.Event(enable_timing=True)
        flag.record(side)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        launch._launch()
        e1.record()
        torch.cuda.synchronize()
        trig = trigger.result()
        pending = len(launch.pending())
        launch.resume()
        launch.drain()
        torch.cuda.synchronize()
        eq = all(torch.equal(run_args[i], ref_args[i]) for i in outs) and not launch.pending()
        trials.append({"after_blocks": thr, "done_seen_at_write": trig["done_seen"], "trigger_reached":
                       bool(trig["reached"]), "pending_after_pause": pending,
                       "mid_grid": 0 < pending < nblk, "pause_latency_us": 1e3 * flag.elapsed_time(e1),
                       "latency_minus_skips_us": 1e3 * flag.elapsed_time(e1)
                       - pending * row["skip_ns_per_block"] / 1e3,
                       "launch_to_write_us": 1e3 * e0.elapsed_time(flag), "bit_equal": bool(eq)})
    row["trials"] = trials
    lat = [t["pause_latency_us"] for t in trials if t["mid_grid"]]
    row["pause_latency_us_median"] = median(lat) if lat else None
    drain = [t["latency_minus_skips_us"] for t in trials if t["mid_grid"]]
    row["drain_us_median"] = median(drain) if drain else None
    ref = row.get("block_us_one_wave", row["block_us_from_waves"])
    row["latency_over_block"] = (row["pause_latency_us_median"] / ref) if lat and ref else None
    row["mid_grid_pauses"] = sum(1 for t in trials if t["mid_grid"])
    row["bit_equal_all"] = all(t["bit_equal"] for t in trials)
    return row


def time_stack(fwd: Any, f_plain: Any, f_probe: Any, params: list[dict[str, Any]], xcs: tuple[Any, ...],
               rounds: int, rep: int, tokens: int) -> list[dict[str, Any]]:
    """A stack of len(params) layers: each variant's one compiled graph applied layer after layer (the probes
    disarmed: a module global holds one control block per kernel, and every layer launches the same kernels),
    eager beside it; tokens/s of the whole stack."""
    from torch._dynamo.utils import counters

    x, c, s = xcs

    def stack(f: Any) -> Any:
        def run() -> Any:
            h = x
            for p in params:
                h = f(p, h, c, s)
            return h
        return run

    fs = {"stack_eager": stack(fwd), "stack_compiled": stack(f_plain), "stack_compiled_probes": stack(f_probe)}
    graphs0 = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        ys = {k: f() for k, f in fs.items()}
    ts: dict[str, list[float]] = {k: [] for k in fs}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in fs.items():
                ts[k].append(float(triton.testing.do_bench(f, warmup=3, rep=rep, return_mode="median")))
    recompiles = counters["stats"]["unique_graphs"] - graphs0
    out = []
    for k, v in ts.items():
        m = median(v)
        out.append({"variant": k, "layers": len(params), "stack_ms": m, "tokens_per_s": tokens / (m / 1e3),
                    "rounds_ms": v, "recompiles": recompiles,
                    "output_equal_compiled": bool(torch.equal(ys[k], ys["stack_compiled"])),
                    "finite": bool(torch.isfinite(ys[k]).all())})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) per variant per round")
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop pausing kernels after this much wall")
    ap.add_argument("--stack", type=int, default=0, help="also time a stack of this many layers (distinct "
                                                         "weights, one compiled graph), with and without probes")
    ap.add_argument("--no-pause", action="store_true", help="skip the per-kernel pauses")
    ap.add_argument("--pause-first", type=int, default=3, help="pause this many kernels (largest grids) before "
                                                               "timing the stack, the rest after")
    ns = ap.parse_args()
    t_start = time.perf_counter()
    from concordia_ft.instrument.inductor import ArmedLaunches, capture_launches
    from concordia_ft.instrument.pause import GpuPauseTrigger

    fwd, params, xcs, shape = make_layers(max(1, ns.stack), ns.batch, ns.seq)
    inputs = (params[0], *xcs)
    tokens = ns.batch * ns.seq
    summary: dict[str, Any] = {"shape": shape, "tokens_per_call": tokens}
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []

    def save() -> Path:
        summary["wall_s"] = time.perf_counter() - t_start
        return write_results("qwen3_probes", rows + kernels + [{"variant": "summary", **summary}],
                             baseline=[r for r in rows if r["variant"] == "compiled"],
                             notes="baseline = the same layer compiled by torch.compile without probes; "
                                   "compiled_probes = probes disarmed; compiled_probes_armed = probes armed, "
                                   "with the memset that zeroes their control blocks before each call; "
                                   "compiled_plus_reset = the baseline plus that memset; pause rows: "
                                   "per kernel, paused by the GPU trigger at a count of finished blocks",
                             out_dir=ns.out_dir)

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
        plain_launches = capture_launches(f_plain, inputs)
        plain_with_probes = ArmedLaunches(plain_launches, repeated="skip").with_probes
        # the baseline must really be the plain compile: recorded (when it is not, "compiled" timings are no
        # baseline, and only armed vs disarmed of the instrumented graph compares like with like)
        summary["plain_kernels_with_probes"] = plain_with_probes
        print(f"plain variant kernels with probes: {len(plain_with_probes)}", flush=True)
        launches = capture_launches(f_probe, inputs)
        def armed_once(a: Any) -> tuple[Any, list[int]]:
            """One armed call: its output and the done blocks of every armed launch."""
            a.arm()
            a.reset()
            try:
                with torch.no_grad():
                    y = f_probe(*inputs)
                return y, a.done_counts()
            finally:
                a.disarm()

        armed: Any = None
        try:  # a kernel launched twice per call: armed per launch by a stream write of its global
            armed = ArmedLaunches(launches, repeated="per_launch")
            y_armed, done = armed_once(armed)
            summary["repeated_kernels"] = "per_launch"
        except Exception as e:  # noqa: BLE001 - fall back to leaving them disarmed, and say so
            if armed is not None:
                armed.disarm()
            armed = ArmedLaunches(launches, repeated="skip")
            y_armed, done = armed_once(armed)
            summary["repeated_kernels"] = f"skipped ({type(e).__name__}: {e})"[:400]
        if not armed.launches or sorted(armed.with_probes) != sorted(inst):
            raise RuntimeError(f"armed {len(armed.launches)} launches; kernels with probes {armed.with_probes}, "
                               f"instrumented {inst} (captured {[k.name for k in launches]}, not armed "
                               f"{armed.skipped})")
        same_size = torch.zeros_like(armed.arena)
        print(f"armed {len(armed.launches)}/{len(launches)} launches (repeated kernels: "
              f"{summary['repeated_kernels'][:160]}); not armed {list(armed.skipped)}", flush=True)
        summary.update(kernels_plain=len(k_plain), kernels_probes=len(k_probe), kernels_instrumented=len(inst),
                       kernels_refused=refused, kernels_unseen_by_hook=[k for k in k_probe if k not in reps],
                       deferred_votes=sum(1 for k in inst if reps[k].deferred_vote),
                       launches_per_call=len(launches), launches_armed=len(armed.launches),
                       armed_share_of_launch_blocks=sum(k.nblocks for k in armed.launches)
                       / max(1, sum(k.nblocks for k in launches)),
                       launches_not_armed=armed.skipped, static_launcher=all(k.static for k in launches),
                       armed_all_blocks_done=done == [k.nblocks for k in armed.launches],
                       armed_done_vs_blocks=[[d, k.nblocks] for d, k in zip(done, armed.launches, strict=True)],
                       control_bytes=4 * armed.arena.numel(),
                       probes_output_equal_plain=bool(torch.equal(y_plain, y_probe)),
                       armed_output_equal_plain=bool(torch.equal(y_plain, y_armed)),
                       compiled_vs_eager_max_abs=float((y_plain.float() - y_eager.float()).abs().max()))

        def armed_call(*a: Any) -> Any:
            armed.reset()
            return f_probe(*a)

        def plain_reset_call(*a: Any) -> Any:
            same_size.zero_()
            return f_plain(*a)

        variants = {"eager": fwd, "compiled": f_plain, "compiled_probes": f_probe,
                    "compiled_probes_armed": armed_call, "compiled_plus_reset": plain_reset_call}
        from torch._dynamo.utils import counters

        graphs0 = counters["stats"]["unique_graphs"]
        ts = time_alternating(variants, inputs, ns.rounds, ns.rep,
                              before={"compiled_probes": armed.disarm, "compiled_probes_armed": armed.arm})
        armed.disarm()
        summary["recompiles_while_timing"] = counters["stats"]["unique_graphs"] - graphs0
        med = {k: median(v) for k, v in ts.items()}
        for k, v in ts.items():
            rows.append({"variant": k, "layer_ms": med[k], "tokens_per_s": tokens / (med[k] / 1e3),
                         "rounds_ms": v})
        base = med["compiled"]
        summary.update(layer_ms_compiled=base, layer_ms_probes=med["compiled_probes"],
                       layer_ms_probes_armed=med["compiled_probes_armed"],
                       layer_ms_plus_reset=med["compiled_plus_reset"],
                       probe_overhead_pct=100 * (med["compiled_probes"] / base - 1),
                       armed_overhead_pct=100 * (med["compiled_probes_armed"] / base - 1),
                       armed_vs_plus_reset_pct=100 * (med["compiled_probes_armed"] / med["compiled_plus_reset"] - 1),
                       tokens_per_s_compiled=tokens / (base / 1e3),
                       tokens_per_s_probes=tokens / (med["compiled_probes"] / 1e3),
                       tokens_per_s_probes_armed=tokens / (med["compiled_probes_armed"] / 1e3))
        print(f"layer: compiled {base:.4f} ms, probes disarmed {med['compiled_probes']:.4f} "
              f"({summary['probe_overhead_pct']:+.2f}%), armed+reset {med['compiled_probes_armed']:.4f} "
              f"({summary['armed_overhead_pct']:+.2f}%; vs compiled+reset {summary['armed_vs_plus_reset_pct']:+.2f}"
              f"%), eager {med['eager']:.3f} ms; {len(inst)}/{len(k_probe)} kernels instrumented, armed output "
              f"equal {summary['armed_output_equal_plain']}, all blocks done {summary['armed_all_blocks_done']}",
              flush=True)
        save()
        def do_stack() -> None:
            if ns.stack <= 1:
                return
            if time.perf_counter() - t_start > ns.budget_s - 6:
                summary["stack_skipped"] = "out of the run's time budget"
                return
            stack_rows = time_stack(fwd, f_plain, f_probe, params, xcs, ns.rounds, ns.rep, tokens)
            rows.extend(stack_rows)
            st = {r["variant"]: r for r in stack_rows}
            summary.update(stack_layers=ns.stack,
                           stack_ms_compiled=st["stack_compiled"]["stack_ms"],
                           stack_ms_probes=st["stack_compiled_probes"]["stack_ms"],
                           stack_probe_overhead_pct=100 * (st["stack_compiled_probes"]["stack_ms"]
                                                           / st["stack_compiled"]["stack_ms"] - 1),
                           stack_tokens_per_s_compiled=st["stack_compiled"]["tokens_per_s"],
                           stack_tokens_per_s_probes=st["stack_compiled_probes"]["tokens_per_s"],
                           recompiles_while_timing=summary["recompiles_while_timing"]
                           + st["stack_compiled"]["recompiles"])
            print(f"stack of {ns.stack}: compiled {summary['stack_ms_compiled']:.3f} ms "
                  f"({summary['stack_tokens_per_s_compiled']:.0f} tok/s), probes disarmed "
                  f"{summary['stack_ms_probes']:.3f} ms ({summary['stack_probe_overhead_pct']:+.2f}%), "
                  f"recompiles {summary['recompiles_while_timing']}", flush=True)
            save()
        trigger = GpuPauseTrigger()
        unique = list({k.name: k for k in reversed(launches)}.values())  # each kernel once (its first launch)
        order = [] if ns.no_pause else sorted(unique, key=lambda k: -k.nblocks)
        if not order[:ns.pause_first]:
            do_stack()
        for i, k in enumerate(order):
            if i == ns.pause_first:  # the stack's tokens/s between the largest kernels' pauses and the rest
                do_stack()
            if time.perf_counter() - t_start > ns.budget_s:
                kernels.append({"variant": "pause", "kernel": k.name, "skipped": "out of the run's time budget"})
                continue
            try:
                r = pause_kernel(k, trigger, (0.25, 0.5, 0.75))
            except Exception:  # noqa: BLE001 - reported per kernel, the others still run
                r = {"kernel": k.name, "error": traceback.format_exc()[-1500:]}
            kernels.append({"variant": "pause", **r})
            print("pause:", json.dumps({kk: v for kk, v in r.items() if kk not in ("trials", "config")})[:600],
                  flush=True)
            save()
        if 0 < len(order) <= ns.pause_first:
            do_stack()
        done_rows = [r for r in kernels if "trials" in r]
        summary.update(pause_kernels=len(done_rows),
                       pause_mid_grid_all=bool(done_rows) and all(r["mid_grid_pauses"] == len(r["trials"])
                                                                  for r in done_rows),
                       pause_bit_equal_all=bool(done_rows) and all(r["bit_equal_all"] for r in done_rows))
    except Exception:  # noqa: BLE001
        summary["error"] = traceback.format_exc()[-3000:]
        print(summary["error"], flush=True)
    path = save()
    print(path)
    ok = ("error" not in summary and summary.get("armed_output_equal_plain") is True
          and summary.get("pause_bit_equal_all") is True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
