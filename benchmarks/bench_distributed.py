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

Usage: python benchmarks/bench_distributed.py [--rounds 2] [--kills 3] [--backend gloo|nccl] [--out-dir D]
       python benchmarks/bench_distributed.py --suite partial [--rounds 2] [--kills 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from concordia_ft.benchreport import print_table, write_results  # noqa: E402
from concordia_ft.distributed import run_job  # noqa: E402
from concordia_ft.distributed.timeline import load_stamps, recovery_phases, service_during_repairs  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "hot": {"standby": {"hot": 1, "warm": 0, "order": ["hot", "cold"]}},
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=("recovery", "partial"), default="recovery")
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
                phases = [p for p in recovery_phases(r.repairs, r.timings, r.events) if not p["note"]]
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
