"""Per-request sampling settings and the sampler: greedy rows in one batched argmax, sampled rows each from
the request's own ``torch.Generator`` (so a request's draws depend on its own history only, never on which
other requests share the step). The generator's state is what the engine logs (``RngRows``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError

RNG_ROW_ALIGN = 512


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_new_tokens} must be >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature={self.temperature} must be between 0 and 100")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        d = dict(d)
        d["eos_token_ids"] = tuple(int(e) for e in d.get("eos_token_ids", ()))
        return cls(**d)


class RngRows:
    """One host row of bytes per running request holding its generator's state (a paged region: one block per
    row, flagged when the request drew). ``rows`` slots are handed out FIFO like KV blocks."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self.state_bytes = int(torch.Generator(device=device).get_state().numel())
        self.row_bytes = -(-self.state_bytes // RNG_ROW_ALIGN) * RNG_ROW_ALIGN
        self.buf = np.zeros(rows * self.row_bytes, np.uint8)
        self.dirty = np.zeros(rows, np.uint8)
        self.free = list(range(rows))

    def take(self) -> int:
        if not self.free:
            raise ConfigError("no sampler row is free: more running requests than max_running")
        return self.free.pop(0)

    def give_back(self, row: int) -> None:
        self.free.append(row)

    def save(self, row: int, gen: torch.Generator) -> None:
        lo = row * self.row_bytes
        self.buf[lo: lo + self.state_bytes] = gen.get_state().numpy()
        self.dirty[row] = 1

    def load(self, row: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        lo = row * self.row_bytes
        gen.set_state(torch.from_numpy(self.buf[lo: lo + self.state_bytes].copy()))
        return gen


def new_generator(device: torch.device, seed: int | None) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # unseeded: random, but logged, so a recovered request continues the same stream
    else:
        gen.manual_seed(int(seed))
    return gen


def _warp(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = row.float() / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        vals, idx = torch.sort(x, descending=True)
        cum = torch.softmax(vals, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(vals, dim=-1) > p.top_p  # keep the smallest prefix reaching top_p
        x = x.scatter(0, idx, vals.masked_fill(drop, float("-inf")))
    return torch.softmax(x, dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [B, V]``; row ``i`` draws from ``gens[i]`` unless it is greedy."""
    out: list[torch.Tensor] = []
    greedy = torch.argmax(logits, dim=-1)
    for i, (p, g) in enumerate(zip(params, gens, strict=True)):
        if p.greedy:
            out.append(greedy[i: i + 1])
        else:
            assert g is not None, "a sampled request has a generator"
            out.append(torch.multinomial(_warp(logits[i], p), 1, generator=g))
    return [int(t) for t in torch.cat(out).tolist()]
