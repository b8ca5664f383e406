"""Checks of the paged attention kernel (serve/attention.py) run through Triton's CPU interpreter, in a process
of their own: Triton must see ``TRITON_INTERPRET=1`` before it is imported (its language builtins are decorated
at import). ``python tests/attention_cases.py CASE`` exits 0 when the case holds (tests/test_attention.py)."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from attention_pool import Pool  # noqa: E402
from concordia_ft.serve import attention as A  # noqa: E402


def reference(rep: int) -> None:
    p = Pool([37, 5, 70], rep=rep)
    got = p.run([(0, 0, 37), (1, 0, 5), (2, 0, 70)])
    for i, n in enumerate(p.lens):
        k, v = p.keys(i)
        ref = A.reference_attention(p.q[i], k, v, list(range(n)), p.scale)
        mine = torch.stack([got[(i, j)] for j in range(n)]).double()
        assert (mine - ref).abs().max().item() < 1e-5


def invariance() -> None:
    p = Pool([37, 5, 70, 22])
    together = p.run([(0, 0, 37), (1, 0, 5), (2, 0, 70), (3, 0, 22)])
    alone = p.run([(2, 0, 70)])
    moved = p.run([(3, 0, 22), (2, 0, 70), (0, 30, 37)])  # another position in the batch, other companions
    chunked = {**p.run([(2, 0, 13), (0, 5, 6)]), **p.run([(1, 2, 3), (2, 13, 68)]), **p.run([(2, 68, 69)])}
    chunked |= p.run([(3, 4, 5), (2, 69, 70)])  # the last position as a decode step
    for j in range(70):
        ref = together[(2, j)]
        assert torch.equal(alone[(2, j)], ref), j
        assert torch.equal(moved[(2, j)], ref), j
        assert torch.equal(chunked[(2, j)], ref), j


def engine() -> None:
    """A tiny Qwen3 engine with the kernel (eager steps and the padded static decode step) gives
    transformers' own greedy tokens, prompts chunked and joining late."""
    from concordia_ft.serve import Engine, SamplingParams
    from llm_helpers import tiny_model

    model, ref = tiny_model("qwen3"), tiny_model("qwen3")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 3, 12, 7)]
    for graphs in ("off", "padded"):
        eng = Engine(model, None, {"num_blocks": 40, "block_size": 4, "max_batch_tokens": 16, "max_model_len": 64,
                                   "checkpoint": False, "graphs": graphs})
        assert eng.kernel
        reqs = [eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in prompts[:3]]
        eng.step()
        reqs += [eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in prompts[3:]]
        while eng.has_work:
            eng.step()
        if graphs == "padded":
            assert eng.graphs is not None and eng.graphs.replays > 0
        for p, r in zip(prompts, reqs, strict=True):
            want = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
            assert r.generated == want, (graphs, r.id)


def linear() -> None:
    """The invariant linear and RMSNorm kernels: float64 within float32 rounding, rows equal for any row count."""
    from concordia_ft.serve import invariant as inv

    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 70, generator=g), torch.randn(90, 70, generator=g)
    y = inv.linear(x, w)
    assert (y.double() - x.double() @ w.double().T).abs().max().item() < 1e-4
    assert torch.equal(inv.linear(x[[5, 80, 3]], w), y[[5, 80, 3]])
    wg, wu = torch.randn(40, 70, generator=g), torch.randn(40, 70, generator=g)
    gu = inv.gate_up(x, wg, wu)
    xd = x.double()
    want = torch.nn.functional.silu(xd @ wg.double().T) * (xd @ wu.double().T)
    assert (gu.double() - want).abs().max().item() < 1e-3
    assert torch.equal(inv.gate_up(x[[7, 1]], wg, wu), gu[[7, 1]])
    nw = torch.randn(70, generator=g)
    z = inv.rms_norm(x, nw, 1e-6)
    ref = nw.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (z.double() - ref).abs().max().item() < 1e-4
    assert torch.equal(inv.rms_norm(x[:3], nw, 1e-6), z[:3])


def invariant_engine() -> None:
    """An engine with invariant=True computes each request's K/V rows (every layer, every position) and tokens
    bit for bit the same alone as among others joining late, with its prompt chunked differently (another
    ``max_batch_tokens``), greedy and seeded."""
    from concordia_ft.serve import Engine, SamplingParams
    from llm_helpers import tiny_model

    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 21, 4, 13)]
    opts = {"num_blocks": 60, "block_size": 4, "max_batch_tokens": 16, "max_model_len": 64, "checkpoint": False,
            "invariant": True}

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=8, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)

    def run(eng: Engine, step_hook: object = None) -> dict[str, list[int]]:
        slots: dict[str, list[int]] = {}
        while eng.has_work:
            for r in eng.running.values():
                slots[r.id] = list(r.slots)  # its table grows as it decodes
            eng.step()
            if callable(step_hook):
                step_hook()
        return slots

    def rows(eng: Engine, slots: list[int], n: int) -> torch.Tensor:
        return eng.pool.storage.view(-1, eng.geo.row_bytes)[slots[:n]].clone()

    eng = Engine(model, None, opts)
    reqs = [eng.submit(p, params(i)) for i, p in enumerate(prompts[:2])]
    late = iter([prompts[2:]])
    slots = run(eng, lambda: [reqs.append(eng.submit(p, params(len(reqs)))) for p in next(late, [])])
    for i, p in enumerate(prompts):
        alone = Engine(model, None, {**opts, "max_batch_tokens": 5})  # another prefill chunking
        r = alone.submit(p, params(i))
        mine = run(alone)
        assert r.generated == reqs[i].generated, i
        n = len(p) + len(r.generated) - 1  # the last sampled token's K/V is never computed
        assert torch.equal(rows(alone, mine[r.id], n), rows(eng, slots[reqs[i].id], n)), i


CASES = {"linear": linear, "invariant_engine": invariant_engine, "reference1": lambda: reference(1), "reference2": lambda: reference(2), "reference3": lambda: reference(3),
         "invariance": invariance, "engine": engine}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
    print("ok", sys.argv[1])
