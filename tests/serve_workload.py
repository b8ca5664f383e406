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
    """Submit each arrival (``(step, id, prompt, params[, priority])``) when the engine is at its step (unless
    the engine already holds it), step until idle; returns every request's generated tokens."""
    pending = [a for a in arrivals if engine.get(a[1]) is None and a[0] >= engine.step_no]
    for _ in range(max_steps):
        for a in [a for a in pending if a[0] <= engine.step_no]:
            engine.submit(a[2], a[3], request_id=a[1], priority=a[4] if len(a) > 4 else 0)
            pending.remove(a)
        if not engine.has_work and not pending:
            break
        out = engine.step()
        if on_step is not None:
            on_step(out)
    return {a[1]: engine.get(a[1]).generated for a in arrivals}


# prefix sharing and preemption: a small pool (20 blocks of 4 slots), a system prompt every request starts with
# (3 full blocks), second turns that extend a first turn's prompt, two priorities; the pool holds about half of
# what the running requests would need at once, so requests are preempted and recomputed from the cache
SHARED_OPTIONS = {"num_blocks": 20, "block_size": 4, "max_running": 6, "max_waiting": 64, "max_model_len": 80,
                  "max_batch_tokens": 24}


def shared_workload(n: int = 12, seed: int = 7) -> list[tuple[int, str, list[int], SamplingParams, int]]:
    """``(arrival step, id, prompt, params, priority)``."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 256, (14,), generator=g).tolist()
    out: list[tuple[int, str, list[int], SamplingParams, int]] = []
    for i in range(n):
        if i % 4 == 3:  # a second turn: an earlier prompt, its answer's stand-in and a new question
            prompt = out[i - 2][2] + torch.randint(3, 256, (5,), generator=g).tolist()
        else:
            prompt = system + torch.randint(3, 256, (int(torch.randint(2, 11, (1,), generator=g)),),
                                            generator=g).tolist()
        new = int(torch.randint(6, 21, (1,), generator=g))
        if i % 2:
            p = SamplingParams(max_new_tokens=new, temperature=0.9, top_k=40, top_p=0.95, seed=200 + i)
        else:
            p = SamplingParams(max_new_tokens=new, temperature=0.0)
        out.append((i // 2, f"s{i:02d}", prompt, p, 1 if i % 3 == 1 else 0))
    return out


def state_digest(engine: Engine) -> str:
    """The scheduling state a step leaves: block tables, the prefix cache and its LRU list, the waiting queue."""
    import hashlib
    import json

    doc = {"tables": engine.blocks.tables, "cache": engine.blocks.state(),
           "waiting": [[r.id, len(r.ids), r.preemptions] for r in engine.waiting],
           "running": sorted([r.id, len(r.ids), r.n_computed] for r in engine.running.values())}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
