"""Where the armed probe's cost at decode shapes goes: one Inductor-shaped kernel at a time, launched in a CUDA
graph, with parts of the armed path taken out of its PTX.

Issue 11's armed decode shapes miss <= 2% (instrument/DESIGN.md section 7): each ~1.3 us Triton kernel pays
about 0.2 us armed, with the header's address in the kernel's last parameter (``header_arg``) and nothing read
disarmed. That path has two parts: the leader's 64-bit header load at entry, and the reducing barrier that
hands its decision to the block (the kernel's own first barrier, or one inserted before its first store). This
probe times, per kernel and shape, in the same process and interleaved round by round:

- ``plain``: Triton's PTX as compiled;
- ``disarmed`` / ``armed``: ``SafepointOptions(header_arg=True)``, the parameter null / the header's address;
- ``armed_noload``: armed, the header load replaced by zeros (the barrier and the branches stay);
- ``armed_novote``: armed, the header loaded, the decision's reducing barrier taken out (a kernel's own barrier
  is put back as the plain ``bar.sync``; only the leader's warp waits for the load);
- ``armed_neither``: both taken out;
- ``plain+const``, ``plain+global``, ``plain+globals``: Triton's code unchanged, with the module globals that
  the rewriter declares (the constant-bank control pointer, the marker globals, both) and nothing using them;
- ``armed_weak``, ``armed_cg``, ``armed_gpu``, ``armed_nc``: armed, the header read by a weak load, an L2-only
  weak load, a GPU-scope relaxed load, a non-coherent load instead of the volatile (system-scope) one.

The armed_* variants other than ``armed`` are measurements only: they do not pause correctly, or are not shown
to. Every variant's output is checked against
plain's, bit for bit, and against a float64 reference on fresh random data. Each timed graph holds ``--launches``
launches, each kernel's input written by the launch before it (ping-pong), optionally with a small cuBLAS GEMM
before each launch as in a decode layer (``--with-gemm``).

    python experiments/probe_vote_cost.py --rounds 7

What it found (instrument/DESIGN.md §6i): the 0.2 us was mostly the module's constant bank (a ``.const`` variable
costs +0.10 us at every launch, read or not); with the records' pointer moved to a ``.global`` the armed path
costs +0.05-0.07 us per decode kernel.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' Triton kernels (instrument_kernels)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchreport
from benchreport import print_table, write_results  # noqa: E402

from concordia_lab.instrument.ptxas import assemble  # noqa: E402
from concordia_lab.instrument.safepoints import SafepointOptions, rewrite_ptx  # noqa: E402
from instrument_kernels import poi_silu_mul_kernel as silu_mul_kernel  # noqa: E402


@triton.jit
def add_kernel(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    a = tl.load(in_ptr0 + xindex, xmask).to(tl.float32)
    b = tl.load(in_ptr1 + xindex, xmask).to(tl.float32)
    tl.store(out_ptr0 + xindex, (a + b).to(tl.bfloat16), xmask)


@triton.jit
def rmsnorm_kernel(in_ptr0, in_ptr1, out_ptr0, xnumel, R0_BLOCK: tl.constexpr):
    # Inductor's per-row reduction shape (XBLOCK 1): load the row, sum of squares, rsqrt, scale, store
    row = tl.program_id(0)
    cols = tl.arange(0, R0_BLOCK)
    x = tl.load(in_ptr0 + row * R0_BLOCK + cols).to(tl.float32)
    ms = tl.sum(x * x, 0) / R0_BLOCK
    w = tl.load(in_ptr1 + cols).to(tl.float32)
    tl.store(out_ptr0 + row * R0_BLOCK + cols, (x * tl.math.rsqrt(ms + 1e-6) * w).to(tl.bfloat16))


# name -> (kernel, block constexpr, warps, elements of the input, elements of the second input, grid)
CASES: dict[str, tuple[Any, dict[str, int], int, int, int, int]] = {
    "silu_mul 1x1 (12 blocks)": (silu_mul_kernel, {"XBLOCK": 256}, 4, 3072, 3072, 12),
    "silu_mul 8x1 (96 blocks)": (silu_mul_kernel, {"XBLOCK": 256}, 4, 8 * 3072, 8 * 3072, 96),
    "add 1x1 (4 blocks)": (add_kernel, {"XBLOCK": 256}, 4, 1024, 1024, 4),
    "rmsnorm 1x1 (1 block)": (rmsnorm_kernel, {"R0_BLOCK": 1024}, 8, 1024, 1024, 1),
    "rmsnorm 8x1 (8 blocks)": (rmsnorm_kernel, {"R0_BLOCK": 1024}, 8, 8 * 1024, 1024, 8),
    "silu_mul 8x512 (12288 blocks)": (silu_mul_kernel, {"XBLOCK": 1024}, 4, 4096 * 3072, 4096 * 3072, 12288),
}

_HDR_LOAD = re.compile(r"^\s*(?:@%\S+\s+)?ld\.[a-z.]*v2\.u32\s+\{%cft_r12, %cft_r13\}, \[%cft_rd[02]\+\d+\];\s*$",
                       re.M)
_VOTE = re.compile(r"^\s*(bar|barrier)\.red\.or\.pred\s+%cft_p2, 0, %cft_p2;\s*$", re.M)


_DECL = re.compile(r"^\.visible \.(?:const|global) .*\bcft_\w+.*;$", re.M)
_LOADS = {"armed_weak": "ld.global.v2.u32", "armed_cg": "ld.global.cg.v2.u32",
          "armed_gpu": "ld.relaxed.gpu.global.v2.u32", "armed_nc": "ld.global.nc.v2.u32"}


def _entry_line(ptx: str) -> int:
    return ptx.index(".visible .entry")


def variant_ptx(ptx: str, variant: str) -> str:
    """The PTX of one variant (see the module's docstring and ``VARIANTS``)."""
    if variant == "plain":
        return ptx
    out = rewrite_ptx(ptx, SafepointOptions(header_arg=True)).ptx
    if variant.startswith("plain+"):  # plain code, with the module globals the rewriter declares
        # the default's constant-bank pointer, header_arg's marker globals (its own pointer is a .global now)
        default = _DECL.findall(rewrite_ptx(ptx, SafepointOptions()).ptx)
        decls = [d for d in default if ".const" in d] + [d for d in _DECL.findall(out) if "cft_ctl_" not in d]
        keep = {"plain+globals": decls,
                "plain+const": [d for d in decls if ".const" in d],
                "plain+global": [d for d in decls if ".global" in d]}[variant]
        i = _entry_line(ptx)
        return ptx[:i] + "\n".join(keep) + "\n\n" + ptx[i:]
    if variant in ("disarmed", "armed", "armed_hdr_w"):
        return out
    if variant == "armed_unguarded":  # the leader's header load no longer waits for the null test
        out, n = re.subn(r"^\s*@%cft_p3 bra \t\$__cft\d+_early;\n", "", out, flags=re.M)
        if n != 1:
            raise SystemExit(f"{variant}: expected one null test before the header load, found {n}")
        return out
    if variant in _LOADS:
        out, n = _HDR_LOAD.subn(lambda m: m.group(0).replace("ld.volatile.global.v2.u32", _LOADS[variant]), out)
        if n != 1 or _LOADS[variant] not in out:
            raise SystemExit(f"{variant}: expected one header load, found {n}")
        return out
    if variant in ("armed_noload", "armed_neither"):
        out, n = _HDR_LOAD.subn("\tmov.u32 \t%cft_r12, 0;\n\tmov.u32 \t%cft_r13, 0;", out)
        if n != 1:
            raise SystemExit(f"{variant}: expected one header load, found {n}")
    if variant in ("armed_novote", "armed_neither"):
        own_barrier = "bar.sync" in ptx  # the vote replaced the kernel's own barrier: put a plain one back
        out, n = _VOTE.subn("\tbar.sync \t0;" if own_barrier else "", out)
        if n != 1:
            raise SystemExit(f"{variant}: expected one decision vote, found {n}")
    return out


# plain+*: Triton's code with the rewriter's module globals declared (not used by the code);
# armed_<load>: the armed path with the header read by another load instruction (weak, L2-only, GPU scope,
# non-coherent: measurement only, see the docstring)
VARIANTS = ("plain", "plain+const", "plain+global", "plain+globals", "disarmed", "armed", "armed_noload",
            "armed_novote", "armed_neither", "armed_weak", "armed_cg", "armed_gpu", "armed_nc", "armed_unguarded",
            "armed_hdr_w")
ARMED = {v for v in VARIANTS if v.startswith("armed")}


def run_case(case: str, ns: argparse.Namespace, gen: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Compile, check and time one case: its rows (one per variant) and its output checks."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from concordia_ft.cuda import driver as cd

    drv = cd.bindings()
    dev = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    kern, const, warps, n0, n1, grid = CASES[case]
    sig = {"in_ptr0": "*bf16", "in_ptr1": "*bf16", "out_ptr0": "*bf16", "xnumel": "i32",
           **{k: "constexpr" for k in const}}
    ck = triton.compile(ASTSource(kern, sig, const), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": warps})
    ptx = ck.asm["ptx"]
    name = ck.metadata.name
    shared = int(ck.metadata.shared)
    funcs: dict[str, Any] = {}
    regs: dict[str, int] = {}
    mods = []
    for v in VARIANTS:
        res = assemble(variant_ptx(ptx, v))
        mod = cd.check(drv.cuModuleLoadData(res.cubin), f"cuModuleLoadData({v})")
        mods.append(mod)
        funcs[v] = cd.check(drv.cuModuleGetFunction(mod, name.encode()), "cuModuleGetFunction")
        regs[v] = res.registers.get(name, -1)
    x = [(torch.randn(n0, generator=gen) * 2).to(torch.bfloat16).to(dev) for _ in range(2)]
    # w with a zeroed 64-byte-aligned tail: armed_hdr_w reads its header there (the page and lines every launch
    # reads anyway)
    w_tail = torch.zeros(n1 + 64, dtype=torch.bfloat16, device=dev)
    w_tail[:n1] = (torch.rand(n1, generator=gen) + 0.5).to(torch.bfloat16)
    w = w_tail[:n1]
    hdr_w = (w_tail.data_ptr() + 2 * n1 + 63) // 64 * 64
    y = torch.empty(n0, dtype=torch.bfloat16, device=dev)
    arena = torch.zeros(64, dtype=torch.int32, device=dev)  # the header of an armed call: pause 0, mode 0

    def args(src: Any, dst: Any, header: int) -> Any:
        return cd.KernelArgs([(ctypes.c_uint64, src.data_ptr()), (ctypes.c_uint64, w.data_ptr()),
                              (ctypes.c_uint64, dst.data_ptr()), (ctypes.c_int32, n0),
                              (ctypes.c_uint64, 0), (ctypes.c_uint64, header)])

    keep: list[Any] = []

    def one(v: str, src: Any, dst: Any) -> None:  # on torch's current stream (the capture's, in a capture)
        a = args(src, dst, (hdr_w if v == "armed_hdr_w" else arena.data_ptr()) if v in ARMED else 0)
        keep.append(a)
        cd.launch(funcs[v], grid, 32 * warps, a, cd.Stream.from_torch(), shared_bytes=shared, what=v)

    # correctness: each variant's output against plain's (bits) and a float64 reference
    xf, wf = x[0].double().cpu(), w.double().cpu()
    if kern is silu_mul_kernel:
        ref = xf * torch.sigmoid(xf) * wf
    elif kern is add_kernel:
        ref = xf + wf
    else:
        r = xf.view(-1, 1024)
        ref = (r * torch.rsqrt((r * r).mean(1, keepdim=True) + 1e-6) * wf).flatten()
    outs = {}
    for v in VARIANTS:
        y.fill_(float("nan"))
        one(v, x[0], y)
        torch.cuda.synchronize()
        outs[v] = y.clone()
    for v in VARIANTS:
        checks.append({"case": case, "variant": v, "bit_equal_plain": bool(torch.equal(outs[v].view(torch.int16),
                                                                                      outs["plain"].view(torch.int16))),
                       "max_abs_err_vs_f64": float((outs[v].double().cpu() - ref).abs().max()),
                       "registers": regs[v]})
    gemm_a = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    gemm_b = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    gemm_c = torch.empty(1, 1024, device=dev, dtype=torch.bfloat16)
    graphs: dict[str, Any] = {}
    for v in VARIANTS:
        g = torch.cuda.CUDAGraph()
        torch.mm(gemm_a, gemm_b, out=gemm_c)  # cuBLAS's handle and workspace exist before the capture
        for _ in range(2):  # warm
            for i in range(4):
                one(v, x[i % 2], x[(i + 1) % 2] if kern is not rmsnorm_kernel else y)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for i in range(ns.launches):
                if ns.with_gemm:
                    torch.mm(gemm_a, gemm_b, out=gemm_c)
                src, dst = (x[i % 2], x[(i + 1) % 2]) if kern is not rmsnorm_kernel else (x[0], y)
                one(v, src, dst)
        graphs[v] = g
    torch.cuda.synchronize()
    per: dict[str, list[float]] = {v: [] for v in VARIANTS}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(ns.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            graphs[v].replay()
            times = []
            for _ in range(ns.replays):
                start.record()
                graphs[v].replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000.0 / ns.launches)
            per[v].append(statistics.median(times))
    base = statistics.median(per["plain"])
    for v in VARIANTS:
        med = statistics.median(per[v])
        rows.append({"case": case, "variant": v, "us_per_launch": round(med, 4),
                     "vs_plain_us": round(med - base, 4), "vs_plain_pct": round(100.0 * (med / base - 1), 2),
                     "rounds_us": [round(t, 4) for t in per[v]], "registers": regs[v],
                     "with_gemm": ns.with_gemm})
    del graphs
    for m in mods:
        drv.cuModuleUnload(m)
    print_table(case, [r for r in rows if r["case"] == case],
                ["variant", "us_per_launch", "vs_plain_us", "vs_plain_pct", "registers"])
    return rows, checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--launches", type=int, default=200, help="launches per timed CUDA graph")
    ap.add_argument("--replays", type=int, default=20, help="timed replays per round (median)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--with-gemm", action="store_true", help="a 1 x 1024 x 1024 cuBLAS GEMM before each launch")
    ap.add_argument("--tag", default=None)
    ns = ap.parse_args()

    import torch

    from concordia_ft.cuda import driver as cd

    torch.cuda.init()
    cd.ensure_context()
    gen = torch.Generator(device="cpu").manual_seed(20261203)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for case in ns.cases.split(","):
        r, c = run_case(case, ns, gen)
        rows += r
        checks += c
    bad = [c for c in checks if not c["bit_equal_plain"]]
    print_table("outputs", checks)
    tag = ns.tag or ("h200" + ("-gemm" if ns.with_gemm else ""))
    path = write_results("vote_cost", rows, baseline=[r for r in rows if r["variant"] == "plain"],
                         notes="per-launch GPU time of one kernel in a CUDA graph of --launches launches "
                               "(median of replays, median of rounds), variants interleaved per round; "
                               "the armed_* variants but armed are measurement-only mutations of the header_arg PTX; "
                               "plain+* are plain code with the rewriter's module globals; checks: every variant bit-equal to plain and its error against "
                               f"float64; {vars(ns)}; checks={checks}", tag=tag)
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
