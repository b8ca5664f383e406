"""The arena KV cache: same outputs as StaticCache (bit-exact) and DynamicCache (greedy tokens), dirty blocks
derived from append positions, and a restored arena that continues exactly like the original."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

from concordia_ft.errors import ConfigError  # noqa: E402
from concordia_ft.integrations.transformers import ArenaKVCache, plan_arena  # noqa: E402
from llm_helpers import prompt_ids, tiny_config, tiny_model  # noqa: E402

CASES = [("llama", None), ("qwen3", None), ("qwen3", 6)]
IDS = ["llama", "qwen3", "qwen3-sliding6"]


def _decode(model, cache, ids, steps):
    logits, toks = [], []
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        for _ in range(steps):
            last = out.logits[:, -1]
            logits.append(last)
            tok = last.argmax(-1, keepdim=True)
            toks.append(int(tok))
            out = model(input_ids=tok, cache=cache, use_cache=True)
    return torch.cat(logits), toks


@pytest.mark.parametrize(("family", "window"), CASES, ids=IDS)
def test_arena_equals_static_and_dynamic(family, window):
    model = tiny_model(family, sliding_window=window)
    ids = prompt_ids(10)
    a_logits, a_toks = _decode(model, ArenaKVCache(model.config, 40), ids, 16)
    s_logits, s_toks = _decode(model, StaticCache(config=model.config, max_cache_len=40), ids, 16)
    d_logits, d_toks = _decode(model, DynamicCache(config=model.config), ids, 16)
    assert torch.equal(a_logits, s_logits)  # same arithmetic as StaticCache, only the storage differs
    assert a_toks == s_toks == d_toks
    torch.testing.assert_close(a_logits, d_logits, rtol=1e-4, atol=1e-4)
    assert len(set(a_toks)) > 3  # the model is not degenerate: the comparison means something


@pytest.mark.parametrize(("family", "window"), CASES, ids=IDS)
def test_generate_accepts_arena_cache(family, window):
    model = tiny_model(family, sliding_window=window)
    ids = prompt_ids(9)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    got = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                         cache=ArenaKVCache(model.config, 32))
    assert torch.equal(ref, got)


def test_dirty_blocks_follow_append_positions():
    model = tiny_model("llama")
    cache = ArenaKVCache(model.config, 64, block_bytes=512)
    geo = cache.geometry
    row = geo.sections[0].row_bytes  # 2 layers * (K+V) * 2 heads * 16 dims * 4 bytes = 512
    assert row == 2 * 2 * 2 * 16 * 4 and geo.n_blocks == 64 * row // 512
    with torch.no_grad():
        model(input_ids=prompt_ids(5), cache=cache, use_cache=True)
    assert cache.lengths() == [5, 5]
    cache.mark_dirty()
    assert np.flatnonzero(cache.dirty_blocks.numpy()).tolist() == [0, 1, 2, 3, 4]
    cache.dirty_blocks[:] = 0  # what the runtime does after the commit
    cache.mark_clean()
    assert cache.mark_dirty() == 0  # nothing new
    with torch.no_grad():
        model(input_ids=torch.tensor([[7]]), cache=cache, use_cache=True)
    cache.mark_dirty()
    assert np.flatnonzero(cache.dirty_blocks.numpy()).tolist() == [5]
    # the bytes outside the dirty blocks did not change since the commit: only block 5 differs from a copy
    # taken before the step (checked the other way round: row 5 is non-zero now, row 6 still zero)
    arena = cache.arena.numpy()
    assert arena[5 * row: 6 * row].any() and not arena[6 * row:].any()


def test_sliding_layer_marks_its_window_after_rolling():
    model = tiny_model("qwen3", sliding_window=4)
    cache = ArenaKVCache(model.config, 32, block_bytes=512)
    geo = cache.geometry
    full, slide = geo.sections
    assert slide.rows == 4 and slide.start_bytes >= 32 * full.row_bytes
    with torch.no_grad():
        model(input_ids=prompt_ids(3), cache=cache, use_cache=True)
        cache.mark_dirty()
        cache.dirty_blocks[:] = 0
        cache.mark_clean()
        for tok in (5, 6):  # length 3 -> 5: the window (4 rows) rolls
            model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
    ranges = cache.dirty_byte_ranges()
    assert (full.start_bytes + 3 * full.row_bytes, full.start_bytes + 5 * full.row_bytes) in ranges
    assert (slide.start_bytes, slide.start_bytes + 4 * slide.row_bytes) in ranges


@pytest.mark.parametrize(("family", "window"), CASES, ids=IDS)
def test_restored_arena_continues_exactly(family, window):
    model = tiny_model(family, sliding_window=window)
    cache = ArenaKVCache(model.config, 48)
    with torch.no_grad():
        model(input_ids=prompt_ids(11), cache=cache, use_cache=True)
        for tok in (9, 17, 33):
            model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
    copy = ArenaKVCache(model.config, 48)
    copy.arena.copy_(cache.arena)
    copy.set_lengths(cache.lengths())
    a_logits, _ = _decode(model, cache, torch.tensor([[44]]), 10)
    b_logits, _ = _decode(model, copy, torch.tensor([[44]]), 10)
    assert torch.equal(a_logits, b_logits)


def test_geometry_round_trips_and_rejects_unknown_layers():
    cfg = tiny_config("qwen3", sliding_window=8)
    geo = plan_arena(cfg, 100, dtype=torch.bfloat16)
    from concordia_ft.integrations.transformers import ArenaGeometry

    assert ArenaGeometry.from_description(geo.describe()) == geo
    assert geo.nbytes % geo.block_bytes == 0
    cfg.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match="linear_attention"):
        plan_arena(cfg, 100)
