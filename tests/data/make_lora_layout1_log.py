"""Write tests/data/lora-layout1/: a LoRA training log in layout 1 (``lora.steps`` + ``lora.rng``), the layout
concordia_ft wrote before ``lora.state``. It must be run with a tree from BEFORE that change (commit 5f7c2c5),
so the log is what that code wrote, not an imitation:

    git archive 5f7c2c5 src | tar -x -C /tmp/cft-layout1
    PYTHONPATH=/tmp/cft-layout1/src:tests python tests/data/make_lora_layout1_log.py

Sync epochs, file backend, one epoch per step (LAYOUT1_STEPS of them); the LOCK file is not kept.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch
from llm_helpers import LAYOUT1_LORA, LAYOUT1_LR, LAYOUT1_SEED, LAYOUT1_STEPS, VOCAB, tiny_model

OUT = Path(__file__).resolve().parent / "lora-layout1"


def main() -> int:
    work = Path(tempfile.mkdtemp()) / "log"
    model = tiny_model("qwen3")
    torch.manual_seed(LAYOUT1_SEED)
    t = LoraTrainer(model, work, lora_config=default_lora_config(**LAYOUT1_LORA), lr=LAYOUT1_LR,
                    async_checkpoint=False)
    if sorted(sp.name for sp in t.runtime.table) != ["lora.adam", "lora.params", "lora.rng", "lora.steps"]:
        print("this tree writes another layout: run it with the src of a tree from before lora.state",
              file=sys.stderr)
        t.close()
        return 1
    losses = [r.loss for r in t.train(lambda k: synthetic_batch(k, vocab=VOCAB), LAYOUT1_STEPS)]
    t.close()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    for f in work.iterdir():
        if f.name != "LOCK":
            shutil.copy2(f, OUT / f.name)
    print(f"wrote {OUT} ({sum(f.stat().st_size for f in OUT.iterdir())} bytes); losses {losses}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
