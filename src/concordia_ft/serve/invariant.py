"""Batch-invariant linear layers and RMSNorm for the engine (``EngineOptions.invariant``).

A request's tokens are a function of the request alone only if every operation on its rows gives the same bits
whatever else is in the batch. Elementwise ops, the embedding, RoPE and the sampler (a generator per request)
already do; the paged attention kernel does by construction (serve/attention.py). What does not: cuBLAS picks
its algorithm (tile shape, split-K) from the matrix shapes, so a row's reduction order over K changes with the
number of rows; torch's row reductions (RMSNorm's mean) split a row across threads or blocks by the shape too.

So, with ``invariant`` on, the engine swaps the forward of its model's ``nn.Linear`` and RMSNorm modules for:
- ``linear``: a Triton GEMM whose tile configuration is a function of ``(N, K)`` only (never of M), one program
  per output tile, K walked in fixed steps in order, no split-K: row ``i`` of ``x @ W.T`` is the same bits
  for any M and any position of the row among the M;
- ``rms_norm``: one program per row, the whole row in registers, one fixed reduction tree;
- ``gate_up``: a SiLU-gated MLP's gate and up projections as ``linear`` computes them, SiLU and the product in the
  same kernel (two launches and two elementwise kernels fewer per layer).
The swap is per module instance (no global dispatcher override), made once when the engine is built.

On the CPU (CPU tensors, Triton's interpreter off) the same three functions are torch ops whose every output
element is reduced by the same call shape whatever M is (``_cpu_*`` below, serve/DESIGN.md "The forward"):
- a product of row ``i`` and weight row ``j`` is an elementwise product written into a fresh contiguous
  ``[rows, N, K]`` buffer and summed over its last (contiguous) dim: torch reduces each output of an
  inner-contiguous sum on its own, in an order fixed by ``K`` alone (parallel work is split over outputs,
  never over the reduced dim), so neither the row count, the row's place, nor the row block it falls in (rows
  are taken in blocks only to bound the buffer) changes a bit. Operands in float32 (bfloat16 upcast exactly),
  one rounding at the end. Not ``F.linear`` / ``bmm``: the BLAS (and oneDNN, for bfloat16) choose kernels and
  blockings by M, and a row's sum over K changes with them;
- transcendental functions (SiLU's exponential, the attention's softmax) are ``exp_f32``: Cody-Waite range
  reduction and a polynomial in float64 built only of IEEE adds, multiplies and integer ops, so an element's
  value never depends on whether torch's loop reaches it through a SIMD lane or the scalar tail (torch's
  vectorized ``exp`` and its scalar ``exp`` are different implementations, and which one an element gets
  depends on the tensor's size and the thread split);
- RMSNorm's mean of squares is that same inner-contiguous sum over the row, and ``1 / sqrt`` (both correctly
  rounded IEEE operations) instead of ``rsqrt``;
- the attention is ``TorchAttention``: each query over a number of key tiles fixed by its position.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

_kernels: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    import triton
    import triton.language as tl

    from . import attention

    attention.prepare_interpreter()

    @triton.jit
    def concordia_linear(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                         HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :].to(tl.int64) * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def concordia_gate_up(x_ptr, g_ptr, u_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # silu(x @ Wg.T) * (x @ Wu.T) in one pass over x: both accumulators walk K as concordia_linear does
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            wmask = (rn[None, :] < N) & (kk[:, None] < K)
            woff = rn[None, :].to(tl.int64) * swn + kk[:, None] * swk
            acc_g = tl.dot(a, tl.load(g_ptr + woff, mask=wmask, other=0.0), acc_g)
            acc_u = tl.dot(a, tl.load(u_ptr + woff, mask=wmask, other=0.0), acc_u)
        y = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, y.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def concordia_rms_norm(x_ptr, w_ptr, y_ptr, N, sx, sy, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + c, mask=c < N, other=0.0).to(tl.float32)
        var = tl.sum(x * x, 0) / N
        h = (x * tl.math.rsqrt(var + eps)).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + c, mask=c < N, other=0.0)
        tl.store(y_ptr + row * sy + c, (w * h).to(y_ptr.dtype.element_ty), mask=c < N)

    return {"linear": concordia_linear, "gate_up": concordia_gate_up, "rms_norm": concordia_rms_norm}


# at most this many float32 elements in a CPU product buffer (rows are taken in blocks that fit it)
CPU_BUFFER_ELEMS = 1 << 22
_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238  # ln 2 split so that n * _LN2_HI is exact for |n| < 2^20
_LN2_LO = 1.9082149292705877e-10
_EXP_COEFFS = tuple(1.0 / math.factorial(i) for i in range(13, -1, -1))  # Taylor, highest first


def torch_path(x: torch.Tensor) -> bool:
    """Whether the invariant ops on ``x`` run as torch ops (a CPU tensor with Triton's interpreter off)."""
    from . import attention

    return x.device.type != "cuda" and not attention.interpreted()


def exp_f32(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` of a float32 tensor as float32, from IEEE adds, multiplies and integer ops only (so the same
    bits for an element wherever it sits in any tensor): ``x = n ln2 + r``, ``|r| <= ln2 / 2``, ``exp(r)`` by a
    degree-13 Taylor polynomial in float64 (error < 1e-17 relative), times ``2^n`` built from its bits; one
    rounding to float32. ``-inf`` gives 0; inputs are clamped to [-150, 89] (beyond: 0 and inf in float32)."""
    xd = x.to(torch.float64).clamp(-150.0, 89.0)
    n = torch.floor(xd * _LOG2E + 0.5)
    r = (xd - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    two_n = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)
    return (p * two_n).to(torch.float32)


def silu_f32(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` of a float32 tensor, elementwise from ``exp_f32`` (position-independent bits)."""
    return x / (1.0 + exp_f32(-x))


def dot_rows(a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``sum(a * b, -1)`` (float32, broadcast to ``shape``, whose last dim is reduced): the product is written
    into a contiguous buffer of ``shape`` so the sum is an inner-contiguous reduction, each output reduced on
    its own in an order fixed by ``shape[-1]`` (see the module docstring)."""
    buf = torch.empty(shape, dtype=torch.float32, device=a.device)
    torch.mul(a, b, out=buf)
    return buf.sum(-1)


def _cpu_products(x2: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``x2 @ w.T`` in float32 for each ``w``, rows in blocks of a size that depends on the weight alone."""
    m, k = x2.shape
    n = weights[0].shape[0]
    xf = x2.to(torch.float32)
    wf = [w.to(torch.float32)[None] for w in weights]  # [1, N, K]
    block = max(1, CPU_BUFFER_ELEMS // max(1, n * k))
    outs = [torch.empty(m, n, dtype=torch.float32, device=x2.device) for _ in weights]
    for r0 in range(0, m, block):
        xr = xf[r0: r0 + block, None, :]  # [R, 1, K]
        for o, w in zip(outs, wf, strict=True):
            o[r0: r0 + block] = dot_rows(xr, w, (xr.shape[0], n, k))
    return outs


def _cpu_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    (y,) = _cpu_products(x2, (weight,))
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2.dtype)


def _cpu_gate_up(x2: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = _cpu_products(x2, (gate, up))
    return (silu_f32(g) * u).to(x2.dtype)


def _cpu_rms_norm(x2: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    xf = x2.to(torch.float32)
    var = dot_rows(xf, xf, tuple(xf.shape)) / xf.shape[1]
    h = (xf * (1.0 / torch.sqrt(var + eps))[:, None]).to(dtype)
    return (weight * h).to(dtype)


def kernels() -> dict[str, Any]:
    if not _kernels:
        _kernels.update(_build())
    return _kernels


def tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BM, BN, BK, warps)`` for a weight of ``n`` outputs x ``k`` inputs: a function of the weight alone,
    so every batch size runs the same arithmetic. Narrow tiles for narrow weights (decode steps need programs
    across the SMs); M tiles of 64 rows."""
    bn = 32 if n <= 4096 else 64
    return 64, bn, 64, 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over the last dim of ``x``, batch-invariant (see the module docstring)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    if torch_path(x):
        return _cpu_linear(x2, weight, bias).view(*shape[:-1], n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps = tiles(n, k)
    kernels()["linear"][(-(-m // bm), -(-n // bn))](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), x2.stride(1),
        weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), HAS_BIAS=bias is not None,
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=3)
    return y.view(*shape[:-1], n)


def gate_up(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` in one kernel (a gated MLP's first half), batch-invariant like
    ``linear``; the product is taken in float32 before one rounding."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = gate.shape[0]
    if up.shape != gate.shape or up.stride() != gate.stride():
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} projections must match")
    if torch_path(x):
        return _cpu_gate_up(x2, gate, up).view(*shape[:-1], n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps = tiles(n, k)
    kernels()["gate_up"][(-(-m // bm), -(-n // bn))](
        x2, gate, up, y, m, n, k, x2.stride(0), x2.stride(1), gate.stride(0), gate.stride(1), y.stride(0),
        y.stride(1), BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=3)
    return y.view(*shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` per row in float32, as transformers' RMSNorm computes it."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[1]
    if torch_path(x):
        return _cpu_rms_norm(x2, weight, eps, torch.promote_types(weight.dtype, x.dtype)).view(shape)
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    import triton

    kernels()["rms_norm"][(x2.shape[0],)](x2, weight, y, n, x2.stride(0), y.stride(0), float(eps),
                                          BLOCK=triton.next_power_of_2(n), num_warps=4)
    return y.view(shape)


class TorchAttention:
    """The batch-invariant attention of one step in torch ops for CPU tensors, the paged attention kernel's
    contract (serve/attention.py). Each query at position ``p`` is computed over exactly ``ceil((p + 1) /
    BLOCK_N)`` tiles of keys (positions ``0 .. L - 1``, keys past ``p`` masked), together with the step's other
    queries that need as many tiles, whatever their request: every reduction (``q . k`` over D, the softmax's
    max and sum over L, ``P @ V`` over L) is a ``dot_rows`` sum (or a max) over the last dim of length fixed by
    ``p`` alone, and the exponential is ``exp_f32``. So a query's output depends only on its query, its position
    and its request's keys: not on the batch, the chunking, or whether the position is computed in a prefill or
    a decode step. Planned once per step from the
    kernel's tiles (``[n_tiles, 4]``: table row, first packed token, tokens, first position) and block tables, and
    run per layer by ``__call__``."""

    def __init__(self, tables: torch.Tensor, tiles: torch.Tensor, n_tiles: int, page: int) -> None:
        from .attention import BLOCK_N

        meta = tiles.view(-1)[: 4 * n_tiles].view(n_tiles, 4).tolist()
        rows: list[int] = []
        toks: list[int] = []
        pos: list[int] = []
        for r, t0, n, p0 in meta:
            rows += [r] * n
            toks += range(t0, t0 + n)
            pos += range(p0, p0 + n)
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        toks_t = torch.as_tensor(toks, dtype=torch.long)
        pos_t = torch.as_tensor(pos, dtype=torch.long)
        ntiles = pos_t // BLOCK_N + 1
        tab = tables.to(torch.long)
        w = tab.shape[1]
        # per group of queries that need the same number of key tiles: packed tokens [G], key slots [G, L] and
        # the causal mask [G, L]
        self.groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for nt in sorted(set(ntiles.tolist())):
            sel = (ntiles == nt).nonzero().view(-1)
            keys = torch.arange(nt * BLOCK_N)
            blk = tab[rows_t[sel]][:, (keys // page).clamp(max=w - 1)]  # [G, L] (past the table: masked keys)
            slots = blk * page + keys % page
            mask = keys[None, :] <= pos_t[sel][:, None]
            self.groups.append((toks_t[sel], slots, mask))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                 scale: float) -> None:
        """``out[T, Hq, D] = attention(q[T, Hq, D])`` over one layer's pool K/V ``[slots, Hkv, D]``."""
        hq, d = q.shape[1], q.shape[2]
        hkv = k_layer.shape[1]
        rep = hq // hkv
        for toks, slots, mask in self.groups:
            length = slots.shape[1]
            chunk = max(1, CPU_BUFFER_ELEMS // (hq * length * d))  # queries per product buffer (memory only)
            for c0 in range(0, len(toks), chunk):
                tk, sl, mk = toks[c0: c0 + chunk], slots[c0: c0 + chunk], mask[c0: c0 + chunk]
                g = len(tk)
                qg = q[tk].to(torch.float32).view(g, hkv, rep, 1, d)
                kg = k_layer[sl].to(torch.float32).permute(0, 2, 1, 3)[:, :, None]  # [G, Hkv, 1, L, D]
                s = dot_rows(qg, kg, (g, hkv, rep, length, d)) * scale  # [G, Hkv, rep, L]
                m4 = mk[:, None, None, :]
                s = torch.where(m4, s, float("-inf"))
                e = exp_f32(s - s.amax(-1, keepdim=True))  # exp(-inf) = 0: masked keys add nothing
                denom = e.sum(-1, keepdim=True)
                vg = v_layer[sl].to(torch.float32).permute(0, 2, 3, 1)[:, :, None]  # [G, Hkv, 1, D, L]
                pv = dot_rows(e[:, :, :, None, :], vg, (g, hkv, rep, d, length))  # [G, Hkv, rep, D]
                out[tk] = (pv / denom).view(g, hq, d).to(out.dtype)


def _linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def _norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6)))


def _gated_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(gate_up(x, self.gate_proj.weight, self.up_proj.weight))


def _is_silu_gated_mlp(mod: Any) -> bool:
    """A transformers gated MLP (``down(act(gate(x)) * up(x))``) with SiLU and no biases."""
    parts = [getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(mod, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"  # transformers' own SiLU
    return all(isinstance(p, torch.nn.Linear) and p.bias is None for p in parts) and silu


def install(model: torch.nn.Module) -> int:
    """Swap the forward of every ``nn.Linear``, RMSNorm and SiLU-gated MLP module of ``model`` (its instances
    only) for the batch-invariant kernels (a gated MLP's gate and up projections and its SiLU in one kernel);
    returns how many modules were switched."""
    n = 0
    for mod in model.modules():
        if _is_silu_gated_mlp(mod):
            mod.forward = types.MethodType(_gated_mlp_forward, mod)  # type: ignore[method-assign]
            n += 1
        if isinstance(mod, torch.nn.Linear):
            mod.forward = types.MethodType(_linear_forward, mod)  # type: ignore[method-assign]
            n += 1
        elif type(mod).__name__.endswith("RMSNorm") and getattr(mod, "weight", None) is not None:
            mod.forward = types.MethodType(_norm_forward, mod)  # type: ignore[method-assign]
            n += 1
    return n


__all__ = ["TorchAttention", "dot_rows", "exp_f32", "gate_up", "install", "kernels", "linear", "rms_norm", "silu_f32", "tiles", "torch_path"]
