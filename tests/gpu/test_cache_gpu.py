"""The arena cache on a GPU: the shared length counters (one device tensor, read with one copy) equal the
per-layer counters, and the dirty blocks equal the CPU cache's, through prefill, decode, commits and reset."""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from concordia_ft.integrations.transformers import ArenaKVCache  # noqa: E402
from llm_helpers import prompt_ids, tiny_model  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_dirty_blocks_and_lengths_equal_cpu(family: str) -> None:
    model = tiny_model(family)
    ids = prompt_ids(11)
    caches = {dev: ArenaKVCache(model.config, 96, block_bytes=512, device=dev) for dev in ("cpu", "cuda")}
    models = {"cpu": model, "cuda": tiny_model(family).to("cuda")}
    gen = torch.Generator().manual_seed(3)
    feeds = [ids] + [torch.randint(0, model.config.vocab_size, (1, int(n)), generator=gen)
                     for n in torch.randint(1, 4, (12,), generator=gen)]
    # transformers renamed the forward's cache argument in 5.x (the device image's release may predate it)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        for step, feed in enumerate(feeds):
            got = {}
            for dev, cache in caches.items():
                models[dev](input_ids=feed.to(dev), use_cache=True, **{kw: cache})
                lengths = cache.lengths()
                assert lengths == [layer.length() for layer in cache.layers]  # shared tensor == each counter
                n = cache.mark_dirty(lengths)
                got[dev] = (lengths, n, cache.dirty_blocks.cpu().clone())
                if step % 3 == 2:  # commit now and then: the next marks start from the new lengths
                    cache.mark_clean(lengths)
                    cache.dirty_blocks.zero_()
            assert got["cpu"][0] == got["cuda"][0] and got["cpu"][1] == got["cuda"][1]
            assert torch.equal(got["cpu"][2], got["cuda"][2]), f"step {step}"
            assert got["cuda"][1] >= 1  # every feed dirtied at least one block
    for cache in caches.values():  # reset() zeroes the counters in place: still the shared views
        cache.reset()
        assert cache.lengths() == [0] * len(cache.layers)
