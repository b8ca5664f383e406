"""The serving engine's sampling rules: each setting generate() shares gives generate()'s tokens (greedy and
seeded sampling, several settings side by side in one batch); the OpenAI frequency / presence penalties (which
generate() lacks) equal a float64 reference loop; stop strings stop at the token that completes them, across
token boundaries; log-probabilities equal the model's log-softmax; and an engine restarted on its log mid-way
continues every one of these requests to the same tokens, log-probabilities and finish reasons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from concordia_ft.errors import ConfigError
from concordia_ft.serve import Engine, SamplingParams
from llm_helpers import byte_tokenizer, prompt_ids, tiny_model

N_NEW = 16
SEED = 1234
OPTS = {"num_blocks": 64, "block_size": 4, "max_model_len": 64, "max_batch_tokens": 32}


@pytest.fixture(scope="module")
def llama() -> Any:
    """The engine's model (the engine installs its paged attention into it)."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ref() -> Any:
    """The same weights for generate() and the reference loops."""
    return tiny_model("llama")


def _generate(model: Any, ids: list[int], **kw: Any) -> list[int]:
    seed = kw.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    kw.setdefault("eos_token_id", None)
    out = model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def _run(model: Any, reqs: list[tuple[list[int], SamplingParams]], log: Path | None = None,
         tokenizer: Any = None) -> list[Any]:
    opts = {**OPTS, "checkpoint": log is not None}
    with Engine(model, log, opts, tokenizer=tokenizer) as eng:
        rs = [eng.submit(p, sp) for p, sp in reqs]
        while eng.has_work:
            eng.step()
    return rs


def _plain(model: Any, ids: list[int]) -> list[int]:
    return _generate(model, ids, do_sample=False)


def test_generate_parity_side_by_side_in_one_batch(llama: Any, ref: Any) -> None:
    """Every request of the batch has other settings; each equals generate() with the same ones."""
    p1, p2, p3 = (prompt_ids(12, seed=s)[0].tolist() for s in (1, 2, 3))
    b1 = _plain(ref, p1)
    samp = dict(temperature=0.9, top_k=40, top_p=0.9)
    cases: list[tuple[list[int], SamplingParams, dict[str, Any]]] = [
        (p1, SamplingParams(N_NEW, temperature=0.0, repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (p1, SamplingParams(N_NEW, temperature=0.0, logit_bias=((b1[1], -30.0), (b1[4], 5.0))),
         dict(sequence_bias=[[[b1[1]], -30.0], [[b1[4]], 5.0]])),
        (p1, SamplingParams(N_NEW, temperature=0.0, min_tokens=8, eos_token_ids=(b1[2],)),
         dict(eos_token_id=b1[2], min_new_tokens=8)),
        (p2, SamplingParams(N_NEW, seed=SEED, **samp), dict(do_sample=True, seed=SEED, **samp)),
        (p2, SamplingParams(N_NEW, seed=SEED + 1, repetition_penalty=1.5, **samp),
         dict(do_sample=True, seed=SEED + 1, repetition_penalty=1.5, **samp)),
        (p3, SamplingParams(N_NEW, seed=7, temperature=0.7, top_p=0.5, logit_bias=((5, 3.0),), min_tokens=4,
                            eos_token_ids=(9,)),
         dict(do_sample=True, seed=7, temperature=0.7, top_p=0.5, top_k=0, sequence_bias=[[[5], 3.0]],
              min_new_tokens=4, eos_token_id=9)),
        (p3, SamplingParams(N_NEW, temperature=0.0), dict(do_sample=False)),
    ]
    got = _run(llama, [(p, sp) for p, sp, _ in cases])
    for (p, _, kw), r in zip(cases, got, strict=True):
        want = _generate(ref, p, **kw)
        assert r.generated == want, kw
    assert got[0].generated != b1 and got[1].generated != b1  # each setting changed something: not ignored


def _reference_penalties(model: Any, ids: list[int], f: float, p: float) -> list[int]:
    """Greedy with OpenAI's penalties, float64, the whole sequence recomputed each token (no cache)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(N_NEW):
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(seq[len(ids):], dtype=torch.long), minlength=logits.numel())
            logits = logits - f * counts.double() - p * (counts > 0).double()
            seq.append(int(torch.argmax(logits)))
    return seq[len(ids):]


def test_frequency_and_presence_penalties_equal_a_float64_reference(llama: Any, ref: Any) -> None:
    ids = prompt_ids(10, seed=5)[0].tolist()
    settings = [(1.5, 0.0), (0.0, 1.9), (0.8, 0.6), (-0.5, 0.0)]
    got = _run(llama, [(ids, SamplingParams(N_NEW, temperature=0.0, frequency_penalty=f, presence_penalty=p))
                       for f, p in settings])
    plain = _plain(ref, ids)
    for (f, p), r in zip(settings, got, strict=True):
        assert r.generated == _reference_penalties(ref, ids, f, p), (f, p)
    assert got[0].generated != plain and got[1].generated != plain


def test_stop_strings_across_token_boundaries_and_min_tokens(llama: Any, ref: Any) -> None:
    tok = byte_tokenizer()
    ids = prompt_ids(12, seed=9)[0].tolist()
    base = _plain(ref, ids)
    text = [tok.decode([t]) for t in base]
    # a stop string made of the end of token 5's text and all of token 6's: it spans a token boundary
    stop = text[5][-1:] + text[6]
    first = next(i for i in range(1, N_NEW) if stop in tok.decode(base[: i + 1]))
    r, late, none = _run(llama, [
        (ids, SamplingParams(N_NEW, temperature=0.0, stop=(stop, "never-there"))),
        (ids, SamplingParams(N_NEW, temperature=0.0, stop=(stop,), min_tokens=first + 2)),
        (ids, SamplingParams(N_NEW, temperature=0.0, stop=("never-there",)))], tokenizer=tok)
    assert r.finish_reason == "stop" and r.generated == base[: first + 1]
    assert late.generated[: first + 2] == base[: first + 2]  # not before min_tokens
    assert none.finish_reason == "length" and none.generated == base
    with Engine(llama, None, {**OPTS, "checkpoint": False}) as eng, pytest.raises(ConfigError, match="tokenizer"):
        eng.submit(ids, SamplingParams(N_NEW, stop=("x",)))


def test_logprobs_are_the_models_log_softmax(llama: Any, ref: Any) -> None:
    ids = prompt_ids(12, seed=4)[0].tolist()
    r, s = _run(llama, [(ids, SamplingParams(N_NEW, temperature=0.0, logprobs=5)),
                        (ids, SamplingParams(N_NEW, seed=3, temperature=0.8, logprobs=0))])
    for req, k in ((r, 5), (s, 0)):
        seq = ids + req.generated
        with torch.no_grad():
            lsm = torch.log_softmax(ref(torch.tensor([seq])).logits[0].double(), -1)
        assert len(req.logprobs) == N_NEW
        for i, lp in enumerate(req.logprobs):
            row = lsm[len(ids) + i - 1]
            assert lp.logprob == pytest.approx(float(row[req.generated[i]]), abs=1e-4)
            top = torch.topk(row, k) if k else None
            assert [t for t, _ in lp.top] == ([] if top is None else top.indices.tolist())
            if top is not None:
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert [t for t, _ in r.logprobs[0].top][0] == r.generated[0]  # greedy: the most likely


def test_a_restart_on_the_log_continues_every_setting(llama: Any, ref: Any, shm_dir: Path) -> None:
    """Stopped after a few steps (the log holds every committed step) and recovered in a fresh engine: each
    request's tokens, log-probabilities and finish reason equal an uninterrupted engine's."""
    tok = byte_tokenizer()
    ids = [prompt_ids(12, seed=s)[0].tolist() for s in (11, 12, 13, 14)]
    base = _plain(ref, ids[0])
    stop = tok.decode(base[9:11])
    reqs = [
        (ids[0], SamplingParams(N_NEW, temperature=0.0, stop=(stop,), logprobs=2)),
        (ids[1], SamplingParams(N_NEW, seed=5, temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5,
                                presence_penalty=0.4, logit_bias=((7, 2.0),), logprobs=3)),
        (ids[2], SamplingParams(N_NEW, seed=6, temperature=1.0, top_k=20, min_tokens=12, eos_token_ids=(3, 4))),
        (ids[3], SamplingParams(N_NEW, temperature=0.0, presence_penalty=1.0, stop=("zz",))),
    ]
    want = _run(llama, reqs, shm_dir / "ref", tokenizer=tok)
    assert want[0].finish_reason == "stop" and len(want[0].generated) < N_NEW
    eng = Engine(llama, shm_dir / "log", OPTS, tokenizer=tok)
    rs = [eng.submit(p, sp) for p, sp in reqs]
    for _ in range(6):
        eng.step()
    assert all(0 < len(r.generated) < 10 for r in rs)
    before = [[(lp.logprob, lp.top) for lp in r.logprobs] for r in rs]
    eng.close()
    with Engine.recover(shm_dir / "log", llama, OPTS, tokenizer=tok) as back:
        assert {r.id for r in rs} <= set(back.running)
        while back.has_work:
            back.step()
        got = [back.get(r.id) for r in rs]
    for w, g, b in zip(want, got, before, strict=True):
        assert g is not None
        assert (g.generated, g.finish_reason) == (w.generated, w.finish_reason)
        # what the killed engine delivered comes back bit for bit; the rest equals an uninterrupted engine's
        # (another engine's CPU arithmetic may differ in the last bits: compared to 1e-5)
        assert [(lp.logprob, lp.top) for lp in g.logprobs[: len(b)]] == b
        assert len(g.logprobs) == len(w.logprobs)
        for x, y in zip(g.logprobs, w.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)


def test_a_penalised_request_does_not_depend_on_its_batch(llama: Any) -> None:
    p = SamplingParams(12, temperature=0.9, seed=11, repetition_penalty=1.4, frequency_penalty=0.7,
                       logit_bias=((17, 4.0),))
    prompt = list(range(10, 30))
    alone = _run(llama, [(prompt, p)])[0]
    crowd = _run(llama, [(list(range(3 + i, 9 + 2 * i)), SamplingParams(20, temperature=1.0, seed=i,
                                                                        presence_penalty=0.5 * (i % 2)))
                         for i in range(5)] + [(prompt, p)])
    assert crowd[-1].generated == alone.generated


def test_preempted_and_readmitted_requests_keep_their_logprobs_across_restarts(llama: Any, shm_dir: Path) -> None:
    """A pool too small for three requests: one is preempted (recomputed later, sharing its own cached blocks);
    the engine is restarted on its log while it waits and again after it was admitted again."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (11,), generator=g).tolist() for _ in range(3)]
    opts = {"num_blocks": 9, "block_size": 4, "max_model_len": 36, "max_batch_tokens": 64}
    reqs = [
        (prompts[0], SamplingParams(8, temperature=0.0, logprobs=2, frequency_penalty=0.5), 0),
        (prompts[1], SamplingParams(8, seed=3, temperature=0.9, logprobs=3, repetition_penalty=1.3), 1),
        (prompts[2], SamplingParams(8, temperature=0.0, logprobs=1, presence_penalty=0.5), 0),
    ]

    def submit(eng: Engine) -> list[Any]:
        return [eng.submit(p, sp, request_id=f"r{i}", priority=pr) for i, (p, sp, pr) in enumerate(reqs)]

    with Engine(llama, shm_dir / "ref", opts) as eng:
        want = submit(eng)
        while eng.has_work:
            eng.step()
    assert eng.preempted >= 1

    def lps(r: Any) -> list[Any]:
        return [(lp.logprob, lp.top) for lp in r.logprobs]

    eng = Engine(llama, shm_dir / "log", opts)
    rs = submit(eng)
    eng.step()
    eng.step()
    assert rs[1].status == "waiting" and rs[1].preemptions == 1 and len(rs[1].logprobs) == 2
    held = {r.id: lps(r) for r in rs}
    eng.close()
    eng = Engine.recover(shm_dir / "log", llama, opts)
    assert eng.get("r1").status == "waiting"
    assert {rid: lps(eng.get(rid)) for rid in held} == held  # bit for bit, the waiting one's from the metadata
    for _ in range(50):
        if eng.get("r1").status == "running" and len(eng.get("r1").generated) >= 4:
            break
        eng.step()
    r1 = eng.get("r1")
    assert r1.status == "running" and r1.preemptions >= 1, r1.status
    held = {rid: lps(eng.get(rid)) for rid in held}
    eng.close()
    with Engine.recover(shm_dir / "log", llama, opts) as back:
        assert {rid: lps(back.get(rid))[: len(v)] for rid, v in held.items()} == held
        while back.has_work:
            back.step()
        got = [back.get(f"r{i}") for i in range(3)]
    for w, r in zip(want, got, strict=True):
        assert (r.generated, r.finish_reason) == (w.generated, w.finish_reason), r.id
        assert len(r.logprobs) == len(w.logprobs) == 8
        for x, y in zip(r.logprobs, w.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5) and [t for t, _ in x.top] == [t for t, _ in y.top]
