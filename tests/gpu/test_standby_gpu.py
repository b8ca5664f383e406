"""A Standby on the GPU: the decode graph captured before any log is read stays valid after a recovery into
its arena. The first token of resume() comes from a graph replay (no eager step, no capture), the restored arena
holds the live session's committed rows byte for byte, and the continued tokens equal an uninterrupted run's
(greedy: in graph mode; seeded sampling: eager on the same arena); a damaged log raises before any token; a
new session on a standby decodes exactly like a plain one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from concordia_ft.errors import LogCorruptError
from concordia_ft.session import Session, Standby
from support import REPO

sys.path.insert(0, str(REPO / "tests"))
from llm_helpers import GEN_KW, prompt_ids, qwen3_06b_cuda, tiny_model  # noqa: E402

MAX_LEN = 96
NEW = 40
CUT = 17


class _Die(Exception):
    pass


def _abandon(model, log: Path, mode: str, durability: str, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    s = Session(model, log, max_cache_len=MAX_LEN, backend="dram", durability=durability)
    n = [0]

    def on_token(tok: int) -> None:
        n[0] += 1
        if n[0] == CUT:
            raise _Die

    with pytest.raises(_Die):
        s.generate(prompt, max_new_tokens=NEW, eos_token_ids=(), on_token=on_token, **GEN_KW[mode])
    ids, arena = s.ids, s.cache.arena.clone()
    s.close()
    return ids, arena


@pytest.mark.parametrize(("size", "durability"), [("tiny-fp32", "durable"), ("tiny-fp32", "pipelined"),
                                                  ("qwen3-0.6b-bf16", "durable")])
def test_recovery_into_a_standby_decodes_its_first_token_from_the_warm_graph(shm_dir: Path, size: str,
                                                                              durability: str) -> None:
    model = tiny_model("qwen3").cuda() if size == "tiny-fp32" else qwen3_06b_cuda()
    prompt = prompt_ids(12) if size == "tiny-fp32" else torch.randint(0, 1000, (1, 40),
                                                                      generator=torch.Generator().manual_seed(3))
    ref = Session(model, shm_dir / "ref", max_cache_len=MAX_LEN, decode="eager")
    want = ref.generate(prompt, max_new_tokens=NEW, eos_token_ids=())
    ref.close()
    ids, live = _abandon(model, shm_dir / "log", "greedy", durability, prompt)
    sb = Standby(model, max_cache_len=MAX_LEN, durability=durability)
    assert sb.decoder is not None and sb.decoder.graph is not None, sb.why_no_graph
    assert sb.capture_s > 0
    ptr = sb.cache.arena.data_ptr()
    r = Session.recover(shm_dir / "log", model, durability=durability, standby=sb)
    assert r.cache.arena.data_ptr() == ptr and r.recovery_phases["graph_ready"]
    # pipelined: the epochs of up to pipeline_depth shown tokens may be missing (a kill; here the writer is let
    # finish, so usually none are)
    assert r.ids == ids[:len(r.ids)] and len(r.ids) >= len(ids) - (2 if durability == "pipelined" else 0)
    used = (r.n_tokens - 1) * r.cache.geometry.sections[0].row_bytes
    assert torch.equal(r.cache.arena[:used], live[:used])  # the committed rows, byte for byte
    shown: list[int] = []
    out = r.resume(on_token=shown.append)
    assert out == want, next(i for i, (a, b) in enumerate(zip(out, want, strict=True)) if a != b)
    st = r._graph.stats
    # every token after the recovery came from the warm graph: no eager step, no capture in this session
    assert st.epochs == len(shown) and len(r.stats.step_s) == len(shown)
    r.close()
    again = Session.recover(shm_dir / "log", model, decode="eager")  # the graph's epochs are the eager log's
    assert again.ids[prompt.shape[1]:] == want
    again.close()


def test_seeded_sampling_on_a_standby_continues_exactly(shm_dir: Path) -> None:
    model = tiny_model("qwen3").cuda()
    ref = Session(model, shm_dir / "ref", max_cache_len=MAX_LEN)
    want = ref.generate(prompt_ids(12), max_new_tokens=NEW, eos_token_ids=(), **GEN_KW["sampled"])
    ref.close()
    ids, _ = _abandon(model, shm_dir / "log", "sampled", "durable", prompt_ids(12))
    r = Session.recover(shm_dir / "log", model, standby=Standby(model, max_cache_len=MAX_LEN))
    assert r.ids == ids
    assert r.resume() == want  # sampling decodes eagerly on the standby's arena
    r.close()


def test_a_damaged_log_raises_before_any_token_with_a_standby(shm_dir: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from test_session_standby import _damage_kv

    model = tiny_model("qwen3").cuda()
    _abandon(model, shm_dir / "log", "greedy", "durable", prompt_ids(12))
    _damage_kv(shm_dir / "log")
    for opts in (None, {"recovery": {"defer_verify": ()}}):  # checked while streaming (default) / at the open
        sb = Standby(model, max_cache_len=MAX_LEN)
        with pytest.raises(LogCorruptError, match="checksum"):
            Session.recover(shm_dir / "log", model, standby=sb, runtime_options=opts)
        sb.close()


def test_a_new_session_on_a_standby_equals_a_plain_one(shm_dir: Path) -> None:
    model = tiny_model("qwen3").cuda()
    with Session(model, shm_dir / "plain", max_cache_len=MAX_LEN) as s:
        want = s.generate(prompt_ids(12), max_new_tokens=NEW, eos_token_ids=())
    with Session(model, shm_dir / "warm", max_cache_len=MAX_LEN, standby=Standby(model, max_cache_len=MAX_LEN)) as s:
        got = s.generate(prompt_ids(12), max_new_tokens=NEW, eos_token_ids=())
        assert s._graph is not None and s._graph.stats.epochs == NEW - 1  # the prefill's token is eager
    assert got == want
