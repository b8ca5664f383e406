"""Sessions across device types on the GPU: the H200 log of tests/data/h200 recovers on a GPU exactly (the
same sampler stream), a session and a LoRA run logged on the CPU continue on the GPU, and the generation
settings give model.generate()'s tokens on CUDA too.

Marker gpu (tests/gpu/conftest.py).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from concordia_ft.session import Session  # noqa: E402
from llm_helpers import (  # noqa: E402
    DEVLOG_FAMILY,
    DEVLOG_KILL_AFTER,
    DEVLOG_LORA,
    DEVLOG_LORA_LR,
    DEVLOG_LORA_STEPS,
    DEVLOG_LORA_TOTAL,
    DEVLOG_NEW,
    DEVLOG_PROMPT,
    GEN_KW,
    VOCAB,
    byte_tokenizer,
    prompt_ids,
    tiny_model,
    write_lora,
    write_session,
)

pytestmark = pytest.mark.gpu
H200 = Path(__file__).resolve().parents[1] / "data" / "h200"


def _gpu_model():
    return tiny_model(DEVLOG_FAMILY).cuda()


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_the_h200_log_continues_exactly_on_a_gpu(mode, tmp_path):
    exp = json.loads((H200 / "expected.json").read_text())["session"][mode]
    log = tmp_path / "log"
    shutil.copytree(H200 / f"session-{mode}", log)
    s = Session.recover(log, _gpu_model())
    try:
        assert s.rng_exact and s.ids[DEVLOG_PROMPT:] == exp["shown"]
        assert s.resume() == exp["uninterrupted"]
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_cpu_session_continues_on_the_gpu(mode, tmp_path):
    shown = write_session(tmp_path / "cpu", "cpu", mode, DEVLOG_KILL_AFTER)
    full_cpu = write_session(tmp_path / "cpu-full", "cpu", mode, None)
    runs = []
    for k in range(2):
        log = tmp_path / f"copy{k}"
        shutil.copytree(tmp_path / "cpu", log, ignore=shutil.ignore_patterns("LOCK"))
        s = Session.recover(log, _gpu_model())
        try:
            assert s.device.type == "cuda" and not s.rng_exact and s.ids[DEVLOG_PROMPT:] == shown
            runs.append(s.resume())
        finally:
            s.close()
    assert runs[0] == runs[1] and len(runs[0]) == DEVLOG_NEW and runs[0][:DEVLOG_KILL_AFTER] == shown
    if mode == "greedy":  # the GPU's own continuation of what the CPU committed, and the CPU's uninterrupted run
        ids = torch.tensor([prompt_ids(DEVLOG_PROMPT)[0].tolist() + shown], device="cuda")
        gpu = _gpu_model().generate(ids, max_new_tokens=DEVLOG_NEW - DEVLOG_KILL_AFTER, do_sample=False,
                                    eos_token_id=None)
        assert runs[0] == shown + gpu[0, ids.shape[1]:].tolist() == full_cpu


def test_a_cpu_lora_run_continues_on_the_gpu(tmp_path):
    from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch

    write_lora(tmp_path / "cpu", "cpu", DEVLOG_LORA_STEPS)
    full = write_lora(tmp_path / "cpu-full", "cpu", DEVLOG_LORA_TOTAL)
    t = LoraTrainer.recover(tmp_path / "cpu", tiny_model("qwen3").cuda(), lora_config=default_lora_config(**DEVLOG_LORA),
                            lr=DEVLOG_LORA_LR, async_checkpoint=False)
    try:
        assert t.step == DEVLOG_LORA_STEPS and t.cuda_rng is not None
        losses = [r.loss for r in t.train(lambda k: synthetic_batch(k, vocab=VOCAB, device="cuda"),
                                          DEVLOG_LORA_TOTAL)]
    finally:
        t.close()
    assert losses == pytest.approx(full[DEVLOG_LORA_STEPS:], rel=1e-4)


CUDA_CASES = {
    "min_new_tokens": dict(min_new_tokens=10, eos_token_id=[7, 9, 11, 13]),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=1, repetition_penalty=1.3),
    "bad_words_suppress": dict(bad_words_ids=[[3], [4, 5]], suppress_tokens=[6, 8], begin_suppress_tokens=[10]),
    "stop_strings": dict(stop_strings=["a", "b", "c", "d", "e"]),
    "typical_min_p": dict(typical_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_settings_give_model_generates_tokens_on_cuda(case, mode, tmp_path):
    model = _gpu_model()
    tok = byte_tokenizer() if case == "stop_strings" else None
    kw = {"max_new_tokens": 20, "eos_token_id": None, **GEN_KW[mode], **CUDA_CASES[case]}
    seed = kw.pop("seed", None)
    ids = prompt_ids(DEVLOG_PROMPT).cuda()
    if seed is not None:
        torch.manual_seed(seed)
    ref = model.generate(ids, **kw, **({"tokenizer": tok} if tok is not None else {}))[0, DEVLOG_PROMPT:].tolist()
    with Session(model, tmp_path / "log", tok, max_cache_len=64) as s:
        got = s.generate(ids, seed=seed, **kw)
    assert got == ref
