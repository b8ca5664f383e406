"""A fixed serving workload (arrivals by engine step, greedy and seeded requests) and the driver that feeds it
to an Engine: the same function drives the uninterrupted reference, the process that is SIGKILLed and the
recovered engine, so all three see the same arrivals at the same steps."""

from __future__ import annotations

import torch

from concordia_ft.serve import Engine, SamplingParams

OPTIONS = {"num_blocks": 96, "block_size": 8, "max_running": 6, "max_waiting": 64, "max_model_len": 256,
           "max_batch_tokens": 24}


def workload(n: int = 14, seed: int = 5) -> list[tuple[int, str, list[int], SamplingParams]]:
    """``(arrival step, id, prompt, params)``: prompts of 3..30 tokens, some longer than a prefill chunk,
    half greedy, half seeded top-k/top-p sampling, more requests than the batch holds (they queue)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen = int(torch.randint(3, 31, (1,), generator=g))
        prompt = torch.randint(3, 256, (plen,), generator=g).tolist()
        new = int(torch.randint(6, 25, (1,), generator=g))
        if i % 2:
            p = SamplingParams(max_new_tokens=new, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i)
        else:
            p = SamplingParams(max_new_tokens=new, temperature=0.0)
        out.append((2 * i // 3, f"r{i:02d}", prompt, p))
    return out


def drive(engine: Engine, arrivals, on_step=None, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Submit each arrival when the engine is at its step (unless the engine already holds it), step until
    idle; returns every request's generated tokens."""
    pending = [a for a in arrivals if engine.get(a[1]) is None and a[0] >= engine.step_no]
    for _ in range(max_steps):
        for a in [a for a in pending if a[0] <= engine.step_no]:
            engine.submit(a[2], a[3], request_id=a[1])
            pending.remove(a)
        if not engine.has_work and not pending:
            break
        out = engine.step()
        if on_step is not None:
            on_step(out)
    return {a[1]: engine.get(a[1]).generated for a in arrivals}
