"""The invariant mode on the CPU without Triton (serve/invariant.py's torch ops, invariant.TorchAttention): the
ops match float64 within rounding and give every row the same bits for any row count, subset, order and row
block; the attention gives a query the same bits alone, among other requests, at another place in the batch,
chunked and as a decode step; an engine with ``invariant=True`` gives each request, greedy and seeded, the same
tokens, log-probabilities and K/V rows as the request alone, whatever joins, whatever the chunking, and
transformers' own greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attention_pool import Pool
from concordia_ft.serve import Engine, SamplingParams
from concordia_ft.serve import attention as A
from concordia_ft.serve import invariant as inv
from llm_helpers import tiny_model

pytestmark = pytest.mark.skipif(A.interpreted(), reason="Triton's interpreter is on: the ops run as Triton kernels")

DTYPES = [torch.float32, torch.bfloat16]


def _subsets(g: torch.Generator, m: int) -> list[torch.Tensor]:
    """Row index sets of ``m`` rows: singletons, prefixes, random subsets and permutations of many sizes."""
    out = [torch.tensor([i]) for i in (0, m // 2, m - 1)] + [torch.arange(n) for n in (2, 3, 7, m)]
    for n in (1, 2, 5, 9, 16, 31, 33, 64, m - 1):
        out.append(torch.randperm(m, generator=g)[:n])
    out.append(torch.randperm(m, generator=g))
    return out


def test_exp_f32_is_accurate_and_the_same_bits_anywhere() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randn(5001, generator=g) * 30, torch.tensor([0.0, -0.0, 88.5, -87.0, -103.0, -160.0])])
    e = inv.exp_f32(x)
    ref = torch.exp(x.double())
    fin = (ref > 1e-37) & (ref < 3e38)  # normal float32 results
    assert ((e.double() - ref).abs()[fin] / ref[fin]).max().item() < 1.2e-7
    assert torch.isinf(e[ref > 3.5e38]).all() and (e[ref < 1e-46] == 0).all()
    assert inv.exp_f32(torch.tensor([float("-inf"), -200.0])).tolist() == [0.0, 0.0]
    # each element alone, and in tensors of other lengths (SIMD lanes vs scalar tails), gives the same bits
    for n in (1, 3, 17, 1000):
        assert torch.equal(torch.cat([inv.exp_f32(x[i: i + n]) for i in range(0, len(x), n)]), e)
    assert torch.equal(inv.silu_f32(x[:77]), torch.cat([inv.silu_f32(x[i: i + 1]) for i in range(77)]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(40, 70), (256, 64), (130, 16)])
def test_linear_matches_float64_and_every_row_is_batch_invariant(dtype: torch.dtype, nk: tuple[int, int],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = nk
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(97, k, generator=g).to(dtype)
    y, yb = inv.linear(x, w), inv.linear(x, w, b)
    assert y.dtype == dtype
    want = x.double() @ w.double().T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((y.double() - want).abs() / (want.abs() + 1)).max().item() < tol
    assert ((yb.double() - want - b.double()).abs() / (want.abs() + 1)).max().item() < tol
    for idx in _subsets(g, len(x)):
        assert torch.equal(inv.linear(x[idx], w), y[idx]), len(idx)
        assert torch.equal(inv.linear(x[idx], w, b), yb[idx]), len(idx)
    assert torch.equal(inv.linear(x.view(97, 1, k), w).view(97, n), y)  # leading dims only reshape
    # rows taken in blocks (a small product buffer): the same bits
    monkeypatch.setattr(inv, "CPU_BUFFER_ELEMS", 3 * n * k + 1)
    assert torch.equal(inv.linear(x, w), y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_matches_float64_and_is_batch_invariant(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    wg, wu = torch.randn(128, 64, generator=g).to(dtype), torch.randn(128, 64, generator=g).to(dtype)
    x = torch.randn(80, 64, generator=g).to(dtype) * 0.3
    y = inv.gate_up(x, wg, wu)
    xd = x.double()
    want = torch.nn.functional.silu(xd @ wg.double().T) * (xd @ wu.double().T)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((y.double() - want).abs() / (want.abs() + 1)).max().item() < tol
    for idx in _subsets(g, len(x)):
        assert torch.equal(inv.gate_up(x[idx], wg, wu), y[idx]), len(idx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_transformers_and_is_batch_invariant(dtype: torch.dtype) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(3)
    norm = Qwen3RMSNorm(72, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(72, generator=g))
    x = (torch.randn(90, 72, generator=g) * 3).to(dtype)
    y = inv.rms_norm(x, norm.weight, 1e-6)
    with torch.no_grad():
        want = norm(x)
    assert y.dtype == want.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((y.double() - want.double()).abs() / (want.double().abs() + 1)).max().item() < tol
    for idx in _subsets(g, len(x)):
        assert torch.equal(inv.rms_norm(x[idx], norm.weight, 1e-6), y[idx]), len(idx)


class TorchPool(Pool):
    """attention_pool's random pool and requests, the step computed by invariant.TorchAttention."""

    def attend(self, q: torch.Tensor, out: torch.Tensor, tiles: torch.Tensor, n_tiles: int) -> None:
        w = self.hkv * self.d
        k = self.storage[:, self.view.k_off: self.view.k_off + w].view(-1, self.hkv, self.d)
        v = self.storage[:, self.view.v_off: self.view.v_off + w].view(-1, self.hkv, self.d)
        inv.TorchAttention(self.tab, tiles, n_tiles, self.page)(q, out, k, v, self.scale)


@pytest.mark.parametrize("rep", [1, 2, 3])
def test_torch_attention_matches_float64(rep: int) -> None:
    p = TorchPool([37, 5, 140], rep=rep, d=16)
    got = p.run([(0, 0, 37), (1, 0, 5), (2, 0, 140)])
    for i, n in enumerate(p.lens):
        k, v = p.keys(i)
        ref = A.reference_attention(p.q[i], k, v, list(range(n)), p.scale)
        mine = torch.stack([got[(i, j)] for j in range(n)]).double()
        assert (mine - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_attention_rows_equal_alone_among_others_chunked_and_decoding(dtype: torch.dtype) -> None:
    p = TorchPool([37, 5, 150, 22, 64], d=16, dtype=dtype, seed=5)
    together = p.run([(0, 0, 37), (1, 0, 5), (2, 0, 150), (3, 0, 22), (4, 0, 64)])
    alone = p.run([(2, 0, 150)])
    moved = p.run([(3, 0, 22), (4, 60, 64), (2, 0, 150), (0, 30, 37)])  # another place, other companions
    chunked = {**p.run([(2, 0, 13), (0, 5, 6)]), **p.run([(1, 2, 3), (2, 13, 65)]), **p.run([(2, 65, 149)])}
    chunked |= p.run([(3, 4, 5), (2, 149, 150), (4, 0, 64)])  # the last position as a decode step
    for j in range(150):
        ref = together[(2, j)]
        assert torch.equal(alone[(2, j)], ref), j
        assert torch.equal(moved[(2, j)], ref), j
        assert torch.equal(chunked[(2, j)], ref), j
    for j in range(60, 64):
        assert torch.equal(moved[(4, j)], together[(4, j)]), j


OPTS = {"num_blocks": 100, "block_size": 4, "max_batch_tokens": 16, "max_model_len": 160, "checkpoint": False,
        "invariant": True}


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=i,
                          ignore_eos=True, logprobs=2)


def _serve(eng: Engine, prompts: list[list[int]], order: list[int], joins: dict[int, list[int]]
           ) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
    """Submit ``order`` (prompt indices) at first and ``joins[step]`` after that step; run to the end. Returns
    each prompt's request and its K/V rows (every layer) of its positions but the last, read from the pool right
    after the step it finished in (its blocks go back to the pool then: a later request may write them)."""
    reqs = {i: eng.submit(prompts[i], _params(i)) for i in order}
    slots: dict[int, list[int]] = {}
    rows: dict[int, torch.Tensor] = {}
    step = 0
    while eng.has_work or any(s > step for s in joins):
        for i, r in reqs.items():
            if r.slots:
                slots[i] = list(r.slots)  # its table grows as it decodes
        eng.step()
        step += 1
        for i, r in reqs.items():
            if r.status == "finished" and i not in rows:
                n = len(r.ids) - 1  # the last sampled token's K/V is never computed
                assert len(slots[i]) >= n
                rows[i] = eng.pool.storage.view(-1, eng.geo.row_bytes)[slots[i][:n]].clone()
        reqs |= {i: eng.submit(prompts[i], _params(i)) for i in joins.get(step, [])}
    return reqs, rows


@pytest.mark.parametrize(("family", "dtype"), [("qwen3", torch.float32), ("llama", torch.float32),
                                                ("qwen3", torch.bfloat16)])
def test_engine_request_equals_the_request_alone_whatever_joins_and_however_chunked(family: str,
                                                                                   dtype: torch.dtype) -> None:
    model = tiny_model(family, dtype=dtype)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 70, 4, 13, 66, 1)]
    eng = Engine(model, None, OPTS)
    assert eng.kernel and eng.opts.invariant
    assert type(model.lm_head.forward).__name__ == "method"  # the instance's forward, switched
    reqs, rows = _serve(eng, prompts, [0, 1], {1: [2, 3], 3: [4, 5]})
    # other companions, other places in the batch, other chunking, the padded static decode step
    other = Engine(model, None, {**OPTS, "max_batch_tokens": 7, "graphs": "padded"})
    reqs2, rows2 = _serve(other, prompts, [5, 4, 3], {2: [0], 4: [2, 1]})
    assert other.graphs is not None and other.graphs.replays > 0
    for i in range(len(prompts)):
        alone = Engine(model, None, {**OPTS, "max_batch_tokens": 5})
        mine, my_rows = _serve(alone, prompts, [i], {})
        r = mine[i]
        assert len(r.generated) == 8
        assert r.generated == reqs[i].generated == reqs2[i].generated, i
        assert r.logprobs == reqs[i].logprobs == reqs2[i].logprobs, i
        assert torch.equal(my_rows[i], rows[i]) and torch.equal(my_rows[i], rows2[i]), i


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_greedy_tokens_are_transformers_own(family: str) -> None:
    model, ref = tiny_model(family), tiny_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 71, 12)]
    eng = Engine(model, None, OPTS)
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
    while eng.has_work:
        eng.step()
    for p, r in zip(prompts, reqs, strict=True):
        want = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        assert r.generated == want, r.id
