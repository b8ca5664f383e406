"""Where an engine step's epoch goes: a per-phase breakdown of the epoch of every decode step, and a cProfile of
the epoch calls, at N concurrent greedy requests (Qwen3-0.6B dims on a GPU, a tiny model on CPU).

Per decode step (the step's forward + sampling is ``forward``): ``meta`` (Engine._meta(): the state as a
dict), ``encode`` (its JSON), ``collect`` (the Runtime's trackers: scan, gather, DtoH/placement), ``append`` (the
log: layout, CRCs, stores, commit), ``checkpoint`` (the whole call). Modes: ``sync`` (Runtime.checkpoint) and,
when the engine has it, ``c`` (the step-epoch path: rows gathered on the device into a pinned ring, the epoch
committed by the GIL-free C writer).

    python benchmarks/profile_serve_epoch.py --concurrency 32          # H200
    python benchmarks/profile_serve_epoch.py --device cpu --quick      # checks the script
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
from bench_serve import build, log_dir, options, prompts, sync  # noqa: E402

from concordia_ft.benchreport import median, write_results  # noqa: E402
from concordia_ft.core.format import encode_json  # noqa: E402
from concordia_ft.serve import Engine, SamplingParams  # noqa: E402
from concordia_ft.serve.engine import META_KEY  # noqa: E402


def run(model: Any, device: str, n: int, prompt: int, new: int, mode: str, profile: bool) -> dict[str, Any]:
    vocab = int(model.config.vocab_size)
    d, backend = log_dir(n * (prompt + new) * 200_000)
    extra: dict[str, Any] = {"checkpoint": True, "backend": backend}
    if mode != "sync":
        extra["step_epochs"] = mode
    eng = Engine(model, d / "log", options(n, prompt, new, **extra))
    for p in prompts(n, prompt, vocab):
        eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    rows: dict[str, list[float]] = {k: [] for k in ("step", "forward", "meta", "encode", "collect", "append",
                                                     "checkpoint")}
    prof = cProfile.Profile() if profile else None
    orig = eng.checkpoint

    def timed_checkpoint() -> int | None:
        t0 = time.perf_counter()
        m = eng._meta()
        t1 = time.perf_counter()
        encode_json({META_KEY: m})
        t2 = time.perf_counter()
        rows["meta"].append(t1 - t0)
        rows["encode"].append(t2 - t1)
        if prof is not None:
            prof.enable()
        try:
            return orig()
        finally:
            if prof is not None:
                prof.disable()

    if mode == "sync":
        eng.checkpoint = timed_checkpoint  # type: ignore[method-assign]
    decode = 0
    while eng.has_work:
        c0 = eng.graphs.capture_s if eng.graphs is not None else 0.0
        t0 = time.perf_counter()
        out = eng.step()
        sync(device)
        dt = time.perf_counter() - t0
        c1 = eng.graphs.capture_s if eng.graphs is not None else 0.0
        pure = out.batch_tokens == len(out.new_tokens) and out.batch_tokens and c1 == c0
        if not pure:
            for k in ("meta", "encode"):
                if len(rows[k]) > len(rows["step"]):
                    rows[k].pop()
            continue
        decode += 1
        rows["step"].append(dt)
        rows["forward"].append(out.forward_s)
        rows["checkpoint"].append(out.checkpoint_s)
        st = eng.runtime.last_stats if eng.runtime is not None else None
        if mode == "sync" and st is not None:
            rows["collect"].append(st.detect_seconds)
            rows["append"].append(st.append_seconds)
    eng.close()
    res = {"mode": mode, "concurrent": n, "decode_steps": decode,
           **{f"{k}_ms": 1e3 * median(v) for k, v in rows.items() if v}}
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(28)
        res["profile"] = s.getvalue()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--modes", default="sync")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-lines", default=20, type=int)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    model = build("tiny" if a.quick else "0.6b", a.device, dtype)
    Engine(model, None, options(2, 16, 4, checkpoint=False))  # attention installed
    rows = []
    for n in [int(x) for x in a.concurrency.split(",")]:
        for mode in a.modes.split(","):
            run(model, a.device, n, a.prompt, 4, mode, False)  # warm-up: captures, allocations
            r = run(model, a.device, n, a.prompt, a.new, mode, False)
            p = run(model, a.device, n, a.prompt, min(a.new, 16), mode, True)
            r["profile"] = p.get("profile", "")
            prof = r.pop("profile")
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            if mode == "sync":
                print("\n".join(ln[:150] for ln in prof.splitlines()[8:8 + int(a.profile_lines)]), flush=True)
            rows.append(r)
    if a.out:
        print("wrote", write_results("serve_epoch_profile", rows, baseline=[], out_dir=a.out,
                                     notes="per-phase medians over decode steps (ms)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
