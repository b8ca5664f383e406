"""A random paged KV pool and requests over it, for the paged attention kernel's tests (CPU and GPU)."""

from __future__ import annotations

import torch

from concordia_ft.serve import attention as A


class Pool:
    """A random pool of ``blocks`` blocks of ``page`` rows, 2 layers, and requests with shuffled block tables."""

    def __init__(self, lens: list[int], *, hkv: int = 2, rep: int = 2, d: int = 32, page: int = 4,
                 seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hkv, self.rep, self.d, self.page, self.lens = hkv, rep, d, page, lens
        blocks = sum(-(-n // page) for n in lens) + 3
        self.storage = torch.randn(blocks * page, 2 * 2 * hkv * d, generator=g).to(device, dtype)
        w = hkv * d
        self.view = A.PoolView(self.storage, 2 * w, 3 * w, hkv, d, page)  # layer 1
        perm = torch.randperm(blocks, generator=g).tolist()
        self.tables = []
        for n in lens:
            nb = -(-n // page)
            self.tables.append(perm[:nb])
            perm = perm[nb:]
        width = max(len(t) for t in self.tables)
        tab = torch.zeros(len(lens), width, dtype=torch.long)
        for i, t in enumerate(self.tables):
            tab[i, : len(t)] = torch.tensor(t)
        self.tab = tab.to(device)
        self.q = [torch.randn(n, hkv * rep, d, generator=g).to(device, dtype) for n in lens]
        self.scale = d ** -0.5

    def keys(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = [self.tables[i][p // self.page] * self.page + p % self.page for p in range(self.lens[i])]
        v = self.view
        k = self.storage[slots, v.k_off: v.k_off + self.hkv * self.d].view(-1, self.hkv, self.d)
        vv = self.storage[slots, v.v_off: v.v_off + self.hkv * self.d].view(-1, self.hkv, self.d)
        return k.cpu(), vv.cpu()

    def attend(self, q: torch.Tensor, out: torch.Tensor, tiles: torch.Tensor, n_tiles: int) -> None:
        """One step's attention of the packed queries ``q`` into ``out``: the paged attention kernel."""
        A.launch(q, out, self.view, self.tab, tiles, n_tiles, self.scale)

    def run(self, feeds: list[tuple[int, int, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """Feeds ``(request, lo, hi)`` packed in order; returns each (request, position)'s output row."""
        q = torch.cat([self.q[r][lo:hi] for r, lo, hi in feeds])
        out = torch.full_like(q, float("nan"))
        firsts, t = [], 0
        for _, lo, hi in feeds:
            firsts.append(t)
            t += hi - lo
        tiles = A.plan_tiles([r for r, _, _ in feeds], firsts, [hi - lo for _, lo, hi in feeds],
                             [lo for _, lo, _ in feeds], A.block_q(self.rep))
        self.attend(q, out, torch.tensor(tiles, dtype=torch.long, device=q.device), len(tiles) // 4)
        res = {}
        for (r, lo, hi), f in zip(feeds, firsts, strict=True):
            for j in range(lo, hi):
                res[(r, j)] = out[f + j - lo]
        return res
