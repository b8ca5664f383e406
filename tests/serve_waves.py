"""Successive waves on one serving engine (the steady state of a server): the workload, the engine options that
make a small CPU log compact every few waves, and the driver shared by the waves tests and their SIGKILLed
child (the uninterrupted reference, the killed process and the recovered engine see the same arrivals)."""

from __future__ import annotations

import torch

from concordia_ft.serve import Engine, SamplingParams

BATCH = 4
WAVE_STEPS = 30  # a wave arrives every this many engine steps (each finishes well before the next)
# a pool for two waves (finished requests' rows stay in it until their blocks are reused), a DRAM log; no prefix
# cache (the waves' prompts are random: it would only keep their blocks, live, until the pool needs them)
OPTIONS = {"num_blocks": 2 * BATCH * 6, "block_size": 8, "max_running": BATCH, "max_waiting": 64,
           "max_model_len": 48, "max_batch_tokens": 64, "keep_finished": BATCH, "backend": "dram",
           "prefix_caching": False}
COMPACT_AFTER = 96 << 10  # the runtime's threshold (bytes appended), scaled down: a compaction every ~2 waves


def waves(n: int, seed: int = 11) -> list[tuple[int, str, list[int], SamplingParams]]:
    """``n`` waves of ``BATCH`` requests, wave ``w`` arriving at engine step ``w * WAVE_STEPS``: every wave of the
    same shape (request ``i``: a prompt of 12 + 5 i random tokens, 8 + 2 i new ones; greedy and seeded sampling
    alternating), so each wave's epochs hold the same rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in range(n):
        for i in range(BATCH):
            prompt = torch.randint(3, 256, (12 + 5 * i,), generator=g).tolist()
            new = 8 + 2 * i
            if i % 2:
                p = SamplingParams(max_new_tokens=new, temperature=0.8, top_k=30, seed=1000 * w + i)
            else:
                p = SamplingParams(max_new_tokens=new, temperature=0.0)
            out.append((w * WAVE_STEPS, f"w{w}-{i}", prompt, p))
    return out


def compact_often(engine: Engine) -> Engine:
    assert engine.runtime is not None
    engine.runtime.compact_after_bytes = COMPACT_AFTER
    return engine


def drive_waves(engine: Engine, arrivals, on_step=None, max_steps: int = 10_000) -> dict[str, list[int]]:
    """``serve_workload.drive`` for an engine that evicts finished outputs (keep_finished): the tokens every
    step handed out, per request, from the engine's step on."""
    pending = [a for a in arrivals if engine.get(a[1]) is None and a[0] >= engine.step_no]
    got: dict[str, list[int]] = {}
    for _ in range(max_steps):
        for a in [a for a in pending if a[0] <= engine.step_no]:
            engine.submit(a[2], a[3], request_id=a[1])
            pending.remove(a)
        if not engine.has_work and not pending:
            break
        out = engine.step()
        for rid, toks in out.new_tokens.items():
            got.setdefault(rid, []).extend(toks)
        for rid in out.finished:
            engine.collect(rid)
        if on_step is not None:
            on_step(out)
    return got
