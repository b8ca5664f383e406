"""`concordia dist run`: a distributed job on this machine (gloo on CPU, or NCCL with every rank on one GPU),
with ranks killed on purpose, repaired in place from standbys; prints the result and each repair's phases.

    concordia dist run --world 4 --steps 60 --hot 1 --kill 1@20 --kill 3@40
    concordia dist run --workload tp_decode --world 2 --steps 16 --warm 1 --chaos 5
    concordia dist run --workload mytrain:MyLoop --world 4 --steps 100     # your own loop (README)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from ..errors import ConfigError
from .output import console


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("dist", help="run a distributed job with rank failures repaired without a restart")
    s = p.add_subparsers(dest="dist_cmd", required=True)
    r = s.add_parser("run", help="run a job (a coordinator + ranks + standbys) and report its repairs")
    r.add_argument("--workload", default="dp_lora", metavar="NAME",
                   help="dp_lora, tp_decode, replica_serve, or MODULE:NAME of your own loop (README)")
    r.add_argument("--world", type=int, default=4)
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    r.add_argument("--hot", type=int, default=1, help="hot standbys (up, model built, connected)")
    r.add_argument("--warm", type=int, default=0, help="warm standbys (up, model built, not connected)")
    r.add_argument("--restart", action="store_true", help="on a failure restart every rank (the baseline)")
    r.add_argument("--kill", action="append", default=[], metavar="RANK@CUT",
                   help="SIGKILL rank RANK once cut CUT is committed (repeatable)")
    r.add_argument("--chaos", type=int, default=0, metavar="N",
                   help="SIGKILL N random ranks at random times (0.1-1.5 s apart, start-up and repairs included)")
    r.add_argument("--seed", type=int, default=0, help="the seed of --chaos's choices")
    r.add_argument("--heartbeat-ms", type=int, default=50)
    r.add_argument("--job-dir", default=None, help="where the logs go (default: a new temporary directory)")


def _kills(specs: list[str]) -> list[dict[str, int]]:
    out = []
    for spec in specs:
        try:
            rank, cut = spec.split("@")
            out.append({"rank": int(rank), "after_cut": int(cut)})
        except ValueError:
            raise ConfigError(f"--kill {spec!r}: use RANK@CUT, e.g. --kill 1@20") from None
    return out


def run(args: argparse.Namespace) -> int:
    """Errors are raised: ``cli.main.guarded`` turns them into one line (ConfigError: exit 2, a job that
    failed: 1, torch missing: 2 with the extra to install)."""
    c = console()
    from ..distributed import DistOptions, run_job
    from ..distributed.timeline import load_faults, recovery_phases
    from ..distributed.workload import validate

    kills = _kills(args.kill)
    bad = [k["rank"] for k in kills if not 0 <= k["rank"] < args.world]
    if bad:
        raise ConfigError(f"--kill names rank {bad[0]}, but the world has ranks 0..{args.world - 1}")
    if args.chaos < 0:
        raise ConfigError(f"--chaos {args.chaos}: the number of random kills must be >= 0")
    opts = DistOptions(workload=args.workload, world=args.world, steps=args.steps, backend=args.backend,
                       device="cuda:0" if args.backend == "nccl" else "cpu", heartbeat_ms=args.heartbeat_ms,
                       on_failure="restart" if args.restart else "repair",
                       standby={"hot": args.hot, "warm": args.warm}, kills=tuple(kills),
                       chaos={"kills": args.chaos, "seed": args.seed, "min_delay_ms": 100, "max_delay_ms": 1500}
                       if args.chaos else {})
    validate(opts)  # refused with its cause before a directory or a process exists
    job_dir = Path(args.job_dir) if args.job_dir else Path(tempfile.mkdtemp(prefix="concordia-dist-"))
    c.print(f"job in {job_dir}: {args.workload}, {args.world} ranks, {args.backend}")
    r = run_job(job_dir, opts)
    c.print(f"done in {r.wall_s:.1f} s, {len(r.repairs)} repair(s), {r.kills} kill(s)")
    digests = {rank: str(v.get("digest", ""))[:16] for rank, v in sorted(r.results.items())}
    if len(set(digests.values())) == 1:  # one replicated state (dp_lora, tp_decode): every rank agrees
        res = r.results[min(r.results)]
        shown = res.get("losses") or res.get("tokens")
        if isinstance(shown, list):
            c.print(f"result digest {next(iter(digests.values()))} on every rank; last values {shown[-4:]}")
        else:
            c.print(f"result (the same on every rank): {str(res)[:200]}")
    else:  # each rank its own state (replica_serve, or your own loop's)
        c.print("result digest per rank: " + ", ".join(f"{k}: {d}" for k, d in digests.items()))
    if r.coordinator_restarts:
        c.print(f"the coordinator was started again {r.coordinator_restarts} time(s) after it died")
    for p in recovery_phases(r.repairs, r.timings, r.events, load_faults(job_dir)):
        line = (f"  gen {p['gen']} {p['failure']} ({p['standby']}, sent by {p['sent_by']}): detection "
                f"{_ms(p['detection_ms'])}, decide {_ms(p['decide_ms'])}")
        if p["note"]:
            line += f"; {p['note']}"
        else:
            line += (f", abort {_ms(p['abort_ms'])}, start {_ms(p['start_ms'])}, restore {_ms(p['restore_ms'])}, "
                     f"rebuild {_ms(p['rebuild_ms'])}, first step {_ms(p['first_step_ms'])}, total "
                     f"{_ms(p['total_ms'])}"
                     + ("" if p["total_ms"] is not None else
                        f" (detection to first step {_ms(p['detect_to_first_step_ms'])})"))
        c.print(line)
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
