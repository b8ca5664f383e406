"""The serving engine on CPU: batched paged decoding equals transformers' own generate() per request; seeded
requests draw the same tokens whatever shares their batch; a SIGKILLed engine process is recovered from its log
(twice) and every request finishes token-exact against an uninterrupted engine fed the same arrivals; prefix
hits skip the shared prefill; requests are preempted by priority and resumed equal to generate(); a process
SIGKILLed while requests share blocks and wait preempted is recovered to the uninterrupted engine's exact
scheduling state and tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from concordia_ft.errors import ConfigError, ContextLengthError, QueueFullError, RecoveryError
from concordia_ft.serve import Engine, SamplingParams
from llm_helpers import tiny_model
from serve_workload import OPTIONS, SHARED_OPTIONS, drive, shared_workload, state_digest, workload
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
        # every block went back: to the free list, or (full ones) to the prefix cache's LRU list
        assert not eng.blocks.tables and eng.blocks.n_available == 40 and eng.blocks.n_cached > 0
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


# slow: the openai client's two SIGKILLs of a server (test_serve_client) and the SIGKILL mid-preemption below are
# the fast run's
@pytest.mark.slow
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


# -- prefix caching, growing admission, preemption, priorities ------------------------------------------------

def _generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _finish(eng: Engine) -> None:
    while eng.has_work:
        eng.step()


def test_a_prefix_hit_skips_the_shared_prefill_and_equals_generate() -> None:
    ref, model = tiny_model("llama"), tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, 256, (21,), generator=g).tolist()
    tail = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 6, 2)]
    opts = {"checkpoint": False, "num_blocks": 32, "block_size": 4, "max_model_len": 64, "max_batch_tokens": 64}
    eng = Engine(model, None, opts)
    a = eng.submit(system + tail[0], _greedy(5))
    assert eng.step().batch_tokens == 24
    a_table = list(eng.blocks.tables[a.id])
    _finish(eng)
    assert eng.blocks.n_cached == 7  # 24 prompt + 4 decoded positions computed: 7 full blocks
    b = eng.submit(system + tail[1], _greedy(6))
    assert eng.step().batch_tokens == 27 - 20  # 5 whole blocks of the system prompt were A's
    assert b.n_computed == 27 and eng.blocks.tables[b.id][:5] == a_table[:5] and eng.blocks.hits == 5
    c = eng.submit(system + tail[2], _greedy(4))  # while B runs: the same 5 blocks, two tables each
    eng.step()
    assert eng.blocks.tables[c.id][:5] == a_table[:5]
    assert [eng.blocks.ref(x) for x in a_table[:5]] == [2] * 5
    d = eng.submit(system[:20], _greedy(3))  # all 5 blocks cached: the last one is computed (its last token)
    assert eng.step().batch_tokens == 2 + 4  # B, C decode; D feeds positions 16..19
    assert eng.blocks.tables[d.id][:4] == a_table[:4] and eng.blocks.tables[d.id][4] != a_table[4]
    _finish(eng)
    for r in (a, b, c, d):
        assert r.generated == _generate(ref, r.ids[: r.n_prompt], r.params.max_new_tokens), r.id
    cold = Engine(model, None, {**opts, "prefix_caching": False})
    cold.submit(system + tail[0], _greedy(2))
    _finish(cold)
    cold.submit(system + tail[1], _greedy(2))
    assert cold.step().batch_tokens == 27 and cold.blocks.n_cached == 0


def test_growth_preempts_the_lowest_priority_then_the_latest_and_resumes_equal_to_generate() -> None:
    ref, model = tiny_model("llama"), tiny_model("llama")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (11,), generator=g).tolist() for _ in range(3)]
    eng = Engine(model, None, {"checkpoint": False, "num_blocks": 9, "block_size": 4, "max_model_len": 36,
                               "max_batch_tokens": 64})
    a = eng.submit(prompts[0], _greedy(8), request_id="a")
    b = eng.submit(prompts[1], _greedy(8), request_id="b", priority=1)  # lower priority, earlier arrival
    c = eng.submit(prompts[2], _greedy(8), request_id="c")
    eng.step()  # 3 prefills of 11 tokens (admitted by priority): 3 blocks each, the pool is full; 12 tokens fit
    assert eng.blocks.tables == {"a": [0, 1, 2], "c": [3, 4, 5], "b": [6, 7, 8]} and eng.preempted == 0
    eng.step()  # 13 tokens each: a (best) needs a 4th block: b goes, though c arrived after it
    assert b.status == "waiting" and b.preemptions == 1 and len(b.generated) == 2 and eng.preempted == 1
    # b's full blocks went to the cache (released tail first); a and c evicted its tail, then its middle
    assert eng.blocks.tables == {"a": [0, 1, 2, 8], "c": [3, 4, 5, 7]} and eng.blocks.lru() == [6]
    assert list(eng.waiting) == [b]
    meta = json.loads(eng._meta_json())["concordia.serve"]
    want = eng._meta()
    meta.pop("time"), want.pop("time")
    assert json.loads(json.dumps(want)) == meta and meta["waiting"][0]["preemptions"] == 1
    _finish(eng)
    assert eng.preempted >= 1 and b.preemptions >= 1
    for r in (a, b, c):  # the recomputed request's tokens are generate()'s
        assert r.generated == _generate(ref, prompts["abc".index(r.id)], 8), r.id


def test_a_higher_priority_arrival_preempts_a_running_lower_one() -> None:
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    low, high = (torch.randint(3, 256, (16,), generator=g).tolist() for _ in range(2))
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, seed=5)
    eng = Engine(model, None, {"checkpoint": False, "num_blocks": 8, "block_size": 4, "max_model_len": 32})
    lo = eng.submit(low, sampled, priority=3)
    eng.step()
    assert eng.blocks.tables[lo.id] == [0, 1, 2, 3, 4]  # 17 tokens: its 5th block at the step's end
    peer = eng.submit(list(reversed(low)), _greedy(4), priority=3)  # same priority: waits, preempts nobody
    eng.step()
    assert peer.status == "waiting" and lo.status == "running"
    hi = eng.submit(high, _greedy(4), priority=0)
    eng.step()
    assert hi.status == "running" and lo.status == "waiting" and lo.preemptions == 1 and len(lo.generated) == 2
    assert [r.id for r in eng.waiting] == [lo.id, peer.id]  # back in its place by arrival
    _finish(eng)
    alone = Engine(model, None, {"checkpoint": False, "num_blocks": 8, "block_size": 4, "max_model_len": 32})
    again = alone.submit(low, sampled)
    _finish(alone)
    assert lo.generated == again.generated  # its generator waited with it: the same draws


def test_reserve_admission_holds_whole_budgets_and_never_preempts() -> None:
    ref, model = tiny_model("llama"), tiny_model("llama")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (11,), generator=g).tolist() for _ in range(3)]
    eng = Engine(model, None, {"checkpoint": False, "num_blocks": 9, "block_size": 4, "max_model_len": 36,
                               "max_batch_tokens": 64, "admission": "reserve"})
    reqs = [eng.submit(p, _greedy(8), priority=i % 2) for i, p in enumerate(prompts)]
    eng.step()
    assert [r.status for r in reqs] == ["running", "waiting", "waiting"]  # 5 blocks each: one fits
    assert eng.blocks.tables[reqs[0].id] == [0, 1, 2, 3, 4]
    assert [r.id for r in eng.waiting] == [reqs[2].id, reqs[1].id]  # priority 0 before 1
    _finish(eng)
    assert eng.preempted == 0
    for r, p in zip(reqs, prompts, strict=True):
        assert r.generated == _generate(ref, p, 8)
    with pytest.raises(ConfigError, match="admission='fifo'"):
        Engine(model, None, {"checkpoint": False, "admission": "fifo"})


@pytest.fixture(scope="module")
def shared_reference() -> tuple[dict[str, list[int]], dict[int, str]]:
    """The uninterrupted engine on the sharing/preemption workload: its tokens and each step's state digest."""
    eng = Engine(tiny_model("llama"), None, {**SHARED_OPTIONS, "checkpoint": False})
    digests: dict[int, str] = {}
    got = drive(eng, shared_workload(), on_step=lambda o: digests.__setitem__(o.step, state_digest(eng)))
    assert eng.preempted >= 5 and eng.blocks.hits >= 40
    return got, digests


def _run_paused(log_dir: Path, mode: str, pause: int) -> tuple[dict, dict[str, list[int]]]:
    """Run the child until its log ends at step ``pause``, then SIGKILL it: its start event and its tokens."""
    env = subprocess_env()
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen([PYTHON, str(CHILD), str(log_dir), mode, str(pause)], stdout=subprocess.PIPE,
                            text=True, env=env)
    start: dict = {}
    got: dict[str, list[int]] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        ev = json.loads(line)
        if ev["ev"] == "start":
            start = ev
        if ev["ev"] == "step":
            for rid, toks in ev["new"].items():
                got.setdefault(rid, []).extend(toks)
            if ev["step"] == pause:
                proc.send_signal(signal.SIGKILL)
                break
    assert proc.wait(timeout=60) == -signal.SIGKILL
    return start, got


def _mid_preemption_and_sharing(eng: Engine) -> bool:
    shared = any(eng.blocks.ref(b) > 1 for b in range(eng.blocks.num_blocks))
    return shared and any(r.generated for r in eng.waiting) and eng.blocks.n_evictable > 0


def test_sigkilled_mid_preemption_and_sharing_recovers_the_schedule_token_exact(
        shm_dir: Path, shared_reference: tuple[dict[str, list[int]], dict[int, str]]) -> None:
    reference, digests = shared_reference
    log = shm_dir / "log"
    _, before = _run_paused(log, "new-shared", 6)
    # the second process writes its epochs with the pipelined C step writer (a step ahead of its outputs)
    start, middle = _run_paused(log, "recover-shared-c-async", 13)
    # the recovered engine stood exactly where the uninterrupted one stood after step 6: tables, cache, LRU, queue
    assert start["step"] == 6 and start["state"] == digests[6]
    for rid, toks in before.items():
        assert reference[rid][: len(toks)] == toks and start["have"][rid] >= len(toks), rid
    for rid, toks in middle.items():
        n = start["have"].get(rid, 0)
        assert reference[rid][n: n + len(toks)] == toks, rid
    eng = Engine.recover(log, tiny_model("llama"), SHARED_OPTIONS)
    assert eng.step_no >= 13 and state_digest(eng) == digests[eng.step_no]
    assert _mid_preemption_and_sharing(eng)  # blocks named by two tables, preempted requests with tokens waiting
    got = drive(eng, shared_workload())
    eng.close()
    assert got == reference


def test_recovery_refuses_inconsistent_block_state(shm_dir: Path) -> None:
    """A log whose block tables and cache no correct engine writes (committed through the real writer from a
    damaged in-memory state) is refused by Engine.recover before anything is restored."""
    model = tiny_model("llama")
    for i, damage in enumerate(("owned twice", "cached under a key")):
        log = shm_dir / f"log{i}"
        eng = Engine(model, log, SHARED_OPTIONS)
        for _step, rid, prompt, params, prio in shared_workload()[:4]:
            eng.submit(prompt, params, request_id=rid, priority=prio)
        for _ in range(3):
            eng.step()
        ids = sorted(eng.running)
        if damage == "owned twice":
            private = next(b for b in eng.blocks.tables[ids[0]] if eng.blocks.hash_of(b) is None)
            eng.blocks.tables[ids[1]][-1] = private
        else:
            b = next(b for b in eng.blocks.tables[ids[0]] if eng.blocks.hash_of(b) is not None)
            old = eng.blocks._hash_of[b]
            del eng.blocks._block_of[old]
            eng.blocks._hash_of[b] = bytes(16)
            eng.blocks._block_of[bytes(16)] = b
            eng.blocks._version += 1
        for r in eng.running.values():
            r._frag_key = None
        eng.checkpoint()
        eng.close()
        with pytest.raises(RecoveryError, match=damage):
            Engine.recover(log, model, SHARED_OPTIONS)


@pytest.mark.slow  # a whole engine under Triton's interpreter: minutes on two cores
def test_under_the_invariant_engine_a_hit_and_a_recompute_hold_a_fresh_prefills_bytes() -> None:
    """invariant=True (Triton's interpreter on the CPU, a process of its own): a prefix hit's K/V rows equal a
    fresh prefill's byte for byte, and so do a preempted request's recomputed rows its decoded ones."""
    pytest.importorskip("triton")
    r = subprocess.run([PYTHON, str(REPO / "tests" / "prefix_invariant_case.py")], capture_output=True, text=True,
                       env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().endswith("ok")
