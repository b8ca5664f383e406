"""The executor's hazard guard, driven by the interposer, on the H200: hangs over a user's workload (target 0).

Runs experiments/guard_workload.py in fresh processes:
- guarded: the interposer loaded by the driver (its native guard), no Python hooks, a resident executor that
  never leaves by itself, through eager first launches, cuBLAS's first call, a new Triton kernel, a
  torch.compile'd function, empty_cache, synchronize and a Qwen3 build + decode; every step under a watchdog;
- control (the baseline: what a user has without it): the same executor and the cuBLAS step, no interposer,
  no hooks: the step must hang and the watchdog end it (shows that the watchdog, and the test, can fail).
Writes experiments/results/guard-<tag>.json.  Run: python3 experiments/bench_guard.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments"))  # concordia_lab: the instrumentation and the executor
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchreport

from benchreport import write_results  # noqa: E402

from concordia_lab.instrument import interposer as ip  # noqa: E402

WORKLOAD = ROOT / "experiments" / "guard_workload.py"


def run_workload(*, guarded: bool, steps: str | None = None, step_timeout: float = 120.0,
                 trace: bool = True, timeout: float = 500.0) -> dict[str, Any]:
    """One child process; returns its final JSON (guarded and finished) or what hung and where."""
    env = ip.child_env() if guarded else dict(os.environ)
    if not guarded:
        env.pop("CUDA_INJECTION64_PATH", None)
    if trace:
        env["CONCORDIA_GUARD_TRACE"] = "1"
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{env.get('PYTHONPATH', '')}"
    tmp = tempfile.mkdtemp(prefix="cft-guard-")  # fresh compile caches: every kernel is new to the process
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    cmd = [sys.executable, str(WORKLOAD), "--step-timeout", str(step_timeout)]
    if steps:
        cmd += ["--steps", steps]
    if not guarded:
        cmd.append("--no-hooks")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:  # the watchdog itself did not fire: still a hang, and reported
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = "parent timeout", -9
    wall = time.perf_counter() - t0
    started = [ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("STEP ")]
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"step"')]
    finals = [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"native_guard"')]
    if rc == 0 and finals:
        return {**finals[-1], "rc": 0, "hangs": 0, "hung_step": None, "wall_s": round(wall, 1)}
    stuck = started[-1] if started and len(rows) < len(started) else None
    watchdog = "Timeout (" in err  # faulthandler's line: the step was stuck, not failing
    hung = stuck if (watchdog or rc == -9) else None
    return {"rc": rc, "hangs": 1 if hung else 0, "hung_step": hung, "failed_step": None if hung else stuck,
            "rows": rows, "wall_s": round(wall, 1), "watchdog": watchdog, "tail": (err or out)[-1500:]}


STEPS = ("eager", "cublas", "triton", "compile", "empty_cache", "synchronize", "qwen3")


def problems(g: dict[str, Any]) -> list[str]:
    """What is wrong with a guarded run (empty: the executor stayed attached through every step, was really
    resident at a hazard of each, and every module loaded inside a guarded call). The GPU test asserts this."""
    out: list[str] = []
    if g.get("rc") != 0 or g.get("hangs") != 0:
        return [f"rc {g.get('rc')}, hung in {g.get('hung_step')}, failed in {g.get('failed_step')}"]
    if not g.get("native_guard") or g.get("hooks") != ["native guard (CUPTI interposer)"]:
        out.append(f"native guard {g.get('native_guard')}, hooks {g.get('hooks')}")
    steps = {r["step"]: r for r in g.get("rows", [])}
    if set(steps) != set(STEPS):
        out.append(f"steps run: {sorted(steps)}")
    for name, r in steps.items():
        if r.get("stepped_aside", 0) < 1:
            out.append(f"{name}: the executor was never stepped aside (not resident at any hazard)")
        if r.get("unguarded_loads", 0) or r.get("timeouts", 0):
            out.append(f"{name}: {r.get('unguarded_loads')} unguarded loads {r.get('unguarded')}, "
                       f"{r.get('timeouts')} timeouts")
    sync = steps.get("synchronize", {})
    if sync.get("sync_calls", 0) < 1:  # torch.cuda.synchronize must reach a guarded driver entry
        out.append(f"cuCtxSynchronize never seen: the synchronize call reached {sync.get('sync_driver_calls')}")
    elif sync.get("sync_stepped_aside", 0) < 1:  # and the executor, resident at that moment, must have left
        out.append("synchronize: the executor was resident but not stepped aside for the device-wide sync")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="experiments/results")
    ap.add_argument("--control-timeout", type=float, default=8.0)
    ap.add_argument("--child-timeout", type=float, default=500.0, help="the guarded process's wall limit")
    ap.add_argument("--control-from", default="", help="a guard results JSON whose control run to keep "
                                                       "instead of running it again (device time)")
    ns = ap.parse_args()
    g = run_workload(guarded=True, timeout=ns.child_timeout)
    if ns.control_from:
        doc = json.loads(Path(ns.control_from).read_text())
        c = {k: v for k, v in doc["baseline"][0].items() if k != "run"}
        c["from"] = f"{doc.get('git_commit')} {doc.get('date')}"
    else:
        c = run_workload(guarded=False, steps="cublas", step_timeout=ns.control_timeout, trace=False)
    rows = [{"run": "guarded", "step": r["step"], **{k: v for k, v in r.items() if k != "step"}}
            for r in g.get("rows", [])]
    summary = {"guarded_rc": g["rc"], "guarded_hangs": g.get("hangs"), "guarded_hung_step": g.get("hung_step"),
               "guarded_failed_step": g.get("failed_step"),
               "native_guard": g.get("native_guard"), "hooks": g.get("hooks"), "guard": g.get("guard"),
               "control_rc": c["rc"], "control_hangs": c.get("hangs"), "control_hung_step": c.get("hung_step"),
               "control_watchdog_fired": c.get("watchdog"), "guarded_wall_s": g.get("wall_s"),
               "control_wall_s": c.get("wall_s")}
    if g["rc"] != 0:
        summary["guarded_tail"] = g.get("tail")
    for r in rows:
        print(json.dumps(r))
    summary["problems"] = problems(g)
    print(json.dumps({k: v for k, v in summary.items() if k != "guard"}))
    path = write_results("guard", rows + [{"run": "summary", **summary}],
                         baseline=[{"run": "control (no interposer, no hooks)", **{k: v for k, v in c.items()
                                                                                  if k != "tail"}}],
                         notes="hangs counted by a per-step faulthandler watchdog (exit instead of hang); the "
                               "executor's idle timeout and lease are 10 min, so a step it blocks never ends "
                               "by itself", out_dir=ns.out_dir)
    print(f"wrote {path}")
    ok = not summary["problems"] and c.get("hangs") == 1
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
