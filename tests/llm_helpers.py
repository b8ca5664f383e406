"""Tiny random causal LMs of two families (Llama, Qwen3) for fast CPU tests: hidden 64, 2 layers, vocab 256."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

FAMILIES = ("llama", "qwen3")
VOCAB = 256


def tiny_config(family: str, *, sliding_window: int | None = None, layers: int = 2):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    if family == "llama":
        from transformers import LlamaConfig

        if sliding_window is not None:
            raise ValueError("llama has no sliding window; use qwen3")
        return LlamaConfig(**common)
    if family == "qwen3":
        from transformers import Qwen3Config

        extra = {}
        if sliding_window is not None:
            # layer 0 sliding, layer 1 full: both kinds in one arena
            extra = dict(use_sliding_window=True, sliding_window=sliding_window,
                         layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1))
        return Qwen3Config(head_dim=16, **common, **extra)
    raise ValueError(f"unknown family {family!r}")


def tiny_model(family: str, *, seed: int = 0, sliding_window: int | None = None, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, sliding_window=sliding_window)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # random init is small: scale up so the logits are far from ties and the text is not constant
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = 0
    return model.eval()


def qwen3_06b_cuda():
    """Qwen3-0.6B dimensions, random bf16 weights, on the GPU (the benchmarks' model)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_llm

    return bench_llm.build(bench_llm.qwen3_06b(), "cuda")


def prompt_ids(n: int = 12, *, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


# tests/data/lora-layout1/: a LoRA training log in layout 1 (AdamW's step counters in lora.steps, the RNG state
# in lora.rng), written by concordia_ft before lora.state (tests/data/make_lora_layout1_log.py made it); dropout
# is on, so its RNG state matters to the next step's loss
LAYOUT1_LORA = {"r": 2, "dropout": 0.1, "targets": ("q_proj", "v_proj")}
LAYOUT1_SEED, LAYOUT1_STEPS, LAYOUT1_LR = 7, 3, 1e-2

def byte_tokenizer():
    """A byte-level tokenizer whose token id is the byte value (vocab 256, no merges), for stop_strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(VOCAB):  # GPT-2's byte -> visible character map
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(VOCAB)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# tests/data/h200/ and tests/data/session-v1/: logs written by tests/data/make_device_logs.py (a session
# interrupted after DEVLOG_KILL_AFTER of DEVLOG_NEW tokens, greedy and sampled; a LoRA run of DEVLOG_LORA_STEPS
# steps); expected.json beside them holds the writer's uninterrupted tokens and losses
DEVLOG_FAMILY, DEVLOG_PROMPT, DEVLOG_NEW, DEVLOG_KILL_AFTER, DEVLOG_CACHE = "llama", 12, 24, 10, 48
DEVLOG_LORA = {"r": 2, "dropout": 0.0, "targets": ("q_proj", "v_proj")}
DEVLOG_LORA_STEPS, DEVLOG_LORA_TOTAL, DEVLOG_LORA_LR = 3, 5, 1e-2

GEN_KW = {
    "greedy": dict(do_sample=False),
    "sampled": dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=1234),
}


class Stop(Exception):
    """Raised by on_token: the process stops there (what it committed stays, as after a kill)."""


def write_session(log, device: str, mode: str, kill_after: int | None) -> list[int]:
    """The device-log session: returns the tokens shown before it stopped after ``kill_after`` (None: all)."""
    from concordia_ft.session import Session

    model = tiny_model(DEVLOG_FAMILY).to(device)
    seen: list[int] = []

    def on_token(tok: int) -> None:
        seen.append(tok)
        if kill_after is not None and len(seen) >= kill_after:
            raise Stop

    with Session(model, log, max_cache_len=DEVLOG_CACHE) as s:
        try:
            s.generate(prompt_ids(DEVLOG_PROMPT), max_new_tokens=DEVLOG_NEW, eos_token_ids=(),
                       on_token=on_token, **GEN_KW[mode])
        except Stop:
            pass
    return seen


def write_lora(log, device: str, steps: int) -> list[float]:
    """The device-log LoRA run: ``steps`` sync epochs; returns the losses."""
    from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch

    t = LoraTrainer(tiny_model("qwen3").to(device), log, lora_config=default_lora_config(**DEVLOG_LORA),
                    lr=DEVLOG_LORA_LR, async_checkpoint=False)
    losses = [r.loss for r in t.train(lambda k: synthetic_batch(k, vocab=VOCAB, device=device), steps)]
    t.close()
    return losses


def run_writer(log_dir: str, family: str, window: int | None, mode: str, max_new: int, every: int,
               delay_s: float, durability: str = "durable", settings: dict | None = None) -> None:
    """Child process: generate with a checkpoint every ``every`` tokens, print each token as it is produced.

    ``delay_s`` makes the consumer slow (like a terminal or a network client) so the parent can kill it
    mid-answer; it does not change what is generated.
    """
    import sys
    import time

    from concordia_ft.session import Session

    model = tiny_model(family, sliding_window=window)
    tok = byte_tokenizer() if settings and "stop_strings" in settings else None
    s = Session(model, log_dir, tok, checkpoint_every=every, max_cache_len=96, durability=durability)

    def on_token(tok: int) -> None:
        print(f"TOKEN {tok}", flush=True)
        time.sleep(delay_s)

    print("READY", flush=True)
    kw = {**GEN_KW[mode], **(settings or {})}
    if "eos_token_id" not in kw:
        kw["eos_token_ids"] = ()
    s.generate(prompt_ids(12), max_new_tokens=max_new, on_token=on_token, **kw)
    print("DONE", flush=True)
    sys.stdout.flush()


def run_lora_writer(log_dir: str, family: str, steps: int, delay_s: float, mode: str = "sync",
                    stall_epoch: int = 0) -> None:
    """Child process: LoRA SFT with one epoch per step; prints each step's loss as train_step returns it.

    ``mode`` "sync": the step's epoch is committed when it is printed. "async": it may still be in flight.
    ``stall_epoch`` (async): that epoch's append is held up for a minute, so it is surely in flight when the
    parent kills this process right after the step is printed."""
    import time

    from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch
    from faults import FaultyLog

    trainer = LoraTrainer(tiny_model(family), log_dir, lr=1e-2, async_checkpoint=mode == "async")
    if stall_epoch:
        trainer.runtime.log = FaultyLog(trainer.runtime.log, delay_s=60.0, delay_epochs={stall_epoch})
    print("READY", flush=True)

    def on_step(res) -> None:
        print(f"STEP {res.step} {res.loss!r}", flush=True)
        time.sleep(delay_s)

    trainer.train(lambda k: synthetic_batch(k, vocab=VOCAB), steps, on_step=on_step)
    print("DONE", flush=True)


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1] == "lora":
        mode = sys.argv[6] if len(sys.argv) > 6 else "sync"
        stall = int(sys.argv[7]) if len(sys.argv) > 7 else 0
        run_lora_writer(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), mode, stall)
        raise SystemExit(0)
    _, log_dir, family, window, mode, max_new, every, delay, *rest = sys.argv
    run_writer(log_dir, family, None if window == "none" else int(window), mode, int(max_new), int(every),
               float(delay), durability="pipelined" if rest[:1] == ["async"] else "durable",
               settings=json.loads(rest[1]) if len(rest) > 1 else None)
