"""Paged attention over the engine's KV pool: one Triton kernel for prefill, chunked prefill and decode.

The kernel reads K and V in place through the block tables (no per-step gather of a request's keys) and is
**batch-invariant by construction**: the arithmetic that produces one query row's output depends only on that
row's query, its position and its request's keys, never on the rest of the batch.

- A program owns one *tile*: up to ``block_q`` consecutive query tokens of ONE request and one K/V head; its
  ``M = 32`` matrix rows are the tile's tokens x that head's query heads (grouped-query attention: the
  ``rep`` query heads of a K/V head share every key load). Rows of tokens the tile does not hold are padding.
- Keys are visited from position 0 upward in fixed tiles of ``BLOCK_N`` keys, with an online softmax in
  float32. A row never sees a key past its position (causal mask). Key tiles wholly past a row's position
  (visited because a later row of the same tile needs them) leave that row's running max, sum and
  accumulator bit-identical (``exp2(-inf) = 0``, ``alpha = exp2(0) = 1``), so how a prompt is cut into tiles
  or chunks, and whether a position is computed in a prefill or a decode step, does not change a bit.
- No split of the key axis: one program walks all of a row's keys in the same order whatever the batch.
- ``M``, ``BLOCK_N``, the warp count and the stage count are constants of the model's geometry, so every step
  of an engine (and of a recovered engine) runs the same compiled kernel and the same MMA shapes.

Why our own kernel rather than FlexAttention's paged block masks (published 2.4-7.3x slower than
FlashAttention at decode, and a mask per step) or FlashInfer (a 62 MB wheel that JIT-compiles with nvcc, and
whose decode splits the key axis by a plan that depends on the batch): the recovery contract needs a kernel
whose bits do not depend on the batch, and both prefill and decode through one code path.

``reference_attention`` is the float64 definition the kernel is tested against (and the CPU path's oracle).

``invariant.TorchAttention`` keeps the same contract in torch ops for CPU tensors (the invariant mode on a CPU
model, Triton's interpreter off).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

M_ROWS = 32  # matrix rows of a program: tokens x query heads of one K/V head
BLOCK_N = 64  # keys per inner tile
NUM_WARPS = 4
NUM_STAGES = 2

_kernel: Any = None


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``, Triton's own switch)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def prepare_interpreter() -> None:
    """Under Triton's interpreter only (no effect on compiled kernels), two changes:

    - Triton 3.6's interpreter turns a loop bound into an int with ``int(array)`` on a one-element array, which
      numpy >= 2.3 refuses; take the element instead.
    - ``tl.dot`` becomes a product whose every output element sums over K in one fixed order. The interpreter's
      own ``np.matmul`` goes to the machine's BLAS, whose kernels may sum a row in another order depending on
      where the row sits in the tile (OpenBLAS on AVX-512 does); a GPU's MMA of a fixed tile shape does not, and
      the kernels' batch invariance rests on that.
    """
    if not interpreted():
        return
    import numpy as np
    from triton.runtime import interpreter as ti

    orig = ti._patch_lang_tensor
    if getattr(orig, "_concordia", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    orig_dot = ti.InterpreterBuilder.create_dot

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        a_data, b_data = a.data.astype(acc), b.data.astype(acc)
        # [M, K, 1] * [1, K, N] summed over K by numpy's sequential reduction of a non-last axis: out[i, j]
        # adds k = 0, 1, ... in order whatever M is and wherever row i sits
        prod = a_data[..., :, :, None] * b_data[..., None, :, :]
        return ti.TensorHandle(np.add.reduce(prod, axis=-2) + d.data, d.dtype.scalar)

    patched._concordia = True  # type: ignore[attr-defined]
    ti._patch_lang_tensor = patched
    ti.InterpreterBuilder.create_dot = create_dot


def _build() -> Any:
    import triton
    import triton.language as tl

    prepare_interpreter()

    @triton.jit
    def concordia_paged_attention(
        q_ptr, q_st, q_sh,  # query [T, Hq, D]: token stride, head stride (the last dim contiguous)
        o_ptr, o_st, o_sh,  # output [T, Hq, D]
        kv_ptr, row_stride, k_off, v_off,  # K[slot, h, d] = kv_ptr[slot * row_stride + k_off + h * D + d]
        tab_ptr, tab_stride,  # block tables [R, W] (int32)
        tiles_ptr,  # [n_tiles, 4] int32: table row, first packed token, tokens, position of the first token
        qk_scale,  # softmax scale * log2(e)
        REP: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr,
        PAGE: tl.constexpr,
    ):
        tile = tl.program_id(0)
        hk = tl.program_id(1)
        four = tl.arange(0, 4)
        meta = tl.load(tiles_ptr + tile * 4 + four)
        req = tl.sum(tl.where(four == 0, meta, 0))
        t0 = tl.sum(tl.where(four == 1, meta, 0))
        n = tl.sum(tl.where(four == 2, meta, 0))
        p0 = tl.sum(tl.where(four == 3, meta, 0))
        rows = tl.arange(0, M)
        qi = rows // REP
        head = hk * REP + rows % REP
        valid = (qi < n) & (qi < BQ)
        d = tl.arange(0, D)
        tok = (t0 + qi).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * q_st + head[:, None] * q_sh + d[None, :], mask=valid[:, None], other=0.0)
        qpos = p0 + qi
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        kend = p0 + n
        tab = tab_ptr + req.to(tl.int64) * tab_stride
        for start in range(0, kend, BN):
            kidx = start + tl.arange(0, BN)
            inside = kidx < kend
            blk = tl.load(tab + kidx // PAGE, mask=inside, other=0)
            slot = blk.to(tl.int64) * PAGE + kidx % PAGE
            base = kv_ptr + slot[:, None] * row_stride + hk * D + d[None, :]
            k = tl.load(base + k_off, mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(kidx[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(base + v_off, mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + tok[:, None] * o_st + head[:, None] * o_sh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None])

    @triton.jit
    def concordia_kv_write(k_ptr, k_st, k_sh, v_ptr, v_st, v_sh, kv_ptr, row_stride, k_off, v_off, slots_ptr,
                           D: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
        # token t's K and V (all its K/V heads) into its pool row: one program a token
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK)
        inside = e < W
        h = e // D
        d = e % D
        slot = tl.load(slots_ptr + t).to(tl.int64)
        k = tl.load(k_ptr + t * k_st + h * k_sh + d, mask=inside)
        v = tl.load(v_ptr + t * v_st + h * v_sh + d, mask=inside)
        row = kv_ptr + slot * row_stride + e
        tl.store(row + k_off, k.to(kv_ptr.dtype.element_ty), mask=inside)
        tl.store(row + v_off, v.to(kv_ptr.dtype.element_ty), mask=inside)

    return {"attention": concordia_paged_attention, "kv_write": concordia_kv_write}


def kernel(name: str = "attention") -> Any:
    """A compiled-on-first-use Triton kernel (importing this module never imports Triton)."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel[name]


def write_kv(k: torch.Tensor, v: torch.Tensor, view: PoolView, slots: torch.Tensor) -> None:
    """Token ``t``'s ``k[t], v[t]`` (``[T, Hkv, D]``, the head dimension contiguous) into pool slot ``slots[t]``
    of the layer ``view`` names, in one launch."""
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("the K/V write needs the head dimension contiguous")
    t = k.shape[0]
    if t == 0:
        return
    w = view.kv_heads * view.head_dim
    import triton

    kernel("kv_write")[(t,)](k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), view.storage,
                             view.storage.stride(0), view.k_off, view.v_off, slots, D=view.head_dim, W=w,
                             BLOCK=triton.next_power_of_2(w), num_warps=4)


def block_q(rep: int) -> int:
    """Query tokens a program holds for ``rep`` query heads per K/V head."""
    if not 1 <= rep <= M_ROWS:
        raise ValueError(f"{rep} query heads per K/V head: the paged attention kernel takes 1 to {M_ROWS}")
    return M_ROWS // rep


@dataclass(frozen=True)
class PoolView:
    """Where one layer's K and V live in the pool's typed storage ``[rows, row_elems]``."""

    storage: torch.Tensor  # [rows, row_elems] in the model's dtype
    k_off: int
    v_off: int
    kv_heads: int
    head_dim: int
    page: int  # rows per block


def plan_tiles(rows: list[int], firsts: list[int], counts: list[int], positions: list[int], bq: int) -> list[int]:
    """The flat ``[n_tiles * 4]`` tile list of feeds: feed ``i`` is ``counts[i]`` packed tokens from
    ``firsts[i]`` of table row ``rows[i]``, its first token at ``positions[i]``; cut into tiles of ``bq``."""
    out: list[int] = []
    for r, f, c, p in zip(rows, firsts, counts, positions, strict=True):
        for k in range(0, c, bq):
            out += (r, f + k, min(bq, c - k), p + k)
    return out


def launch(q: torch.Tensor, out: torch.Tensor, view: PoolView, tables: torch.Tensor, tiles: torch.Tensor,
           n_tiles: int, scale: float) -> None:
    """``out[T, Hq, D] = attention(q[T, Hq, D])`` for the tiles ``tiles[n_tiles, 4]`` (int32, on the device)
    over the keys the block tables ``tables[R, W]`` (int32) name. Stream-ordered; no host sync."""
    hq, d = q.shape[1], q.shape[2]
    rep = hq // view.kv_heads
    if q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("paged attention needs the head dimension contiguous")
    bq = block_q(rep)
    kernel("attention")[(n_tiles, view.kv_heads)](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1),
        view.storage, view.storage.stride(0), view.k_off, view.v_off, tables, tables.stride(0), tiles,
        scale * math.log2(math.e), REP=rep, D=d, M=M_ROWS, BQ=bq, BN=BLOCK_N, PAGE=view.page,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def reference_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, positions: list[int],
                        scale: float) -> torch.Tensor:
    """float64 causal attention of one request: ``q[T, Hq, D]`` at ``positions`` over its keys
    ``k_rows/v_rows[L, Hkv, D]`` (position order). The definition the kernel is tested against."""
    hq, hkv = q.shape[1], k_rows.shape[1]
    rep = hq // hkv
    k = k_rows.double().repeat_interleave(rep, dim=1)  # [L, Hq, D]
    v = v_rows.double().repeat_interleave(rep, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        s = torch.einsum("hd,lhd->hl", q[i].double(), k[: p + 1]) * scale
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v[: p + 1])
    return out


__all__ = ["BLOCK_N", "M_ROWS", "PoolView", "block_q", "interpreted", "kernel", "prepare_interpreter", "write_kv", "launch", "plan_tiles", "reference_attention"]
