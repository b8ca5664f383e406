"""LoRA SFT with an epoch per step: a SIGKILLed trainer resumes with the same next-step loss (bit-exact) as an
uninterrupted run, because adapter, AdamW moments and step counters come back byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402

from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch  # noqa: E402
from llm_helpers import VOCAB, tiny_model  # noqa: E402

HELPERS = Path(__file__).with_name("llm_helpers.py")
SRC = Path(__file__).resolve().parents[1] / "src"


def _batch(k):
    return synthetic_batch(k, vocab=VOCAB)


def test_regions_hold_adapter_and_optimizer(tmp_path):
    with LoraTrainer(tiny_model("qwen3"), tmp_path / "log", lr=1e-2) as t:
        before = t.params_flat.clone()
        res = t.train_step(_batch(0))
        assert not torch.equal(before, t.params_flat)  # the optimizer wrote through the flat buffer
        assert t.adam_flat.abs().sum() > 0 and float(t.steps_flat[0]) == 1.0
        # every adapter parameter is a view of the one registered buffer
        ptrs = {p.data_ptr() for p in t.model.parameters() if p.requires_grad}
        lo = t.params_flat.data_ptr()
        hi = lo + t.params_flat.numel() * t.params_flat.element_size()
        assert all(lo <= p < hi for p in ptrs)
        st = t.runtime.last_stats
        assert res.pages == st.pages and st.payload_bytes >= 3 * t.params_flat.numel() * 4
        # 2 layers * r=8 * (in + out) over q, o (64->64), k, v (64->32), gate, up (64->128), down (128->64)
        assert t.n_adapter_params == 2 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sigkilled_training_resumes_with_the_same_loss(family, tmp_path):
    steps, kill_after = 9, 4
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, str(HELPERS), "lora", str(tmp_path / "log"), family, str(steps), "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: dict[int, float] = {}
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("STEP "):
                _, k, loss = line.split()
                seen[int(k)] = float(loss)
                if int(k) == kill_after:
                    os.kill(child.pid, signal.SIGKILL)
                    break
    finally:
        child.kill()
        child.wait(timeout=30)
    assert kill_after in seen, child.stderr.read() if child.stderr else ""

    with LoraTrainer(tiny_model(family), tmp_path / "ref", lr=1e-2) as ref:
        ref_losses = [r.loss for r in ref.train(_batch, steps)]
    assert [seen[k] for k in sorted(seen)] == ref_losses[: len(seen)]

    t = LoraTrainer.recover(tmp_path / "log", tiny_model(family), lr=1e-2)
    assert kill_after <= t.step < steps  # killed mid-run
    resumed = [r.loss for r in t.train(_batch, steps)]
    t.close()
    assert resumed == ref_losses[steps - len(resumed):]  # the next-step loss (and all after) are bit-equal
    assert len(set(ref_losses)) == steps  # training moves: equal losses are not trivially equal
