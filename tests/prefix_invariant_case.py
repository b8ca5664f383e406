"""Prefix caching and recompute preemption under the batch-invariant engine (invariant=True: the paged attention
kernel and the invariant linear/RMSNorm kernels, run on the CPU through Triton's interpreter, in a process of its
own: Triton must see ``TRITON_INTERPRET=1`` before it is imported). Exits 0 and prints ``ok`` when:

- a request whose prompt starts with another's cached blocks holds, at every position, K/V rows byte-equal to
  those of the same request prefilled alone without a cache (prefilled in other chunks), and the same tokens;
- a request preempted and recomputed (its generated tokens' K/V computed by a prefill instead of by decodes)
  holds K/V rows byte-equal to the uninterrupted request's, and the same tokens (sampled and greedy).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from concordia_ft.serve import Engine, SamplingParams  # noqa: E402
from llm_helpers import tiny_model  # noqa: E402

OPTS = {"num_blocks": 40, "block_size": 4, "max_batch_tokens": 16, "max_model_len": 64, "checkpoint": False,
        "invariant": True}


def rows(eng: Engine, rid: str, n: int) -> bytes:
    r = eng.get(rid)
    assert r is not None and r.n_computed >= n, (rid, r and r.n_computed, n)
    arena = eng.pool.arena.view(eng.geo.slots, eng.geo.row_bytes)
    return arena[torch.as_tensor(r.slots[:n])].numpy().tobytes()


def run_until(eng: Engine, rid: str, n_generated: int) -> None:
    while len(eng.get(rid).generated) < n_generated:  # type: ignore[union-attr]
        eng.step()


def main() -> None:
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(12)
    system = torch.randint(3, 256, (13,), generator=g).tolist()
    a, b = (system + torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 7))
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, seed=3)

    # a prefix hit: b shares a's 3 cached blocks of the system prompt and computes 8 positions from 12
    eng = Engine(model, None, OPTS)
    eng.submit(a, SamplingParams(max_new_tokens=6, temperature=0.0), request_id="a")
    while eng.has_work:
        eng.step()
    eng.submit(b, sampled, request_id="b")
    out = eng.step()
    assert out.batch_tokens == len(b) - 12 and eng.blocks.hits == 3, (out.batch_tokens, eng.blocks.hits)
    alone = Engine(model, None, {**OPTS, "prefix_caching": False})
    alone.submit(b, sampled, request_id="b")  # prefilled in chunks of 16 and 4, the hit one in one of 8
    run_until(eng, "b", 6)
    run_until(alone, "b", 6)
    n = len(b) + 5
    assert rows(eng, "b", n) == rows(alone, "b", n), "a hit's K/V differ from a fresh prefill's"
    for e in (eng, alone):
        while e.has_work:
            e.step()
    assert eng.get("b").generated == alone.get("b").generated  # type: ignore[union-attr]

    # recompute preemption: 3 requests of 11 tokens fill a 9-block pool; the lowest priority one is preempted
    small = {**OPTS, "num_blocks": 9, "max_model_len": 36, "max_batch_tokens": 64}
    prompts = [torch.randint(3, 256, (11,), generator=g).tolist() for _ in range(3)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0), sampled,
              SamplingParams(max_new_tokens=12, temperature=0.0)]
    tight = Engine(model, None, small)
    for i, p in enumerate(prompts):
        tight.submit(p, params[i], request_id=f"p{i}", priority=1 if i == 1 else 0)
    run_until(tight, "p0", 3)
    assert tight.preempted >= 1 and tight.get("p1").preemptions >= 1  # type: ignore[union-attr]
    roomy = Engine(model, None, {**small, "num_blocks": 40, "max_model_len": 64})
    for i, p in enumerate(prompts):
        roomy.submit(p, params[i], request_id=f"p{i}", priority=1 if i == 1 else 0)
    while tight.get("p1").status != "running" or tight.get("p1").n_computed < 11 + 3:  # type: ignore[union-attr]
        tight.step()
    p1 = tight.get("p1")
    assert p1 is not None
    k = p1.n_computed
    run_until(roomy, "p1", k - 11 + 1)
    assert rows(tight, "p1", k) == rows(roomy, "p1", k), "a recomputed request's K/V differ from its decodes'"
    for e in (tight, roomy):
        while e.has_work:
            e.step()
    for i in range(3):
        assert tight.get(f"p{i}").generated == roomy.get(f"p{i}").generated, i  # type: ignore[union-attr]
    print("ok")


if __name__ == "__main__":
    main()
