"""Standby: a session slot warmed up before any log is read (the arena allocated, on CUDA the decode graph
captured). A recovery into it restores the same bytes a plain recovery does, into the standby's own arena, and
continues with the uninterrupted run's tokens (greedy and seeded); a damaged log raises before any token; a
standby of another geometry, or one already used, is refused before anything is restored. The graph half runs
on the GPU (tests/gpu/test_standby_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from concordia_ft.core.replay import ReplayOptions, replay  # noqa: E402
from concordia_ft.errors import ConfigError, LogCorruptError  # noqa: E402
from concordia_ft.session import SESSION_DEFER_VERIFY, Session, Standby  # noqa: E402
from llm_helpers import GEN_KW, prompt_ids, tiny_model  # noqa: E402

MAX_LEN = 96
NEW = 30
CUT = 13  # tokens shown before the writer "dies"


class _Die(Exception):
    pass


def _write(log: Path, model, mode: str) -> tuple[list[int], bytes]:
    """A session abandoned after CUT tokens; returns its ids and the live arena's bytes."""
    s = Session(model, log, max_cache_len=MAX_LEN, backend="dram", runtime_options={"compact_after_bytes": None})
    n = [0]

    def on_token(tok: int) -> None:
        n[0] += 1
        if n[0] == CUT:
            raise _Die

    with pytest.raises(_Die):
        s.generate(prompt_ids(12), max_new_tokens=NEW, eos_token_ids=(), on_token=on_token, **GEN_KW[mode])
    ids, arena = s.ids, s.cache.arena.numpy().tobytes()
    s.close()
    return ids, arena


def _uninterrupted(tmp: Path, model, mode: str) -> list[int]:
    with Session(model, tmp, max_cache_len=MAX_LEN) as s:
        return s.generate(prompt_ids(12), max_new_tokens=NEW, eos_token_ids=(), **GEN_KW[mode])


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_recovery_into_a_standby_restores_its_arena_and_continues_exactly(shm_dir: Path, mode: str) -> None:
    model = tiny_model("qwen3")
    ids, arena = _write(shm_dir / "log", model, mode)
    want = _uninterrupted(shm_dir / "ref", model, mode)
    sb = Standby(model, max_cache_len=MAX_LEN)
    assert sb.decoder is None and "CUDA" in (sb.why_no_graph or "")  # a CPU model: the arena only
    mine = sb.cache.arena
    r = Session.recover(shm_dir / "log", model, standby=sb)
    assert sb.consumed and r.cache.arena is mine  # restored into the standby's tensor, not a new one
    assert r.ids == ids
    used = (r.n_tokens - 1) * r.cache.geometry.sections[0].row_bytes
    assert r.cache.arena.numpy().tobytes()[:used] == arena[:used]
    ph = r.recovery_phases
    assert ph["total_s"] >= ph["open_s"] > 0 and ph["graph_ready"] is False
    assert r.resume() == want
    r.close()


def test_standby_and_plain_recovery_give_the_same_bytes_and_tokens(shm_dir: Path) -> None:
    model = tiny_model("llama")
    _write(shm_dir / "log", model, "greedy")
    outs = []
    for k, sb in enumerate((None, Standby(model, max_cache_len=MAX_LEN))):
        d = shm_dir / f"copy{k}"
        import shutil

        shutil.copytree(shm_dir / "log", d)
        (d / "LOCK").unlink(missing_ok=True)
        r = Session.recover(d, model, standby=sb)
        arena = r.cache.arena.clone()
        outs.append((arena, r.resume(), r.ids))
        r.close()
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1:] == outs[1][1:]


def test_a_new_session_on_a_standby_starts_from_a_zeroed_arena(shm_dir: Path) -> None:
    model = tiny_model("qwen3")
    want = _uninterrupted(shm_dir / "ref", model, "greedy")
    sb = Standby(model, max_cache_len=MAX_LEN)
    sb.cache.arena.fill_(7)  # whatever a warm-up left there
    sb.cache.set_lengths([5] * len(sb.cache.layers))
    with Session(model, shm_dir / "log", max_cache_len=MAX_LEN, standby=sb) as s:
        assert s.cache.lengths() == [0] * len(s.cache.layers)
        assert s.generate(prompt_ids(12), max_new_tokens=NEW, eos_token_ids=()) == want
    r = Session.recover(shm_dir / "log", model)
    assert r.ids[12:] == want
    r.close()


def test_a_standby_of_another_geometry_or_used_twice_is_refused_and_the_log_stays_usable(shm_dir: Path) -> None:
    model = tiny_model("qwen3")
    _write(shm_dir / "log", model, "greedy")
    with pytest.raises(ConfigError, match="max_cache_len=128"):
        Session.recover(shm_dir / "log", model, standby=Standby(model, max_cache_len=128))
    with pytest.raises(ConfigError, match="another model"):
        Session.recover(shm_dir / "log", model, standby=Standby(tiny_model("qwen3"), max_cache_len=MAX_LEN))
    sb = Standby(model, max_cache_len=MAX_LEN)
    r = Session.recover(shm_dir / "log", model, standby=sb)  # the refusals left the log unlocked
    r.close()
    with pytest.raises(ConfigError, match="already serves a session"):
        Session.recover(shm_dir / "log", model, standby=sb)
    Session.recover(shm_dir / "log", model).close()


def _damage_kv(log: Path) -> None:
    """Flip one byte in the middle of the largest 'kv' payload (the prefill's KV rows)."""
    res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",)))
    assert res.pending is not None
    c = max(res.pending.deferred, key=lambda c: c.data.nbytes)
    path, offset, head, n = c.path, c.offset, bytes(c.data[:64]), c.data.nbytes
    del c
    res.close()
    raw = bytearray(Path(path).read_bytes())
    at = raw.find(head, offset)
    assert at >= 0
    raw[at + n // 2] ^= 0x10
    Path(path).write_bytes(bytes(raw))


@pytest.mark.parametrize("verify", ["deferred", "at_open"])
@pytest.mark.parametrize("standby", [False, True])
def test_a_damaged_kv_payload_raises_before_any_token(shm_dir: Path, verify: str, standby: bool) -> None:
    assert SESSION_DEFER_VERIFY == ("kv",)  # the default: the KV checksums run with its restore
    model = tiny_model("qwen3")
    _write(shm_dir / "log", model, "greedy")
    _damage_kv(shm_dir / "log")
    opts = {"recovery": {"defer_verify": ()}} if verify == "at_open" else None
    sb = Standby(model, max_cache_len=MAX_LEN) if standby else None
    with pytest.raises(LogCorruptError, match="checksum"):
        Session.recover(shm_dir / "log", model, runtime_options=opts, standby=sb)
    with pytest.raises(LogCorruptError):  # the log was closed (unlocked), and is still refused
        Session.recover(shm_dir / "log", model)
