"""The built-in workloads (small real torch models, deterministic), written against the same contract as
your own loop (workload.py: ``Workload``); the distributed runtime is tested and measured on them.

- ``dp_lora``: data-parallel LoRA-style training. A frozen 3-layer MLP (weights from the seed) with rank-r
  adapters A, B on each layer; every rank draws its own batch from (seed, rank, step); the adapter gradients
  and the loss travel in ONE flat buffer allreduced per step (one collective: the boundary); Adam on the flat
  adapter vector. State: adapter, Adam moments, the loss of every step (float64).
- ``tp_decode``: tensor-parallel greedy decode over ``world`` ranks. A small decoder (embedding, ``layers``
  blocks of replicated causal attention + an MLP split by columns of W1 / rows of W2, one allreduce per block,
  replicated LM head). State: the KV cache (positions are idempotent writes), the token ids.
- ``replica_serve``: replicated serving (``replicated = True``). Every rank holds the whole ``tp_decode`` model
  (split over one rank) and serves its own stream of ``requests`` greedy-decode requests (prompts from (seed,
  rank, request)), ``round_tokens`` positions per round; a round opens with ONE allreduce of every rank's
  remaining work (the progress exchange: the boundary). The ranks' states are independent, so survivors keep
  serving while a replacement joins (DESIGN.md §5b). ``decode_ms`` paces a decode step (a stand-in for the
  step time of a larger model; 0: as fast as the CPU goes); the pacing is outside the state.

A step's local work before its first collective must be a function of the state (or an idempotent write into
it): a cut is taken at that collective and a recovered rank replays the step from the top (DESIGN.md §3).
Threads: one per process (``torch.set_num_threads(1)`` in the worker), so a replacement computes the same bits.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError
from .workload import Group, Workload


def _gen(*key: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:7], "little"))
    return g


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class DpLora(Workload):
    """Data-parallel LoRA-style training (see the module docstring)."""

    def __init__(self, *, seed: int, world: int, steps: int, device: str = "cpu", dim: int = 64,
                 hidden: int = 128, lora_rank: int = 8, batch: int = 16, lr: float = 1e-2) -> None:
        self.rank, self.world, self.steps, self.device = -1, world, steps, device
        self.collectives_per_step = 1
        self.seed, self.batch, self.lr = seed, batch, lr
        g = _gen(seed, 0)
        dims = [(dim, hidden), (hidden, hidden), (hidden, dim)]
        self.base = [(torch.randn(o, i, generator=g) / i ** 0.5).to(device) for i, o in dims]  # frozen
        self.teacher = [torch.randn(o, i, generator=g) / i ** 0.5 for i, o in dims]
        self.shapes: list[tuple[int, int]] = []
        for i, o in dims:
            self.shapes += [(lora_rank, i), (o, lora_rank)]
        self.n = sum(a * b for a, b in self.shapes)
        self._init = self._initial(g)
        self._state = {k: v.clone() for k, v in self._init.items()}

    def _initial(self, g: torch.Generator) -> dict[str, torch.Tensor]:
        parts = []
        for k, (a, b) in enumerate(self.shapes):
            parts.append((torch.randn(a * b, generator=g) * 0.05) if k % 2 == 0 else torch.zeros(a * b))
        return {"adapter": torch.cat(parts), "adam_m": torch.zeros(self.n), "adam_v": torch.zeros(self.n),
                "losses": torch.zeros(self.steps, dtype=torch.float64)}

    def bind(self, rank: int) -> None:
        self.rank = rank

    def state(self) -> dict[str, torch.Tensor]:
        return self._state

    def initial_state(self) -> dict[str, torch.Tensor]:
        return self._init

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _gen(self.seed, 1, self.rank, step)
        x = torch.randn(self.batch, self.shapes[0][1], generator=g)
        y = x
        for w in self.teacher:
            y = torch.tanh(y @ w.T)
        return x.to(self.device), y.to(self.device)

    def _forward(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        views, off = [], 0
        for a, b in self.shapes:
            views.append(flat[off:off + a * b].view(a, b))
            off += a * b
        h = x
        for k, w in enumerate(self.base):
            la, lb = views[2 * k], views[2 * k + 1]
            h = torch.tanh(h @ w.T + (h @ la.T) @ lb.T)
        return h

    def step(self, step: int, group: Group) -> None:
        st = self._state
        flat = st["adapter"].to(self.device).clone().requires_grad_(True)
        x, y = self._batch(step)
        loss = torch.mean((self._forward(flat, x) - y) ** 2)
        torch.autograd.backward(loss)
        assert flat.grad is not None
        buf = torch.cat([flat.grad.detach(), loss.detach().reshape(1)])
        group.allreduce(buf)
        buf /= self.world
        grad, gloss = buf[:-1].cpu(), buf[-1].cpu()
        b1, b2, t = 0.9, 0.999, step + 1
        st["adam_m"].mul_(b1).add_(grad, alpha=1 - b1)
        st["adam_v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        mhat = st["adam_m"] / (1 - b1 ** t)
        vhat = st["adam_v"] / (1 - b2 ** t)
        st["adapter"].sub_(self.lr * mhat / (vhat.sqrt() + 1e-8))
        st["losses"][step] = float(gloss)

    def result(self) -> dict[str, Any]:
        return {"losses": [float(v) for v in self._state["losses"]], "digest": state_digest(self._state)}

    def warmup(self) -> None:
        self.bind(0)
        self.step(0, _OneRank())  # the restore then overwrites the state this leaves


class TpDecode(Workload):
    """Tensor-parallel greedy decode (see the module docstring). ``steps`` = new tokens."""

    @classmethod
    def final_cut(cls, steps: int, args: Mapping[str, Any]) -> int:
        return int(args.get("prompt_len", 8)) - 1 + steps  # one step per position fed

    @classmethod
    def check(cls, world: int, steps: int, args: Mapping[str, Any]) -> None:
        ffn, dim, heads = int(args.get("ffn", 256)), int(args.get("dim", 64)), int(args.get("heads", 4))
        if ffn % world:
            divisors = [w for w in range(1, ffn + 1) if ffn % w == 0 and w <= 64]
            raise ConfigError(f"tp_decode: ffn={ffn} does not split over {world} ranks (the MLP is split by "
                              f"columns); use a world in {divisors} or workload_args ffn divisible by {world}")
        if heads < 1 or dim % heads:
            raise ConfigError(f"tp_decode: dim={dim} does not split into heads={heads}")
        if int(args.get("prompt_len", 8)) < 1:
            raise ConfigError("tp_decode: prompt_len must be >= 1")

    def __init__(self, *, seed: int, world: int, steps: int, device: str = "cpu", vocab: int = 96,
                 dim: int = 64, heads: int = 4, layers: int = 2, ffn: int = 256, prompt_len: int = 8) -> None:
        self.check(world, steps, {"ffn": ffn, "dim": dim, "heads": heads, "prompt_len": prompt_len})
        self.rank, self.world, self.device = -1, world, device
        self.new_tokens = steps
        self.prompt_len = prompt_len
        self.steps = prompt_len - 1 + steps  # one step per position fed
        self.collectives_per_step = layers
        self.heads, self.layers, self.dim = heads, layers, dim
        g = _gen(seed, 7)
        s = dim ** -0.5
        self.emb = (torch.randn(vocab, dim, generator=g) * 0.5).to(device)
        self.full: list[tuple[torch.Tensor, ...]] = []  # every rank's weights: a standby binds any rank
        self.blocks: list[tuple[torch.Tensor, ...]] = []
        self.ffn = ffn
        for _ in range(layers):
            qkv = torch.randn(3 * dim, dim, generator=g) * s
            wo = torch.randn(dim, dim, generator=g) * s
            w1 = torch.randn(ffn, dim, generator=g) * s
            w2 = torch.randn(dim, ffn, generator=g) * ffn ** -0.5
            self.full.append((qkv, wo, w1, w2))
        self.head = (torch.randn(vocab, dim, generator=g) * s).to(device)
        total = prompt_len + steps
        prompt = torch.randint(0, vocab, (prompt_len,), generator=_gen(seed, 8))
        tokens = torch.full((total,), -1, dtype=torch.int64)
        tokens[:prompt_len] = prompt
        self._init = {"kv": torch.zeros(layers, 2, total, dim), "tokens": tokens}
        self._state = {k: v.clone() for k, v in self._init.items()}

    def bind(self, rank: int) -> None:
        """Take rank ``rank``'s columns of W1 and rows of W2 (the rest of the MLP lives on the other ranks)."""
        self.rank = rank
        part = self.ffn // self.world
        sl = slice(rank * part, (rank + 1) * part)
        self.blocks = [tuple(t.to(self.device) for t in (qkv, wo, w1[sl].contiguous(), w2[:, sl].contiguous()))
                       for qkv, wo, w1, w2 in self.full]

    def state(self) -> dict[str, torch.Tensor]:
        return self._state

    def initial_state(self) -> dict[str, torch.Tensor]:
        return self._init

    def step(self, step: int, group: Group) -> None:
        self.decode(self._state["kv"], self._state["tokens"], step, group)

    def decode(self, kv: torch.Tensor, tokens: torch.Tensor, pos: int, group: Group) -> None:
        """Feed the token at ``pos`` of one sequence (its KV cache ``kv``, its ids ``tokens``), writing the KV
        row of ``pos`` and, past the prompt, the greedy token at ``pos + 1`` (idempotent writes)."""
        h = self.emb[int(tokens[pos])].reshape(1, -1)
        hd = self.dim // self.heads
        for li, (qkv, wo, w1, w2) in enumerate(self.blocks):
            x = _rms(h)
            q, k, v = torch.split(x @ qkv.T, self.dim, dim=-1)
            kv[li, 0, pos] = k[0].cpu()
            kv[li, 1, pos] = v[0].cpu()
            keys = kv[li, 0, :pos + 1].to(self.device).view(pos + 1, self.heads, hd).transpose(0, 1)
            vals = kv[li, 1, :pos + 1].to(self.device).view(pos + 1, self.heads, hd).transpose(0, 1)
            att = torch.softmax((q.view(self.heads, 1, hd) @ keys.transpose(1, 2)) / hd ** 0.5, dim=-1)
            h = h + (att @ vals).transpose(0, 1).reshape(1, self.dim) @ wo.T
            part = torch.nn.functional.gelu(_rms(h) @ w1.T) @ w2.T  # this rank's share of the MLP
            group.allreduce(part)
            h = h + part
        logits = _rms(h) @ self.head.T
        if pos + 1 >= self.prompt_len:
            tokens[pos + 1] = int(torch.argmax(logits[0]))

    def result(self) -> dict[str, Any]:
        return {"tokens": [int(t) for t in self._state["tokens"]], "digest": state_digest(self._state)}

    def warmup(self) -> None:
        self.bind(0)
        self.step(0, _OneRank())  # the restore then overwrites the state this leaves


class _OneRank:
    """The group of a model split over one rank: its allreduce is the identity."""

    def allreduce(self, t: torch.Tensor) -> None:
        return None


class ReplicaServe(Workload):
    """Replicated serving (see the module docstring). ``steps`` = new tokens per request."""

    replicated = True

    @classmethod
    def check(cls, world: int, steps: int, args: Mapping[str, Any]) -> None:
        requests, rt = int(args.get("requests", 3)), int(args.get("round_tokens", 4))
        decode_ms = float(args.get("decode_ms", 0.0))
        if requests < 1 or rt < 1 or decode_ms < 0:
            raise ConfigError(f"replica_serve: requests={requests} and round_tokens={rt} must be >= 1, "
                              f"decode_ms={decode_ms} >= 0")
        TpDecode.check(1, steps, {**args, "prompt_len": args.get("prompt_len", 6)})

    def __init__(self, *, seed: int, world: int, steps: int, device: str = "cpu", requests: int = 3,
                 round_tokens: int = 4, decode_ms: float = 0.0, prompt_len: int = 6, **model: Any) -> None:
        self.check(world, steps, {"requests": requests, "round_tokens": round_tokens, "decode_ms": decode_ms})
        self.model = TpDecode(seed=seed, world=1, steps=steps, device=device, prompt_len=prompt_len, **model)
        self.model.bind(0)
        self.rank, self.world, self.seed = -1, world, seed
        self.requests, self.round_tokens, self.decode_s = requests, round_tokens, decode_ms / 1e3
        self.collectives_per_step = 1
        self.steps = -1  # the number of rounds is not fixed: the ranks agree on the final cut (progress sum 0)
        self.prompt_len, self.new_tokens = prompt_len, steps
        self.per_request = prompt_len - 1 + steps  # positions fed per request
        self.total = requests * self.per_request
        length = prompt_len + steps
        layers, dim = self.model.layers, self.model.dim
        self._init = {"kv": torch.zeros(requests, layers, 2, length, dim),
                      "tokens": torch.full((requests, length), -1, dtype=torch.int64),
                      "fed": torch.zeros(1, dtype=torch.int64)}  # positions fed so far, over the whole stream
        self._state = {k: v.clone() for k, v in self._init.items()}
        self.stamps: list[tuple[int, int, int]] = []  # (monotonic ns, request, position) of each new token
        self._next_ns = 0

    def bind(self, rank: int) -> None:
        """Take rank ``rank``'s request stream (its prompts), in place (the log registers these tensors)."""
        self.rank = rank
        vocab = self.model.emb.shape[0]
        for r in range(self.requests):
            prompt = torch.randint(0, vocab, (self.prompt_len,), generator=_gen(self.seed, 9, rank, r))
            for st in (self._init, self._state):
                st["tokens"][r, :self.prompt_len] = prompt

    def state(self) -> dict[str, torch.Tensor]:
        return self._state

    def initial_state(self) -> dict[str, torch.Tensor]:
        return self._init

    def remaining(self) -> int:
        return self.total - int(self._state["fed"][0])

    def exchange(self, group: Group) -> int:
        """The round's collective (the boundary): every rank's remaining work, summed; returns the sum."""
        buf = torch.zeros(self.world, dtype=torch.float64)
        buf[self.rank] = self.remaining()
        group.allreduce(buf)
        return int(buf.sum())

    def serve_round(self) -> int:
        """Decode up to ``round_tokens`` positions of this rank's stream, locally; returns the tokens made."""
        st, made = self._state, 0
        for _ in range(self.round_tokens):
            fed = int(st["fed"][0])
            if fed >= self.total:
                break
            req, pos = divmod(fed, self.per_request)
            if self.decode_s:
                time.sleep(max(0.0, (self._next_ns - time.monotonic_ns()) / 1e9))
                self._next_ns = time.monotonic_ns() + int(self.decode_s * 1e9)
            self.model.decode(st["kv"][req], st["tokens"][req], pos, _OneRank())
            st["fed"][0] = fed + 1
            if pos + 1 >= self.prompt_len:
                self.stamps.append((time.monotonic_ns(), req, pos + 1))
                made += 1
        return made

    def step(self, step: int, group: Group) -> None:
        """One lock-step round (for callers that drive a workload step by step)."""
        self.exchange(group)
        self.serve_round()

    def result(self) -> dict[str, Any]:
        return {"tokens": [[int(t) for t in row] for row in self._state["tokens"]],
                "digest": state_digest(self._state)}


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6)
