"""Probe cost on an Inductor-compiled Qwen3 decoder layer and a 28-layer stack (Qwen3-0.6B dimensions, bf16,
random weights), each variant compiled in a process of its own.

Why processes: in one process the "plain" compile ran kernels with probes in sessions 5 and 6 (instrument/
DESIGN.md §3), so no in-process plain number is a baseline. Here the parent starts one worker per variant, each
with its own fresh TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR (FX graph cache off, compiles in-process):
- ``plain``: torch.compile as a user runs it, the hook never imported; ``plain_b``: the same in a second
  process, the A/A control (separate processes place weights, inputs and graphs at different addresses: session
  12 measured plain_b within 0.7% of plain for single layers, 1.9% for the 28-layer 1x1 stack);
- (session 12 tried an in-process plain build beside each probe build, with fresh Inductor and Triton caches
  around it: the probe build that followed picked other configs for two kernels at 8x512 (XBLOCK 1 for 8) and
  ran 18% slower, so it was dropped; the A/A control above measures the process-placement noise instead);
- ``probes_v3``: ``triton_hook.install(SafepointOptions(vote_before_write=False))`` (the session-6 probe);
- ``probes``: protocol 4 without late reads (the entry vote before the first global write where
  straight-line code reaches it, the leader's reads issued at entry);
- ``probes_lazy``: as ``probes`` with ``lazy_entry=True`` (only the leader waits for the control pointer at
  entry; a disarmed launch skips an inserted vote);
- ``probes_late``: as ``probes`` with ``late_reads=True``, session 7's default (entry only issues the pointer's
  load; the leader's reads and the vote happen at the vote site, which a disarmed launch branches past);
- ``probes_v5``: protocol 5, "record on pause", as session 8 built it (the leader reads one 64-bit header word at
  the vote; no exit probes, no done bits, no per-call memset; repeated launches share one control region, so
  the armed stack has no per-launch stream writes either);
- ``probes_v5e``: as ``probes_v5`` with ``early_header=True`` (the leader issues its header load right after
  the kernel's last global load before the vote, so it is in flight during the math);
- ``probes_v5s``: as ``probes_v5`` with ``stmatrix_sync=True`` (a kernel with stmatrix before its first barrier
  votes at that barrier instead of at entry);
- ``probes_v5c``: as ``probes_v5`` with ``const_ctl=True`` (the control pointer in the module's constant bank:
  a constant-cache hit the kernel's streaming loads cannot evict);
- ``probes_v5ce``: ``const_ctl`` and ``entry_header`` (the leader's header read issued at block entry);
  ``probes_v5ces``: the same with ``stmatrix_sync``, today's default; ``probes_v5n``: ``entry_header`` with the pointer global;
  ``probes_v5cesx``: the default with ``cold_path`` (the leader's rare path after the kernel's last instruction).
  ``probes_v5cesw``: the default with ``warp_vote`` (pointwise kernels decide per warp: no vote barrier).
Every worker compiles with ``TORCHINDUCTOR_DETERMINISTIC=1`` and ``triton.autotune_pointwise=False`` (batch 1 of
session 7 autotuned, and the variants picked different XBLOCKs for 9 of 24 kernels: up to 3x apart); with
``--pin-configs 1`` (the default) every autotuner that still holds more than one config (batch 2 of session 7:
the attention-side RMSNorm+rope kernels at decode shapes, whose XBLOCK differed between variants) takes its
first config without benchmarking, so every variant runs the same configs by construction.
Each worker proves what it ran: the PTX/cubin files in its own Triton cache with and without the probe's
marker (``cft_ctl_``), and the module of every captured launch asked for its ``cft_ctl_<kernel>`` global
(``ArmedLaunches.with_probes``): the plain worker must have none, the probe workers all. Outputs are compared
across processes by a hash of their bytes (same seeds, same GPU: the plain and the probe graphs must agree bit
for bit, armed too).

The parent then times the variants alternately, one worker at a time on the GPU (rounds of
``triton.testing.do_bench`` medians): per shape (``--shapes``, BxS tokens; default 8x512 prefill-like and the
decode-like 1x1 and 8x1) the layer and, with ``--stack N``, N layers (distinct weights through one compiled
graph), each both launched from the host ("stream": what a Python caller gets, host-bound at decode) and
replayed as one CUDA graph ("graph": the GPU's time). Modes: plain; probes disarmed; probes ARMED (every
kernel's module global points at a zeroed control block; the call is preceded by the memset that zeroes them;
a kernel launched more than once per call is armed per launch by a stream write of its global, so the armed
stack writes one per launch). Per kernel: GPU durations from torch.profiler (medians over calls), registers,
local memory and blocks per SM of each kernel's CUfunction.

Writes <out-dir>/qwen3_probes-<tag>.json (rewritten after each round), worker logs, and with ``--ptx-dir`` the
PTX files of each worker's cache (the Inductor kernels, for CPU tests).
Run: python3 experiments/bench_qwen3_probes.py --out-dir DIR [--stack 28] [--budget-s S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments"))  # concordia_lab: the instrumentation and the executor
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchreport

VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "plain_b": None,  # a second plain process: the A/A control (what two processes of the same code differ by)
    "probes_v3": {"vote_before_write": False, "late_reads": False, "protocol": 4},
    "probes": {"late_reads": False, "protocol": 4},  # protocol 4 without late reads (session 7's batch-2 name)
    "probes_lazy": {"lazy_entry": True, "late_reads": False, "protocol": 4},
    "probes_late": {"late_reads": True, "protocol": 4},  # session 7's default (protocol 4, late reads)
    # session 8's protocol 5 as first built: the pointer global, the header read at the vote
    "probes_v5": {"protocol": 5, "const_ctl": False, "entry_header": False, "stmatrix_sync": False},
    "probes_v5e": {"protocol": 5, "const_ctl": False, "entry_header": False, "stmatrix_sync": False,
                   "early_header": True},  # the leader's header read after the last load
    "probes_v5s": {"protocol": 5, "const_ctl": False, "entry_header": False, "stmatrix_sync": True},
    "probes_v5c": {"protocol": 5, "const_ctl": True, "entry_header": False, "stmatrix_sync": False},
    "probes_v5ce": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": False},
    # today's default (session 11): the pointer in the constant bank, the header read at entry, stmatrix sync
    "probes_v5ces": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": True},
    "probes_v5n": {"protocol": 5, "const_ctl": False, "entry_header": True, "stmatrix_sync": False},
    # the default's pointer and stmatrix vote, the header read after the kernel's last load (not at entry)
    "probes_v5cls": {"protocol": 5, "const_ctl": True, "entry_header": False, "early_header": True,
                     "stmatrix_sync": True},
    # the default with the leader's rare path (pause, resume) out of line, after the kernel's last instruction
    "probes_v5cesx": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": True,
                      "cold_path": True},
    # the default with the per-warp vote for pointwise kernels (no vote barrier: SafepointOptions.warp_vote)
    "probes_v5cesw": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": True,
                      "warp_vote": True},
    # the header's address in the kernel's profile-scratch parameter (SafepointOptions.header_arg; triton_hook.install()'s
    # default since session 16: a disarmed launch reads no memory; Triton's launcher instead of Inductor's static one)
    "probes_v5cesh": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": True,
                      "header_arg": True},
    # the header read at GPU scope (ld.relaxed.gpu: STRONG.GPU) instead of volatile (STRONG.SYS): with
    # header_arg, and on the default
    "probes_v5ceshg": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": True,
                       "header_arg": True, "header_gpu_scope": True},
    "probes_v5cesg": {"protocol": 5, "const_ctl": True, "entry_header": True, "stmatrix_sync": True,
                      "header_gpu_scope": True},
}

from concordia_lab.instrument.triton_hook import scan_cache  # noqa: E402 - no triton, no torch at import


def worker_env(root: Path, variant: str) -> dict[str, str]:
    """The environment of one variant's worker: caches of its own, nothing shared with another variant."""
    d = root / variant
    env = dict(os.environ)
    env.update(TRITON_CACHE_DIR=str(d / "triton"), TORCHINDUCTOR_CACHE_DIR=str(d / "inductor"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
               TORCHINDUCTOR_COMPILE_THREADS="1", TORCHINDUCTOR_DETERMINISTIC="1", PYTHONPATH=str(ROOT / "src") + os.pathsep
               + env.get("PYTHONPATH", ""))
    env.pop("TRITON_ALWAYS_COMPILE", None)
    return env


# ---------------------------------------------------------------------------------------------- worker

def _worker(ns: argparse.Namespace) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel; anything printed goes to stderr
    os.dup2(2, 1)
    parent = os.getppid()

    def watch() -> None:  # a worker whose parent was killed (a run's time limit) leaves at once
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    import threading

    threading.Thread(target=watch, daemon=True).start()

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj, default=str) + "\n")

    try:
        state = _worker_setup(ns)
        send({"ready": True, **state["info"]})
    except Exception:  # noqa: BLE001 - reported to the parent, which records it
        send({"ready": False, "error": traceback.format_exc()[-3000:]})
        return 1
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            send({"ok": True, **_worker_do(state, req)})
        except Exception:  # noqa: BLE001
            send({"ok": False, "error": traceback.format_exc()[-2000:]})
    return 0


def _digest(t: Any) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def _worker_setup(ns: argparse.Namespace) -> dict[str, Any]:
    opts = json.loads(ns.options)
    t0 = time.perf_counter()
    hooked = opts is not None
    if hooked:  # before torch/Inductor compile anything
        from concordia_lab.instrument import triton_hook
        from concordia_lab.instrument.safepoints import SafepointOptions

        triton_hook.install(SafepointOptions(**opts), cache_dir=os.environ["TRITON_CACHE_DIR"])
    import types

    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    if ns.lock:  # the workers compile at once; Inductor's autotuning benchmarks run one worker at a time, so
        # that another worker's GPU work cannot tip a config choice (the configs chosen are recorded too)
        import fcntl

        bench_all = CachingAutotuner.benchmark_all_configs

        def locked(self: Any, *a: Any, **k: Any) -> Any:
            with open(ns.lock, "a") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    return bench_all(self, *a, **k)
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)

        CachingAutotuner.benchmark_all_configs = locked  # type: ignore[method-assign]
    import torch._inductor.config as icfg
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    from concordia_lab.instrument.inductor import ArmedLaunches, capture_launches

    icfg.triton.autotune_pointwise = False  # one config per kernel, the same in every variant
    if ns.pin_configs:  # no benchmark decides among configs: the first, in every variant (the same list)
        def first_config(self: Any, *a: Any, **k: Any) -> Any:
            return {lch: float(i) for i, lch in enumerate(self.launchers)}

        CachingAutotuner.benchmark_all_configs = first_config  # type: ignore[method-assign]

    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, max_position_embeddings=40960)
    cfg._attn_implementation = "sdpa"
    nl = max(1, ns.stack)
    layers = []
    for i in range(nl):
        torch.manual_seed(i)
        with torch.device("cuda"):
            layers.append(Qwen3DecoderLayer(cfg, layer_idx=0).to(torch.bfloat16).eval())
    layer0 = layers[0]
    params = [{k: v.detach() for k, v in lay.named_parameters()} for lay in layers]
    rot = Qwen3RotaryEmbedding(cfg).to("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in ns.shapes.split(",")]
    state: dict[str, Any] = {"shapes": [], "graphs": {}, "armed": {}, "hooked": hooked, "params": params}
    info: dict[str, Any] = {"variant": ns.worker, "options": opts, "pid": os.getpid(), "shapes": []}
    for si, (b, s) in enumerate(shapes):
        torch.manual_seed(1234 + si)
        x = torch.randn(b, s, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(s, device="cuda")[None].expand(b, s)
        cos, sin = rot(x, pos)

        def fwd(p: dict[str, Any], h: Any, c: Any, sn: Any, _pos: Any = pos) -> Any:
            o = torch.func.functional_call(layer0, p, (h,), {"attention_mask": None, "position_ids": _pos,
                                                              "position_embeddings": (c, sn)})
            return o[0] if isinstance(o, tuple) else o

        def compiled(suffix: str, _name: str = f"fwd_{b}x{s}") -> Any:  # a code object per shape and build
            code = fwd.__code__.replace(co_name=_name + suffix)
            g = types.FunctionType(code, fwd.__globals__, code.co_name, fwd.__defaults__, fwd.__closure__)
            return torch.compile(g, dynamic=False)

        f = compiled("")
        tc = time.perf_counter()
        with torch.no_grad():
            y = f(params[0], x, cos, sin)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - tc

        stacked = ns.stack > 1 and f"{b}x{s}" in ns.stack_shapes.split(",")

        def stack(f: Any = f, x: Any = x, cos: Any = cos, sin: Any = sin) -> Any:
            h = x
            for p in params:
                h = f(p, h, cos, sin)
            return h

        ys = None
        if stacked:
            with torch.no_grad():
                ys = stack()

        launches = capture_launches(f, (params[0], x, cos, sin))
        probe_info = ArmedLaunches(launches, repeated="skip")  # only asks each module for its global
        sh: dict[str, Any] = {"shape": f"{b}x{s}", "tokens": b * s, "compile_s": compile_s,
                              "y_digest": _digest(y), "stack_digest": _digest(ys) if ys is not None else None,
                              "launches": len(launches), "kernels": sorted({k.name for k in launches}),
                              "kernels_with_probes": sorted(probe_info.with_probes),
                              "static_launcher": all(k.static for k in launches),
                              "kernel_attrs": _kernel_attrs(launches)}
        st = {"f": f, "inputs": (params[0], x, cos, sin), "stack": stack, "launches": launches}
        v5 = hooked and int(opts.get("protocol", 5)) == 5
        if hooked:
            armed = ArmedLaunches(launches, repeated="per_launch")
            assert armed.protocol == (5 if v5 else 4), (armed.protocol, opts)
            armed.arm()
            armed.reset()
            with torch.no_grad():
                ya = f(params[0], x, cos, sin)
            done = armed.done_counts()
            armed.disarm()
            sh.update(armed_launches=len(armed.launches), armed_not=armed.skipped,
                      armed_all_blocks_done=done == [k.nblocks for k in armed.launches],
                      armed_digest=_digest(ya), control_bytes=4 * armed.arena.numel(), protocol=armed.protocol,
                      per_launch_writes=sum(len(v) for v in armed._repeat.values()))
            st["armed"] = armed
            if stacked:
                slaunch = capture_launches(stack, ())
                sarmed = ArmedLaunches(slaunch, repeated="per_launch")
                sarmed.arm()
                sarmed.reset()
                with torch.no_grad():
                    ysa = stack()
                sdone = sarmed.done_counts()
                sarmed.disarm()
                sh.update(stack_armed_launches=len(sarmed.launches),
                          stack_per_launch_writes=sum(len(v) for v in sarmed._repeat.values()),
                          stack_control_bytes=4 * sarmed.arena.numel(),
                          stack_armed_all_blocks_done=sdone == [k.nblocks for k in sarmed.launches],
                          stack_armed_digest=_digest(ysa))
                st["stack_armed"] = sarmed
        state["shapes"].append(st)
        info["shapes"].append(sh)
    info["cache"] = scan_cache(os.environ["TRITON_CACHE_DIR"])
    if hooked:
        from concordia_lab.instrument import triton_hook

        reps = triton_hook.reports()
        info["rewriter"] = {k: {"instrumented": r.instrumented, "refused": r.refused, "vote_site": r.vote_site,
                                "exit_probes": r.exit_probes, "barriers": r.barriers} for k, r in reps.items()}
    if ns.ptx_dir:
        dst = Path(ns.ptx_dir) / ns.worker
        dst.mkdir(parents=True, exist_ok=True)
        for p in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.ptx"):
            shutil.copy(p, dst / p.name)
    state["graphs0"] = counters["stats"]["unique_graphs"]
    info["setup_s"] = time.perf_counter() - t0
    state["info"] = info
    return state


def _kernel_attrs(launches: list[Any]) -> dict[str, Any]:
    from cuda.bindings import driver as drv

    from concordia_ft.cuda import driver as cd

    out: dict[str, Any] = {}
    A = drv.CUfunction_attribute
    for k in launches:
        if k.name in out:
            continue
        fn = k.function
        regs = int(cd.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, fn), "attr"))
        local = int(cd.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn), "attr"))
        shared = int(cd.check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn), "attr"))
        dyn = int(getattr(k.autotuner.launchers[0], "shared", 0) or 0) if k.autotuner.launchers else 0
        nw = int(k.autotuner.launchers[0].config.num_warps) if k.autotuner.launchers else 4
        per_sm = int(cd.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, 32 * nw, dyn), "occupancy"))
        cfg = k.autotuner.launchers[0].config if k.autotuner.launchers else None
        out[k.name] = {"config": {kk: str(vv) for kk, vv in cfg.kwargs.items()} if cfg else None,
                       "num_stages": int(cfg.num_stages) if cfg else None,
                       "grid": list(k.grid), "blocks": k.nblocks, "num_warps": nw, "registers": regs,
                       "local_bytes": local, "static_shared": shared, "blocks_per_sm": per_sm}
    return out


def _callable(state: dict[str, Any], req: dict[str, Any]) -> Any:
    """The function timed for one request (one call of the layer or the stack, in the given mode)."""
    import torch

    st = state["shapes"][req["shape"]]
    mode, target = req["mode"], req["target"]
    f, inputs, stack = st["f"], st["inputs"], st["stack"]
    body = (lambda: f(*inputs)) if target == "layer" else stack
    armed_ = st.get("armed" if target == "layer" else "stack_armed")
    if mode == "armed" and armed_ is not None and armed_.protocol == 5:
        run = body  # protocol 5: an armed call needs no reset (records stay zero without a pause)
    elif mode in ("armed", "reset_only"):  # reset_only: the armed call's memset, the probes disarmed
        armed = armed_

        def run() -> Any:
            armed.reset()
            return body()
    else:
        run = body
    if req["how"] == "stream":
        return run
    key = (req["shape"], mode, target)
    if key not in state["graphs"]:  # one CUDA graph of the call, captured in the mode it is timed in
        _prepare(state, req)
        with torch.no_grad():
            for _ in range(2):
                run()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
        torch.cuda.synchronize()
        state["graphs"][key] = g
    return state["graphs"][key].replay


def _prepare(state: dict[str, Any], req: dict[str, Any]) -> None:
    """Module globals for the mode: armed -> this target's control blocks, else 0 (the globals are read when
    each kernel runs, also inside a replayed graph)."""
    st = state["shapes"][req["shape"]]
    for other in state["shapes"]:  # every shape's calls (header_arg arms one call per process at a time)
        for key in ("armed", "stack_armed"):
            if key in other:
                other[key].disarm()
    if req["mode"] == "armed":
        st["armed" if req["target"] == "layer" else "stack_armed"].arm()


def _worker_do(state: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
    import torch
    import triton.testing
    from torch._dynamo.utils import counters

    if req["mode"] in ("armed", "reset_only") and not state["hooked"]:
        raise RuntimeError("the plain variant has no probes to arm")
    fn = _callable(state, req)
    _prepare(state, req)
    if req["op"] == "time":
        with torch.no_grad():
            ms = float(triton.testing.do_bench(fn, warmup=req.get("warmup", 5), rep=req["rep"],
                                               return_mode="median"))
        return {"ms": ms, "recompiles": counters["stats"]["unique_graphs"] - state["graphs0"]}
    if req["op"] == "profile":
        from torch.profiler import ProfilerActivity, profile

        n = int(req.get("n", 20))
        with torch.no_grad():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
        per: dict[str, list[float]] = {}
        for ev in prof.events():
            if "CUDA" in str(getattr(ev, "device_type", "")):  # a kernel or memset: its GPU interval
                per.setdefault(ev.name, []).append(float(ev.time_range.elapsed_us()))
        out = {}
        for name, v in per.items():
            v.sort()
            out[name] = {"count_per_call": len(v) / n, "median_us": v[len(v) // 2], "sum_us_per_call": sum(v) / n}
        return {"kernels": out}
    raise RuntimeError(f"unknown op {req['op']!r}")


# ---------------------------------------------------------------------------------------------- parent

class Worker:
    def __init__(self, variant: str, root: Path, ns: argparse.Namespace, log_dir: Path) -> None:
        self.variant = variant
        self.log = open(log_dir / f"qwen3_probes-worker-{variant}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant,
               "--options", json.dumps(VARIANTS[variant]), "--shapes", ns.shapes, "--stack", str(ns.stack),
               "--stack-shapes", ns.stack_shapes, "--lock", str(root / "gpu.lock"),
               "--pin-configs", str(ns.pin_configs)]
        if ns.ptx_dir:
            cmd += ["--ptx-dir", ns.ptx_dir]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=worker_env(root, variant))
        self.info: dict[str, Any] = {}

    def recv(self, timeout_s: float = 240.0) -> dict[str, Any]:
        import select

        assert self.p.stdout is not None
        ready, _, _ = select.select([self.p.stdout], [], [], timeout_s)
        if not ready:  # a hung kernel (or compile): this worker is dropped, the others go on
            self.p.kill()
            raise RuntimeError(f"worker {self.variant}: no answer in {timeout_s:.0f} s; killed")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.variant} ended (rc {self.p.poll()}); see its log")
        return dict(json.loads(line))

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self.recv(60.0)

    def close(self) -> None:
        try:
            if self.p.poll() is None and self.p.stdin is not None:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(timeout=5)
        except Exception:  # noqa: BLE001
            self.p.kill()
        self.log.close()


def _median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--shapes", default="8x512,1x1,8x1", help="BxS per shape, comma separated")
    ap.add_argument("--stack", type=int, default=28, help="layers of the stack (distinct weights); 0: no stack")
    ap.add_argument("--stack-shapes", default="1x1,8x1", help="the shapes the stack is timed at")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=30, help="do_bench rep (ms) per variant per round")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget-s", type=float, default=600.0, help="no new round after this much wall")
    ap.add_argument("--ptx-dir", default="", help="copy each worker's PTX files here")
    ap.add_argument("--wait-pid", type=int, default=0, help="start timing once this process has ended (a test "
                                                             "run sharing the GPU while the workers compile)")
    ap.add_argument("--pin-configs", type=int, default=1, help="1: every autotuner takes its first config "
                                                                  "(no benchmark decides; same in every variant)")
    ap.add_argument("--profile-how", default="stream", choices=("stream", "graph"),
                    help="the per-kernel profile: host launches, or the replay of each mode's CUDA graph")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--options", default="null", help=argparse.SUPPRESS)
    ap.add_argument("--lock", default="", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        return _worker(ns)
    import signal

    from benchreport import write_results

    def on_term(signum: int, frame: Any) -> None:  # a time limit: leave through the finally below
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="cft-qwen3-probes-"))
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [v for v in ns.variants.split(",") if v]
    shapes = ns.shapes.split(",")
    summary: dict[str, Any] = {"variant": "summary", "variants": {v: VARIANTS[v] for v in names},
                               "shapes": shapes, "stack_layers": ns.stack, "rounds_done": 0}
    rows: list[dict[str, Any]] = []
    workers: dict[str, Worker] = {}

    def save() -> Path:
        summary["wall_s"] = time.perf_counter() - t_start
        return write_results("qwen3_probes", rows + [summary],
                             baseline=[r for r in rows if r.get("mode") == "plain"],
                             notes="each variant compiled in its own process with its own fresh Triton and Inductor "
                                   "caches (plain: the hook never imported); proof per worker in summary.workers "
                                   "(PTX/cubin files with the probe marker, modules with a cft_ctl_ global); "
                                   "timings: do_bench medians per round, variants alternating, one worker on the GPU "
                                   "at a time; stream = launched from the host, graph = one CUDA graph replayed; "
                                   "armed = probes armed with the memset that zeroes their control blocks",
                             out_dir=out_dir)

    ok = True
    try:
        for v in names:  # compile in parallel: CPU work; the GPU is shared only while they compile
            workers[v] = Worker(v, root, ns, out_dir)
        infos = {}
        for v, w in workers.items():
            try:
                w.info = w.recv()
            except RuntimeError as e:
                w.info = {"ready": False, "error": str(e)}
            infos[v] = w.info
            print(f"worker {v}: ready={w.info.get('ready')} setup {w.info.get('setup_s', 0):.1f} s", flush=True)
            if not w.info.get("ready"):
                print(w.info.get("error", ""), flush=True)
        summary["workers"] = infos
        bad = [v for v, i in infos.items() if not i.get("ready")]
        for v in bad:
            workers.pop(v).close()
        # the proof that the baseline is a plain compile, and the probe variants are instrumented
        checks: dict[str, Any] = {}
        for v, i in infos.items():
            if not i.get("ready"):
                continue
            c = i["cache"]
            kern_probes = [k for sh in i["shapes"] for k in sh["kernels_with_probes"]]
            kern_all = [k for sh in i["shapes"] for k in sh["kernels"]]
            if VARIANTS[v] is None:
                checks[v] = {"plain_proven": c["ptx_with_probes"] == 0 and c["cubin_with_probes"] == 0
                             and not kern_probes and c["cubin"] > 0,
                             "cubins": c["cubin"], "cubins_with_probes": c["cubin_with_probes"],
                             "launched_kernels": len(set(kern_all)), "launched_with_probes": len(set(kern_probes))}
            else:
                checks[v] = {"instrumented_proven": sorted(set(kern_probes)) == sorted(set(kern_all))
                             and c["cubin_with_probes"] == c["cubin"] > 0,
                             "cubins": c["cubin"], "cubins_with_probes": c["cubin_with_probes"],
                             "launched_kernels": len(set(kern_all)), "launched_with_probes": len(set(kern_probes)),
                             "armed_all_blocks_done": all(sh.get("armed_all_blocks_done") for sh in i["shapes"]),
                             "stack_armed_all_blocks_done": all(sh.get("stack_armed_all_blocks_done", True)
                                                                for sh in i["shapes"])}
        if "plain" in infos and infos["plain"].get("ready"):
            for v, i in infos.items():
                if v == "plain" or not i.get("ready"):
                    continue
                eq = []
                for a, b in zip(infos["plain"]["shapes"], i["shapes"], strict=True):
                    if VARIANTS[v] is None:  # the A/A control: the same plain outputs
                        eq.append({"shape": a["shape"], "same_kernels": a["kernels"] == b["kernels"],
                                   "disarmed_equal_plain": a["y_digest"] == b["y_digest"],
                                   "stack_equal_plain": a["stack_digest"] == b["stack_digest"]})
                        continue
                    eq.append({"shape": a["shape"], "same_kernels": a["kernels"] == b["kernels"],
                           "same_configs": {k: (a["kernel_attrs"][k]["config"], a["kernel_attrs"][k]["num_warps"])
                                            for k in a["kernel_attrs"]}
                           == {k: (b["kernel_attrs"][k]["config"], b["kernel_attrs"][k]["num_warps"])
                               for k in b["kernel_attrs"]},
                               "disarmed_equal_plain": a["y_digest"] == b["y_digest"],
                               "armed_equal_plain": a["y_digest"] == b.get("armed_digest"),
                               "stack_equal_plain": a["stack_digest"] == b["stack_digest"],
                               "stack_armed_equal_plain": a["stack_digest"] == b.get("stack_armed_digest",
                                                                                      a["stack_digest"])})
                checks[v]["bit_equal"] = eq
        summary["checks"] = checks
        print(json.dumps(checks)[:2000], flush=True)
        save()
        if ns.wait_pid:
            t_w = time.perf_counter()
            while time.perf_counter() - t_w < 120:
                try:
                    os.kill(ns.wait_pid, 0)
                except OSError:
                    break
                time.sleep(0.2)
            summary["waited_for_pid_s"] = time.perf_counter() - t_w
        # what is timed: (target, shape index, how, mode) per variant
        jobs: list[tuple[str, int, str]] = []
        for si, s in enumerate(shapes):
            for how in ("graph", "stream"):
                jobs.append(("layer", si, how))
                if ns.stack > 1 and s in ns.stack_shapes.split(","):
                    jobs.append(("stack", si, how))
        configs = [(v, m) for v in workers for m in (("plain",) if VARIANTS[v] is None else ("disarmed", "armed"))]
        if "probes" in workers:  # the armed call's memset alone, probes disarmed: what arming costs besides probes
            configs.append(("probes", "reset_only"))
        prof: dict[str, Any] = {}

        def do_profile() -> None:  # per kernel GPU time (profiler), every shape and mode, after the first round
            for si, s in enumerate(shapes):
                for v, m in configs:
                    if v not in workers:
                        continue
                    try:
                        res = workers[v].ask(op="profile", shape=si, target="layer", how=ns.profile_how, mode=m,
                                             n=10)
                    except RuntimeError as e:
                        res = {"error": str(e)}
                        workers.pop(v).close()
                    prof[f"{s}/{v}/{m}"] = res.get("kernels", res.get("error"))
            summary["profile"] = prof
            summary["per_kernel"] = _per_kernel(prof, shapes, infos)
            save()

        times: dict[tuple[str, int, str, str, str], list[float]] = {}
        recompiles: dict[str, int] = {}
        for r in range(ns.rounds):
            if r > 0 and time.perf_counter() - t_start > ns.budget_s:
                summary["rounds_cut"] = f"budget: {r} of {ns.rounds} rounds"
                break
            for target, si, how in jobs:
                order = configs if r % 2 == 0 else list(reversed(configs))
                for v, m in order:
                    if v not in workers:
                        continue
                    try:
                        res = workers[v].ask(op="time", shape=si, target=target, how=how, mode=m, rep=ns.rep)
                    except RuntimeError as e:
                        res = {"ok": False, "error": str(e)}
                        workers.pop(v).close()
                    if not res.get("ok"):
                        summary.setdefault("errors", []).append({"variant": v, "mode": m, "target": target,
                                                                 "shape": shapes[si], "how": how,
                                                                 "error": res.get("error")})
                        print(res.get("error"), flush=True)
                        continue
                    times.setdefault((target, si, how, v, m), []).append(res["ms"])
                    recompiles[v] = res["recompiles"]
            summary["rounds_done"] = r + 1
            rows[:] = _rows(times, shapes, infos)
            summary["recompiles_while_timing"] = recompiles
            summary.update(_headline(rows))
            save()
            print(f"round {r + 1}: " + json.dumps(_headline(rows))[:1500], flush=True)
            if r == 0:
                do_profile()

    except (Exception, SystemExit):  # noqa: BLE001
        summary["error"] = traceback.format_exc()[-3000:]
        print(summary["error"], flush=True)
        ok = False
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(root, ignore_errors=True)
    path = save()
    print(path)
    checks = summary.get("checks", {})
    ok = ok and bool(checks.get("plain", {}).get("plain_proven")) and all(
        c.get("plain_proven") if VARIANTS[v] is None else c.get("instrumented_proven") for v, c in checks.items())
    return 0 if ok else 1


def _rows(times: dict[tuple[str, int, str, str, str], list[float]], shapes: list[str],
          infos: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for (target, si, how, v, m), ts in sorted(times.items()):
        tokens = infos[v]["shapes"][si]["tokens"]
        med = _median(ts)
        base = times.get((target, si, how, "plain", "plain"))
        row = {"target": target, "shape": shapes[si], "how": how, "variant": v, "mode": m, "ms": med,
               "tokens_per_s": tokens / (med / 1e3), "rounds_ms": ts}
        if base:
            row["vs_plain_pct"] = 100 * (med / _median(base) - 1)
        if m == "armed" and (target, si, how, v, "disarmed") in times:
            row["vs_disarmed_pct"] = 100 * (med / _median(times[(target, si, how, v, "disarmed")]) - 1)
        rows.append(row)
    return rows


def _headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in rows:
        if "vs_plain_pct" in r and r["variant"] != "plain":  # plain_b/plain: the A/A control
            out[f"{r['target']}_{r['shape']}_{r['how']}_{r['variant']}_{r['mode']}_pct"] = round(r["vs_plain_pct"], 2)
    return {"overhead_vs_plain": out}


def _per_kernel(prof: dict[str, Any], shapes: list[str], infos: dict[str, Any]) -> list[dict[str, Any]]:
    """Per Triton kernel: median GPU us per mode and the change vs plain; registers and blocks per SM."""
    out = []
    for si, s in enumerate(shapes):
        base = prof.get(f"{s}/plain/plain")
        if not isinstance(base, dict):
            continue
        for name, b in base.items():
            if not name.startswith("triton_"):
                continue
            row: dict[str, Any] = {"shape": s, "kernel": name, "plain_us": b["median_us"],
                                   "count_per_call": b["count_per_call"]}
            for key, d in prof.items():
                sh, v, m = key.split("/")
                if sh != s or v == "plain" or not isinstance(d, dict) or name not in d:
                    continue
                row[f"{v}_{m}_us"] = d[name]["median_us"]
                row[f"{v}_{m}_pct"] = 100 * (d[name]["median_us"] / b["median_us"] - 1)
            for v, i in infos.items():
                a = i.get("shapes", [{}] * (si + 1))[si].get("kernel_attrs", {}).get(name) if i.get("ready") else None
                if a:
                    row[f"{v}_registers"] = a["registers"]
                    row[f"{v}_blocks_per_sm"] = a["blocks_per_sm"]
                    row["blocks"] = a["blocks"]
            out.append(row)
        tot = {k: sum(d["sum_us_per_call"] for d in prof[k].values()) for k in prof
               if k.startswith(s + "/") and isinstance(prof[k], dict)}
        out.append({"shape": s, "kernel": "ALL (GPU us per call, every kernel and memset)", **tot})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
