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


def prompt_ids(n: int = 12, *, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)
