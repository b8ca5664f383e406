"""A log outlives its device: a session and a LoRA run logged on an H200 recover and continue on a CPU, and a
session log of metadata version 1 (the sampler's raw state in region ``rng``) still recovers exactly.

The logs are real (tests/data/make_device_logs.py wrote them; tests/data/h200/expected.json says where and
with what). Across device types the sampler cannot continue the writer's stream (CUDA Philox vs CPU Mersenne
Twister): greedy continues token for token, seeded sampling continues deterministically on the new device.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

from concordia_ft.session import Session  # noqa: E402
from llm_helpers import (  # noqa: E402
    DEVLOG_FAMILY,
    DEVLOG_KILL_AFTER,
    DEVLOG_LORA,
    DEVLOG_LORA_LR,
    DEVLOG_LORA_TOTAL,
    DEVLOG_NEW,
    DEVLOG_PROMPT,
    VOCAB,
    prompt_ids,
    tiny_model,
)

DATA = Path(__file__).with_name("data")
H200 = DATA / "h200"
V1 = DATA / "session-v1"


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)  # recovery appends to the log: never to the committed fixture
    return dst


def _expected(root: Path) -> dict:
    return json.loads((root / "expected.json").read_text())


class _Stop(Exception):
    pass


def test_the_fixture_was_written_on_a_gpu():
    exp = _expected(H200)
    assert exp["device_type"] == "cuda" and "H200" in exp["device"], exp


def test_a_greedy_gpu_session_continues_on_the_cpu_token_for_token(tmp_path):
    exp = _expected(H200)["session"]["greedy"]
    model = tiny_model(DEVLOG_FAMILY)
    s = Session.recover(_copy(H200 / "session-greedy", tmp_path), model)
    try:
        assert s.device.type == "cpu" and not s.rng_exact  # the sampler record is the GPU's
        assert s.gen is not None and s.gen.n_new == DEVLOG_KILL_AFTER and not s.gen.done
        assert s.ids[DEVLOG_PROMPT:] == exp["shown"]
        got = s.resume()
    finally:
        s.close()
    # the CPU's own greedy continuation of what the GPU committed, and (these logits are far from ties) the
    # GPU's uninterrupted run
    ids = torch.tensor([prompt_ids(DEVLOG_PROMPT)[0].tolist() + exp["shown"]])
    cpu = model.generate(ids, max_new_tokens=DEVLOG_NEW - DEVLOG_KILL_AFTER, do_sample=False, eos_token_id=None)
    assert got == exp["shown"] + cpu[0, ids.shape[1]:].tolist()
    assert got == exp["uninterrupted"]


def test_a_sampled_gpu_session_continues_on_the_cpu_and_then_recovers_exactly(tmp_path):
    exp = _expected(H200)["session"]["sampled"]
    runs = []
    for k in range(2):
        s = Session.recover(_copy(H200 / "session-sampled", tmp_path / str(k)), tiny_model(DEVLOG_FAMILY))
        try:
            assert not s.rng_exact and s.ids[DEVLOG_PROMPT:] == exp["shown"]
            runs.append(s.resume())
        finally:
            s.close()
    # what the GPU committed is kept; the rest is drawn by the CPU, the same in every recovery of this log
    assert runs[0] == runs[1] and len(runs[0]) == DEVLOG_NEW and runs[0][:DEVLOG_KILL_AFTER] == exp["shown"]
    # once the CPU has logged its own sampler, a crash there resumes the CPU's stream exactly
    log = _copy(H200 / "session-sampled", tmp_path / "again")
    s = Session.recover(log, tiny_model(DEVLOG_FAMILY))

    def stop(_tok: int) -> None:
        if s.gen.n_new >= DEVLOG_KILL_AFTER + 4:
            raise _Stop

    with pytest.raises(_Stop):
        s.resume(on_token=stop)
    s.close()
    r = Session.recover(log, tiny_model(DEVLOG_FAMILY))
    try:
        assert r.rng_exact and r.gen.n_new == DEVLOG_KILL_AFTER + 4
        assert r.resume() == runs[0]
    finally:
        r.close()


def test_a_gpu_lora_run_continues_on_the_cpu(tmp_path):
    from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch

    exp = _expected(H200)["lora"]
    t = LoraTrainer.recover(_copy(H200 / "lora", tmp_path), tiny_model("qwen3"),
                            lora_config=default_lora_config(**DEVLOG_LORA), lr=DEVLOG_LORA_LR, async_checkpoint=False)
    try:
        assert t.step == exp["steps_logged"] and t.last_loss == exp["losses"][t.step - 1]
        losses = [r.loss for r in t.train(lambda k: synthetic_batch(k, vocab=VOCAB), DEVLOG_LORA_TOTAL)]
    finally:
        t.close()
    # the adapter and optimizer state came over bit for bit; the CPU's kernels round differently from the GPU's
    assert losses == pytest.approx(exp["losses"][exp["steps_logged"]:], rel=1e-4)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_version_1_session_log_recovers_exactly_and_continues_in_version_2(mode, tmp_path):
    exp = _expected(V1)["session"][mode]
    log = _copy(V1 / f"session-{mode}", tmp_path)
    s = Session.recover(log, tiny_model(DEVLOG_FAMILY))
    try:
        assert s.rng_exact and s.ids[DEVLOG_PROMPT:] == exp["shown"]
        assert s.resume() == exp["uninterrupted"]  # the same stream: written and read on a CPU
    finally:
        s.close()
    import concordia_ft as cft

    rec = cft.recover(log)
    assert rec.meta["concordia.session"]["version"] == 2
    assert "rng" not in rec.regions and "sampler" in rec.regions
    again = Session.recover(log, tiny_model(DEVLOG_FAMILY))
    try:
        assert again.gen.done and again.resume() == exp["uninterrupted"]
    finally:
        again.close()


def test_the_sampler_record_round_trips_and_says_whose_state_it_holds():
    import numpy as np

    from concordia_ft.errors import RecoveryError
    from concordia_ft.integrations.generation import (
        SAMPLER_BYTES,
        decode_sampler_state,
        encode_sampler_state,
        restore_sampler_state,
    )

    g = torch.Generator().manual_seed(5)
    torch.rand(7, generator=g)
    rec = np.zeros(SAMPLER_BYTES, np.uint8)
    assert decode_sampler_state(rec) is None  # never written
    encode_sampler_state(g, rec)
    kind, state = decode_sampler_state(rec)
    h = torch.Generator()
    assert kind == "cpu" and restore_sampler_state(h, kind, state)
    assert torch.equal(torch.rand(5, generator=h), torch.rand(5, generator=g))  # the same stream continues
    cuda_like = (123).to_bytes(8, "little") + (64).to_bytes(8, "little")  # Philox seed + offset
    a, b = torch.Generator(), torch.Generator()
    assert not restore_sampler_state(a, "cuda", cuda_like) and not restore_sampler_state(b, "cuda", cuda_like)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))  # reseeded, deterministically
    rec[:8] = np.frombuffer(b"garbage!", np.uint8)
    with pytest.raises(RecoveryError, match="sampler record"):
        decode_sampler_state(rec)
