"""Session: token-identical to model.generate(), and a SIGKILLed generating process recovered in another
process finishes with exactly the tokens the uninterrupted run produces (greedy and seeded sampling)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import concordia_ft as cft  # noqa: E402
from concordia_ft.errors import CompactionError, CompactionWarning, ConfigError, RecoveryError  # noqa: E402
from concordia_ft.session import Session  # noqa: E402
from faults import FullDiskForBases  # noqa: E402
from llm_helpers import GEN_KW, prompt_ids, tiny_model  # noqa: E402

HELPERS = Path(__file__).with_name("llm_helpers.py")
SRC = Path(__file__).resolve().parents[1] / "src"


def _reference(family, window, mode, max_new, tmp_path):
    model = tiny_model(family, sliding_window=window)
    with Session(model, tmp_path / "ref", max_cache_len=96) as s:
        toks = s.generate(prompt_ids(12), max_new_tokens=max_new, eos_token_ids=(), **GEN_KW[mode])
    return model, toks


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_equals_model_generate(family, mode, tmp_path):
    model = tiny_model(family)
    ids = prompt_ids(12)
    kw = dict(GEN_KW[mode])
    seed = kw.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    ref = model.generate(ids, max_new_tokens=24, eos_token_id=None, **kw)[0, 12:].tolist()
    with Session(model, tmp_path / "log") as s:
        got = s.generate(ids, max_new_tokens=24, eos_token_ids=(), **GEN_KW[mode])
    assert got == ref
    assert len(set(got)) > 3


@pytest.mark.parametrize(("family", "window", "mode", "every", "epochs"), [
    ("qwen3", 5, "sampled", 1, "sync"),  # sliding-window layer rolls during the run; the sampler state is restored
    ("llama", None, "sampled", 1, "async"),  # decode epochs committed by the background writer
    pytest.param("llama", None, "greedy", 1, "sync", marks=pytest.mark.slow),
    pytest.param("llama", None, "sampled", 3, "sync", marks=pytest.mark.slow),  # resume redoes up to 2 tokens
])
def test_sigkill_mid_generate_then_recover(family, window, mode, every, epochs, tmp_path):
    max_new = 40
    log_dir = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen(
        [sys.executable, str(HELPERS), str(log_dir), family, str(window).lower(), mode, str(max_new), str(every),
         "0.03", epochs], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: list[int] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith("TOKEN "):
                seen.append(int(line.split()[1]))
                if len(seen) == 13:
                    os.kill(child.pid, signal.SIGKILL)
                    break
    finally:
        child.kill()
        child.wait(timeout=30)
    assert len(seen) == 13, f"child ended early: {child.stderr.read() if child.stderr else ''}"
    assert child.returncode == -signal.SIGKILL

    model, ref = _reference(family, window, mode, max_new, tmp_path)
    s = Session.recover(log_dir, model)
    assert s.gen is not None and not s.gen.done
    lag = 1 if epochs == "async" else 0  # an async token's epoch commits while the next one is computed
    assert 13 - every - lag <= s.gen.n_new < max_new  # killed mid-answer, after the 13th token was printed
    committed = s.ids[s.gen.start:]
    assert committed == ref[: len(committed)] == seen[: len(committed)]
    got = s.resume()
    s.close()
    assert got == ref
    assert seen == ref[: len(seen)]


def test_recover_rejects_a_different_model(tmp_path):
    model = tiny_model("llama")
    with Session(model, tmp_path / "log") as s:
        s.generate(prompt_ids(8), max_new_tokens=4, eos_token_ids=())
    with pytest.raises(RecoveryError, match="fingerprint"):
        Session.recover(tmp_path / "log", tiny_model("llama", seed=1))


def test_new_session_refuses_an_existing_log(tmp_path):
    model = tiny_model("llama")
    with Session(model, tmp_path / "log") as s:
        s.generate(prompt_ids(8), max_new_tokens=2, eos_token_ids=())
    with pytest.raises(ConfigError, match="already holds a log"):
        Session(model, tmp_path / "log")


def test_second_generate_reuses_the_prefix_and_recovers(tmp_path):
    model = tiny_model("qwen3")
    p = prompt_ids(10)
    with Session(model, tmp_path / "log") as s:
        first = s.generate(p, max_new_tokens=6, eos_token_ids=())
        follow = s.ids + [5, 6, 7]
        second = s.generate(follow, max_new_tokens=6, eos_token_ids=())
        cached_before = s.stats.epoch_bytes[-1]
    # the same two calls with the full sequence each time (no reuse) give the same tokens
    with Session(model, tmp_path / "ref") as r:
        assert r.generate(p, max_new_tokens=6, eos_token_ids=()) == first
    ref2 = model.generate(torch.tensor([follow]), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert second == ref2[0, len(follow):].tolist()
    rec = Session.recover(tmp_path / "log", model)
    assert rec.ids == follow + second and rec.resume() == second and cached_before > 0
    rec.close()


def test_recover_refuses_a_log_that_no_session_wrote(tmp_path):
    import numpy as np

    import concordia_ft as cft

    with cft.Runtime(tmp_path / "log") as rt:
        rt.register("a", np.arange(512, dtype=np.int64))
        rt.checkpoint(meta={"something": "else"})
    with pytest.raises(RecoveryError, match="no concordia_ft.Session metadata"):
        Session.recover(tmp_path / "log", tiny_model("llama"))
    assert cft.recover(tmp_path / "log").epoch == 1  # the refused recovery left the log as it was


def test_the_first_epoch_after_recovery_is_a_delta_and_no_host_copy_is_kept(tmp_path):
    model = tiny_model("qwen3")
    with Session(model, tmp_path / "log", max_cache_len=64) as s:
        s.generate(prompt_ids(12), max_new_tokens=5, eos_token_ids=())
        n_tokens, arena = s.n_tokens, s.cache.arena.clone()
    rec = Session.recover(tmp_path / "log", model)
    try:
        assert rec.n_tokens == n_tokens and torch.equal(rec.cache.arena, arena)
        assert rec.recovered.images == {}  # restored into the arena and token buffers: no second copy held
        rec.generate(rec.ids, max_new_tokens=1, eos_token_ids=())  # the same sequence: reuses the cache
        # restored bytes are the baseline: one row of KV (its blocks), the token block and the sampler
        # state, not the whole arena that recovery wrote
        st = rec.runtime.last_stats
        kv_pages = -(-rec.cache.geometry.nbytes // 4096)
        assert kv_pages >= 8 and 1 <= st.region_pages["kv"] <= 2 and st.region_pages["tokens"] == 1, st
    finally:
        rec.close()


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_async_epochs_log_what_sync_epochs_log(mode, tmp_path):
    """Async decode epochs: the same tokens, the same recovered state, and every token's epoch committed by the
    time generate() returns (its last one synchronously)."""
    model = tiny_model("qwen3")
    out = {}
    for epochs in ("sync", "async"):
        with Session(model, tmp_path / epochs, max_cache_len=96, durability="pipelined" if epochs == "async" else "durable") as s:
            toks = s.generate(prompt_ids(12), max_new_tokens=20, eos_token_ids=(), **GEN_KW[mode])
            assert s.runtime._inflight is None  # generate() returned with nothing in flight
            assert s.stats.epochs == 1 + 20  # the prompt's, then one per token (async ones recorded once committed)
            last = s.runtime.epoch
            rng = bytes(s.rng[: s.rng_bytes])
        r = Session.recover(tmp_path / epochs, model)
        assert r.gen is not None and r.gen.done and r.gen.n_new == 20 and r.runtime.epoch == last == 21
        assert bytes(r.rng[: r.rng_bytes]) == rng  # (an unseeded session's generator starts from its own state)
        out[epochs] = (toks, r.ids, bytes(r.cache.arena.numpy()), rng if mode == "sampled" else b"")
        r.close()
    assert out["sync"] == out["async"]


def test_a_failed_compaction_warns_and_the_session_goes_on(tmp_path):
    """ENOSPC for every new base (at the log's OS boundary): the Session's threshold compactions all fail; each
    failure is a CompactionWarning and generation goes on token-exact, every epoch kept; a fresh process's
    recovery sees all of them."""
    model, ref = _reference("llama", None, "sampled", 20, tmp_path)
    disk = FullDiskForBases()
    disk.full = True
    opts = {"log_io": disk, "compact_after_bytes": 1, "background_compaction": False}
    with pytest.warns(CompactionWarning, match="No space left") as caught:
        with Session(model, tmp_path / "log", max_cache_len=96, runtime_options=opts) as s:
            got = s.generate(prompt_ids(12), max_new_tokens=20, eos_token_ids=(), **GEN_KW["sampled"])
            epochs = s.runtime.epoch
            assert s.runtime.compaction_error is not None
    assert got == ref and disk.refused >= 5
    assert len([w for w in caught if w.category is CompactionWarning]) >= 5  # one per failure, none lost
    a = np.arange(8192, dtype=np.uint8)
    with cft.Runtime(tmp_path / "plain", fsync="never", compact_after_bytes=1, background_compaction=False,
                     log_io=disk) as rt:  # a plain Runtime keeps its contract: the next checkpoint raises, once
        rt.register("a", a)
        rt.checkpoint()
        a[0] = 1
        with pytest.raises(CompactionError, match="No space left"):
            rt.checkpoint()
        disk.full = False
        assert rt.checkpoint() == rt.epoch and rt.epoch is not None
    code = (f"import sys; sys.path.insert(0, {str(HELPERS.parent)!r}); from llm_helpers import tiny_model; "
            "from concordia_ft.session import Session; "
            f"s = Session.recover({str(tmp_path / 'log')!r}, tiny_model('llama')); print(s.runtime.epoch)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == epochs
