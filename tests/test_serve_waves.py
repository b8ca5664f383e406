"""A serving engine in steady state: ten successive waves on one engine with step epochs on a DRAM log that
compacts every few waves. The epoch work of a wave stays what the first waves' was (bytes appended, metadata
bytes; no step falls back to the generic path; every segment roll takes a segment prepared ahead; each
compaction's base holds only what live requests need, not the pool's dead rows), the tokens are those of an
engine without a log, and an engine SIGKILLed while a compaction runs recovers token-exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from concordia_ft.core import slotlog
from concordia_ft.serve import Engine
from llm_helpers import tiny_model
from serve_waves import BATCH, OPTIONS, WAVE_STEPS, compact_often, drive_waves, waves
from support import PYTHON, REPO, subprocess_env

pytestmark = pytest.mark.skipif(not slotlog.available(), reason=f"C writer: {slotlog.status()}")

N_WAVES = 10
CHILD = REPO / "tests" / "serve_waves_child.py"


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    eng = Engine(tiny_model("llama"), None, {**OPTIONS, "checkpoint": False, "backend": "file", "keep_finished": 1000})
    return drive_waves(eng, waves(N_WAVES))


def _live_bound(eng: Engine, running: int) -> int:
    """The most a base may hold with ``running`` requests: their blocks' rows and token pages, every generator
    row, the metadata, the epoch's headers."""
    per_req = -(-eng.opts.max_model_len // eng.geo.block_size) * eng.geo.block_size
    return running * per_req * (eng.geo.row_bytes + 512) + eng.rng.buf.nbytes + (256 << 10)


@pytest.mark.parametrize("pipelined", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_ten_waves_keep_the_epoch_work_flat(shm_dir: Path, reference: dict[str, list[int]], pipelined: bool) -> None:
    eng = compact_often(Engine(tiny_model("llama"), shm_dir / "log",
                               {**OPTIONS, "step_epochs": "c", "async_epochs": pipelined}))
    rt, fast = eng.runtime, eng.fast
    assert rt is not None and fast is not None
    arrivals = waves(N_WAVES)
    per_wave: list[dict[str, float]] = []
    got: dict[str, list[int]] = {}
    last = {"bytes": 0, "fallbacks": 0}
    wave_bytes = 0

    def on_step(o):
        nonlocal wave_bytes
        wave_bytes += o.epoch_bytes

    for w in range(N_WAVES):
        part = [a for a in arrivals if a[0] == w * WAVE_STEPS]
        # the wave, then idle steps up to the next wave's arrival (a server between bursts)
        for rid, toks in drive_waves(eng, part, on_step=on_step).items():
            got.setdefault(rid, []).extend(toks)
        while eng.step_no < (w + 1) * WAVE_STEPS - 1:
            on_step(eng.step())
        per_wave.append({"bytes": wave_bytes, "meta": len(eng._meta_json()),
                         "fallbacks": fast.fallbacks - last["fallbacks"]})
        last["fallbacks"] = fast.fallbacks
        wave_bytes = 0
    rt.wait_compaction()  # the last compaction's numbers are in
    assert got == reference
    # no step's epoch went through the generic path, for any reason (compaction seals included)
    assert fast.fallbacks == 0, fast.fallback_reasons
    assert [p["fallbacks"] for p in per_wave] == [0] * N_WAVES
    # the log compacted several times; those that began mid-wave sealed the active segment through the step
    # writer's roll (no lease end), the others at the lease's end between waves
    c = rt.compaction_stats()
    assert c["count"] >= 3, c
    assert fast.seal_rolls >= 1
    # every segment the log started after construction was prepared ahead by the log's worker
    rs = rt.log.roll_stats
    assert rs["rolls"] >= c["count"] and rs["on_the_spot"] == 0, rs
    # each base holds at most what BATCH running requests need (the pool is two waves' worth: a base of the
    # whole pool would be ~twice that)
    base = rt.last_compaction
    assert base is not None and base.compacted
    assert c["bytes_after"] / c["count"] <= _live_bound(eng, BATCH), c
    # flat from the second wave on: the epochs' bytes per wave and the metadata (keep_finished = one wave)
    later = per_wave[1:]
    b = [p["bytes"] for p in later]
    assert max(b) <= 1.05 * min(b), b
    m = [p["meta"] for p in later]
    assert max(m) <= 1.1 * min(m), m
    eng.close()
    # and the log recovers the last state: nothing running, the last wave's outputs
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), {**OPTIONS, "step_epochs": "c"})
    last_ids = {a[1] for a in arrivals if a[0] == (N_WAVES - 1) * WAVE_STEPS}
    assert not rec.running and set(rec.finished) == last_ids
    assert {rid: rec.finished[rid].generated for rid in last_ids} == {rid: reference[rid] for rid in last_ids}
    rec.close()


@pytest.mark.parametrize("prefix_caching", [pytest.param(False, marks=pytest.mark.slow), True])
def test_compaction_drops_the_rows_of_finished_requests(shm_dir: Path, reference: dict[str, list[int]],
                                                        prefix_caching: bool) -> None:
    """Idle after three waves, every block was freed: a compaction's base holds the rows of the blocks the prefix
    cache keeps (live: a later prompt may share them), none of the others (dead: a new owner writes a row before
    anything reads it); the recovered pool is those rows and zeros elsewhere, and the next waves continue
    token-exact."""
    opts = {**OPTIONS, "step_epochs": "c", "prefix_caching": prefix_caching}
    eng = Engine(tiny_model("llama"), shm_dir / "log", opts)
    arrivals = waves(N_WAVES)
    got = drive_waves(eng, [a for a in arrivals if a[0] < 3 * WAVE_STEPS])
    rows = eng.pool.arena.view(eng.geo.slots, eng.geo.row_bytes)
    assert not eng.running and rows.any()  # finished requests' rows are still in the pool
    cached = sorted(int(b) for b, _ in eng.blocks.state()["cached"])
    assert bool(cached) == prefix_caching
    bs = eng.geo.block_size
    live = torch.zeros(eng.geo.slots, dtype=torch.bool)
    for b in cached:
        live[b * bs:(b + 1) * bs] = True
    assert rows[~live].any()  # dead rows the base must not hold
    assert eng.runtime is not None
    res = eng.runtime.compact()
    assert res is not None and res.compacted
    # the header, the metadata, the token pages and the cached blocks' rows; no other row
    assert res.bytes_after <= int(live.sum()) * eng.geo.row_bytes + (16 << 10), res
    pool = rows.clone()
    eng.close()
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), opts)
    got_rows = rec.pool.arena.view(rec.geo.slots, rec.geo.row_bytes)
    assert not got_rows[~live].any() and torch.equal(got_rows[live], pool[live])
    rest = drive_waves(rec, [a for a in arrivals if a[0] >= 3 * WAVE_STEPS])
    rec.close()
    assert {**got, **rest} == reference


def _run_child(log_dir: Path, mode: str, kill_when_compacting: bool) -> tuple[int, dict[str, int],
                                                                          dict[str, list[int]], bool]:
    env = subprocess_env()
    env["PYTHONPATH"] = str(REPO / "tests") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen([PYTHON, str(CHILD), str(log_dir), mode, str(N_WAVES)], stdout=subprocess.PIPE,
                            text=True, env=env)
    got: dict[str, list[int]] = {}
    have: dict[str, int] = {}
    killed_compacting = False
    assert proc.stdout is not None
    for line in proc.stdout:
        ev = json.loads(line)
        if ev["ev"] == "start":
            have = ev["have"]
        if ev["ev"] == "step":
            for rid, toks in ev["new"].items():
                got.setdefault(rid, []).extend(toks)
            if kill_when_compacting and ev["compacting"] and ev["compactions"] >= 1:
                os.kill(proc.pid, signal.SIGKILL)  # from outside, by pid, while its compactor runs
                killed_compacting = True
                break
    return proc.wait(timeout=120), have, got, killed_compacting


def test_sigkill_while_compacting_recovers_token_exact(shm_dir: Path, reference: dict[str, list[int]]) -> None:
    log = shm_dir / "log"
    rc, _, before, killed = _run_child(log, "new", kill_when_compacting=True)
    assert killed and rc == -signal.SIGKILL
    rc, have, after, _ = _run_child(log, "recover", kill_when_compacting=False)
    assert rc == 0
    for rid, toks in before.items():  # what the killed process handed out was logged
        assert reference[rid][: len(toks)] == toks, rid
    for rid, toks in after.items():
        n = have.get(rid, 0)
        assert reference[rid][n: n + len(toks)] == toks, rid
    # every request of the waves got all its tokens across the two processes
    for rid, ref in reference.items():
        if rid in have:  # running or kept at the crash: the log's tokens, then the recovered engine's
            assert have[rid] + len(after.get(rid, [])) == len(ref), rid
        elif len(before.get(rid, [])) == len(ref):  # finished before the crash (its output evicted since)
            assert rid not in after
        else:  # arrived after the last committed step (or waited): all of it from the recovered engine
            assert after.get(rid) == ref, rid


@pytest.mark.parametrize("path", ["c", pytest.param("runtime", marks=pytest.mark.slow)])
def test_finished_outputs_live_in_a_region_not_in_every_epochs_metadata(shm_dir: Path, reference: dict[str, list[int]],
                                                                        path: str) -> None:
    """Ten waves with every output kept (keep_finished 64): the metadata names each finished output by its slot
    of the ``done`` region (a dozen bytes), so it does not grow with their tokens; the outputs recover whole."""
    opts = {**OPTIONS, "step_epochs": path, "keep_finished": 64}
    eng = Engine(tiny_model("llama"), shm_dir / "log", opts)
    arrivals = waves(N_WAVES)
    drive_waves(eng, arrivals[:BATCH])
    one = len(eng._meta_json())
    drive_waves(eng, arrivals[BATCH:])
    assert len(eng.finished) == N_WAVES * BATCH
    many = len(eng._meta_json())
    assert many - one <= 16 * (N_WAVES - 1) * BATCH, (one, many)  # [slot, collected] a finished output
    eng.close()
    rec = Engine.recover(shm_dir / "log", tiny_model("llama"), opts)
    assert {rid: r.generated for rid, r in rec.finished.items()} == reference
    assert {rid: r.finish_reason for rid, r in rec.finished.items()} == {
        rid: r.finish_reason for rid, r in eng.finished.items()}
    rec.close()
