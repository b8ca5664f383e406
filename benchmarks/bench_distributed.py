"""Recovery of a 4-rank data-parallel job after a SIGKILLed rank, per phase: hot / warm / cold standby vs a
full restart (every process new: start + model + restore + group init), all in the same run, interleaved.

Each job is real: a coordinator process holding the store and the commit log, 4 rank processes (dp_lora,
gloo on CPU or NCCL on one GPU with a host id per process), standbys per mode. The coordinator SIGKILLs a
rank after chosen cuts, once the previous repair is over and the mode's standby is ready again, and stamps
the kill; phases come from its events and the members' timings (``timeline.recovery_phases``).

Every job's result must equal the uninterrupted reference run's (bitwise), or the benchmark fails.

``--suite partial``: partial service of a replicated serving job (``replica_serve``, 4 ranks each decoding
its own requests): a rank SIGKILLed, replaced from a hot or a cold standby, with survivors serving on
(``partial_service``) against the same job with survivors rewinding and waiting (what a data-parallel job
must do: the baseline), interleaved. Per repair: survivors' new tokens/s during the repair window (kill ->
the replacement's first token) vs the second before the kill, the longest survivor stall, and the time until
the replacement serves again (``timeline.service_during_repairs``). Writes ``distributed_partial-<tag>.json``.

``--suite chaos``: faults from outside the job at random moments (the benchmark process SIGKILLs ranks and the
coordinator by pid, stamping each in faults.jsonl), hot and cold standbys; every job's digest must equal the
uninterrupted run's; phases per repair, and every wait that ended on a timeout (from the logs). Writes
``distributed_chaos-<tag>.json``.

Usage: python benchmarks/bench_distributed.py [--rounds 2] [--kills 3] [--backend gloo|nccl] [--out-dir D]
       python benchmarks/bench_distributed.py --suite chaos [--rounds 2] [--faults 6] [--steps 400]
       python benchmarks/bench_distributed.py --suite partial [--rounds 2] [--kills 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from benchreport import print_table, write_results  # noqa: E402

from concordia_ft.distributed import run_job  # noqa: E402
from concordia_ft.distributed.timeline import (  # noqa: E402
    load_faults,
    load_stamps,
    recovery_phases,
    service_during_repairs,
    stamp_fault,
)

MODES: dict[str, dict[str, Any]] = {
    "hot": {"standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"]}},  # connected ahead (spare groups)
    "hot-build": {"standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"], "preconnect": False}},
    "warm": {"standby": {"hot": 0, "warm": 1, "order": ["warm", "cold"]}},
    "cold": {"standby": {"hot": 0, "warm": 0, "order": ["cold"]}},
    "restart": {"standby": {"hot": 0, "warm": 0, "order": ["cold"]}, "on_failure": "restart"},
}
PARTIAL_MODES: dict[str, dict[str, Any]] = {
    "hot-partial": {"standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"]}, "partial_service": True},
    "hot-stall": {"standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"]}, "partial_service": False},
    "cold-partial": {"standby": {"hot": 0, "warm": 0, "order": ["cold"]}, "partial_service": True},
    "cold-stall": {"standby": {"hot": 0, "warm": 0, "order": ["cold"]}, "partial_service": False},
}
SERVE_ARGS = {"requests": 3, "decode_ms": 20.0, "round_tokens": 4}
PHASES = ("detection_ms", "decide_ms", "abort_ms", "start_ms", "restore_ms", "rebuild_ms", "first_step_ms",
          "total_ms")


def run_partial(a: argparse.Namespace, root: Path) -> Path:
    device = "cuda:0" if a.backend == "nccl" else "cpu"
    base = {"workload": "replica_serve", "world": a.world, "steps": a.tokens, "backend": a.backend,
            "device": device, "fsync": "always", "workload_args": SERVE_ARGS}
    expect = run_job(root / "reference", {**base, "standby": {"hot": 0}}, timeout_s=600).results
    rows: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        for mode, extra in PARTIAL_MODES.items():
            kills = [{"after_cut": 8 + 24 * k, "rank": (rnd + k) % a.world} for k in range(a.kills)]
            r = run_job(root / f"{mode}-{rnd}", {**base, **extra, "kills": kills}, timeout_s=900)
            if r.results != expect:
                raise SystemExit(f"{mode} round {rnd}: the tokens differ from the uninterrupted run")
            for x in service_during_repairs(r.repairs, r.events, load_stamps(r.job_dir)):
                x["ratio_during_vs_before"] = (x["survivor_tps_during"] / x["survivor_tps_before"]
                                               if x["survivor_tps_before"] else None)
                rows.append({"mode": mode, "round": rnd, **x})
            print(f"round {rnd} {mode}: {len(r.repairs)} repairs, wall {r.wall_s:.1f} s", flush=True)
    summary = []
    for mode in PARTIAL_MODES:
        sel = [x for x in rows if x["mode"] == mode]
        med = {k: statistics.median(x[k] for x in sel) if sel else None
               for k in ("survivor_tps_before", "survivor_tps_during", "ratio_during_vs_before", "serve_again_ms",
                         "longest_survivor_stall_ms")}
        summary.append({"mode": mode, "n": len(sel), **med,
                        "max_survivor_stall_ms": max((x["longest_survivor_stall_ms"] for x in sel), default=None)})
    notes = (f"{a.world} ranks, replica_serve (each rank its own {SERVE_ARGS['requests']} requests x {a.tokens} "
             f"new tokens, a decode step paced at >= {SERVE_ARGS['decode_ms']} ms, {SERVE_ARGS['round_tokens']} "
             f"tokens per round, one progress allreduce per round = the boundary), {a.backend} on {device}, "
             f"fsync=always; a rank SIGKILLed by the coordinator {a.kills}x per job, {a.rounds} interleaved rounds. "
             "partial: survivors serve on during the repair; stall: survivors rewind to the committed cut and wait "
             "(the baseline). Throughput counts survivors' new tokens (a replayed token is not new): during = kill "
             "-> replacement's first token, before = the 1 s before the kill. Medians over repairs; every job's "
             "tokens equal the uninterrupted run's. A repair whose dead rank had no work left at the committed "
             "cut has no replacement token (nothing to serve) and no row.")
    path = write_results("distributed_partial", summary, baseline=rows, notes=notes, out_dir=a.out_dir,
                         tag=a.tag or ("cpu" if a.backend == "gloo" else None))
    print_table("partial service during a repair (medians)", summary)
    return path


CHAOS_MODES: dict[str, dict[str, Any]] = {
    "hot": {"standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"]}},
    "cold": {"standby": {"hot": 0, "warm": 0, "order": ["cold"]}},
}


def _committed(job_dir: Path) -> int:
    try:
        lines = (job_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return -1
    cuts = [-1]
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == "commit":
            cuts.append(int(e["cut"]))
    return max(cuts)


def _members(job_dir: Path) -> dict[str, int]:
    """The job's rank processes now (wid -> pid), from the coordinator's record."""
    try:
        doc = json.loads((job_dir / "coord" / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    procs = doc.get("procs", {})
    return {w: int(procs[w]["pid"]) for w in doc.get("members", []) if w in procs}


def _inject(job_dir: Path, rng: random.Random, faults: int, coordinator_p: float, lo_s: float, hi_s: float,
            done: threading.Event, log: list[dict[str, Any]]) -> None:
    """Kill processes of a running job from outside, by pid, at random moments (start-up, steps, collectives,
    repairs in progress: the delays do not wait for anything), stamping each in faults.jsonl first."""
    while len(log) < faults:
        # the first fault at start-up; the others once the job runs, at random gaps, a quarter of them short
        # enough to land in the repair the previous one started
        if log and not any(p.name.startswith("result") for p in job_dir.glob("*")) and _committed(job_dir) < 0:
            if done.wait(0.05):
                return
            continue
        gap = rng.uniform(lo_s, 0.15) if log and rng.random() < 0.25 else rng.uniform(lo_s, hi_s)
        if done.wait(gap):
            return
        if rng.random() < coordinator_p and (job_dir / "coord" / "pid").exists():
            pid, wid = int((job_dir / "coord" / "pid").read_text()), "coordinator"
        else:
            members = _members(job_dir)
            if not members:
                continue  # not started yet: the next moment
            wid = rng.choice(sorted(members))
            pid = members[wid]
        stamp_fault(job_dir, wid, "SIGKILL from outside", by="bench (outside)")
        try:
            os.kill(pid, signal.SIGKILL)
            log.append({"wid": wid, "pid": pid})
        except ProcessLookupError:
            pass


def run_chaos(a: argparse.Namespace, root: Path) -> Path:
    """Faults from outside at random moments: every job's digest must equal the uninterrupted run's; per repair
    its phases; waits on a timeout counted from every process's log."""
    base = {"workload": "dp_lora", "world": a.world, "steps": a.steps, "backend": a.backend, "fsync": "always",
            "device": "cuda:0" if a.backend == "nccl" else "cpu", "max_rebuilds": 32}
    expect = run_job(root / "reference", {**base, "standby": {"hot": 0}}, timeout_s=900).same_on_every_rank()
    rows: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    rng = random.Random(a.seed)
    for rnd in range(a.rounds):
        for mode, extra in CHAOS_MODES.items():
            job = root / f"chaos-{mode}-{rnd}"
            done, sent = threading.Event(), []
            inj = threading.Thread(target=_inject, args=(job, random.Random(rng.random()), a.faults, 0.15,
                                                         0.05, a.max_gap_s, done, sent), daemon=True)
            t0 = time.monotonic()
            inj.start()
            try:
                r = run_job(job, {**base, **extra}, timeout_s=1200)
            finally:
                done.set()
                inj.join()
            same = r.same_on_every_rank() == expect
            waits = _timeout_waits(job)
            phases = recovery_phases(r.repairs, r.timings, r.events, load_faults(job))
            for p in phases:
                rows.append({"mode": mode, "round": rnd, **p})
            jobs.append({"mode": mode, "round": rnd, "faults_sent": len(sent),
                         "coordinator_kills": sum(1 for x in sent if x["wid"] == "coordinator"),
                         "coordinator_restarts": r.coordinator_restarts, "repairs": len(r.repairs),
                         "digest_equal": same, "timeout_waits": waits, "wall_s": time.monotonic() - t0})
            print(f"round {rnd} {mode}: {len(sent)} faults, {len(r.repairs)} repairs, "
                  f"{r.coordinator_restarts} coordinator restarts, digest {'equal' if same else 'DIFFERS'}, "
                  f"{len(waits)} timeout waits, {time.monotonic() - t0:.1f} s", flush=True)
            if not same:
                raise SystemExit(f"{mode} round {rnd}: the result differs from the uninterrupted run ({job})")
    summary = []
    for mode in CHAOS_MODES:
        sel = [x for x in rows if x["mode"] == mode and x["cut"] >= 0]  # the job was up (a cut committed)
        timed = [x["total_ms"] for x in sel if x["total_ms"] is not None]
        summary.append({"mode": mode, "repairs": len(sel), "timed": len(timed),
                        "start_up_repairs": sum(1 for x in rows if x["mode"] == mode and x["cut"] < 0),
                        "total_ms_median": statistics.median(timed) if timed else None,
                        "total_ms_max": max(timed, default=None),
                        "detection_ms_median": statistics.median(
                            [x["detection_ms"] for x in sel if x["detection_ms"] is not None] or [0.0]),
                        "cut_short": sum(1 for x in sel if x["note"]),
                        "timeout_waits": sum(len(j["timeout_waits"]) for j in jobs if j["mode"] == mode),
                        "digests_equal": all(j["digest_equal"] for j in jobs if j["mode"] == mode)})
    notes = (f"{a.world} ranks, dp_lora {a.steps} steps, {a.backend}, fsync=always; {a.faults} SIGKILLs per job sent "
             f"from outside the job by pid (the benchmark process), 15% of them to the coordinator: the first at "
             f"start-up (0.05-{a.max_gap_s} s after the job starts), the others once a cut is committed, at random "
             f"gaps of 0.05-{a.max_gap_s} s (a quarter of them under 0.15 s: into the repair in progress): steps, "
             "collectives, prepares, rebuilds, restores. Rows: every repair; the summary counts repairs of a job "
             "that was up (start-up ones apart). Phases measured from each fault's stamp (faults.jsonl), 'total' = "
             "kill -> every member finished its first step again; repairs cut short by the next fault have no "
             "total. timeout_waits: lines in any process's log of a wait that ended on a timeout. 2 CPU cores "
             "shared with ~8 other engineers' work: noisy.")
    path = write_results("distributed_chaos", summary, baseline=rows + [{"job": j} for j in jobs], notes=notes,
                         out_dir=a.out_dir, tag=a.tag or ("cpu" if a.backend == "gloo" else None))
    print_table("faults from outside at random moments", summary)
    return path


def _timeout_waits(job: Path) -> list[str]:
    """Lines of the job's logs that say a wait ended on a timeout (a store or group timeout that was waited
    out, as opposed to a wait abandoned when the generation moved)."""
    hits = []
    for f in [job / "coordinator.log", *sorted((job / "logs").glob("*.log"))]:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        hits += [f"{f.name}: {line[:200]}" for line in text.splitlines()
                 if "timed out" in line.lower() or "timeout" in line.lower()]
    return hits


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=("recovery", "partial", "chaos"), default="recovery")
    ap.add_argument("--faults", type=int, default=6, help="chaos: SIGKILLs sent from outside per job")
    ap.add_argument("--steps", type=int, default=400, help="chaos: steps per job")
    ap.add_argument("--max-gap-s", type=float, default=2.0, help="chaos: the longest delay between two faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=100, help="partial: new tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--gap", type=int, default=150, help="steps between kills (a kill also waits for the standby)")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--keep", action="store_true", help="keep the job directories (printed)")
    a = ap.parse_args()
    device = "cuda:0" if a.backend == "nccl" else "cpu"
    gap = a.gap
    steps = gap * (a.kills + 1)
    base = {"workload": "dp_lora", "world": a.world, "steps": steps, "backend": a.backend, "device": device,
            "fsync": "always"}
    root = Path(tempfile.mkdtemp(prefix="cft-bench-dist-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        if a.suite == "partial":
            print(f"wrote {run_partial(a, root)}")
            return 0
        if a.suite == "chaos":
            print(f"wrote {run_chaos(a, root)}")
            return 0
        ref = run_job(root / "reference", {**base, "standby": {"hot": 0}}, timeout_s=600)
        expect = ref.same_on_every_rank()
        rows: list[dict[str, Any]] = []
        for rnd in range(a.rounds):
            for mode in a.modes.split(","):
                extra = MODES[mode]
                kills = [{"after_cut": gap * (k + 1) - gap // 2, "rank": (rnd + k) % a.world} for k in range(a.kills)]
                r = run_job(root / f"{mode}-{rnd}", {**base, **extra, "kills": kills}, timeout_s=900)
                if r.same_on_every_rank() != expect:
                    raise SystemExit(f"{mode} round {rnd}: the result differs from the uninterrupted run")
                phases = [p for p in recovery_phases(r.repairs, r.timings, r.events, load_faults(r.job_dir))
                          if not p["note"]]
                if len(phases) < len(r.repairs):
                    print(f"  {len(r.repairs) - len(phases)} repair(s) of {mode} without every member's timing "
                          f"(interrupted by a later failure): {r.job_dir}", flush=True)
                for p in phases:
                    rows.append({"mode": mode, "round": rnd, **p})
                print(f"round {rnd} {mode}: {len(r.repairs)} repairs, wall {r.wall_s:.1f} s", flush=True)
        summary = []
        for mode in a.modes.split(","):
            sel = [x for x in rows if x["mode"] == mode]
            s: dict[str, Any] = {"mode": mode, "n": len(sel)}
            for ph in PHASES:
                vals = [x[ph] for x in sel if x[ph] is not None]
                s[ph] = statistics.median(vals) if vals else None
            s["max_abort_ms"] = max((x["abort_ms"] for x in sel), default=None)
            s["max_detection_ms"] = max((x["detection_ms"] for x in sel if x["detection_ms"] is not None),
                                        default=None)
            summary.append(s)
        restart = next((s["total_ms"] for s in summary if s["mode"] == "restart"), None)
        for s in summary:
            s["speedup_vs_restart"] = restart / s["total_ms"] if s["total_ms"] and restart else None
        notes = (f"{a.world} ranks, dp_lora, {a.backend} on {device}, fsync=always; a rank SIGKILLed by the "
                 f"coordinator {a.kills}x per job, {a.rounds} interleaved rounds; medians per phase. restart = the "
                 "baseline: kill every rank, start new processes (import + model), restore each from its log, "
                 "init the group. Every job's losses and state digest equal the uninterrupted run's.")
        path = write_results("distributed", summary, baseline=rows, notes=notes, out_dir=a.out_dir,
                             tag=a.tag or ("cpu" if a.backend == "gloo" else None))
        print_table("recovery per phase (medians, ms)", summary,
                    ["mode", "n", *PHASES, "max_abort_ms", "speedup_vs_restart"])
        print(f"wrote {path}")
    finally:
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
