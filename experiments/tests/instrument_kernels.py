"""Real Triton kernels for the safe-point tests: compiled to PTX for sm_90 without a GPU (CPU CI), and
launched on the H200 by the GPU tests and the pause benchmark. Each entry of KERNELS gives the signature,
constexprs and compile options used in both places."""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def matmul_kernel(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * sam + (k + rk)[None, :] * sak,
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        y = tl.load(b + (k + rk)[:, None] * sbk + rn[None, :] * sbn,
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def softmax_kernel(x, y, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
    v = v - tl.max(v, 0)
    e = tl.exp(v)
    tl.store(y + row * stride + cols, e / tl.sum(e, 0), mask=cols < n_cols)


@triton.jit
def layernorm_kernel(x, y, w, b, n_cols, stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        acc += tl.load(x + row * stride + cols, mask=cols < n_cols, other=0.0)
    mean = tl.sum(acc, 0) / n_cols
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        v = tl.load(x + row * stride + cols, mask=cols < n_cols, other=0.0) - mean
        acc2 += tl.where(cols < n_cols, v * v, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(acc2, 0) / n_cols + eps)
    for off in range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < n_cols
        v = tl.load(x + row * stride + cols, mask=m, other=0.0)
        out = (v - mean) * rstd * tl.load(w + cols, mask=m) + tl.load(b + cols, mask=m)
        tl.store(y + row * stride + cols, out, mask=m)


@triton.jit
def atomic_sum_kernel(x, out, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n, other=0.0)
    tl.atomic_add(out, tl.sum(v, 0))


@triton.jit
def grid_barrier_kernel(x, sem, n, BLOCK: tl.constexpr):
    # Inductor's cooperative-reduction pattern: every block arrives, then spins until all have
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)
    tl.atomic_add(sem, 1, sem="release")
    while tl.atomic_add(sem, 0, sem="acquire") < tl.num_programs(0):
        pass
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) + 1, mask=offs < n)


@triton.jit
def last_block_kernel(x, partial, ticket, out, n, BLOCK: tl.constexpr):
    # split-K style: the block that draws the last ticket reduces everybody's partials
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(partial + pid, tl.sum(tl.load(x + offs, mask=offs < n, other=0.0), 0))
    t = tl.atomic_add(ticket, 1, sem="acq_rel")
    if t == tl.num_programs(0) - 1:
        p = tl.load(partial + tl.arange(0, 1024), mask=tl.arange(0, 1024) < tl.num_programs(0), other=0.0)
        tl.store(out, tl.sum(p, 0))


@triton.jit
def persistent_copy_kernel(x, y, n_tiles, BLOCK: tl.constexpr):
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offs, tl.load(x + offs) + 1.0)


@triton.jit
def rowdot_reps_kernel(x, w, reps, out, n_cols, stride, BLOCK: tl.constexpr):
    """out[row] = sum of acc after reps[row] steps of acc = 3 acc + x[row] * w, in int32: exact on the GPU and in
    the interpreter alike (integer arithmetic), and the per-row pass count makes chosen blocks long (the
    GPU -> CPU handoff test: long blocks hold the GPU while the pause lands, short ones are left pending)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    xv = tl.load(x + row * stride + cols, mask=m, other=0).to(tl.int32)
    wv = tl.load(w + cols, mask=m, other=0).to(tl.int32)
    n = tl.load(reps + row)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for _ in range(0, n):
        acc = acc * 3 + xv * wv  # a multiplicative recurrence: no closed form for the compiler to fold the loop to
    tl.store(out + row, tl.sum(acc, 0))


KERNELS: dict[str, dict[str, Any]] = {
    "matmul": dict(fn=matmul_kernel, signature={
        "a": "*fp16", "b": "*fp16", "c": "*fp32", "M": "i32", "N": "i32", "K": "i32", "sam": "i32",
        "sak": "i32", "sbk": "i32", "sbn": "i32", "scm": "i32", "scn": "i32",
        "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
        constexprs={"BM": 128, "BN": 128, "BK": 64}, options={"num_warps": 8, "num_stages": 3}),
    "softmax": dict(fn=softmax_kernel, signature={"x": "*fp32", "y": "*fp32", "n_cols": "i32", "stride": "i32",
                                                  "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 1024}, options={"num_warps": 4}),
    "layernorm": dict(fn=layernorm_kernel, signature={
        "x": "*fp32", "y": "*fp32", "w": "*fp32", "b": "*fp32", "n_cols": "i32", "stride": "i32",
        "eps": "fp32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 512}, options={"num_warps": 4}),
    "atomic_sum": dict(fn=atomic_sum_kernel, signature={"x": "*fp32", "out": "*fp32", "n": "i32",
                                                        "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 1024}, options={"num_warps": 4}),
    "grid_barrier": dict(fn=grid_barrier_kernel, signature={"x": "*fp32", "sem": "*i32", "n": "i32",
                                                            "BLOCK": "constexpr"},
                         constexprs={"BLOCK": 256}, options={"num_warps": 4}),
    "last_block": dict(fn=last_block_kernel, signature={"x": "*fp32", "partial": "*fp32", "ticket": "*i32",
                                                        "out": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 256}, options={"num_warps": 4}),
    "persistent_copy": dict(fn=persistent_copy_kernel, signature={"x": "*fp32", "y": "*fp32", "n_tiles": "i32",
                                                                  "BLOCK": "constexpr"},
                            constexprs={"BLOCK": 1024}, options={"num_warps": 4}),
    "rowdot_reps": dict(fn=rowdot_reps_kernel, signature={"x": "*i8", "w": "*i8", "reps": "*i32", "out": "*i32",
                                                          "n_cols": "i32", "stride": "i32", "BLOCK": "constexpr"},
                        constexprs={"BLOCK": 16}, options={"num_warps": 8}),
}


def compile_for_sm90(name: str, **option_overrides: Any) -> Any:
    """Compile KERNELS[name] for sm_90 (no GPU needed); returns Triton's CompiledKernel (asm['ptx'])."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = KERNELS[name]
    opts = {**spec["options"], **option_overrides}
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


@triton.jit
def pdl_scale_kernel(x, y, n, BLOCK: tl.constexpr):
    gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2.0, mask=offs < n)
    gdc_launch_dependents()


KERNELS["pdl_scale"] = dict(fn=pdl_scale_kernel, signature={"x": "*fp32", "y": "*fp32", "n": "i32",
                                                            "BLOCK": "constexpr"},
                            constexprs={"BLOCK": 1024}, options={"num_warps": 4, "launch_pdl": True})


@triton.jit
def copy_then_reduce_kernel(x, y, s, n_cols, BLOCK: tl.constexpr):
    # writes global memory before its reduction barriers: those barriers are not restartable safe points
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x + row * n_cols + cols, mask=cols < n_cols, other=0.0)
    tl.store(y + row * n_cols + cols, v, mask=cols < n_cols)
    tl.store(s + row, tl.sum(v, 0))


KERNELS["copy_then_reduce"] = dict(fn=copy_then_reduce_kernel, signature={
    "x": "*fp32", "y": "*fp32", "s": "*fp32", "n_cols": "i32", "BLOCK": "constexpr"},
    constexprs={"BLOCK": 1024}, options={"num_warps": 4})


@triton.jit
def poi_silu_mul_kernel(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    # shaped like Inductor's pointwise kernels (loads, math, a masked store; no branch, no barrier)
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_ptr0 + xindex, xmask).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + xindex, xmask).to(tl.float32)
    tl.store(out_ptr0 + xindex, (tmp0 * tl.sigmoid(tmp0) * tmp1).to(tl.bfloat16), xmask)


KERNELS["poi_silu_mul"] = dict(fn=poi_silu_mul_kernel, signature={
    "in_ptr0": "*bf16", "in_ptr1": "*bf16", "out_ptr0": "*bf16", "xnumel": "i32", "XBLOCK": "constexpr"},
    constexprs={"XBLOCK": 512}, options={"num_warps": 8})


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                     pack=1)


@triton.jit
def spin_rows_timed_kernel(x, reps, out, times, BLOCK: tl.constexpr):
    """out[row] after reps[row] steps of acc = 3 acc + x[row] (int32: exact), and each block's start and end on
    the GPU's global timer (ns) in times[2 row], times[2 row + 1]: blocks that run as long as asked, timed by
    the GPU itself (the pause-drain benchmark: which blocks were running when the pause landed, how long)."""
    row = tl.program_id(0)
    t0 = _globaltimer()
    xv = tl.load(x + row * BLOCK + tl.arange(0, BLOCK))
    n = tl.load(reps + row)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for _ in range(0, n):
        acc = acc * 3 + xv
    tl.store(out + row, tl.sum(acc, 0))
    t1 = _globaltimer()
    tl.store(times + 2 * row, t0)
    tl.store(times + 2 * row + 1, t1)


KERNELS["spin_rows_timed"] = dict(fn=spin_rows_timed_kernel, signature={
    "x": "*i32", "reps": "*i32", "out": "*i32", "times": "*i64", "BLOCK": "constexpr"},
    constexprs={"BLOCK": 128}, options={"num_warps": 4})
