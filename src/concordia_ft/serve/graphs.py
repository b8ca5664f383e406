"""Decode steps as CUDA graphs, one per (batch bucket, key-length bucket), replayed on static tensors.

A step whose every feed is a decode (one token per request, each sampling) runs on the static inputs of the
smallest bucket that holds it: ``nb`` request rows (1, 2, 4, ... 64, at most ``max_running`` rounded up) and
``nk`` key positions (a power of two >= 64, at most ``max_model_len`` rounded up to a block). The host fills one
int64 buffer, ``[ids | positions | block tables]``, copies it to the device in one transfer and replays; the
graph derives everything else on the device: each row's key slots from its table, the write slot, the causal
mask, the dirty flags of the rows written, and the float32 logits of every row (the sampler reads the first
``n``). Prefill and chunked steps run eagerly (their shapes vary), and so does any step that fits no bucket.

Padded rows (``n < nb``): row ``j`` of the padding feeds token 0 at position ``j % block_size`` with a table of
scratch block ``num_blocks + j // block_size`` (``KVPool``'s unlogged tail): it writes its own scratch slot
and reads only scratch slots written by padding rows of the same step. A real row's table is padded with the
first scratch block; those keys are past its position, so masked. Graphs are captured lazily (on a bucket's
first use) with padding-only inputs, so the capture's warm-up writes scratch rows only, and share one memory
pool (one step is in flight at a time).

``mode="padded"`` runs the same static step without capturing it: the same kernels at the same shapes, so a
captured engine and a padded one are bitwise equal (the GPU test checks it); on CPU it checks the padding and
table logic against the variable-shape eager path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from .kv import KernelBatch, PagedBatch, sdpa_backends

log = logging.getLogger("concordia_ft.serve.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_KEYS = 64
MODES = ("on", "padded")


def batch_buckets(max_running: int) -> tuple[int, ...]:
    """The batch buckets an engine of ``max_running`` requests uses (the last one holds them all)."""
    out = tuple(b for b in BATCH_BUCKETS if b < max_running)
    top = next((b for b in BATCH_BUCKETS if b >= max_running), None)
    return out + ((top,) if top is not None else ())


def scratch_blocks_for(max_running: int, block_size: int) -> int:
    """Scratch blocks the padding rows of the largest bucket need (one slot each)."""
    top = batch_buckets(max_running)[-1] if max_running <= BATCH_BUCKETS[-1] else BATCH_BUCKETS[-1]
    return -(-top // block_size)


class _Static:
    """One bucket's static tensors (and its graph, once captured)."""

    def __init__(self, nb: int, nk: int, block_size: int, scratch: int, device: torch.device) -> None:
        self.nb, self.nk = nb, nk
        self.nt = nk // block_size
        n = 2 * nb + nb * self.nt
        cuda = device.type == "cuda"
        self.buf = torch.zeros(n, dtype=torch.long, device=device)
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=cuda) if cuda else self.buf
        self.host_np = self.host.numpy()
        self.ids = self.buf[:nb]
        self.pos = self.buf[nb:2 * nb]
        self.tables = self.buf[2 * nb:].view(nb, self.nt)
        self.keys = torch.arange(nk, device=device)
        self.q_index = torch.arange(nb, device=device).view(nb, 1)
        self.q_valid = torch.ones(nb, 1, dtype=torch.bool, device=device)
        # padding rows (see the module docstring); row j of the padding
        j = np.arange(nb)
        self.pad_pos = j % block_size
        self.pad_tab = np.repeat((scratch + j // block_size)[:, None], self.nt, axis=1)
        self.scratch = scratch
        self.copied = torch.cuda.Event() if cuda else None
        self.graph: Any = None
        self.failed: str | None = None
        self.logits: torch.Tensor | None = None
        self.capture_s = 0.0
        self.replays = 0

    def fill_padding(self, first: int) -> None:
        """Rows ``first..nb-1`` become padding rows ``0..nb-1-first``."""
        h, nb = self.host_np, self.nb
        k = nb - first
        h[first:nb] = 0
        h[nb + first: 2 * nb] = self.pad_pos[:k]
        self.tables_np()[first:] = self.pad_tab[:k]

    def tables_np(self) -> np.ndarray:
        return self.host_np[2 * self.nb:].reshape(self.nb, self.nt)


class DecodeGraphs:
    """The engine's graph-captured decode steps (``mode`` "on") or the same static steps run eagerly
    ("padded")."""

    def __init__(self, engine: Any, mode: str) -> None:
        self.eng = engine
        self.mode = mode
        geo = engine.geo
        self.bs = geo.block_size
        self.buckets = batch_buckets(engine.opts.max_running)
        cap = -(-engine.opts.max_model_len // self.bs) * self.bs
        keys = []
        k = MIN_KEYS
        while k < cap:
            if k % self.bs == 0:
                keys.append(k)
            k *= 2
        keys.append(cap)
        # the paged attention kernel reads each row's keys through its table up to its position: one key bucket
        self.key_buckets = (cap,) if engine.kernel else tuple(keys)
        self.statics: dict[tuple[int, int], _Static] = {}
        self.mempool: Any = torch.cuda.graph_pool_handle() if mode == "on" else None
        self.replays = 0
        self.eager_steps = 0

    def bucket(self, n: int, keys: int) -> tuple[int, int] | None:
        nb = next((b for b in self.buckets if b >= n), None)
        nk = next((k for k in self.key_buckets if k >= keys), None)
        return None if nb is None or nk is None else (nb, nk)

    def prepare(self, n: int, keys: int) -> bool:
        """Capture, ahead of it, the bucket a decode step of ``n`` requests over ``keys`` key positions will
        replay (a recovering engine does it while its pool is being restored: the capture writes scratch rows
        only). True when that bucket has a graph."""
        b = self.bucket(n, keys)
        if self.mode != "on" or b is None:
            return False
        st = self.statics.get(b)
        if st is None:
            st = self.statics[b] = _Static(b[0], b[1], self.bs, self.eng.pool.scratch_block, self.eng.device)
        if st.graph is None and st.failed is None:
            self._capture(st)
        return st.graph is not None

    @property
    def capture_s(self) -> float:
        return sum(st.capture_s for st in self.statics.values())

    def run(self, feeds: list[tuple[Any, int, int]]) -> torch.Tensor | None:
        """float32 logits ``[n, V]`` of a decode-only step (feeds ``(request, pos, pos + 1)``), or None if no
        bucket holds it (the caller runs it eagerly)."""
        n = len(feeds)
        b = self.bucket(n, max(s for _, s, _ in feeds) + 1)
        if b is None:
            return None
        st = self.statics.get(b)
        if st is None:
            st = self.statics[b] = _Static(b[0], b[1], self.bs, self.eng.pool.scratch_block, self.eng.device)
        if self.mode == "on" and st.graph is None and (st.failed is not None or not self._capture(st)):
            return None
        if st.copied is not None:
            st.copied.synchronize()  # the previous step's transfer has read the pinned buffer
        h, nb, nt = st.host_np, st.nb, st.nt
        tab = st.tables_np()
        tables = self.eng.blocks.tables
        tab[:n] = st.scratch
        for i, (r, s, _) in enumerate(feeds):
            h[i] = r.ids[s]
            h[nb + i] = s
            t = tables[r.id][:nt]
            tab[i, : len(t)] = t
        st.fill_padding(n)
        if st.host is not st.buf:
            st.buf.copy_(st.host, non_blocking=True)
            assert st.copied is not None
            st.copied.record()
        if self.mode == "on":
            st.graph.replay()
            assert st.logits is not None
            logits = st.logits
        else:
            with sdpa_backends(self.eng.device):
                logits = self._compute(st)
        st.replays += 1
        self.replays += 1
        return logits[:n]

    def _compute(self, st: _Static) -> torch.Tensor:
        eng = self.eng
        pool = eng.pool
        bs, nb, nk = self.bs, st.nb, st.nk
        batch: KernelBatch | PagedBatch
        if eng.kernel:
            write = st.tables.gather(1, (st.pos // bs).view(nb, 1)).view(nb) * bs + st.pos % bs
            ar = st.q_index.view(nb)
            tiles = torch.stack([ar, ar, torch.ones_like(ar), st.pos], 1).view(-1)
            batch = KernelBatch(pool, write, st.tables, tiles, nb)
        else:
            kv_slots = st.tables[:, st.keys // bs] * bs + st.keys % bs  # [nb, nk]
            write = kv_slots.gather(1, st.pos.view(nb, 1)).view(nb)
            mask = (st.keys.view(1, 1, nk) <= st.pos.view(nb, 1, 1)).unsqueeze(1)  # [nb, 1, 1, nk]
            batch = PagedBatch(pool, write, st.q_index, st.q_valid, kv_slots, mask, dense=True)
        h = eng.decoder(input_ids=st.ids.view(1, nb), position_ids=st.pos.view(1, nb), use_cache=False,
                        concordia_batch=batch).last_hidden_state
        pool.flags.index_fill_(0, write, 1)
        return eng.lm_head(h[0]).float()

    def _capture(self, st: _Static) -> bool:
        """Capture ``st``'s step on padding-only inputs (its warm-up writes scratch rows only)."""
        t0 = time.perf_counter()
        st.fill_padding(0)
        try:
            with sdpa_backends(self.eng.device):
                st.buf.copy_(st.host)  # synchronous: the host buffer is refilled right after
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(self.eng.opts.capture_warmups):
                        self._compute(st)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.mempool, capture_error_mode="thread_local"):
                    st.logits = self._compute(st)
            st.graph = g
        except Exception as e:  # noqa: BLE001 - a capture that fails leaves this bucket to the eager step
            st.failed = f"{type(e).__name__}: {e}"
            log.warning("decode graph for batch %d x %d keys not captured (%s); those steps run eagerly",
                        st.nb, st.nk, st.failed)
            torch.cuda.synchronize()
            return False
        torch.cuda.current_stream().synchronize()
        st.capture_s = time.perf_counter() - t0
        return True


__all__ = ["BATCH_BUCKETS", "MODES", "DecodeGraphs", "batch_buckets", "scratch_blocks_for"]
