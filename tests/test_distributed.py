"""concordia_ft.distributed on real processes and real gloo: ranks SIGKILLed (by themselves, at named points,
or by the coordinator at random times), stopped, given collective and sticky CUDA errors; the coordinator
killed too. Every faulty run must give bitwise the result of an uninterrupted run, every member of a
generation must resume from the same committed cut, and no committed cut may be lost.

The pure parts (timeouts, classification, the two-slot prepare log, the commit log) are tested directly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from concordia_ft.distributed import DistOptions, JobResult, run_job
from concordia_ft.distributed.epochs import CommitLog, RankEpochs
from concordia_ft.distributed.health import (
    Action,
    Beat,
    FailureKind,
    classify_exception,
    classify_report,
    classify_silence,
    classify_stopped,
    classify_wedged,
    plan_timeouts,
)
from concordia_ft.distributed.timeline import load_stamps, recovery_phases, service_during_repairs
from concordia_ft.distributed.workloads import ReplicaServe
from concordia_ft.errors import ConfigError, DeviceError, RecoveryError


def _scratch() -> Path:
    root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("/tmp")
    p = root / f"cft-dist-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    p.mkdir()
    return p


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    p = _scratch()
    yield p
    shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- pure
def test_timeouts_come_from_measured_steps() -> None:
    opts = DistOptions(heartbeat_ms=50, heartbeat_misses=20, hang_factor=50, min_progress_timeout_ms=2000)
    t = plan_timeouts([], opts)
    assert (t.heartbeat_timeout_ms, t.progress_timeout_ms) == (1000, 2000)
    t = plan_timeouts([12.0, 80.0, 30.0], opts)
    assert t.progress_timeout_ms == 50 * 80.0 and t.slowest_step_ms == 80.0


def test_silence_is_a_hang_after_its_timeout() -> None:
    opts = DistOptions(heartbeat_ms=50, heartbeat_misses=20)
    t = plan_timeouts([10.0], opts)
    beat = Beat(at_ns=0, step=3, in_step=False, step_started_ns=0)
    assert classify_silence(2, beat, 0, int(999e6), t) is None
    v = classify_silence(2, beat, 0, int(1001e6), t)
    assert v is not None and v.kind is FailureKind.HANG and v.action is Action.KILL_REPLACE and "1001 ms" in v.detail
    busy = Beat(at_ns=int(2.5e9), step=3, in_step=True, step_started_ns=0)
    v = classify_silence(1, busy, int(2.5e9), int(2.5e9), t)
    assert v is not None and "in step 3 for 2500 ms" in v.detail
    assert Beat.decode(busy.encode()) == busy
    # the same time spent blocked in a collective is waiting on a peer: never this rank's hang
    waiting = Beat(at_ns=int(2.5e9), step=3, in_step=True, step_started_ns=0, waiting_ns=int(1e8))
    assert classify_silence(1, waiting, int(2.5e9), int(2.5e9), t) is None
    assert Beat.decode(waiting.encode()) == waiting


def test_a_stopped_peer_is_found_not_the_survivor_waiting_on_it() -> None:
    t = plan_timeouts([10.0], DistOptions(heartbeat_ms=50))
    assert t.stopped_ms == 100
    assert classify_stopped(2, "S", 0, int(5e9), t) is None  # sleeping in a wait: alive
    assert classify_stopped(2, "T", int(1e9), int(1e9 + 50e6), t) is None  # stopped 50 ms: not yet
    v = classify_stopped(2, "T", int(1e9), int(1e9 + 150e6), t)
    assert v is not None and v.kind is FailureKind.HANG and v.action is Action.KILL_REPLACE and "stopped" in v.detail
    # every rank waiting in a collective past the progress timeout, all alive: the communicator, not a rank
    w = [Beat(at_ns=int(3e9), step=4, in_step=True, step_started_ns=0, waiting_ns=int(5e8)) for _ in range(3)]
    v = classify_wedged(w, int(3e9), t)
    assert v is not None and v.kind is FailureKind.COLLECTIVE_ERROR and v.action is Action.REBUILD
    computing = [*w[:2], Beat(at_ns=int(3e9), step=4, in_step=True, step_started_ns=0)]
    assert classify_wedged(computing, int(3e9), t) is None  # one computes: its own progress timeout decides


def test_collective_error_waits_for_a_death_to_explain_it() -> None:
    opts = DistOptions(collective_grace_ms=200)
    rep = {"kind": "collective", "message": "Connection closed by peer"}
    assert classify_report(0, rep, 0, int(100e6), opts, dead=[]) is None  # within the grace
    assert classify_report(0, rep, 0, int(300e6), opts, dead=[3]) is None  # explained by rank 3's death
    v = classify_report(0, rep, 0, int(300e6), opts, dead=[])
    assert v is not None and v.kind is FailureKind.COLLECTIVE_ERROR and v.action is Action.REBUILD
    sticky = classify_report(1, {"kind": "cuda", "sticky": "1", "message": "x"}, 0, 0, opts, dead=[])
    assert sticky is not None and sticky.kind is FailureKind.STICKY_CUDA and sticky.action is Action.KILL_REPLACE


def test_exceptions_are_classified_from_the_driver_table() -> None:
    assert classify_exception(RuntimeError("CUDA error: an illegal memory access was encountered"))[:2] == ("cuda", True)
    assert classify_exception(RuntimeError("CUDA error: out of memory"))[:2] == ("cuda", False)
    assert classify_exception(DeviceError(719, "CUDA_ERROR_LAUNCH_FAILED", True))[:2] == ("cuda", True)
    assert classify_exception(ValueError("bad"))[:2] == ("error", False)


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="backend"):
        DistOptions(backend="mpi")
    with pytest.raises(ConfigError, match="nccl"):
        DistOptions(backend="nccl", device="cpu")
    with pytest.raises(ConfigError, match="standby order"):
        DistOptions.coerce({"standby": {"order": ["lukewarm"]}})
    o = DistOptions.coerce({"world": 3, "standby": {"hot": 2}, "faults": [{"rank": 1, "point": "prepare"}]})
    assert DistOptions.from_json(o.to_json()) == o


def test_prepare_log_rolls_back_an_uncommitted_cut(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(3000, generator=g), "n": torch.zeros(4, dtype=torch.int64)}
    seen = {}
    ep = RankEpochs(tmp_path / "r0", state, fsync="always")
    for cut in range(4):
        state["w"].add_(torch.randn(3000, generator=g))
        state["n"] += cut
        ep.prepare(cut)
        seen[cut] = {k: v.clone() for k, v in state.items()}
    ep.close()
    state2 = {k: torch.zeros_like(v) for k, v in state.items()}
    ep2 = RankEpochs(tmp_path / "r0", state2, fsync="always")
    assert ep2.restore() == [2, 3]
    for cut in (3, 2):  # 3: the newest (committed); 2: 3 was prepared but never committed: rolled back
        ep2.rewind(cut)
        assert all(torch.equal(state2[k], seen[cut][k]) for k in state)
    with pytest.raises(RecoveryError, match="no slot holds cut 1"):
        ep2.rewind(1)
    ep2.close()


def test_commit_log_survives_reopen_and_refuses_gaps(tmp_path: Path) -> None:
    log = CommitLog(tmp_path / "c")
    assert log.cut == -1
    for c in range(3):
        log.commit(c, gen=c // 2)
    with pytest.raises(AssertionError, match="one after another"):
        log.commit(5, gen=1)
    log.close()
    again = CommitLog(tmp_path / "c")
    assert (again.cut, again.gen, again.history) == (2, 1, [0, 1, 2])
    again.close()


# ------------------------------------------------------------------------------------------ processes
def _check_consistent(r: JobResult, world: int, *, replicated: bool = False) -> None:
    """Every member of every generation resumed from that generation's planned cut with the same state
    (``replicated``: each rank has its own state, so only the cut is compared); commits never went backwards
    and never skipped."""
    plans = {int(e["gen"]): e for e in r.events if e["event"] == "plan"}
    for g, members in r.timings.items():
        cuts = {m["resumed_cut"] for m in members}
        assert len(cuts) == 1, f"generation {g}: members resumed from different cuts {cuts}"
        if g in plans:
            assert cuts == {plans[g]["cut"]}
        digests = {m["resume_digest"] for m in members}
        assert replicated or len(digests) == 1, f"generation {g}: members resumed with different states"
    committed = -1
    for e in r.events:
        if e["event"] == "start":
            assert e["cut"] >= committed, f"a restarted coordinator lost committed cut {committed}"
            committed = e["cut"]
        if e["event"] == "commit":
            assert e["cut"] == committed + 1, f"cut {e['cut']} committed after {committed}"
            committed = e["cut"]
        if e["event"] == "plan":
            assert e["cut"] == committed, f"generation {e['gen']} resumes from {e['cut']}, committed {committed}"
    assert len(r.results) == world


DP = {"workload": "dp_lora", "world": 4, "steps": 16, "standby": {"hot": 0}}


@pytest.fixture(scope="module")
def dp_reference(scratch: Path) -> dict:
    r = run_job(scratch / "dp-ref", DP, timeout_s=240)
    assert r.repairs == []
    return r.same_on_every_rank()


def test_rank_killed_at_every_point_gives_the_uninterrupted_result(scratch: Path, dp_reference: dict) -> None:
    faults = [{"rank": 1, "cut": 2, "point": "collective"},  # inside a collective
              {"rank": 2, "cut": 4, "point": "prepare"},  # during its prepare (nothing durable yet)
              {"rank": 3, "cut": 6, "point": "prepared"},  # prepared, not yet published
              {"rank": 0, "cut": 8, "point": "uncommitted"},  # between prepare and commit
              {"rank": 2, "point": "rebuild", "min_gen": 4},  # a survivor, during the rebuild
              {"rank": 1, "cut": 11, "point": "collective", "action": "error"},  # a link error, no death
              {"rank": 3, "cut": 13, "point": "step", "action": "stop"},  # a hang (SIGSTOP)
              {"rank": 0, "cut": 15, "point": "step", "action": "cuda"}]  # a sticky CUDA error (700)
    opts = {**DP, "standby": {"hot": 1}, "faults": faults, "min_progress_timeout_ms": 3000}
    r = run_job(scratch / "dp-faults", opts, timeout_s=300)
    assert r.same_on_every_rank() == dp_reference  # bitwise: losses and the state digest
    kinds = [rep["kind"] for rep in r.repairs]
    assert kinds.count("process-death") >= 5, kinds
    assert {"collective-error", "hang", "sticky-cuda"} <= set(kinds), kinds
    hangs = [rep for rep in r.repairs if rep["kind"] == "hang"]  # the stopped rank, never a peer waiting on it
    assert [rep["ranks"] for rep in hangs] == [[3]] and "stopped" in hangs[0]["detail"], hangs
    _check_consistent(r, 4)
    bound = DistOptions().abort_bound_ms
    aborts = [m["abort_ms"] for ms in r.timings.values() for m in ms if m["role"] == "survivor"]
    assert aborts and max(aborts) <= bound, f"an abort blocked {max(aborts):.1f} ms > {bound} ms"
    phases = recovery_phases(r.repairs, r.timings, r.events)
    assert any(p["standby"] == "hot" for p in phases)


def test_hot_standby_connected_ahead_replaces_a_rank_without_building_a_group(scratch: Path,
                                                                            dp_reference: dict) -> None:
    """Spare groups (DESIGN.md §5c): the ready hot standby and the ranks build, at a boundary ahead of any
    failure, a group per rank it could replace; each of two SIGKILLed ranks is then replaced through the spare
    (no group built during the repair: the repair plan says so, and every member's generation started from a
    connected group), the refilled standby connected ahead again in between, and the result is bitwise the
    uninterrupted run's."""
    kills = [{"rank": 1, "after_cut": 3}, {"rank": 2, "after_cut": 9}]
    r = run_job(scratch / "dp-spare", {**DP, "standby": {"hot": 1, "order": ["hot", "cold"]}, "kills": kills},
                timeout_s=300)
    assert r.same_on_every_rank() == dp_reference
    assert [rep["spare"] for rep in r.repairs] == [True, True], r.repairs
    for rep in r.repairs:
        assert all(m["spare"] for m in r.timings[int(rep["gen"])]), r.timings[int(rep["gen"])]
    _check_consistent(r, 4)
    assert len([e for e in r.events if e["event"] == "spare-ready"]) >= 2


def _run_in_thread(job_dir: Path, opts: dict, **kw: object) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = run_job(job_dir, opts, **kw)  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            out["error"] = e

    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th, out


def _wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _committed(job_dir: Path) -> int:
    path = job_dir / "events.jsonl"
    cuts = [-1]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e["event"] == "commit":
            cuts.append(int(e["cut"]))
    return max(cuts)


def _starts(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e["event"] == "start":
            out.append(e)
    return out


def test_coordinator_killed_from_outside_is_started_again_and_resumes(scratch: Path, dp_reference: dict) -> None:
    """The coordinator is SIGKILLed by pid from outside the job (as the OOM killer or an operator would), once
    after cut 5 and again while its successor is taking the ranks back; ``run_job`` starts it again each time
    on the same directory. The ranks outlive it: every one is kept (no process restarted, no model rebuilt),
    rejoins from the committed cut, and the job ends with the uninterrupted result."""
    job = scratch / "dp-coord"
    th, out = _run_in_thread(job, {**DP, "faults": [{"rank": 2, "cut": 3, "point": "uncommitted"}]}, timeout_s=300)
    _wait_for(lambda: _committed(job) >= 5, "cut 5")
    first = _starts(job)[0]["pid"]
    os.kill(first, signal.SIGKILL)
    _wait_for(lambda: len(_starts(job)) >= 2, "a new coordinator")
    os.kill(_starts(job)[1]["pid"], signal.SIGKILL)  # while it hands the kept ranks their plan
    th.join(300)
    assert "error" not in out, out.get("error")
    r: JobResult = out["result"]
    assert r.coordinator_restarts == 2
    starts = [e for e in r.events if e["event"] == "start"]
    assert len(starts) == 3 and starts[1]["cut"] >= 5 and starts[2]["cut"] >= starts[1]["cut"]
    before = [e["members"] for e in r.events if e["event"] == "plan" and e["t_ns"] < starts[1]["t_ns"]]
    assert sorted(starts[1]["kept"].values()) == sorted(before[-1]), (starts, before)
    # the second kill lands while its coordinator hands the kept ranks their plan: a rank caught between plans
    # may be replaced by the third (seen once under load), never one the second did not keep
    kept2, kept3 = starts[1]["kept"], starts[2]["kept"]
    assert all(kept2.get(slot) == member for slot, member in kept3.items()) and kept3, starts
    assert r.same_on_every_rank() == dp_reference
    _check_consistent(r, 4)


@pytest.mark.slow  # the fast run's repairs are of the data-parallel and replica workloads
def test_tensor_parallel_decode_survives_a_kill(scratch: Path) -> None:
    base = {"workload": "tp_decode", "world": 2, "steps": 10, "standby": {"hot": 0, "warm": 0}}
    ref = run_job(scratch / "tp-ref", base, timeout_s=240).same_on_every_rank()
    kills = [{"rank": 1, "after_cut": 9}]  # sent once the warm standby is up (the commit waits for it)
    faults = [{"rank": 0, "cut": 13, "point": "uncommitted"}]
    r = run_job(scratch / "tp-faults", {**base, "faults": faults, "kills": kills, "standby": {"hot": 0, "warm": 1}},
                timeout_s=240)
    assert r.same_on_every_rank()["tokens"] == ref["tokens"]
    assert r.same_on_every_rank() == ref
    assert ref["tokens"][8:] != [ref["tokens"][8]] * 10  # the decode is not degenerate
    _check_consistent(r, 2)
    assert {s for rep in r.repairs for s in rep["standby"].values()} >= {"warm"}


SERVE = {"workload": "replica_serve", "world": 3, "steps": 60,
         "workload_args": {"requests": 3, "decode_ms": 20, "round_tokens": 4}}
STALL_BOUND_MS = 1000  # the longest a survivor may go without a new token while a replacement is restored


def test_replicas_serve_through_a_repair(scratch: Path) -> None:
    """Partial service: rank 1 of a replicated serving job is SIGKILLed twice: by the coordinator after cut 6
    (replaced by the hot standby: ~0.1 s), then its replacement kills itself inside the progress allreduce of
    cut 14 (no standby left: a cold process, seconds). The replacement restored the committed cut of ~6, so at
    its cut 14 it always has most of its stream left (a survivor, which serves alone through the first repair,
    may already have served its whole stream by its cut 14 on a loaded host: no replacement would then have
    anything to serve). Survivors keep decoding their own requests meanwhile. Every request's tokens equal the
    uninterrupted run's bitwise, no survivor ever produced a token twice (nothing of its own was rolled back),
    no committed cut was lost, and no survivor stalled longer than the bound while a replacement came up."""
    expect = {}  # the uninterrupted run, in this process: a replica's tokens depend on its own stream only
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in every rank (worker.py): the same bits
    for rank in range(SERVE["world"]):
        wl = ReplicaServe(seed=DistOptions().seed, world=SERVE["world"], steps=SERVE["steps"],
                          **{**SERVE["workload_args"], "decode_ms": 0})
        wl.bind(rank)
        while wl.remaining():
            wl.serve_round()
        expect[rank] = wl.result()
    torch.set_num_threads(threads)
    opts = {**SERVE, "standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"], "refill": False},
            "kills": [{"after_cut": 6, "rank": 1}], "faults": [{"rank": 1, "cut": 14, "point": "collective",
                                                               "min_gen": 1}]}
    r = run_job(scratch / "serve-faults", opts, timeout_s=240)
    assert r.results == expect  # every rank's tokens (and state digest), the replaced ranks' included
    assert len({str(v["tokens"]) for v in expect.values()}) == 3  # each rank served its own requests
    assert len(r.repairs) == 2 and all(rep["partial"] for rep in r.repairs), r.repairs
    assert [rep["standby"] for rep in r.repairs] == [{"1": "hot"}, {"1": "cold"}]
    _check_consistent(r, 3, replicated=True)
    stamps = load_stamps(r.job_dir)
    service = service_during_repairs(r.repairs, r.events, stamps)
    assert len(service) == 2, service
    for s in service:
        assert s["survivor_tokens_during"] > 0, s
        assert s["longest_survivor_stall_ms"] <= STALL_BOUND_MS, s
    survivors = {m["wid"] for ms in r.timings.values() for m in ms if m["role"] == "survivor"}
    assert survivors and survivors <= set(stamps)
    for wid in survivors:
        made = [(req, pos) for _, req, pos in stamps[wid]["stamps"]]
        assert len(made) == len(set(made)), f"survivor {wid} produced a token twice: it was rolled back"


@pytest.mark.slow
def test_hundred_random_kills(scratch: Path) -> None:
    """>= 100 SIGKILLs of ranks at random times (any phase: steps, collectives, prepares, rebuilds, restores),
    plus one coordinator kill per job; every job bitwise equal to the uninterrupted run (run with -s to see
    the counts)."""
    opts = {**DP, "steps": 300, "standby": {"hot": 2, "warm": 1}, "max_rebuilds": 64}
    ref = run_job(scratch / "chaos-ref", opts, timeout_s=600).same_on_every_rank()
    total, jobs = 0, 0
    while total < 100 and jobs < 12:
        chaos = {"kills": 25, "seed": jobs, "min_delay_ms": 30, "max_delay_ms": 900}
        job = scratch / f"chaos-{jobs}"
        th, out = _run_in_thread(job, {**opts, "chaos": chaos}, timeout_s=900)
        at = 60 + 30 * (jobs % 5)
        _wait_for(lambda job=job, at=at: _committed(job) >= at, "the cut to kill the coordinator at", 600)
        os.kill(int((job / "coord" / "pid").read_text()), signal.SIGKILL)
        th.join(900)
        assert "error" not in out, out.get("error")
        r = out["result"]
        assert r.same_on_every_rank() == ref, f"job {jobs}: the result differs from the uninterrupted run"
        _check_consistent(r, 4)
        kills = len({e["wid"] for e in r.events if e["event"] == "kill"})  # distinct processes killed
        total += kills
        jobs += 1
        plans = sum(1 for e in r.events if e["event"] == "plan")
        print(f"chaos job {jobs}: {kills} rank processes killed, {r.coordinator_restarts} coordinator kill, "
              f"{plans} repairs, {r.wall_s:.0f} s", flush=True)
    print(f"chaos total: {total} rank kills in {jobs} jobs, each with a coordinator kill", flush=True)
    assert total >= 100


def test_cli_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from concordia_ft.cli.main import main

    cases = [(["--kill", "x"], "use RANK@CUT"), (["--world", "2", "--kill", "5@3"], "ranks 0..1"),
             (["--chaos=-2"], "--chaos -2"), (["--workload", "tp_decode", "--world", "3"], "ffn=256 does not split"),
             (["--workload", "no_such_loop"], "unknown workload 'no_such_loop'"),
             (["--steps", "10", "--kill", "1@10"], "could never fire")]
    for extra, cause in cases:
        assert main(["dist", "run", *extra, "--job-dir", str(tmp_path / "job")]) == 2, extra
        err = capsys.readouterr().err
        assert cause in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) <= 2, err  # the cause in one line (and what to do)
    assert not list(tmp_path.iterdir())  # nothing was started


def test_bad_jobs_are_refused_before_anything_starts(tmp_path: Path) -> None:
    bad = [({"workload": "tp_decode", "world": 3}, "ffn=256 does not split over 3 ranks"),
           ({"workload": "dp_lora", "world": 2, "kills": [{"rank": 7, "after_cut": 3}]}, "ranks 0..1"),
           ({"steps": 10, "kills": [{"rank": 1, "after_cut": 10}]}, "could never fire"),
           ({"kills": [{"rank": 1, "after_cut": -1}]}, "cuts start at 0"),
           ({"workload": "nope"}, "unknown workload 'nope'"),
           ({"workload": "no_such_module_xyz:Loop"}, "cannot import module"),
           ({"workload": "tp_decode", "workload_args": {"layerz": 3}}, "bad argument"),
           ({"chaos": {"kills": -2}}, "must be a count >= 0"),
           ({"chaos": {"kills": 2, "min_delay_ms": 50, "max_delay_ms": 10}}, "min_delay_ms <= max_delay_ms"),
           ({"standby": {"hot": -1}}, "must be >= 0"),
           ({"workload": lambda **kw: None}, "top level of an importable module")]
    for opts, cause in bad:
        with pytest.raises(ConfigError, match=re.escape(cause)):
            run_job(tmp_path / "job", opts)
    assert not list(tmp_path.iterdir())


def _readme_loop(dest: Path) -> Path:
    """The README's own-loop example, written out as the module it tells the user to write."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("```python\n# mytrain.py\n", 1)[1].split("```", 1)[0]
    (dest / "mytrain.py").write_text(block)
    return dest


def test_the_readmes_own_loop_runs_and_survives_a_kill(scratch: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's example loop, as a user writes it, runs as a job named "mytrain:MyLoop"; a rank killed
    inside its collective is replaced, and every rank ends with exactly the weights of the loop computed in
    this process (every rank's step, summed by hand: a reference on fresh data; the allreduce may add the ranks'
    terms in another order, so within float32 rounding), the same on every rank."""
    monkeypatch.syspath_prepend(str(_readme_loop(tmp_path)))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import mytrain  # type: ignore[import-not-found]

    world, steps, seed = 3, 10, 1234
    loops = [mytrain.MyLoop(seed=seed, world=world, steps=steps) for _ in range(world)]
    for r, lp in enumerate(loops):
        lp.bind(r)
    for step in range(steps):  # the reference: all ranks in one process, the allreduce done by hand
        noise = [torch.randn(lp.w.shape, generator=torch.Generator().manual_seed(hash((seed, r, step))))
                 for r, lp in enumerate(loops)]
        total = torch.zeros_like(loops[0].w)
        for lp, n in zip(loops, noise, strict=True):
            total += lp.w - n
        for lp in loops:
            lp.w -= 0.1 * total / world
    want = loops[0].result()
    opts = {"workload": "mytrain:MyLoop", "world": world, "steps": steps, "seed": seed,
            "standby": {"hot": 0, "order": ["cold"]}, "faults": [{"rank": 1, "cut": 4, "point": "collective"}]}
    r = run_job(scratch / "readme-loop", opts, timeout_s=240)
    got = r.same_on_every_rank()
    assert got["w_sum"] == pytest.approx(want["w_sum"], rel=1e-5, abs=1e-4) and got["w_sum"] != 0
    assert [rep["kind"] for rep in r.repairs] == ["process-death"]
    _check_consistent(r, world)
