"""The serving engine's static decode step (the shapes and inputs a CUDA graph captures) on CPU: padded to a
batch bucket and a key bucket, with scratch rows for the padding, it produces the tokens of the variable-shape
eager step and of transformers' generate(); its padding rows are never logged; a log it wrote recovers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from concordia_ft.errors import ConfigError
from concordia_ft.serve import Engine, SamplingParams
from concordia_ft.serve.graphs import batch_buckets, scratch_blocks_for
from llm_helpers import tiny_model
from serve_workload import OPTIONS, drive, workload


def test_buckets_cover_max_running() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(6) == (1, 2, 4, 8)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64)  # more than 64 decodes: eager
    assert scratch_blocks_for(6, 8) == 1 and scratch_blocks_for(64, 16) == 4


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_static_decode_equals_eager_and_generate(family: str) -> None:
    model, ref = tiny_model(family), tiny_model(family)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 3, 12, 7)]
    got = {}
    for mode in ("off", "padded"):
        opts = {"num_blocks": 40, "block_size": 4, "max_batch_tokens": 16, "max_model_len": 64,
                "checkpoint": False, "graphs": mode, "max_running": 5}
        eng = Engine(model, None, opts)
        reqs = [eng.submit(p, SamplingParams(max_new_tokens=12, temperature=0.0)) for p in prompts[:3]]
        eng.step()
        reqs += [eng.submit(p, SamplingParams(max_new_tokens=12, temperature=0.0)) for p in prompts[3:]]
        graph_steps = 0
        while eng.has_work:
            graph_steps += eng.step().graph
        got[mode] = [r.generated for r in reqs]
        if mode == "padded":
            assert graph_steps > 5 and eng.graphs is not None and eng.graphs.replays == graph_steps
            # batches of 5 and fewer used the 8-row bucket and smaller ones; keys up to 64
            assert {nb for nb, _ in eng.graphs.statics} <= {1, 2, 4, 8}
        else:
            assert graph_steps == 0 and eng.graphs is None
    assert got["padded"] == got["off"]
    for p, toks in zip(prompts, got["padded"], strict=True):
        want = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        assert toks == want


def test_padding_rows_are_never_logged_and_the_log_recovers(shm_dir: Path) -> None:
    model = tiny_model("llama")
    opts = {**OPTIONS, "graphs": "padded"}
    ref = drive(Engine(model, None, {**opts, "checkpoint": False, "graphs": "off"}), workload())
    eng = Engine(model, shm_dir / "log", opts)
    row = eng.geo.row_bytes
    steps = []
    arrivals = workload()
    cut = {}

    def on_step(out):  # noqa: ANN001
        steps.append(out)
        if out.graph and out.batch_tokens < eng.graphs.bucket(out.batch_tokens, 1)[0]:
            # a padded decode step: exactly its real rows were logged (one per request), none of the padding
            assert eng.runtime.last_stats.region_pages["kv"] * eng.geo.page_bytes == out.batch_tokens * row
        if len(steps) == 9:
            cut.update({r.id: list(r.ids) for r in eng.running.values()})

    drive(eng, arrivals, on_step=on_step, max_steps=9)
    assert any(o.graph for o in steps)
    eng.close()
    rec = Engine.recover(shm_dir / "log", model)
    assert rec.graphs is not None and rec.graphs.mode == "padded"  # the logged mode, not the default
    for rid, ids in cut.items():
        assert rec.get(rid).ids == ids
    assert drive(rec, arrivals) == ref  # seeded and greedy requests alike, token-exact
    rec.close()


def test_graphs_on_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        Engine(tiny_model("llama"), None, {"checkpoint": False, "graphs": "on"})
    with pytest.raises(ConfigError, match="graphs="):
        Engine(tiny_model("llama"), None, {"checkpoint": False, "graphs": "yes"})


def test_async_epochs_hand_out_each_step_once_committed_and_recover(shm_dir: Path) -> None:
    model = tiny_model("llama")
    ref = drive(Engine(model, None, {**OPTIONS, "checkpoint": False}), workload())
    eng = Engine(model, shm_dir / "log", {**OPTIONS, "async_epochs": True})
    live = [eng]
    seen: dict[str, list[int]] = {}
    steps = []

    def on_step(out):  # noqa: ANN001
        steps.append(out)
        if out.new_tokens:  # handed out only once committed: the log already holds this step
            assert out.epoch is not None and out.epoch <= live[0].runtime.log.last_epoch
        for rid, t in out.new_tokens.items():
            seen.setdefault(rid, []).extend(t)

    drive(eng, workload(), on_step=on_step, max_steps=10)
    assert steps[0].new_tokens == {} and steps[1].step == 1  # one step late
    cut = {rid: list(t) for rid, t in seen.items()}
    eng.close()  # the epoch still being written commits: the log is one step ahead of what was handed out
    rec = Engine.recover(shm_dir / "log", model)
    assert rec.opts.async_epochs is False  # a delivery option of the new engine, not logged
    for rid, t in cut.items():
        assert rec.get(rid).generated[: len(t)] == t
    assert drive(rec, workload()) == ref

    seen.clear()
    whole = Engine(model, shm_dir / "log2", {**OPTIONS, "async_epochs": True})
    live[0] = whole
    got = drive(whole, workload(), on_step=on_step)
    assert not whole.has_work and got == ref
    assert seen == {k: v for k, v in ref.items() if v}  # every token handed out, exactly once, in order
    whole.close()


def test_async_engine_reports_only_delivered_tokens() -> None:
    model = tiny_model("llama")
    eng = Engine(model, None, {**OPTIONS, "checkpoint": False})
    assert eng.delivered(eng.submit([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))) == ([], None)


def test_async_delivered_lags_the_engine_by_the_held_step(shm_dir: Path) -> None:
    model = tiny_model("llama")
    with Engine(model, shm_dir / "log", {**OPTIONS, "async_epochs": True}) as eng:
        r = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
        out = eng.step()
        assert out.new_tokens == {} and len(r.generated) == 1 and eng.delivered(r) == ([], None)
        out = eng.step()
        assert out.new_tokens == {r.id: r.generated[:1]} and out.starts == {r.id: 0}
        assert eng.delivered(r) == (r.generated[:1], None)
        eng.step()  # the third token: the request finished in the engine, not yet for its client
        assert r.finish_reason == "length" and eng.delivered(r) == (r.generated[:2], None)
        out = eng.step()  # nothing to run: the last epoch commits and its output leaves
        assert out.reasons == {r.id: "length"} and eng.delivered(r) == (r.generated, "length")
        assert not eng.has_work
