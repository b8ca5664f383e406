"""Compute Sanitizer block-entry patches as safe points for SASS-only kernels (cuBLAS, PyTorch eager), on the GPU.

Each variant runs in a fresh process (experiments/bench_blockgate.py --worker VARIANT):
- plain: no tool (the baseline a user runs);
- loaded: the tool preloaded, nothing patched (the Sanitizer's own interception alone);
- patched: every module patched at BLOCK_ENTER; launches disarmed (callback data NULL) and armed (pause word 0);
  then the correctness probes: a pause word set before the launch (every block must skip), set while the
  launch runs (blocks that started finish, the rest skip), and the resume launch (only pending blocks run),
  on an elementwise add and on cuBLAS GEMMs, each output checked against a float64 reference;
- injection: the tool loaded by the driver through CUDA_INJECTION64_PATH instead of LD_PRELOAD (starts? patches?).
Each worker prints one JSON line per probe, so a probe that hangs loses only itself.
Run: python3 experiments/bench_blockgate.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
from benchreport import median, print_table, write_results  # noqa: E402

from concordia_lab.instrument import blockgate as bg  # noqa: E402

STATE_BLOCKS = 1 << 22


def emit(**row: Any) -> None:
    print(json.dumps(row, default=str), flush=True)


# ------------------------------------------------------------------------------------------------ worker side
def timings(torch: Any, label: str, gate: Any = None, reps: int = 5) -> None:
    """Host us per tiny launch, GPU ms of a big add and of GEMMs; with gate: every launch armed (pause 0)."""
    dev = "cuda"
    x = torch.ones(1024, device=dev)
    y = torch.empty_like(x)

    def run(fn: Any) -> Any:
        if gate is None:
            return fn()
        return gate.launch(fn)

    per_launch = []
    for _ in range(reps):
        if gate is not None:
            gate.begin(STATE_BLOCKS)
        torch.cuda.synchronize()
        n = 1000
        with gate.armed() if gate is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            for _ in range(n):
                torch.add(x, 1.0, out=y)
            torch.cuda.synchronize()
            per_launch.append((time.perf_counter() - t0) / n * 1e6)
    emit(probe="tiny_launch", variant=label, us_per_launch=median(per_launch), samples=per_launch)

    def gpu_ms(fn: Any) -> list[float]:
        out = []
        for _ in range(reps):
            if gate is not None:
                gate.begin(STATE_BLOCKS)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run(fn)
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
        return out

    big = [torch.rand(1 << 27, device=dev) for _ in range(3)]
    ms = gpu_ms(lambda: torch.add(big[0], big[1], out=big[2]))
    emit(probe="add_2^27", variant=label, ms=median(ms), samples=ms)
    big.clear()
    for dtype, m, k in ((torch.float16, 8192, 8192), (torch.float32, 4096, 4096)):
        A, B = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, m, device=dev, dtype=dtype)
        C = torch.empty(m, m, device=dev, dtype=dtype)
        torch.matmul(A, B, out=C)
        ms = gpu_ms(lambda A=A, B=B, C=C: torch.matmul(A, B, out=C))
        emit(probe=f"gemm_{str(dtype).split('.')[-1]}_{m}x{k}", variant=label, ms=median(ms), samples=ms)


def spin(us: float) -> None:
    t = time.perf_counter() + us * 1e-6
    while time.perf_counter() < t:
        pass


def classify(got: Any, ref: Any, rtol: float, atol: float, torch: Any) -> dict[str, int]:
    nan = torch.isnan(got)
    if rtol == 0 and atol == 0:  # exact: the float64 result rounded once to the output's dtype
        ok = (got == ref.to(got.dtype)) & ~nan
    else:
        ok = torch.isclose(got.double(), ref, rtol=rtol, atol=atol) & ~nan
    return {"elements": got.numel(), "correct": int(ok.sum()), "untouched": int(nan.sum()),
            "wrong": int((~ok & ~nan).sum())}


def probe_skip(torch: Any, lib: Any, name: str, make: Any, rtol: float, atol: float, delay_us: float | None) -> None:
    """make() -> (fn(out) launching the kernel into out, float64 reference, dtype, shape). Pause before
    (delay_us None) or delay_us after the launch; then resume; every output element checked."""
    fn, ref, dtype, shape = make()
    plain = torch.empty(shape, device="cuda", dtype=dtype)
    fn(plain)  # uninterrupted, disarmed: what the paused-and-resumed output must equal bit for bit
    torch.cuda.synchronize()
    gate = bg.GateControl(lib, "", count_warps=True)
    gate.begin(STATE_BLOCKS)
    out = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    row: dict[str, Any] = {"probe": name, "delay_us": delay_us}
    t0 = time.perf_counter()
    if delay_us is None:
        gate.pause(wait=True)
        gate.launch(lambda: fn(out))
    else:
        def go() -> None:
            fn(out)
            spin(delay_us)
            gate.pause()
        gate.launch(go)
    try:
        torch.cuda.synchronize()
        row["sync_error"] = None
    except Exception as e:  # noqa: BLE001 - the point is to see what the driver reports
        row["sync_error"] = repr(e)[:300]
        emit(**row)
        return
    row["paused_ms"] = (time.perf_counter() - t0) * 1e3
    st = bg.stats(lib)
    grid = st["last_grid"]
    nblocks = grid[0] * grid[1] * grid[2]
    row.update(kernels=st["armed_kernels"][-3:], grid=grid, block=st["last_block"], nblocks=nblocks)
    row["after_pause"] = {**classify(out, ref, rtol, atol, torch), **gate.counts(nblocks)}
    gate.clear()
    gate.launch(lambda: fn(out))
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        row["resume_error"] = repr(e)[:300]
        emit(**row)
        return
    row["after_resume"] = {**classify(out, ref, rtol, atol, torch), **gate.counts(nblocks)}
    row["bit_equal_to_uninterrupted"] = bool(torch.equal(out, plain))
    row["uninterrupted_vs_ref"] = classify(plain, ref, rtol, atol, torch)
    emit(**row)


PROBES = ("add_paused_before", "add_paused_midrun", "gemm_fp16_paused_before", "gemm_fp16_paused_midrun",
          "gemm_fp32_paused_midrun")


def worker(variant: str, probes: tuple[str, ...] = PROBES, reps: int = 5) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    lib = bg.load() if variant != "plain" else None
    t0 = time.perf_counter()
    A = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    (A @ A).sum().item()
    emit(probe="first_gemm", variant=variant, s=time.perf_counter() - t0)
    if variant == "injection":
        emit(probe="stats", variant=variant, stats=bg.stats(lib))
        return
    timings(torch, variant + ("_disarmed" if variant == "patched" else ""), reps=reps)
    if variant != "patched":
        if lib is not None:
            emit(probe="stats", variant=variant, stats=bg.stats(lib))
        return
    timings(torch, "patched_armed", gate=bg.GateControl(lib, ""), reps=reps)
    emit(probe="stats", variant=variant, stats=bg.stats(lib))
    g = torch.Generator(device="cpu").manual_seed(7)

    def make_add() -> Any:
        n = 1 << 27
        a, b = torch.rand(n, generator=g), torch.rand(n, generator=g)
        ref = a.double() + b.double()
        da, db = a.cuda(), b.cuda()
        return (lambda out: torch.add(da, db, out=out)), ref.cuda(), torch.float32, (n,)

    def make_gemm(dtype: Any, m: int, k: int) -> Any:
        def mk() -> Any:
            A = torch.randn(m, k, generator=g).to(dtype)
            B = torch.randn(k, m, generator=g).to(dtype)
            dA, dB = A.cuda(), B.cuda()
            ref = dA.double() @ dB.double()  # float64 on the GPU (DGEMM, disarmed); spot-checked on the CPU
            rows = torch.randint(0, m, (8,), generator=g)
            cpu = A[rows].double().numpy() @ B.double().numpy()
            emit(probe=f"cpu_check_{m}", max_abs_diff_gpu64_vs_cpu64=float(abs(ref[rows.cuda()].cpu().numpy() - cpu).max()))
            return (lambda out: torch.matmul(dA, dB, out=out)), ref, dtype, (m, m)
        return mk

    cases = {"add_paused_before": (make_add, 0, 0, None), "add_paused_midrun": (make_add, 0, 0, 60.0),
             "gemm_fp16_paused_before": (make_gemm(torch.float16, 4096, 4096), 2e-2, 1e-1, None),
             "gemm_fp16_paused_midrun": (make_gemm(torch.float16, 16384, 4096), 2e-2, 1e-1, 400.0),
             "gemm_fp32_paused_midrun": (make_gemm(torch.float32, 8192, 8192), 1e-4, 1e-3, 2000.0)}
    for name in probes:
        mk, rtol, atol, delay = cases[name]
        probe_skip(torch, lib, name, mk, rtol, atol, delay)
    emit(probe="stats_end", variant=variant, stats=bg.stats(lib))


# ------------------------------------------------------------------------------------------------ driver side
def run_worker(variant: str, timeout: float, extra: list[str]) -> list[dict[str, Any]]:
    if variant == "plain":
        env = dict(os.environ)
    elif variant == "loaded":
        env = bg.child_env(patch=False)
    elif variant == "injection":
        env = bg.child_env(via="injection")
    else:
        env = bg.child_env()
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{env.get('PYTHONPATH', '')}"
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--worker", variant, *extra], capture_output=True, text=True,
                           timeout=timeout, env=env)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {timeout} s (a probe hung)", None
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    for row in rows:
        row.setdefault("variant", variant)
    if rc != 0:
        rows.append({"probe": "worker_failed", "variant": variant, "rc": rc, "stderr": err[-1500:]})
    rows.append({"probe": "worker_wall", "variant": variant, "s": time.perf_counter() - t0})
    return rows


def summarize(log: Path) -> None:
    drop = ("samples", "stderr")
    for ln in log.read_text(errors="replace").splitlines():
        if not ln.startswith("{"):
            print(ln[:300])
            continue
        try:
            r = json.loads(ln)
        except ValueError:
            print(ln[:300])
            continue
        if r.get("probe") == "worker_failed":
            print(f"worker_failed {r.get('variant')} rc={r.get('rc')}: {str(r.get('stderr'))[-600:]}")
            continue
        short = {k: v for k, v in r.items() if k not in drop}
        print(json.dumps(short, default=str)[:700])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--worker")
    ap.add_argument("--variants", default="patched,plain,loaded,injection")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--summarize", help="print a short digest of a saved run log")
    ap.add_argument("--probes", default=",".join(PROBES))
    ap.add_argument("--reps", type=int, default=5)
    ns = ap.parse_args()
    if ns.summarize:
        summarize(Path(ns.summarize))
        return 0
    if ns.worker:
        worker(ns.worker, tuple(p for p in ns.probes.split(",") if p), ns.reps)
        return 0
    t0 = time.perf_counter()
    tool, patches = bg.build_tool(), bg.build_patches()
    print(f"built {tool.name} and {patches.name} in {time.perf_counter() - t0:.1f} s; sanitizer from "
          f"{bg.sanitizer_dirs()[1]}", flush=True)
    rows: list[dict[str, Any]] = []
    for v in ns.variants.split(","):
        got = run_worker(v, ns.timeout if v == "patched" else ns.timeout / 2,
                         ["--probes", ns.probes, "--reps", str(ns.reps)])
        for r in got:
            print(json.dumps(r, default=str)[:1200], flush=True)
        rows += got
    base = [r for r in rows if r.get("variant") == "plain"]
    path = write_results("blockgate", [r for r in rows if r.get("variant") != "plain"], baseline=base,
                         out_dir=ns.out_dir,
                         notes="Sanitizer BLOCK_ENTER patches: cost per launch (plain vs loaded vs patched disarmed "
                               "vs armed) and whether SANITIZER_PATCH_ERROR skips blocks cleanly")
    table = [{"probe": r["probe"], "variant": r.get("variant"), "value": r.get("us_per_launch", r.get("ms", r.get("s")))}
             for r in rows if r["probe"] in ("tiny_launch", "add_2^27", "first_gemm") or r["probe"].startswith("gemm_")
             and "ms" in r]
    print_table("blockgate", table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
