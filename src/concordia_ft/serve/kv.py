"""The paged KV pool (one arena for every request) and the attention that reads and writes it.

Layout: ``arena`` (uint8) is ``num_blocks * block_size`` token **rows**; a row holds one token's K and V for
every layer, ``[layer][K|V][kv_head][head_dim]`` in the model's dtype, padded to a multiple of 512 bytes. So a
KV block (``block_size`` rows, ``blocks.BlockPool``) is contiguous, and so is one token: a decode step dirties
exactly one row per request, and the runtime's paged region logs rows (its "blocks") flagged in ``dirty``.

Attention is ours, plugged into transformers through its public attention registry
(``AttentionInterface.register``: the hook transformers keeps for vLLM/TGI-style backends, present in 5.17 and
5.24 alike). The model runs one packed sequence ``[1, T]`` (every request's new tokens, request after
request) with per-token ``position_ids``; no transformers cache is passed, so no mask is built and the
version-specific cache classes never run. Per layer, ``paged_attention`` writes the step's K/V rows into the
pool (``index_copy_`` at the tokens' slots), gathers each request's slots into a padded ``[B, H, L, D]``
batch, and runs one ``scaled_dot_product_attention`` with a per-request causal mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..integrations.transformers import FULL_TYPES, dtype_name, layer_types_and_windows, parse_dtype
from . import attention, invariant

ATTN_NAME = "concordia_paged"
ROW_ALIGN = 512


@dataclass(frozen=True)
class PoolGeometry:
    """Everything that fixes the arena's bytes (recorded in every epoch; recovery checks it)."""

    num_blocks: int
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=parse_dtype(self.dtype)).element_size()

    @property
    def row_elems(self) -> int:
        """Elements of one padded row (a token's K and V of every layer)."""
        raw = self.layers * 2 * self.kv_heads * self.head_dim * self.elem_bytes
        return -(-raw // ROW_ALIGN) * ROW_ALIGN // self.elem_bytes

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.elem_bytes

    @property
    def nbytes(self) -> int:
        return self.slots * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """The largest power of two <= 4096 dividing a row: the runtime's page inside a row."""
        p = 4096
        while self.row_bytes % p:
            p //= 2
        return p

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def plan_pool(config: Any, *, num_blocks: int, block_size: int, dtype: torch.dtype) -> PoolGeometry:
    """The pool for a transformers config (full-attention layers only)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, _ = layer_types_and_windows(cfg)
    bad = [i for i, t in enumerate(types) if t not in FULL_TYPES]
    if bad:
        raise ConfigError(f"layers {bad} are {types[bad[0]]!r}; the serving engine's paged pool holds "
                          "full-attention layers only (sliding-window models are not supported yet)")
    if num_blocks <= 0 or block_size <= 0:
        raise ConfigError(f"num_blocks={num_blocks} and block_size={block_size} must both be positive")
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return PoolGeometry(int(num_blocks), int(block_size), len(types), heads, int(hd), dtype_name(dtype))


class KVPool:
    """The arena, its per-layer K/V views (``[slots, kv_heads, head_dim]``, strided) and the dirty-row flags.

    ``scratch_blocks`` more blocks follow the arena in the same storage: the padded rows of a graph-captured
    decode step (``graphs.DecodeGraphs``) write and read there. They are not part of ``arena`` / ``dirty`` (the
    views the runtime registers), so they are never logged, and no block table names them."""

    def __init__(self, geo: PoolGeometry, device: torch.device | str, *, zeroed: bool = True,
                 scratch_blocks: int = 0) -> None:
        self.geo = geo
        self.scratch_blocks = int(scratch_blocks)
        rows = geo.slots + self.scratch_blocks * geo.block_size
        # always zeroed (a memset at HBM speed on a GPU, calloc'd pages on the CPU): a row no one wrote since a
        # restore reads as zeros, never as stale bytes, which could be NaN and masked keys still go through the
        # score arithmetic (0 * NaN is NaN); `zeroed` is kept for callers that ask for it explicitly
        del zeroed
        self.storage = torch.zeros(rows * geo.row_bytes, dtype=torch.uint8, device=device)
        self.flags = torch.zeros(rows, dtype=torch.uint8, device=device)
        self.arena = self.storage[: geo.nbytes]  # what the runtime registers and logs
        self.dirty = self.flags[: geo.slots]  # one flag per row
        typed = self.storage.view(parse_dtype(geo.dtype)).view(rows, geo.row_elems)
        w = geo.kv_heads * geo.head_dim
        self.k = [typed[:, (2 * i) * w: (2 * i + 1) * w].view(rows, geo.kv_heads, geo.head_dim)
                  for i in range(geo.layers)]
        self.v = [typed[:, (2 * i + 1) * w: (2 * i + 2) * w].view(rows, geo.kv_heads, geo.head_dim)
                  for i in range(geo.layers)]
        self.views = [attention.PoolView(typed, 2 * i * w, (2 * i + 1) * w, geo.kv_heads, geo.head_dim,
                                         geo.block_size) for i in range(geo.layers)]

    @property
    def scratch_block(self) -> int:
        """The first scratch block's id (== ``num_blocks``)."""
        return self.geo.num_blocks


@dataclass
class PagedBatch:
    """One step's packed batch, as the attention needs it (tensors on the pool's device).

    ``write_slots[T]``: the pool slot of each packed token; ``q_index[B, Q]``: packed token of query ``q`` of
    request ``b`` (padded with 0); ``kv_slots[B, L]``: pool slot of each key position (padded with 0);
    ``mask[B, 1, Q, L]``: key ``j`` visible to query ``q`` (causal within the request, False on padding);
    ``q_valid[B, Q]``: real queries. ``dense``: a decode step, one real query per request (``Q == 1``): the
    query heads of each K/V head attend as its queries, and the output is packed by a reshape, not a boolean
    index (no host sync, so a CUDA graph can capture it)."""

    pool: KVPool
    write_slots: torch.Tensor
    q_index: torch.Tensor
    q_valid: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor
    dense: bool = False


@dataclass
class KernelBatch:
    """One step's packed batch for the paged attention kernel (serve/attention.py): ``write_slots[T]`` (the
    pool slot each packed token's K/V goes to), ``tables[R, W]`` (each feed's block table, padded), ``tiles``
    (``[n_tiles, 4]``: table row, first packed token, tokens, first position). No per-step copy of any key."""

    pool: KVPool
    write_slots: torch.Tensor
    tables: torch.Tensor
    tiles: torch.Tensor
    n_tiles: int
    torch_plan: invariant.TorchAttention | None = None  # the CPU path's plan, made by the step's first layer


def kernel_attention(device: torch.device, invariant: bool = False) -> bool:
    """Whether an engine on ``device`` runs the paged attention kernel's batches (``KernelBatch``): on CUDA where
    Triton is installed; on the CPU when Triton's interpreter is switched on (``TRITON_INTERPRET=1``: the
    kernel's exact semantics, slowly, for tests), or in the invariant mode (``invariant``), where
    ``invariant.TorchAttention`` computes them in torch ops; else the gather + SDPA path."""
    if device.type != "cuda" and not attention.interpreted():
        return invariant
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def build_kernel_batch(pool: KVPool, tables: list[list[int]], slots: list[list[int]], starts: list[int],
                       ends: list[int], bq: int, device: torch.device) -> tuple[KernelBatch, torch.Tensor, torch.Tensor]:
    """The kernel's batch of feeds ``i`` = positions ``[starts[i], ends[i])`` of a request whose block table is
    ``tables[i]`` and whose pool slot of position ``p`` is ``slots[i][p]``, in tiles of ``bq`` tokens
    (``attention.block_q``). Built on the host into one pinned
    buffer, moved in one transfer. Returns it, the packed positions ``[T]`` and each feed's last packed token."""
    counts = [e - s for s, e in zip(starts, ends, strict=True)]
    t = sum(counts)
    firsts = np.cumsum([0] + counts[:-1]).tolist()
    tiles = attention.plan_tiles(list(range(len(tables))), firsts, counts, starts, bq)
    w = max(len(tb) for tb in tables)
    nt = len(tiles)
    n = 2 * t + nt + len(tables) * w + len(tables)
    cuda = device.type == "cuda"
    host = torch.empty(n, dtype=torch.long, pin_memory=cuda)
    h = host.numpy()
    h[:t] = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    h[t: 2 * t] = np.concatenate([np.asarray(sl[s:e]) for sl, s, e in zip(slots, starts, ends, strict=True)])
    h[2 * t: 2 * t + nt] = tiles
    tab = h[2 * t + nt: 2 * t + nt + len(tables) * w].reshape(len(tables), w)
    tab[:] = 0
    for i, tb in enumerate(tables):
        tab[i, : len(tb)] = tb
    h[n - len(tables):] = np.asarray(firsts) + np.asarray(counts) - 1
    dev = host.to(device, non_blocking=True)
    batch = KernelBatch(pool, dev[t: 2 * t], dev[2 * t + nt: n - len(tables)].view(len(tables), w),
                        dev[2 * t: 2 * t + nt], nt // 4)
    return batch, dev[:t], dev[n - len(tables):]


def build_batch(pool: KVPool, tables: list[torch.Tensor], starts: list[int], ends: list[int],
                device: torch.device) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """The batch of requests ``i`` feeding positions ``[starts[i], ends[i])`` whose block tables are
    ``tables[i]`` (CPU int64: position ``p`` lives at slot ``tables[i][p // block_size] * block_size + p %
    block_size``). Returns it, the packed positions ``[T]`` and each request's last packed token ``[B]``.
    A handful of tensor ops on the device: no per-token Python."""
    bs = pool.geo.block_size
    lmax = max(ends)
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device, non_blocking=True)
    keys = torch.arange(lmax, device=device)
    kv_slots = padded[:, keys // bs] * bs + keys % bs  # [B, L] (rows past a request's end are masked)
    st = torch.as_tensor(starts, dtype=torch.long).to(device, non_blocking=True)
    qlen = torch.as_tensor([e - s for s, e in zip(starts, ends, strict=True)], dtype=torch.long).to(
        device, non_blocking=True)
    qmax = max(e - s for s, e in zip(starts, ends, strict=True))
    ar = torch.arange(qmax, device=device)
    q_pos = st.unsqueeze(1) + ar.unsqueeze(0)  # [B, Q]
    q_valid = ar.unsqueeze(0) < qlen.unsqueeze(1)
    offsets = torch.cumsum(qlen, 0) - qlen
    q_index = torch.where(q_valid, offsets.unsqueeze(1) + ar.unsqueeze(0), 0)
    mask = (keys.view(1, 1, lmax) <= q_pos.unsqueeze(2)) & q_valid.unsqueeze(2)
    mask[:, :, 0] |= ~q_valid  # a padded query sees key 0 (its output is dropped): no all-masked row, no NaN
    positions = q_pos[q_valid]
    write = kv_slots.gather(1, q_pos.clamp(max=lmax - 1))[q_valid]
    batch = PagedBatch(pool, write, q_index, q_valid, kv_slots, mask.unsqueeze(1))
    return batch, positions, offsets + qlen - 1


def _write_rows(pool: Any, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """The step's K/V rows (``[1, Hkv, T, D]``) into the pool's slots of ``layer``, by torch ops."""
    kl, vl = pool.k[layer], pool.v[layer]
    kl.index_copy_(0, slots, key[0].transpose(0, 1).to(kl.dtype))
    vl.index_copy_(0, slots, value[0].transpose(0, 1).to(vl.dtype))


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query [1, Hq, T, D]``, ``key/value [1, Hkv, T, D]`` (rotated)."""
    batch: PagedBatch | KernelBatch | None = kwargs.get("concordia_batch")
    if batch is None:
        raise ConfigError("the model is set to concordia's paged attention but was called without an engine "
                          "batch; run it through serve.Engine")
    layer = int(module.layer_idx)
    pool = batch.pool
    if isinstance(batch, KernelBatch):
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        out = torch.empty(q.shape, dtype=query.dtype, device=query.device)
        sc = scaling if scaling is not None else q.shape[-1] ** -0.5
        if invariant.torch_path(query):  # the CPU's invariant mode: the kernel's batch in torch ops
            _write_rows(pool, layer, batch.write_slots, key, value)
            if batch.torch_plan is None:
                batch.torch_plan = invariant.TorchAttention(batch.tables, batch.tiles, batch.n_tiles,
                                                            pool.geo.block_size)
            batch.torch_plan(q, out, pool.k[layer], pool.v[layer], sc)
            return out.unsqueeze(0), None
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
        attention.write_kv(k if k.stride(2) == 1 else k.contiguous(), v if v.stride(2) == 1 else v.contiguous(),
                           pool.views[layer], batch.write_slots)
        if q.stride(2) != 1:
            q = q.contiguous()
        attention.launch(q, out, pool.views[layer], batch.tables, batch.tiles, batch.n_tiles, sc)
        return out.unsqueeze(0), None
    _write_rows(pool, layer, batch.write_slots, key, value)
    kl, vl = pool.k[layer], pool.v[layer]
    k = kl[batch.kv_slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    v = vl[batch.kv_slots].permute(0, 2, 1, 3)
    if batch.dense:  # one query per request: a K/V head's query heads are its queries (no K/V copy for GQA)
        b, hkv = k.shape[0], k.shape[1]
        hq, d = query.shape[1], query.shape[3]
        q = query[0].transpose(0, 1).reshape(b, hkv, hq // hkv, d)  # head h = kv head h // rep
        out = torch.nn.functional.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype),
                                                               attn_mask=batch.mask, scale=scaling)
        return out.reshape(1, b, hq, d), None
    q = query[0].transpose(0, 1)[batch.q_index].transpose(1, 2)  # [B, Hq, Q, D]
    b, hkv, length, d = k.shape
    if hkv != q.shape[1]:  # grouped-query attention: each K/V head serves ``rep`` query heads (a copy, no sync)
        rep = q.shape[1] // hkv
        k = k.unsqueeze(2).expand(b, hkv, rep, length, d).reshape(b, hkv * rep, length, d)
        v = v.unsqueeze(2).expand(b, hkv, rep, length, d).reshape(b, hkv * rep, length, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=batch.mask,
                                                           scale=scaling)
    packed = out.transpose(1, 2)[batch.q_valid]  # [T, Hq, D] in packed order
    return packed.unsqueeze(0), None


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The SDPA kernels the engine's attention may use on ``device``. CUDA: the memory-efficient kernel (math
    where it cannot run). Not cuDNN attention, which torch 2.11 prefers on Hopper: it builds an execution plan
    per new (batch, key length) shape (seconds of a run whose shapes change every step) and is not run-to-run
    reproducible at bf16 (integrations/LLM.md); not flash either, which takes no mask. The memory-efficient
    forward is deterministic for a given shape and needs no plan. CPU: unchanged (whatever torch picks)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def install(model: Any) -> str:
    """Register the paged attention with transformers and switch ``model`` to it; returns the previous one."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    prev = str(model.config._attn_implementation)
    try:
        model.set_attn_implementation(ATTN_NAME)
    except Exception:  # noqa: BLE001 - older 5.x refuse or lack it: the config field is what the layers read
        pass
    if model.config._attn_implementation != ATTN_NAME:
        model.config._attn_implementation = ATTN_NAME
    return prev
