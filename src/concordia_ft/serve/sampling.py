"""Per-request sampling settings and the sampler.

Each row of a step's logits goes through the rules its request asked for, in ``generate()``'s order
(transformers' ``_get_logits_processor``): ``logit_bias`` (its ``SequenceBiasLogitsProcessor`` for one-token
sequences), ``repetition_penalty`` (over the prompt and the generated tokens), then the OpenAI frequency and
presence penalties (over the generated tokens, which ``generate()`` does not have), ``min_tokens`` (the end
tokens masked), then temperature, top-k and top-p (its warpers' arithmetic). Greedy rows take one batched
argmax; sampled rows each draw from the request's own ``torch.Generator``, so a request's draws depend on its
own history only, never on which other requests share the step. The generator's state is what the engine logs
(``RngRows``).

The rules are pure functions of a request's token ids: the per-row buffers they read (its ids, its generated
token counts) live on the logits' device, one row per sampler row, and are rebuilt from the ids whenever a row
changes owner (admission, recovery), so nothing of them is logged. A step whose rows use none of them runs no
code for them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError

RNG_ROW_ALIGN = 512
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
LP_WORDS = 64  # float32 words per pool slot in the logprobs region: [chosen, k, (id, logprob) x k, 0...]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one (needs the engine's tokenizer)
    min_tokens: int = 0  # no end token and no stop string before this many tokens
    repetition_penalty: float = 1.0  # generate()'s: logits of tokens seen (prompt + generated) / p (x p below 0)
    frequency_penalty: float = 0.0  # OpenAI's: minus count x f for each generated token
    presence_penalty: float = 0.0  # OpenAI's: minus p for each token generated at least once
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id
    logprobs: int | None = None  # None: off; k: the chosen token's log-probability and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def processed(self) -> bool:
        """Whether the row's logits go through a rule before the warpers (penalties, bias, min_tokens)."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
                    or self.logit_bias or (self.min_tokens and not self.ignore_eos))

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_tokens={self.max_new_tokens} must be >= 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature={self.temperature} must be between 0 and 100")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must be in [0, 1] (0: the most likely token only)")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_tokens={self.min_tokens} must be between 0 and max_tokens={self.max_new_tokens}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1: off)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name}={getattr(self, name)} must be between -2 and 2")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"logprobs={self.logprobs}: between 0 and {MAX_TOP_LOGPROBS} most likely tokens")
        if any(not s for s in self.stop):
            raise ConfigError("a stop string must not be empty")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["stop"] = list(self.stop)
        d["logit_bias"] = [list(b) for b in self.logit_bias]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        d = dict(d)
        d["eos_token_ids"] = tuple(int(e) for e in d.get("eos_token_ids", ()))
        d["stop"] = tuple(str(s) for s in d.get("stop", ()))
        d["logit_bias"] = tuple((int(t), float(b)) for t, b in d.get("logit_bias", ()))
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
    """generate()'s TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, then the softmax."""
    x = row.float() / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        vals, idx = torch.sort(x, descending=False)
        drop = vals.softmax(dim=-1).cumsum(dim=-1) <= (1 - p.top_p)
        drop[-1:] = False  # keep at least one
        x = x.masked_fill(drop.scatter(0, idx, drop), float("-inf"))
    return torch.softmax(x, dim=-1)


@dataclass
class TokenLogprobs:
    """A generated token's log-probability under the model (the log-softmax of its logits before any rule)
    and the ``k`` most likely tokens with theirs."""

    logprob: float
    top: list[tuple[int, float]]

    def pack(self) -> np.ndarray:
        w = np.zeros(LP_WORDS, np.float32)
        w[0], w[1] = self.logprob, len(self.top)
        for i, (t, lp) in enumerate(self.top):
            w[2 + 2 * i], w[3 + 2 * i] = t, lp
        return w

    @classmethod
    def unpack(cls, w: np.ndarray) -> TokenLogprobs:
        k = int(w[1])
        return cls(float(w[0]), [(int(w[2 + 2 * i]), float(w[3 + 2 * i])) for i in range(k)])

    def to_list(self) -> list[Any]:
        return [self.logprob, [[t, lp] for t, lp in self.top]]

    @classmethod
    def from_list(cls, v: list[Any]) -> TokenLogprobs:
        return cls(float(v[0]), [(int(t), float(lp)) for t, lp in v[1]])


class Sampler:
    """The engine's sampler. ``sample(logits, reqs)`` picks one token per row of ``logits [B, V]`` for the
    request of that row (it has ``params``, ``gen``, ``ids``, ``n_prompt``, ``row``, ``logprobs``); requests
    asking for log-probabilities get this token's appended to ``r.logprobs``.

    The rules touch only the tokens a request has (``generate()``'s own gather/scatter over its ids): per
    sampler row, its token ids ``[rows, max_len]`` and its generated-token counts ``[rows, V]`` stay on the
    logits' device, updated in place after each draw; a step reads ``rows x context`` of them, never a whole
    vocabulary row more than the one copy of the logits that the rules are applied to."""

    def __init__(self, max_rows: int, vocab: int, device: torch.device, max_len: int) -> None:
        self.max_rows, self.vocab, self.device, self.max_len = max_rows, vocab, device, max_len
        self.ids: torch.Tensor | None = None  # [rows, max_len] int64: prompt + generated
        self.counts: torch.Tensor | None = None  # [rows, V] float32: generated tokens counted
        self.bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_rows  # logit_bias (ids, values)
        self.owner: list[tuple[str, int] | None] = [None] * max_rows  # (request id, tokens the row holds)

    def _bind(self, reqs: list[Any]) -> None:
        """Rows whose owner changed (or who are behind: a recovered request) are rebuilt from the ids."""
        dev = self.device
        if self.ids is None:
            self.ids = torch.zeros(self.max_rows, self.max_len, dtype=torch.long, device=dev)
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.float32, device=dev)
        assert self.counts is not None
        for r in reqs:
            if self.owner[r.row] == (r.id, len(r.ids)):
                continue
            ids = torch.as_tensor(r.ids, dtype=torch.long, device=dev)
            self.ids[r.row, : len(r.ids)] = ids
            gen = ids[r.n_prompt:]
            self.counts[r.row].zero_().index_add_(0, gen, torch.ones(len(gen), device=dev))
            self.bias[r.row] = None
            if r.params.logit_bias:
                t, v = zip(*r.params.logit_bias, strict=True)
                self.bias[r.row] = (torch.as_tensor(t, dtype=torch.long, device=dev),
                                    torch.as_tensor(v, dtype=torch.float32, device=dev))
            self.owner[r.row] = (r.id, len(r.ids))

    def _process(self, logits: torch.Tensor, idx: list[int], reqs: list[Any]) -> torch.Tensor:
        assert self.ids is not None and self.counts is not None
        dev = logits.device
        x = logits.clone()
        ps = [reqs[i].params for i in idx]
        for i in idx:  # logit_bias first (generate()'s SequenceBiasLogitsProcessor comes before the penalties)
            b = self.bias[reqs[i].row]
            if b is not None:
                x[i, b[0]] += b[1]
        lens = [len(reqs[i].ids) for i in idx]
        rows = torch.as_tensor([reqs[i].row for i in idx], device=dev)
        at = torch.as_tensor(idx, device=dev)[:, None]
        ids = self.ids[rows, : max(lens)]
        pad = torch.arange(ids.shape[1], device=dev)[None, :] >= torch.as_tensor(lens, device=dev)[:, None]
        ids = torch.where(pad, ids[:, :1], ids)  # past a row's end: its first token again (same value written)
        if any(p.repetition_penalty != 1.0 for p in ps):
            rp = torch.as_tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=dev)[:, None]
            v = x[at, ids]
            x[at, ids] = torch.where(v < 0, v * rp, v / rp)
        if any(p.frequency_penalty or p.presence_penalty for p in ps):
            fp = torch.as_tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=dev)[:, None]
            pp = torch.as_tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=dev)[:, None]
            c = self.counts[rows[:, None], ids]  # 0 for a prompt token never generated: no penalty
            x[at, ids] = x[at, ids] - c * fp - (c > 0).float() * pp
        for i in idx:
            r = reqs[i]
            if r.params.min_tokens and not r.params.ignore_eos and len(r.ids) - r.n_prompt < r.params.min_tokens:
                eos = [e for e in r.params.eos_token_ids if 0 <= e < x.shape[1]]
                if eos:
                    x[i, torch.as_tensor(eos, device=dev)] = float("-inf")
        return x

    def sample(self, logits: torch.Tensor, reqs: list[Any]) -> list[int]:
        raw = logits
        proc = [i for i, r in enumerate(reqs) if r.params.processed]
        if proc:
            self._bind([reqs[i] for i in proc])
            logits = self._process(logits, proc, reqs)
        out: list[torch.Tensor] = []
        greedy = torch.argmax(logits, dim=-1)
        for i, r in enumerate(reqs):
            if r.params.greedy:
                out.append(greedy[i: i + 1])
            else:
                assert r.gen is not None, "a sampled request has a generator"
                out.append(torch.multinomial(_warp(logits[i], r.params), 1, generator=r.gen))
        toks_t = torch.cat(out)
        toks = [int(t) for t in toks_t.tolist()]
        if proc:
            assert self.ids is not None and self.counts is not None
            dev = logits.device
            keep = [i for i in proc if len(reqs[i].ids) < self.max_len]
            rows = torch.as_tensor([reqs[i].row for i in keep], device=dev)
            chosen = toks_t[torch.as_tensor(keep, device=dev)]
            self.counts.index_put_((rows, chosen), torch.ones(len(keep), device=dev), accumulate=True)
            self.ids[rows, torch.as_tensor([len(reqs[i].ids) for i in keep], device=dev)] = chosen
            for i in proc:
                r = reqs[i]
                self.owner[r.row] = (r.id, len(r.ids) + 1) if i in keep else None
        lp_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if lp_rows:
            sel = torch.as_tensor(lp_rows, device=logits.device)
            lp = torch.log_softmax(raw[sel].float(), dim=-1)
            k = max(int(reqs[i].params.logprobs) for i in lp_rows)
            top_v, top_i = (torch.topk(lp, k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
            chosen_lp = lp.gather(1, toks_t[sel][:, None])[:, 0].tolist()
            top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(lp_rows):
                kk = int(reqs[i].params.logprobs)
                reqs[i].logprobs.append(TokenLogprobs(chosen_lp[j], list(zip(top_i_l[j][:kk], top_v_l[j][:kk],
                                                                             strict=True))))
        return toks


class StopStrings:
    """Whether a request's newest token completed one of its stop strings: a pure function of its generated
    ids (so a recovered engine stops at the same token). Only an occurrence that ends in the newest token's
    text counts (an earlier one stopped the request then, or came before ``min_tokens``)."""

    WINDOW = 16  # tokens of context beyond the longest stop string's bytes

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def hit(self, p: SamplingParams, generated: list[int]) -> bool:
        if not p.stop or not generated:
            return False
        longest = max(len(s.encode("utf-8")) for s in p.stop)
        lo = max(0, len(generated) - longest - self.WINDOW)
        before = self.tok.decode(generated[lo:-1], skip_special_tokens=True)
        text = self.tok.decode(generated[lo:], skip_special_tokens=True)
        base = len(before.rstrip("\ufffd")) if text.startswith(before.rstrip("\ufffd")) else 0
        return any(text.find(s, max(0, base - len(s) + 1)) >= 0 for s in p.stop)
