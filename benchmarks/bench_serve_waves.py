"""Serving engine in steady state: successive waves on ONE engine (and a Poisson-arrival run), epochs on vs off.

A running server does not start fresh for every batch: its log has grown, compacted, rolled segments, and its
metadata holds the outputs of requests that finished earlier. This benchmark runs ``--waves`` waves of
``--batch`` greedy requests (prompt ``--prompt`` tokens, ``--new`` new tokens each) one after the other on the
same engine, for every mode in ``--modes`` (one engine per mode, the modes alternated wave by wave so a noisy
host hits them alike), and reports per wave:

- whole-wave output tokens/s (prefill included), decode-step tokens/s, TTFT p50, inter-token p50/p99;
- the epoch work: bytes appended (the epochs' bytes, the log directory's size at the wave's end), segments
  started, compactions (count, seconds, bytes before/after, the steps that ran beside one and their mean time),
  the metadata JSON bytes of a mid-wave step, which path each step's epoch took (step epochs through the C
  writer, through its bulk buffer, or the generic Runtime path, with the reason of each fallback), the host
  seconds per phase;
- ``vs_none``: the wave's whole tokens/s over the same wave's with no log.

``--poisson N`` adds a run of N requests arriving as a Poisson process (``--rate`` per second; prompts and new
tokens uniform in ``--poisson-prompt`` / ``--poisson-new``), reported per window of ``--window-s`` seconds.

    python benchmarks/bench_serve_waves.py --waves 10 --batch 32 --prompt 512 --new 128          # GPU, 0.6B dims
    python benchmarks/bench_serve_waves.py --device cpu --dims small --waves 10 --batch 8 --prompt 128 --new 32
    python benchmarks/bench_serve_waves.py --device cpu --quick                                  # smoke test
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_serve import build, sync  # noqa: E402
from benchreport import median, percentile, print_table, write_results  # noqa: E402

from concordia_ft.serve import Engine, SamplingParams  # noqa: E402

# what each mode runs: "none" no log; "epochs" the engine's defaults (what a user gets); the rest pin the path
MODES: dict[str, dict[str, Any]] = {
    "none": {"checkpoint": False},
    "epochs": {},
    "epochs-async": {"async_epochs": True},
    "c": {"step_epochs": "c"},
    "c-async": {"step_epochs": "c", "async_epochs": True},
    "runtime": {"step_epochs": "runtime"},
    "runtime-async": {"step_epochs": "runtime", "async_epochs": True},
}


def log_root(need_bytes: int) -> tuple[Path, str]:
    """tmpfs (the dram backend) when it has room, else a temporary directory (file backend)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.3 * need_bytes:
        return Path(tempfile.mkdtemp(prefix="cft-waves-", dir=shm)), "dram"
    return Path(tempfile.mkdtemp(prefix="cft-waves-")), "file"


def engine_options(batch: int, max_len: int, batch_tokens: int, **kw: Any) -> dict[str, Any]:
    per = -(-max_len // 16)
    return {"num_blocks": batch * per, "block_size": 16, "max_running": batch, "max_waiting": max(256, batch),
            "max_model_len": max_len, "max_batch_tokens": batch_tokens, **kw}


def dir_bytes(d: Path) -> int:
    """Bytes the log's files hold (allocated blocks: a preallocated segment's unused tail does not count)."""
    total = 0
    for p in d.iterdir():
        try:
            total += p.stat().st_blocks * 512
        except OSError:
            pass
    return total


class Probe:
    """The engine's epoch counters, read before and after a wave (or a window) and reported as differences."""

    def __init__(self, eng: Engine, log: Path | None) -> None:
        self.eng, self.log = eng, log
        self.prev = self.read()

    def read(self) -> dict[str, Any]:
        eng = self.eng
        rt = eng.runtime
        if rt is None:
            return {}
        st: dict[str, Any] = {"generation": int(rt.log.manifest.next_generation)}
        c = rt.compaction_stats()
        st.update({"compactions": c["count"], "compaction_s": c["seconds"], "compaction_seal_wait_s": c["seal_wait_s"],
                   "compaction_bytes_after": c["bytes_after"]})
        rs = getattr(rt.log, "roll_stats", None)
        if rs is not None:
            st.update({"rolls_all": rs["rolls"], "rolls_prepared": rs["prepared"], "rolls_on_the_spot": rs["on_the_spot"],
                       "roll_s": rs["seconds"]})
        f = eng.fast
        if f is not None:
            st.update({"c_steps": f.steps, "c_bulk_steps": f.bulk_steps, "fallbacks": f.fallbacks, "rolls": f.rolls,
                       "placed_steps": getattr(f, "placed_steps", 0), "seal_rolls": getattr(f, "seal_rolls", 0),
                       "meta_bytes_sum": f.meta_bytes, **{f"t_{k}": v for k, v in f.t.items()},
                       **{f"fallback_{k}": v for k, v in f.fallback_reasons.items()}})
        return st

    def delta(self) -> dict[str, Any]:
        now = self.read()
        out = {k: (v - self.prev.get(k, 0)) for k, v in now.items() if isinstance(v, (int, float))}
        self.prev = now
        if "generation" in out:
            out["segments_started"] = out.pop("generation")
        return out


def meta_bytes(eng: Engine) -> int:
    if eng.runtime is None:
        return 0
    return len(eng._meta_json())


def run_wave(eng: Engine, device: str, prompts: list[list[int]], new: int, wave: int) -> dict[str, Any]:
    """Submit every prompt, step until idle; the wave's timings and what each step's epoch cost."""
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True),
                       request_id=f"w{wave}-{i}") for i, p in enumerate(prompts)]
    seen: dict[str, list[float]] = {r.id: [] for r in reqs}
    decode_steps: list[float] = []
    ck_steps: list[float] = []
    epoch_bytes = 0
    captured = 0.0
    meta_mid = 0
    compacting_steps: list[float] = []
    idle_steps: list[float] = []
    mid = None
    sync(device)
    t_start = time.perf_counter()
    excluded = 0.0  # the benchmark's own probes inside the wave
    while eng.has_work:
        c0 = eng.graphs.capture_s if eng.graphs is not None else 0.0
        decode = not eng.waiting and bool(eng.running) and all(
            len(r.ids) - r.n_computed == 1 for r in eng.running.values())
        compacting = eng.runtime is not None and eng.runtime.compacting
        t0 = time.perf_counter()
        out = eng.step()
        sync(device)
        t1 = time.perf_counter()
        c1 = eng.graphs.capture_s if eng.graphs is not None else 0.0
        if c1 != c0:
            captured += c1 - c0
        elif decode:
            decode_steps.append(t1 - t0)
            (compacting_steps if compacting else idle_steps).append(t1 - t0)
        ck_steps.append(out.checkpoint_s)
        epoch_bytes += out.epoch_bytes
        for rid, toks in out.new_tokens.items():
            seen[rid] += [t1 - captured - excluded] * len(toks)
        if mid is None and decode and len(eng.running) == len(reqs):
            mid = len(decode_steps)
        if mid is not None and len(decode_steps) == mid + new // 2 and not meta_mid:
            t2 = time.perf_counter()
            meta_mid = meta_bytes(eng)
            excluded += time.perf_counter() - t2
    t_end = time.perf_counter()
    total = sum(len(r.generated) for r in reqs)
    for r in reqs:
        eng.collect(r.id)
    itl = [b - a for ts in seen.values() for a, b in zip(ts, ts[1:], strict=False)]
    ttft = [ts[0] - t_start for ts in seen.values() if ts]
    run_s = t_end - t_start - captured - excluded
    return {"whole_tok_s": total / run_s, "run_s": run_s, "decode_tok_s": len(reqs) * len(decode_steps) / max(
        1e-9, sum(decode_steps)), "step_p50_ms": 1e3 * median(decode_steps) if decode_steps else float("nan"),
        "step_p99_ms": 1e3 * percentile(decode_steps, 99), "ttft_p50_ms": 1e3 * median(ttft),
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
        "checkpoint_s": sum(ck_steps), "epoch_bytes": epoch_bytes, "meta_bytes_mid": meta_mid,
        "steps_beside_compaction": len(compacting_steps),
        "step_beside_compaction_ms": 1e3 * float(np.mean(compacting_steps)) if compacting_steps else 0.0,
        "step_no_compaction_ms": 1e3 * float(np.mean(idle_steps)) if idle_steps else 0.0,
        "capture_s": captured, "tokens": [r.generated for r in reqs]}


def make_engine(model: Any, mode: str, opts: dict[str, Any], need: int) -> tuple[Engine, Path | None]:
    """``mode``, optionally with ``:bulkc`` (a prefill's rows through the pinned bulk buffer and the C writer
    instead of DMA'd into the log by the placed path: CONCORDIA_STEP_EPOCH_BULK=c)."""
    base, _, sfx = mode.partition(":")
    if base == "none":
        return Engine(model, None, {**opts, **MODES[base]}), None
    root, backend = log_root(need)
    log = root / "log"
    if sfx == "bulkc":
        os.environ["CONCORDIA_STEP_EPOCH_BULK"] = "c"
    try:
        return Engine(model, log, {**opts, "backend": backend, **MODES[base]}), log
    finally:
        os.environ.pop("CONCORDIA_STEP_EPOCH_BULK", None)


def bench_waves(model: Any, device: str, a: argparse.Namespace, modes: list[str]) -> list[dict[str, Any]]:
    vocab = int(model.config.vocab_size)
    max_len = a.prompt + a.new
    opts = engine_options(a.batch, max_len, a.batch_tokens or max(2048, min(8192, a.batch * a.prompt)),
                          graphs=a.graphs)
    row_bytes = None
    warm = Engine(model, None, engine_options(2, 24, 2048, graphs=a.graphs, checkpoint=False))  # kernels warmed
    run_wave(warm, device, [[1] * 16, [2] * 16], 8, -1)
    engines: dict[str, tuple[Engine, Path | None, Probe]] = {}
    for m in modes:
        t0 = time.perf_counter()
        eng, log = make_engine(model, m, opts, 3 * a.batch * max_len * 200_000)
        if a.compact_after_mb is not None and eng.runtime is not None:  # a small run's scaled-down threshold
            eng.runtime.compact_after_bytes = int(a.compact_after_mb * (1 << 20))
        engines[m] = (eng, log, Probe(eng, log))
        row_bytes = eng.geo.row_bytes
        print(f"{m}: engine built in {time.perf_counter() - t0:.2f} s (pool {eng.geo.nbytes / 1e6:.1f} MB, row "
              f"{eng.geo.row_bytes} B, log {log}, backend {eng.opts.backend}, step epochs "
              f"{'c' if eng.fast is not None else 'runtime'})", flush=True)
    rows: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(1)
    waves = [[torch.randint(0, vocab, (a.prompt,), generator=g).tolist() for _ in range(a.batch)]
             for _ in range(a.waves)]
    results: dict[tuple[int, str], dict[str, Any]] = {}

    def one(w: int, m: str) -> None:
        eng, log, probe = engines[m]
        r = run_wave(eng, device, waves[w], a.new, w)
        r.update(probe.delta())
        if log is not None:
            r["log_bytes"] = dir_bytes(log)
        results[(w, m)] = r

    try:
        # interleaved: wave w of every mode, then wave w + 1 (a noisy host hits the modes alike; an engine's
        # background work, e.g. a compaction, then also runs beside the other modes' waves); sequential: every
        # wave of one mode, then the next mode (as one server sees them)
        if a.order == "sequential":
            for m in modes:
                for w in range(a.waves):
                    one(w, m)
        else:
            for w in range(a.waves):
                for m in modes[w % len(modes):] + modes[: w % len(modes)]:
                    one(w, m)
        for w in range(a.waves):
            got = {m: results[(w, m)] for m in modes}
            base = got.get("none")
            for m in modes:
                r = got[m]
                row = {"wave": w + 1, "mode": m, "batch": a.batch, "prompt": a.prompt, "new": a.new,
                       "dims": a.dims, "row_bytes": row_bytes,
                       "same_tokens_as_none": None if base is None else r["tokens"] == base["tokens"],
                       **{k: v for k, v in r.items() if k != "tokens"}}
                if base is not None:
                    row["vs_none"] = r["whole_tok_s"] / base["whole_tok_s"]
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    finally:
        for eng, log, _ in engines.values():
            eng.close()
            if log is not None:
                shutil.rmtree(log.parent, ignore_errors=True)
    return rows


def bench_poisson(model: Any, device: str, a: argparse.Namespace, modes: list[str]) -> list[dict[str, Any]]:
    """The same arrivals (by wall time from the run's start) through each mode's engine, one after the other;
    per window of ``--window-s`` seconds: the output tokens/s and what the epochs cost in it."""
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(7)
    lo_p, hi_p = (int(x) for x in a.poisson_prompt.split(","))
    lo_n, hi_n = (int(x) for x in a.poisson_new.split(","))
    gaps = rng.exponential(1.0 / a.rate, a.poisson)
    arrivals = np.cumsum(gaps)
    plens = rng.integers(lo_p, hi_p + 1, a.poisson)
    news = rng.integers(lo_n, hi_n + 1, a.poisson)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in plens]
    max_len = hi_p + hi_n
    opts = engine_options(a.batch, max_len, a.batch_tokens or 2048, graphs=a.graphs, max_waiting=a.poisson)
    rows: list[dict[str, Any]] = []
    for m in modes:
        eng, log = make_engine(model, m, opts, 4 * a.batch * max_len * 200_000)
        if a.compact_after_mb is not None and eng.runtime is not None:
            eng.runtime.compact_after_bytes = int(a.compact_after_mb * (1 << 20))
        probe = Probe(eng, log)
        try:
            t_start = time.perf_counter()
            nxt = 0
            window = 0
            w_tokens = 0
            w_t0 = t_start
            w_bytes = 0
            ttft: list[float] = []
            submitted: dict[str, float] = {}
            first_seen: set[str] = set()
            while nxt < len(prompts) or eng.has_work:
                now = time.perf_counter() - t_start
                while nxt < len(prompts) and arrivals[nxt] <= now:
                    rid = f"p{nxt}"
                    eng.submit(prompts[nxt], SamplingParams(max_new_tokens=int(news[nxt]), temperature=0.0,
                                                            ignore_eos=True), request_id=rid)
                    submitted[rid] = t_start + float(arrivals[nxt])
                    nxt += 1
                if not eng.has_work:
                    time.sleep(max(0.0, min(0.05, float(arrivals[nxt]) - now)))
                    continue
                out = eng.step()
                sync(device)
                t1 = time.perf_counter()
                w_bytes += out.epoch_bytes
                for rid, toks in out.new_tokens.items():
                    w_tokens += len(toks)
                    if rid not in first_seen:
                        first_seen.add(rid)
                        ttft.append(t1 - submitted[rid])
                for rid in out.finished:
                    eng.collect(rid)
                if t1 - w_t0 >= a.window_s or (nxt == len(prompts) and not eng.has_work):
                    window += 1
                    row = {"part": "poisson", "mode": m, "window": window, "t_end_s": t1 - t_start,
                           "tok_s": w_tokens / (t1 - w_t0), "running": len(eng.running), "waiting": len(eng.waiting),
                           "finished_total": len(first_seen), "ttft_p50_ms": 1e3 * median(ttft) if ttft else 0.0,
                           "epoch_bytes": w_bytes, "meta_bytes": meta_bytes(eng), **probe.delta()}
                    if log is not None:
                        row["log_bytes"] = dir_bytes(log)
                    rows.append(row)
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                    w_t0, w_tokens, w_bytes, ttft = t1, 0, 0, []
        finally:
            eng.close()
            if log is not None:
                shutil.rmtree(log.parent, ignore_errors=True)
        gc.collect()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dims", default=None, help="tiny, small (CPU), 0.6b or 8b (default: 0.6b on a GPU, small on CPU)")
    ap.add_argument("--waves", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=None, help="max_batch_tokens (default min(8192, batch x prompt), at least 2048)")
    ap.add_argument("--graphs", default="auto")
    ap.add_argument("--order", default="interleaved", choices=("interleaved", "sequential"),
                    help="interleaved: wave by wave across the modes; sequential: all waves of a mode in a row")
    ap.add_argument("--modes", default="none,epochs",
                    help=f"comma-separated, of {', '.join(MODES)}; ':bulkc': prefill rows through the bulk buffer")
    ap.add_argument("--poisson", type=int, default=0, help="also a Poisson-arrival run of this many requests")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--poisson-prompt", default="64,2048", help="prompt tokens, uniform in LO,HI")
    ap.add_argument("--poisson-new", default="32,512", help="new tokens, uniform in LO,HI")
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--compact-after-mb", type=float, default=None,
                    help="the log's compaction threshold (MiB appended), scaled down for a small CPU run (default: "
                         "the engine's)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 3 small waves, a short Poisson run")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    modes = a.modes.split(",")
    bad = [m for m in modes if m.partition(":")[0] not in MODES or m.partition(":")[2] not in ("", "bulkc")]
    if bad:
        ap.error(f"unknown mode(s) {bad}; of {', '.join(MODES)} (suffix :bulkc for a step-epoch mode)")
    if a.quick:
        a.dims, a.waves, a.batch, a.prompt, a.new = "tiny", 3, 4, 32, 8
        a.poisson, a.rate, a.poisson_prompt, a.poisson_new, a.window_s = a.poisson or 12, 20.0, "8,48", "4,16", 0.5
    dims = a.dims or ("0.6b" if a.device.startswith("cuda") else "small")
    a.dims = dims
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    if a.threads:
        torch.set_num_threads(a.threads)
    model = build(dims, a.device, dtype)
    rows = bench_waves(model, a.device, a, modes)
    if a.poisson:
        rows += bench_poisson(model, a.device, a, modes)
    notes = (f"{a.waves} successive waves of {a.batch} greedy requests (prompt {a.prompt}, {a.new} new) on one engine "
             "per mode, modes alternated wave by wave; whole_tok_s: every token of the wave over its wall time "
             "(prefill included, graph captures excluded); vs_none: over the same wave with no log; epoch_bytes: "
             "the epochs' bytes; log_bytes: the log directory at the wave's end; segments_started: new segment "
             "files (rolls and compaction bases); meta_bytes_mid: the metadata JSON of a mid-wave step; "
             "fallbacks: steps whose epoch took the generic path (fallback_<reason> each)")
    tag = a.tag or ("cpu-quick" if a.quick else None)
    path = write_results("serve_waves", rows, notes=notes, out_dir=a.out, tag=tag)
    cols = ["wave", "mode", "whole_tok_s", "vs_none", "step_p50_ms", "epoch_bytes", "log_bytes", "segments_started",
            "rolls_on_the_spot", "compactions", "compaction_s", "meta_bytes_mid", "fallbacks", "checkpoint_s"]
    print_table("waves", [r for r in rows if "wave" in r], [c for c in cols])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
