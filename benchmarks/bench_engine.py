"""The serving engine against what a user would run instead, in the same process and run.

For each batch B (all prompts of one length, greedy, ``--new`` tokens each, EOS ignored):
- ``hf_static``: transformers' own ``model.generate(..., cache_implementation="static")`` of the batch (it
  compiles its forward: the first call is a warm-up, not timed); whole-wave tokens/s, and its decode rate from
  a 1-token run subtracted;
- ``nolog`` / ``epochs``: ``serve.Engine`` as configured by default (batch-invariant, serve/invariant.py) without a
  log and with an epoch every step (DRAM log); ``cublas`` / ``cublas_epochs``: the same with
  ``invariant=False`` (cuBLAS GEMMs, torch's norms); ``--waves``
  successive waves of B requests on ONE engine, as a running server sees them. Per wave: whole-wave output
  tokens/s (prefill included), decode-step tokens/s (B / median decode step), TTFT p50 and inter-token p50/p99
  (from each request's token arrival times);
- ``roofline``: the HBM bound of a decode step at the wave's mean context (weights + every request's K/V read
  once at 4.8 TB/s).
Each engine row carries ``vs_transformers_static`` (its whole-wave tokens/s over hf_static's, same batch, same
run) and ``epochs_vs_nolog``. ``--poisson N``: N requests (prompts 64-2048, 32-512 new tokens) arriving as a
Poisson process at ``--rate`` requests/s, nolog vs epochs: throughput, TTFT and inter-token percentiles.

    python benchmarks/bench_engine.py --batches 1,8,32,64 --waves 10 --poisson 200     # H200
    python benchmarks/bench_engine.py --quick --device cpu                               # a tiny smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
from bench_serve import build, sync  # noqa: E402
from benchreport import median, percentile, print_table, write_results  # noqa: E402

from concordia_ft.serve import Engine, SamplingParams  # noqa: E402

HBM_BPS = 4.8e12
ENGINE_MODES = ("nolog", "epochs", "cublas", "cublas_epochs")


def prompts(n: int, plen: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (plen,), generator=g).tolist() for _ in range(n)]


def hf_static(model: Any, ps: list[list[int]], new: int, device: str) -> dict[str, Any]:
    ids = torch.tensor(ps, device=device)
    kw = dict(do_sample=False, pad_token_id=0, cache_implementation="static")
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)  # compiles; not timed
    walls, ones = [], []
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        sync(device)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        sync(device)
        t2 = time.perf_counter()
        ones.append(t1 - t0)
        walls.append(t2 - t1)
    b = len(ps)
    n = b * (out.shape[1] - ids.shape[1])
    wall, one = median(walls), median(ones)
    return {"whole_tok_s": n / wall, "decode_tok_s": b * (new - 1) / max(wall - one, 1e-9), "wall_s": wall}


def engine_options(batch: int, max_len: int, block: int = 16) -> dict[str, Any]:
    per = -(-max_len // block)
    return {"num_blocks": batch * per + 64, "block_size": block, "max_running": max(batch, 1),
            "max_waiting": 4 * batch + 16, "max_model_len": max_len, "max_batch_tokens": 8192, "backend": "dram"}


class Wave:
    """Token arrival times of each request of a wave (or a Poisson run)."""

    def __init__(self) -> None:
        self.t_submit: dict[str, float] = {}
        self.arrivals: dict[str, list[float]] = {}
        self.step_s: list[float] = []
        self.decode_steps: list[tuple[float, int]] = []

    def record(self, out: Any, t: float, dt: float) -> None:
        for rid, toks in out.new_tokens.items():
            self.arrivals.setdefault(rid, []).extend([t] * len(toks))
        self.step_s.append(dt)

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        n = sum(len(v) for v in self.arrivals.values())
        ttft = [v[0] - self.t_submit[r] for r, v in self.arrivals.items() if v]
        itl = [b - a for v in self.arrivals.values() for a, b in zip(v, v[1:], strict=False) if b > a]
        return {"tokens": n, "whole_tok_s": n / (t1 - t0), "ttft_p50_ms": 1e3 * percentile(ttft, 50),
                "ttft_p99_ms": 1e3 * percentile(ttft, 99), "itl_p50_ms": 1e3 * percentile(itl, 50),
                "itl_p99_ms": 1e3 * percentile(itl, 99)}


def run_wave(eng: Engine, ps: list[list[int]], new: int, device: str) -> dict[str, Any]:
    w = Wave()
    sync(device)
    t0 = time.perf_counter()
    for p in ps:
        r = eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
        w.t_submit[r.id] = t0
    dec = []
    while eng.has_work:
        s0 = time.perf_counter()
        out = eng.step()
        s1 = time.perf_counter()
        w.record(out, s1, s1 - s0)
        if out.graph:
            dec.append(s1 - s0)
    sync(device)
    t1 = time.perf_counter()
    row = w.summary(t0, t1)
    row["decode_tok_s"] = len(ps) / median(dec) if dec else None
    row["graph_steps"] = len(dec)
    return row


def roofline(model: Any, batch: int, ctx: float, geo: Any) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    step_bytes = weights + batch * ctx * geo.row_bytes
    return batch / (step_bytes / HBM_BPS)


def throughput(models: dict[str, Any], hf: Any, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    max_len = args.prompt + args.new
    for b in args.batches:
        base = hf_static(hf, prompts(b, args.prompt, vocab, 1), args.new, args.device) if "hf_static" in args.modes \
            else None
        if base is not None:
            rows.append({"batch": b, "wave": 0, "mode": "hf_static", **base, "vs_transformers_static": 1.0})
            print(f"B={b} hf_static {base['whole_tok_s']:.0f} tok/s whole, {base['decode_tok_s']:.0f} decode",
                  flush=True)
        per_mode: dict[str, list[dict[str, Any]]] = {}
        for mode in (m for m in args.modes if m in ENGINE_MODES):
            d = tempfile.mkdtemp(prefix="bench-engine-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            logged = mode.endswith("epochs")
            cublas = mode.startswith("cublas")
            opts = dict(engine_options(b, max_len), checkpoint=logged, async_epochs=args.async_epochs,
                        invariant=not cublas)
            t0 = time.perf_counter()
            eng = Engine(models["cublas" if cublas else "invariant"], os.path.join(d, "log") if logged else None, opts)
            ctor = time.perf_counter() - t0
            out = []
            for wave in range(1, args.waves + 1):
                r = run_wave(eng, prompts(b, args.prompt, vocab, 100 + wave), args.new, args.device)
                r.update(batch=b, wave=wave, mode=mode, construct_s=ctor if wave == 1 else None)
                r["roofline_tok_s"] = roofline(models["invariant"], b, args.prompt + args.new / 2, eng.geo)
                r["decode_vs_roofline"] = (r["decode_tok_s"] / r["roofline_tok_s"]) if r["decode_tok_s"] else None
                if base is not None:
                    r["vs_transformers_static"] = r["whole_tok_s"] / base["whole_tok_s"]
                    r["decode_vs_transformers_static"] = (r["decode_tok_s"] / base["decode_tok_s"]
                                                          if r["decode_tok_s"] else None)
                out.append(r)
                print(f"B={b} {mode} wave {wave}: {r['whole_tok_s']:.0f} tok/s whole, decode "
                      f"{r['decode_tok_s'] or 0:.0f}, ttft p50 {r['ttft_p50_ms']:.1f} ms, itl p50/p99 "
                      f"{r['itl_p50_ms']:.2f}/{r['itl_p99_ms']:.2f} ms", flush=True)
            eng.close()
            del eng
            gc.collect()
            shutil.rmtree(d, ignore_errors=True)
            per_mode[mode] = out
        for mode, base_mode, key in (("epochs", "nolog", "epochs_vs_nolog"),
                                     ("nolog", "cublas", "invariant_vs_cublas"),
                                     ("cublas_epochs", "cublas", "epochs_vs_nolog")):
            if mode in per_mode and base_mode in per_mode:
                for a, e in zip(per_mode[base_mode], per_mode[mode], strict=True):
                    e[key] = e["whole_tok_s"] / a["whole_tok_s"]
                    if a.get("decode_tok_s") and e.get("decode_tok_s"):
                        e[key.replace("_vs_", "_decode_vs_")] = e["decode_tok_s"] / a["decode_tok_s"]
        for out in per_mode.values():
            rows += out
    return rows


def poisson(model: Any, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rnd = random.Random(9)
    reqs = [(rnd.randint(64, 2048), rnd.randint(32, 512)) for _ in range(args.poisson)]
    gaps = [rnd.expovariate(args.rate) for _ in reqs]
    rows = []
    for mode in ("nolog", "epochs"):
        d = tempfile.mkdtemp(prefix="bench-engine-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        opts = dict(engine_options(64, 2048 + 512), checkpoint=mode == "epochs", async_epochs=args.async_epochs)
        eng = Engine(model, None if mode == "nolog" else os.path.join(d, "log"), opts)  # the default engine
        g = torch.Generator().manual_seed(4)
        ps = [torch.randint(100, vocab - 1, (n,), generator=g).tolist() for n, _ in reqs]
        w = Wave()
        sync(args.device)
        t0 = time.perf_counter()
        due = t0
        k = 0
        while k < len(reqs) or eng.has_work:
            now = time.perf_counter()
            while k < len(reqs) and due <= now:
                r = eng.submit(ps[k], SamplingParams(max_new_tokens=reqs[k][1], temperature=0.0, ignore_eos=True))
                w.t_submit[r.id] = due
                k += 1
                if k < len(reqs):
                    due += gaps[k]
            if not eng.has_work:
                time.sleep(max(0.0, min(due - time.perf_counter(), 0.05)))
                continue
            s0 = time.perf_counter()
            out = eng.step()
            s1 = time.perf_counter()
            w.record(out, s1, s1 - s0)
        sync(args.device)
        row = w.summary(t0, time.perf_counter())
        row.update(mode=mode, requests=len(reqs), rate_per_s=args.rate, batch=None, wave=None)
        rows.append(row)
        print(f"poisson {mode}: {row['whole_tok_s']:.0f} tok/s, ttft p50/p99 {row['ttft_p50_ms']:.0f}/"
              f"{row['ttft_p99_ms']:.0f} ms, itl p50/p99 {row['itl_p50_ms']:.2f}/{row['itl_p99_ms']:.2f} ms",
              flush=True)
        eng.close()
        del eng
        gc.collect()
        shutil.rmtree(d, ignore_errors=True)
    if len(rows) == 2:
        rows[1]["epochs_vs_nolog"] = rows[1]["whole_tok_s"] / rows[0]["whole_tok_s"]
    return rows


def plot(path: Path) -> Path:
    """Tokens/s against wave (one line per batch and mode) and against batch (last wave), beside the JSON."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if r.get("batch")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for (run, batch, mode) in sorted({(r.get("run", ""), r["batch"], r["mode"]) for r in rows
                                      if r["mode"] != "hf_static"}):
        pts = sorted((r["wave"], r["whole_tok_s"]) for r in rows
                     if r["batch"] == batch and r["mode"] == mode and r.get("run", "") == run)
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{run} B={batch} {mode}".strip())
    for r in rows:
        if r["mode"] == "hf_static":
            a.axhline(r["whole_tok_s"], ls=":", lw=1, color="gray")
    a.set(xlabel="wave (successive waves on one engine)", ylabel="whole-wave output tokens/s", yscale="log",
          title="tokens/s by wave (dotted: transformers static-cache generate)")
    a.legend(fontsize=7, ncol=2)
    modes = sorted({r["mode"] for r in rows})
    for mode in modes:
        last = {r["batch"]: r["whole_tok_s"] for r in sorted((r for r in rows if r["mode"] == mode),
                                                             key=lambda r: (r.get("run", ""), r["wave"]))}
        bs = sorted(last)
        b.plot(bs, [last[x] for x in bs], marker="o", label=mode)
    b.set(xlabel="batch", ylabel="whole-wave output tokens/s (last wave)", xscale="log", yscale="log",
          title="tokens/s by batch")
    b.legend(fontsize=8)
    head = doc.get("notes", "").split(";")[0]
    fig.suptitle(f"{doc['device'].get('gpu', '')}, {head}, commit {doc.get('git_commit', '')[:10]}",
                 fontsize=8)
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="0.6b", choices=["0.6b", "8b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--waves", type=int, default=10)
    ap.add_argument("--modes", default="hf_static,nolog,epochs,cublas")
    ap.add_argument("--async-epochs", action="store_true", help="pipelined epochs (EngineOptions.async_epochs)")
    ap.add_argument("--poisson", type=int, default=0, help="requests of the Poisson-arrival run (0: none)")
    ap.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 waves, to check the script")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", default="serve_throughput")
    args = ap.parse_args()
    if args.quick:
        args.dims, args.waves, args.prompt, args.new, args.batches = "tiny", 2, 32, 8, "1,4"
        args.poisson = min(args.poisson, 8) if args.poisson else 0
    args.batches = [int(x) for x in args.batches.split(",")]
    args.modes = args.modes.split(",")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.dims, args.device, dtype)
    hf = build(args.dims, args.device, dtype) if "hf_static" in args.modes else None  # its own attention
    vocab = model.config.vocab_size
    # an invariant engine switches its model's linear layers and norms: the cuBLAS modes get a model of their own
    models = {"invariant": model,
              "cublas": build(args.dims, args.device, dtype) if any(m.startswith("cublas") for m in args.modes)
              else None}
    rows = throughput(models, hf, args, vocab)
    if args.poisson:
        del hf
        gc.collect()
        rows += poisson(model, args, vocab)
    path = write_results(args.name, rows, out_dir=args.out, tag=None if not args.quick else "quick",
                         notes=f"dims {args.dims}, prompt {args.prompt}, new {args.new}, waves {args.waves}, "
                               f"async_epochs {args.async_epochs}")
    print_table("engine vs transformers", [
        {k: r.get(k) for k in ("batch", "wave", "mode", "whole_tok_s", "decode_tok_s", "vs_transformers_static",
                               "epochs_vs_nolog", "invariant_vs_cublas", "decode_vs_roofline")} for r in rows])
    print(f"wrote {path} and {plot(path)}")


if __name__ == "__main__":
    main()
