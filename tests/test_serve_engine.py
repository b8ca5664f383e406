"""The serving engine on CPU: batched paged decoding equals transformers' own generate() per request; seeded
requests draw the same tokens whatever shares their batch; a SIGKILLed engine process is recovered from its log
(twice) and every request finishes token-exact against an uninterrupted engine fed the same arrivals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from concordia_ft.errors import ContextLengthError, QueueFullError, RecoveryError
from concordia_ft.serve import Engine, SamplingParams
from llm_helpers import tiny_model
from serve_workload import OPTIONS, drive, workload
from support import PYTHON, REPO, subprocess_env

CHILD = REPO / "tests" / "serve_engine_child.py"


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """The uninterrupted engine's tokens for the workload (no log)."""
    eng = Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False})
    return drive(eng, workload())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batched_paged_greedy_equals_generate(family: str, shm_dir: Path) -> None:
    ref, model = tiny_model(family), tiny_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 19, 3, 12, 7)]
    opts = {"num_blocks": 40, "block_size": 4, "max_batch_tokens": 16, "max_model_len": 64}
    with Engine(model, shm_dir / "log", opts) as eng:
        reqs = [eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in prompts[:3]]
        eng.step()  # the late ones join a running batch (continuous batching), the 19-token prompt is chunked
        reqs += [eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.0)) for p in prompts[3:]]
        while eng.has_work:
            eng.step()
        assert eng.blocks.n_free == 40  # every block went back to the free list
    for p, r in zip(prompts, reqs, strict=True):
        want = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist()
        assert r.generated == want, r.id


def test_seeded_request_does_not_depend_on_its_batch() -> None:
    model = tiny_model("llama")
    p = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=11)
    prompt = list(range(10, 30))
    alone = Engine(model, None, {"checkpoint": False, "max_model_len": 128})
    r = alone.submit(prompt, p)
    while alone.has_work:
        alone.step()
    crowd = Engine(model, None, {"checkpoint": False, "max_model_len": 128})
    others = [crowd.submit(list(range(3 + i, 9 + 2 * i)), SamplingParams(max_new_tokens=20, temperature=1.0,
                                                                          seed=i)) for i in range(5)]
    crowd.step()
    r2 = crowd.submit(prompt, p)
    while crowd.has_work:
        crowd.step()
    assert r.generated == r2.generated
    assert len({tuple(o.generated) for o in others}) == 5  # different seeds, different draws


def test_one_epoch_per_step_logs_only_the_rows_written(shm_dir: Path) -> None:
    model = tiny_model("llama")
    with Engine(model, shm_dir / "log", {"num_blocks": 64, "block_size": 8, "max_model_len": 128}) as eng:
        row = eng.geo.row_bytes
        eng.submit(list(range(3, 23)), SamplingParams(max_new_tokens=8, temperature=0.0))
        eng.submit(list(range(5, 9)), SamplingParams(max_new_tokens=8, temperature=0.0))
        first = eng.step()
        assert eng.runtime.last_stats.region_pages["kv"] * eng.geo.page_bytes == 24 * row  # 20 + 4 prompt rows
        e0 = first.epoch
        second = eng.step()
        assert second.epoch == e0 + 1
        assert eng.runtime.last_stats.region_pages["kv"] * eng.geo.page_bytes == 2 * row  # one row each
        assert "rng" not in eng.runtime.last_stats.region_pages or not eng.runtime.last_stats.region_pages["rng"]


def test_over_long_and_queue_full_are_refused() -> None:
    eng = Engine(tiny_model("llama"), None, {"checkpoint": False, "max_model_len": 32, "max_waiting": 1})
    with pytest.raises(ContextLengthError, match="maximum context length is 32"):
        eng.submit(list(range(3, 30)), SamplingParams(max_new_tokens=8))
    eng.submit([5, 6], SamplingParams(max_new_tokens=4))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        eng.submit([5, 6], SamplingParams(max_new_tokens=4))


def _run_child(log_dir: Path, mode: str, kill_after_steps: int | None
               ) -> tuple[int, dict[str, int], dict[str, list[int]]]:
    """Run the workload child; SIGKILL it once it reported ``kill_after_steps`` steps. Returns the wait status,
    how many tokens of each request the engine held when it started, and the tokens it reported after (each
    committed before it was printed)."""
    env = subprocess_env()
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen([PYTHON, str(CHILD), str(log_dir), mode], stdout=subprocess.PIPE, text=True, env=env)
    got: dict[str, list[int]] = {}
    have: dict[str, int] = {}
    steps = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        ev = json.loads(line)
        if ev["ev"] == "start":
            have = ev["have"]
        if ev["ev"] == "step":
            for rid, toks in ev["new"].items():
                got.setdefault(rid, []).extend(toks)
            steps += 1
            if kill_after_steps is not None and steps >= kill_after_steps:
                proc.send_signal(signal.SIGKILL)
                break
    return proc.wait(timeout=60), have, got


def test_sigkilled_engine_recovers_token_exact_twice(shm_dir: Path, reference: dict[str, list[int]]) -> None:
    log = shm_dir / "log"
    rc, _, before = _run_child(log, "new", kill_after_steps=9)
    assert rc == -signal.SIGKILL
    rc, have, middle = _run_child(log, "recover", kill_after_steps=7)  # a recovered engine killed again
    assert rc == -signal.SIGKILL
    assert have and any(have.values())
    for rid, toks in before.items():  # what the killed process handed out is the truth, and was logged
        assert reference[rid][: len(toks)] == toks, rid
        assert have.get(rid, 0) >= len(toks), rid
    for rid, toks in middle.items():  # the recovered one continued each request where the log left it
        n = have.get(rid, 0)
        assert reference[rid][n: n + len(toks)] == toks, rid
    eng = Engine.recover(log, tiny_model("llama"), OPTIONS)
    assert eng.recovered_epoch is not None and (eng.running or eng.waiting)
    assert any(eng.get(rid) is not None and eng.get(rid).generated for rid in reference)
    got = drive(eng, workload())
    eng.close()
    assert got == reference
    assert sum(len(t) for t in reference.values()) > 100


def test_recovery_refuses_a_different_model(shm_dir: Path) -> None:
    with Engine(tiny_model("llama"), shm_dir / "log", {"max_model_len": 64, "num_blocks": 16}) as eng:
        eng.submit([3, 4, 5], SamplingParams(max_new_tokens=4))
        eng.step()
    with pytest.raises(RecoveryError, match="not the one that wrote"):
        Engine.recover(shm_dir / "log", tiny_model("llama", seed=1))


def test_a_damaged_kv_record_is_refused_before_any_block_is_served(shm_dir: Path) -> None:
    log = shm_dir / "log"
    with Engine(tiny_model("llama"), log, {"num_blocks": 32, "block_size": 8, "max_model_len": 128}) as eng:
        first_end = next(log.glob("incr.*.cft")).stat().st_size  # the engine's first epoch (definitions, no rows)
        eng.submit(list(range(3, 40)), SamplingParams(max_new_tokens=30, temperature=0.0))
        for _ in range(12):
            eng.step()
    seg = next(log.glob("incr.*.cft"))
    data = bytearray(seg.read_bytes())
    data[first_end + 5904] ^= 0x40  # inside the first step's KV rows (37 prompt rows of 512 bytes)
    seg.write_bytes(bytes(data))
    from concordia_ft.errors import LogCorruptError

    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
        Engine.recover(log, tiny_model("llama"))


def test_a_pinned_mirror_is_refused_up_front_where_it_cannot_work(shm_dir: Path) -> None:
    """EngineOptions.mirror needs a CUDA model and a DRAM log: a CPU engine is refused before any log exists,
    and a recovery asking for one is refused before the log is touched (its bytes stay as they were)."""
    from concordia_ft.errors import ConfigError

    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="mirror.*CUDA model"):
        Engine(model, shm_dir / "m", {**OPTIONS, "mirror": True, "backend": "dram"})
    assert not (shm_dir / "m").exists() or not any((shm_dir / "m").iterdir())
    eng = Engine(model, shm_dir / "log", OPTIONS)
    eng.submit([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.close()
    before = {p.name: p.read_bytes() for p in (shm_dir / "log").iterdir() if p.is_file()}
    with pytest.raises(ConfigError, match="mirror.*CUDA model"):
        Engine.recover(shm_dir / "log", model, {"mirror": True})
    assert {p.name: p.read_bytes() for p in (shm_dir / "log").iterdir() if p.is_file()} == before
