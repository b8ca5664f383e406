"""The compiled paged attention kernel on the GPU in bf16: within bf16 rounding of a float64 reference (no
further from it than torch's own SDPA on the same inputs), and a request's rows bit-identical alone, among 1-56
random companions at random places in the batch, chunked at several sizes and as decode steps; the same bits
in every run."""

from __future__ import annotations

import random

import pytest
import torch

from attention_pool import Pool
from concordia_ft.serve import attention as A

DIMS = [(8, 2, 128, 16), (8, 4, 128, 16)]  # (kv heads, query heads per kv head, head dim, block size): 0.6B, 8B


def sdpa_error(p: Pool, i: int, ref: torch.Tensor) -> float:
    k, v = p.keys(i)
    q = p.q[i].cpu()
    n = q.shape[0]
    qq = q.transpose(0, 1).unsqueeze(0).cuda()
    kk = k.repeat_interleave(p.rep, dim=1).transpose(0, 1).unsqueeze(0).cuda()
    vv = v.repeat_interleave(p.rep, dim=1).transpose(0, 1).unsqueeze(0).cuda()
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=p.scale)
    return (out[0].transpose(0, 1).double().cpu() - ref).abs().max().item() if n else 0.0


@pytest.mark.parametrize("dims", DIMS)
def test_kernel_is_within_bf16_rounding_of_float64(dims: tuple[int, int, int, int]) -> None:
    hkv, rep, d, page = dims
    lens = [1, 17, 200, 701, 64, 333]
    p = Pool(lens, hkv=hkv, rep=rep, d=d, page=page, seed=7, device="cuda", dtype=torch.bfloat16)
    got = p.run([(i, 0, n) for i, n in enumerate(lens)])
    for i, n in enumerate(lens):
        k, v = p.keys(i)
        ref = A.reference_attention(p.q[i].cpu(), k, v, list(range(n)), p.scale)
        mine = torch.stack([got[(i, j)] for j in range(n)]).double().cpu()
        err = (mine - ref).abs().max().item()
        assert err <= max(2 * sdpa_error(p, i, ref), 1e-2), (i, err)


@pytest.mark.parametrize("dims", DIMS)
def test_rows_are_bit_identical_whatever_the_batch(dims: tuple[int, int, int, int]) -> None:
    hkv, rep, d, page = dims
    rnd = random.Random(5)
    lens = [rnd.randint(1, 900) for _ in range(64)]
    p = Pool(lens, hkv=hkv, rep=rep, d=d, page=page, seed=11, device="cuda", dtype=torch.bfloat16)
    alone = {i: p.run([(i, 0, lens[i])]) for i in range(8)}
    for trial in range(6):
        size = rnd.randint(2, 57)  # 1-56 companions
        others = rnd.sample(range(8, 64), size - 1)
        me = rnd.randrange(8)
        feeds = [(o, 0, lens[o]) for o in others]
        chunk = rnd.choice([1, 7, 16, 64, 512])
        mine = [(me, lo, min(lo + chunk, lens[me])) for lo in range(0, lens[me], chunk)]
        got: dict[tuple[int, int], torch.Tensor] = {}
        for k, f in enumerate(mine):  # the request's chunks, each in a batch of random companions
            batch = feeds[:]
            batch.insert(rnd.randrange(len(batch) + 1), f)
            got |= {key: v for key, v in p.run(batch).items() if key[0] == me}
            if k > 3:
                got |= {key: v for key, v in p.run([f]).items()}
        for j in range(lens[me]):
            assert torch.equal(got[(me, j)], alone[me][(me, j)]), (trial, me, j, chunk)


def test_same_bits_every_run() -> None:
    lens = [400, 3, 129]
    p = Pool(lens, hkv=8, rep=2, d=128, page=16, seed=3, device="cuda", dtype=torch.bfloat16)
    first = p.run([(i, 0, n) for i, n in enumerate(lens)])
    for _ in range(3):
        again = p.run([(i, 0, n) for i, n in enumerate(lens)])
        assert all(torch.equal(first[k], again[k]) for k in first)
