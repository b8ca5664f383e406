"""A request's stream is the one it would have produced alone, through SIGKILLs and whatever arrives after each
recovery (issue: exact whatever else is in the batch).

1. alone: every request (half greedy, half seeded sampling; mixed prompt and output lengths) run alone on one
   engine with no log: the reference streams;
2. crash: a child process serves the requests with an epoch every step, arrivals in groups at steps of its own;
   the parent SIGKILLs it at a random step (``--kills`` times); each next child ``Engine.recover``s the log and
   submits the requests no earlier child had submitted, in another order and at other steps, so the batches
   after a recovery differ from any earlier plan; the last child runs to the end. Every token a client saw
   (printed once its epoch committed) is kept and checked to be a prefix of the final stream.
Reports how many final streams equal their alone reference.

    python benchmarks/bench_invariance.py --requests 300 --kills 3                     # H200
    TRITON_INTERPRET=1 python benchmarks/bench_invariance.py --quick --device cpu      # a tiny model on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_engine import build  # noqa: E402
from benchreport import write_results  # noqa: E402

from concordia_ft.serve import Engine, SamplingParams  # noqa: E402


def plan(n: int, vocab: int, quick: bool) -> list[dict[str, Any]]:
    rnd = random.Random(21)
    out = []
    for i in range(n):
        plen = rnd.randint(4, 40) if quick else rnd.randint(16, 400)
        new = rnd.randint(4, 12) if quick else rnd.randint(8, 48)
        prompt = [rnd.randrange(3, vocab - 1) for _ in range(plen)]
        out.append({"id": f"q{i}", "prompt": prompt, "new": new, "greedy": i % 2 == 0, "seed": 1000 + i})
    return out


def params(q: dict[str, Any]) -> SamplingParams:
    if q["greedy"]:
        return SamplingParams(max_new_tokens=q["new"], temperature=0.0, ignore_eos=True)
    return SamplingParams(max_new_tokens=q["new"], temperature=0.8, top_p=0.95, seed=q["seed"], ignore_eos=True)


def options(args: argparse.Namespace) -> dict[str, Any]:
    o = {"num_blocks": 2048 if not args.quick else 96, "block_size": 16 if not args.quick else 4,
         "max_running": 32 if not args.quick else 6, "max_waiting": 4096, "max_model_len": 512 if not args.quick
         else 64, "max_batch_tokens": 2048 if not args.quick else 24, "backend": "dram",
         "keep_finished": 4096}
    if args.invariant is not None:
        o["invariant"] = args.invariant == "on"
    return o


def alone(model: Any, reqs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, list[int]]:
    eng = Engine(model, None, {**options(args), "checkpoint": False})
    out = {}
    for q in reqs:
        r = eng.submit(q["prompt"], params(q), request_id=q["id"])
        while eng.has_work:
            eng.step()
        out[q["id"]] = list(r.generated)
        eng.collect(r.id)
    eng.close()
    return out


def child(args: argparse.Namespace) -> None:
    """One serving process: a fresh engine or one recovered from the log; submits the requests the parent lists
    (in its order, a group every few steps), prints every committed token and every finished stream."""
    model = build(args.dims, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    reqs = {q["id"]: q for q in plan(args.requests, model.config.vocab_size, args.quick)}
    todo = json.loads(Path(args.todo).read_text())
    opts = options(args)
    eng = Engine.recover(args.log, model, opts) if args.recover else Engine(model, args.log, opts)
    seen = {r.id for r in [*eng.running.values(), *eng.finished.values(), *eng.waiting]}
    todo = [i for i in todo["order"] if i not in seen]
    rnd = random.Random(args.seed)
    print(json.dumps({"ev": "start", "step": eng.step_no, "have": {
        r.id: list(r.generated) for r in [*eng.running.values(), *eng.finished.values()]}}), flush=True)
    k = 0
    while k < len(todo) or eng.has_work:
        if k < len(todo) and (not eng.has_work or rnd.random() < 0.3):
            group = rnd.randint(1, 6 if not args.quick else 3)
            for rid in todo[k: k + group]:
                eng.submit(reqs[rid]["prompt"], params(reqs[rid]), request_id=rid)
            k += group
        out = eng.step()
        fin = {rid: list(eng.get(rid).generated) for rid in out.finished}  # type: ignore[union-attr]
        print(json.dumps({"ev": "step", "step": out.step, "new": out.new_tokens, "finished": fin}), flush=True)
    print(json.dumps({"ev": "done"}), flush=True)


def crash_run(args: argparse.Namespace, reqs: list[dict[str, Any]], work: Path) -> dict[str, Any]:
    log = work / "log"
    rnd = random.Random(args.seed)
    final: dict[str, list[int]] = {}
    seen: dict[str, list[int]] = {}  # every committed token a client received, in order
    kills, prefix_errors = [], 0
    for gen in range(args.kills + 1):
        order = [q["id"] for q in reqs]
        rnd.shuffle(order)  # each process brings the remaining requests in another order
        todo = work / f"todo{gen}.json"
        todo.write_text(json.dumps({"order": order}))
        kill_at = None if gen == args.kills else rnd.randint(3, 12 if args.quick else 40)
        cmd = [sys.executable, __file__, "--child", "--log", str(log), "--todo", str(todo), "--seed", str(gen),
               "--requests", str(args.requests), "--dims", args.dims, "--device", args.device]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--recover"] if gen else []
        cmd += ["--invariant", args.invariant] if args.invariant else []
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        steps = 0
        for line in p.stdout:
            ev = json.loads(line)
            if ev["ev"] == "start":
                for rid, toks in ev["have"].items():  # what the log holds is a continuation of what clients saw
                    if toks[: len(seen.get(rid, []))] != seen.get(rid, []):
                        prefix_errors += 1
            elif ev["ev"] == "step":
                for rid, toks in ev["new"].items():
                    seen.setdefault(rid, []).extend(toks)
                final.update(ev["finished"])
                steps += 1
                if kill_at is not None and steps >= kill_at:
                    os.kill(p.pid, signal.SIGKILL)
                    kills.append({"process": gen, "after_steps": steps})
                    break
        p.wait()
        if kill_at is None and p.returncode != 0:
            raise RuntimeError(f"the last serving process exited with {p.returncode}")
    for rid, toks in final.items():
        if seen.get(rid) != toks:
            prefix_errors += 1
    return {"final": final, "kills": kills, "stream_errors": prefix_errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="0.6b", choices=["0.6b", "8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--invariant", choices=["on", "off"], default=None, help="EngineOptions.invariant (default: "
                    "the engine's own)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and short requests")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recover", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--todo", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.dims = "tiny"
    if args.child:
        child(args)
        return
    model = build(args.dims, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    reqs = plan(args.requests, model.config.vocab_size, args.quick)
    t0 = time.perf_counter()
    ref = alone(model, reqs, args)
    t_alone = time.perf_counter() - t0
    del model
    work = Path(tempfile.mkdtemp(prefix="bench-invariance-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        t1 = time.perf_counter()
        got = crash_run(args, reqs, work)
        t_crash = time.perf_counter() - t1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    equal = sum(got["final"].get(q["id"]) == ref[q["id"]] for q in reqs)
    greedy = [q for q in reqs if q["greedy"]]
    row = {"requests": len(reqs), "equal_to_alone": equal, "finished": len(got["final"]),
           "greedy_equal": sum(got["final"].get(q["id"]) == ref[q["id"]] for q in greedy), "greedy": len(greedy),
           "kills": got["kills"], "stream_errors": got["stream_errors"], "alone_s": t_alone, "crash_s": t_crash,
           "invariant": args.invariant or "default", "dims": args.dims}
    path = write_results("invariance", [row], out_dir=args.out, tag="quick" if args.quick else None,
                         notes="each request's final stream after SIGKILLs with different arrivals after each "
                               "recovery, against the request run alone")
    print(json.dumps({k: v for k, v in row.items() if k != "kills"}), f"kills {got['kills']}")
    print(f"{equal} of {len(reqs)} equal to the request alone; wrote {path}")
    if equal != len(reqs) or got["stream_errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
