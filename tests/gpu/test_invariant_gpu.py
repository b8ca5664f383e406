"""Batch-invariant mode (EngineOptions.invariant) on the GPU: the linear and RMSNorm kernels match float64 within
bf16 rounding and give a row the same bits whatever the number of rows and the row's place among them; an engine
with it gives every request (greedy and seeded) the same tokens alone as among 15 others joining at other steps."""

from __future__ import annotations

import random

import pytest
import torch

from concordia_ft.serve import Engine, SamplingParams
from concordia_ft.serve import invariant as inv


@pytest.mark.parametrize("nk", [(1024, 1024), (3072, 1024), (1024, 3072), (151936, 1024)])
def test_linear_matches_float64_and_is_batch_invariant(nk: tuple[int, int]) -> None:
    n, k = nk
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    x = torch.randn(300, k, device="cuda", generator=g).bfloat16()
    y = inv.linear(x, w)
    ref = x.double() @ w.double().T
    torch_err = (torch.nn.functional.linear(x, w).double() - ref).abs().max().item()
    assert (y.double() - ref).abs().max().item() <= 2 * torch_err + 1e-3
    rnd = random.Random(2)
    for m in (1, 2, 7, 64, 65, 129):
        rows = rnd.sample(range(300), m)
        part = inv.linear(x[rows], w)
        assert torch.equal(part, y[rows]), m


def test_gate_up_matches_float64_and_is_batch_invariant() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    wg = (torch.randn(3072, 1024, device="cuda", generator=g) * 1024 ** -0.5).bfloat16()
    wu = (torch.randn(3072, 1024, device="cuda", generator=g) * 1024 ** -0.5).bfloat16()
    x = torch.randn(200, 1024, device="cuda", generator=g).bfloat16()
    y = inv.gate_up(x, wg, wu)
    xd = x.double()
    ref = torch.nn.functional.silu(xd @ wg.double().T) * (xd @ wu.double().T)
    unfused = (torch.nn.functional.silu(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu))
    assert (y.double() - ref).abs().max().item() <= 2 * (unfused.double() - ref).abs().max().item() + 1e-3
    for m in (1, 5, 64, 65):
        assert torch.equal(inv.gate_up(x[:m], wg, wu), y[:m]), m


def test_rms_norm_matches_transformers_and_is_batch_invariant() -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(1024, eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(200, 1024, device="cuda").bfloat16()
    want = norm(x)
    got = inv.rms_norm(x, norm.weight, 1e-6)
    assert (got.float() - want.float()).abs().max().item() <= 0.02
    for m in (1, 3, 64):
        assert torch.equal(inv.rms_norm(x[:m], norm.weight, 1e-6), got[:m])


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


def test_every_request_alone_equals_it_among_others() -> None:
    model = _model()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 8000, (int(torch.randint(20, 300, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    opts = {"num_blocks": 1024, "block_size": 16, "max_running": 16, "max_model_len": 512, "max_batch_tokens": 256,
            "checkpoint": False, "invariant": True}
    together = Engine(model, None, opts)
    reqs = [together.submit(p, _params(i)) for i, p in enumerate(prompts[:6])]
    steps = 0
    while together.has_work:
        together.step()
        steps += 1
        if steps in (3, 9):  # late joiners: other batch sizes, prefill chunks beside decodes
            k = len(reqs)
            reqs += [together.submit(p, _params(k + i)) for i, p in enumerate(prompts[k:k + 5])]
    assert len(reqs) == 16
    for i, p in enumerate(prompts):
        alone = Engine(model, None, opts)
        r = alone.submit(p, _params(i))
        while alone.has_work:
            alone.step()
        assert r.generated == reqs[i].generated, i
