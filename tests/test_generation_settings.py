"""Session.generate takes what model.generate() takes: each supported argument gives exactly generate()'s tokens
(greedy and seeded sampling), also after a SIGKILL mid-generation; anything else is refused, by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from concordia_ft.errors import ConfigError  # noqa: E402
from concordia_ft.session import Session  # noqa: E402
from llm_helpers import GEN_KW, byte_tokenizer, prompt_ids, tiny_model  # noqa: E402

HELPERS = Path(__file__).with_name("llm_helpers.py")
SRC = Path(__file__).resolve().parents[1] / "src"
N_NEW = 14
SEED = 1234


def _ascii_pair(base: list[int]) -> str:
    """Two printable ASCII tokens the plain run produced (from the 4th token on): a stop string it meets."""
    for i in range(3, len(base) - 1):
        if all(33 <= t <= 126 for t in base[i: i + 2]):
            return bytes(base[i: i + 2]).decode()
    raise AssertionError(f"no two printable tokens in a row in {base}")


# name -> settings built from the plain run's new tokens ``b`` (so each rule has something to act on)
CASES = {
    "min_new_tokens": lambda b: dict(eos_token_id=b[2], min_new_tokens=8),
    "min_length": lambda b: dict(eos_token_id=b[2], min_length=12 + 6),
    "eos_token_id_int": lambda b: dict(eos_token_id=b[4]),
    "eos_token_id_list": lambda b: dict(eos_token_id=[b[6], b[3]], pad_token_id=0),
    "max_length": lambda b: dict(max_new_tokens=None, max_length=12 + 9),
    "no_repeat_ngram_size": lambda b: dict(no_repeat_ngram_size=1),
    "bad_words_ids": lambda b: dict(bad_words_ids=[[b[0]], [b[1], b[2]]]),
    "suppress_tokens": lambda b: dict(suppress_tokens=[b[0], b[1], b[5]]),
    "begin_suppress_tokens": lambda b: dict(begin_suppress_tokens=[b[0]]),
    "repetition_penalty": lambda b: dict(repetition_penalty=1.8),
    "sequence_bias": lambda b: dict(sequence_bias=[[[b[1]], -30.0], [[b[3], b[4]], -30.0]]),
    "exponential_decay": lambda b: dict(eos_token_id=b[9], exponential_decay_length_penalty=(2, 1.6)),
    "forced_eos_token_id": lambda b: dict(forced_eos_token_id=b[0]),
    "forced_bos_token_id": lambda b: dict(forced_bos_token_id=b[3]),  # acts at length 1 only: never, after a prompt
    "renormalize_logits": lambda b: dict(renormalize_logits=True, top_k=5),
    "top_k_top_p_temperature": lambda b: dict(top_k=7, top_p=0.8, temperature=0.6),
    "min_p": lambda b: dict(min_p=0.2),
    "typical_p": lambda b: dict(typical_p=0.5),
    "epsilon_cutoff": lambda b: dict(epsilon_cutoff=0.05),
    "eta_cutoff": lambda b: dict(eta_cutoff=0.05),
    "stop_strings": lambda b: dict(stop_strings=[_ascii_pair(b)]),
}
# the greedy run is the plain run for these, only sampling reads them (generate() ignores them greedy too)
SAMPLING_ONLY = {"top_k_top_p_temperature", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                 "renormalize_logits"}


def _model_generate(model, ids, kw, tokenizer=None):
    kw = dict(kw)
    seed = kw.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    extra = {"tokenizer": tokenizer} if tokenizer is not None else {}
    out = model.generate(ids, **kw, **extra)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def plain(llama):
    ids = prompt_ids(12)
    return {mode: _model_generate(llama, ids, {"max_new_tokens": N_NEW, "eos_token_id": None, **_gen_kw(mode)})
            for mode in GEN_KW}


def _gen_kw(mode: str) -> dict:
    kw = dict(GEN_KW[mode])
    if mode == "sampled":
        kw["seed"] = SEED
    return kw


@pytest.mark.parametrize(("case", "mode"), [(c, m) for c in sorted(CASES) for m in ("greedy", "sampled")
                                            if m == "sampled" or c not in SAMPLING_ONLY])
def test_each_setting_gives_model_generates_tokens(case, mode, llama, plain, tmp_path):
    ids = prompt_ids(12)
    kw = {"max_new_tokens": N_NEW, "eos_token_id": None, **_gen_kw(mode), **CASES[case](plain[mode])}
    if mode == "sampled" and case in SAMPLING_ONLY:
        kw.pop("top_k"), kw.pop("top_p"), kw.pop("temperature")  # the case's own warper only
        kw.update(CASES[case](plain[mode]))
    tok = byte_tokenizer() if case == "stop_strings" else None
    ref = _model_generate(llama, ids, kw, tok)
    with Session(llama, tmp_path / "log", tok, max_cache_len=64) as s:
        got = s.generate(ids, **kw)
    assert got == ref, (case, mode)
    if case != "forced_bos_token_id" and not (mode == "sampled" and case in SAMPLING_ONLY):
        assert got != plain[mode], f"{case} did not change the tokens: the test would not see it ignored"


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_a_generation_config_object(mode, llama, tmp_path):
    from transformers import GenerationConfig

    ids = prompt_ids(12)
    b = _model_generate(llama, ids, {"max_new_tokens": N_NEW, "eos_token_id": None, **_gen_kw(mode)})
    gc = GenerationConfig(max_new_tokens=N_NEW, do_sample=mode == "sampled", top_k=9, temperature=0.7,
                          eos_token_id=b[2], min_new_tokens=6, no_repeat_ngram_size=2)
    torch.manual_seed(SEED)
    ref = llama.generate(ids, generation_config=gc)[0, 12:].tolist()
    with Session(llama, tmp_path / "log") as s:
        got = s.generate(ids, generation_config=gc, seed=SEED)
    assert got == ref and got != b
    assert gc.max_new_tokens == N_NEW and gc.min_length is None  # the caller's object is not changed


def test_defaults_come_from_the_models_generation_config(tmp_path):
    """Like generate(): what the call leaves unset comes from model.generation_config (here top_k and
    temperature, with do_sample passed); Session's own defaults are only 64 new tokens and greedy."""
    model = tiny_model("qwen3")
    model.generation_config.top_k, model.generation_config.temperature = 4, 0.5
    ids = prompt_ids(12)
    torch.manual_seed(SEED)
    ref = model.generate(ids, max_new_tokens=N_NEW, do_sample=True, eos_token_id=None)[0, 12:].tolist()
    with Session(model, tmp_path / "log") as s:
        assert s.generate(ids, max_new_tokens=N_NEW, do_sample=True, eos_token_id=None, seed=SEED) == ref
        greedy = s.generate(ids, eos_token_id=None)
        assert s.gen.settings.max_new_tokens == 64 and not s.gen.settings.do_sample
    assert greedy == model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None)[0, 12:].tolist()


def test_no_eos_on_a_model_without_eos_or_pad_token(tmp_path):
    """eos_token_ids=() (the Session's spelling of "never stop early") on a model whose config names neither an
    eos nor a pad token: the full max_new_tokens, equal to generate() with no eos (it was an IndexError from
    transformers' special-token setup)."""
    model = tiny_model("qwen3")
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = cfg.pad_token_id = None
    ids = prompt_ids(12)
    ref = model.generate(ids, max_new_tokens=N_NEW, do_sample=False)[0, 12:].tolist()
    with Session(model, tmp_path / "log") as s:
        assert s.generate(ids, max_new_tokens=N_NEW, eos_token_ids=()) == ref
    assert len(ref) == N_NEW


@pytest.mark.parametrize(("kw", "named"), [
    (dict(foo_bar=3), "'foo_bar'"),
    (dict(num_beams=2), "num_beams=2"),
    (dict(max_time=5.0), "max_time=5.0"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores=True"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(guidance_scale=1.5), "guidance_scale=1.5"),
    (dict(use_cache=False), "use_cache=False"),
    (dict(logits_processor=[lambda ids, s: s]), "'logits_processor'"),
    (dict(streamer=object()), "on_token"),
    (dict(stop_strings=["ab"]), "tokenizer="),
    (dict(attention_mask=torch.tensor([[0] + [1] * 11])), "padding"),
    (dict(eos_token_id=3, eos_token_ids=[3]), "not both"),
    (dict(temperature=-1.0, do_sample=True), "temperature"),
])
def test_unsupported_settings_are_refused_by_name(kw, named, llama, tmp_path):
    with Session(llama, tmp_path / "log") as s:
        with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
            s.generate(prompt_ids(12), max_new_tokens=4, **kw)
        assert s.runtime.epoch is None  # refused before anything was logged


def test_an_unsupported_field_of_the_models_generation_config_is_refused(tmp_path):
    model = tiny_model("llama")
    model.generation_config.num_beams = 3
    with Session(model, tmp_path / "log") as s:
        with pytest.raises(ConfigError, match="num_beams=3.*generation_config"):
            s.generate(prompt_ids(12), max_new_tokens=4)
        assert s.generate(prompt_ids(12), max_new_tokens=4, num_beams=1) == model.generate(
            prompt_ids(12), max_new_tokens=4, num_beams=1)[0, 12:].tolist()


# every rule whose output depends on the prompt length or the ids so far, in one run: a recovered session must
# rebuild them from the log (prompt length, settings) and continue with the same tokens
KILL_SETTINGS = {
    "greedy": dict(min_new_tokens=30, eos_token_id=[7, 9, 11], no_repeat_ngram_size=2, repetition_penalty=1.2,
                   begin_suppress_tokens=[5], suppress_tokens=[4], bad_words_ids=[[3, 6]]),
    "sampled": dict(min_new_tokens=25, eos_token_id=[7, 9], exponential_decay_length_penalty=[30, 1.05],
                    no_repeat_ngram_size=3, typical_p=0.9, min_p=0.05, sequence_bias=[[[8], 2.0]]),
}


@pytest.mark.parametrize("mode", [pytest.param("greedy", marks=pytest.mark.slow), "sampled"])  # sampled: the RNG too
def test_settings_survive_a_sigkill(mode, tmp_path):
    max_new, kill_at = 40, 13
    settings = KILL_SETTINGS[mode]
    log_dir = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, str(HELPERS), str(log_dir), "qwen3", "none", mode, str(max_new), "1", "0.03", "sync",
         json.dumps(settings)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: list[int] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("TOKEN "):
                seen.append(int(line.split()[1]))
                if len(seen) == kill_at:
                    os.kill(child.pid, signal.SIGKILL)
                    break
    finally:
        child.kill()
        child.wait(timeout=30)
    assert len(seen) == kill_at, f"child ended early: {child.stderr.read() if child.stderr else ''}"

    model = tiny_model("qwen3")
    kw = {"max_new_tokens": max_new, **_gen_kw(mode), **settings}
    ref = _model_generate(model, prompt_ids(12), {**kw, "seed": GEN_KW[mode].get("seed")})
    assert len(ref) > kill_at + 2  # the kill was mid-generation
    s = Session.recover(log_dir, model)
    try:
        assert s.gen is not None and not s.gen.done and s.gen.settings.prompt_len == 12
        assert s.ids[12:] == seen[: s.gen.n_new]
        assert s.resume() == ref
    finally:
        s.close()
    with Session(tiny_model("qwen3"), tmp_path / "plain") as p:  # without the settings the tokens differ
        assert p.generate(prompt_ids(12), max_new_tokens=max_new, eos_token_ids=(), **GEN_KW[mode]) != ref


def test_stop_strings_survive_a_recovery(tmp_path):
    """StopStringCriteria is rebuilt after recovery from the logged settings and the tokenizer passed in."""
    model, tok = tiny_model("llama"), byte_tokenizer()
    ids = prompt_ids(12)
    base = _model_generate(model, ids, {"max_new_tokens": 30, "eos_token_id": None, "do_sample": False})
    stop = _ascii_pair(base[6:])
    ref = _model_generate(model, ids, {"max_new_tokens": 30, "eos_token_id": None, "stop_strings": stop}, tok)
    assert 8 < len(ref) < 30
    with Session(model, tmp_path / "log", tok) as s, pytest.raises(_Interrupt):
        s.generate(ids, max_new_tokens=30, eos_token_id=None, stop_strings=stop,
                   on_token=lambda t: _stop_after(s, 5))
    with pytest.raises(ConfigError, match="stop_strings.*tokenizer="):
        Session.recover(tmp_path / "log", model)
    rec = Session.recover(tmp_path / "log", model, tok)
    try:
        assert rec.gen.n_new == 5 and rec.resume() == ref
    finally:
        rec.close()


class _Interrupt(Exception):
    pass


def _stop_after(s: Session, n: int) -> None:
    if s.gen.n_new >= n:
        raise _Interrupt  # the epoch of token n is committed; the process "dies" here
